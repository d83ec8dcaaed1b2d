"""Benchmark: how large report.html is and how long Chromium takes to open it, graph drawn.

Not collected by pytest (no ``test_`` prefix). Give it the ``--out`` folder of a ``diag compare``
run (e.g. the 500M decoder's from ``bench_llm.py``, whose children write into temp folders: run
``diag compare`` on its cached files yourself)::

    python tests/perf/bench_report.py OUT_DIR [--runs 3]

It re-renders report.html from the folder's diag.json (``diag report``), then opens it in the
headless Chromium the tests use (Debian's, driven by playwright), ``--runs`` times in fresh pages,
and prints the file size and, per run, the time from navigation to the graph's first box drawn
(``#graph-svg g.gn``), with the number of boxes and of collapsed blocks on the first screen.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="a diag compare --out folder (holding diag.json)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="diag-bench-report-"))
    subprocess.run(["diag", "report", str(args.out / "diag.json"), "--out", str(work)], check=True, capture_output=True)
    report = work / "report.html"
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("needs Debian's chromium (tools/test-setup.sh installs it)")
    times: list[float] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        for _ in range(args.runs):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            start = time.perf_counter()
            page.goto(report.resolve().as_uri())
            page.wait_for_selector("#graph-svg g.gn")
            times.append(time.perf_counter() - start)
            boxes = page.locator("#graph-svg g.gn").count()
            blocks = page.locator("#graph-svg g.gn[data-block-collapsed]").count()
            page.close()
        browser.close()
    size = report.stat().st_size
    print(
        f"report.html {size / 1e6:.2f} MB; graph drawn in {statistics.median(times):.2f} s (median of {args.runs}: "
        f"{', '.join(f'{t:.2f}' for t in times)}); first screen {boxes} boxes, {blocks} collapsed blocks"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
