"""Issue 25 item 3: when several verified fixes exist, the best (smallest change that meets) comes first."""

import json

from test_exclude import write_fixture

from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fix.exclude import ExcludeOptions, derive_exclusions, ranked_fixes, summary_lines

QDQ = Recipe(mode="static", quant_format="QDQ", activation_type="QUInt8", weight_type="QInt8")


def test_op_type_fix_that_meets_ranks_before_the_longer_node_list(tmp_path):
    fp, npz, _ = write_fixture(tmp_path, "convnet")
    r = derive_exclusions(
        fp, QDQ, FeedSpec(inputs=str(npz), batch=8), ExcludeOptions("cosine>=0.9999", bench_runs=0, progress=False)
    )
    fixes = ranked_fixes(r)
    assert [f["rank"] for f in fixes] == list(range(1, len(fixes) + 1))
    assert fixes[0]["kind"] == "nodes_to_exclude" or fixes[0]["size"] <= len(r.nodes_to_exclude)
    [sug] = r.op_type_suggestions
    doc = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert doc["fixes"] == fixes and doc["nodes_to_exclude"] == r.nodes_to_exclude  # existing fields kept
    assert sug["met"] and 1 + len(sug["nodes_to_exclude"]) < len(r.nodes_to_exclude)  # exact mode: CPU-independent
    assert fixes[0]["kind"] == "op_types_to_quantize"
    assert fixes[0]["op_types_to_quantize"] == sug["op_types_to_quantize"]
    first, second = summary_lines(r)[:2]
    assert first.startswith("target cosine>=0.9999 met on ") and " by op_types_to_quantize=" in first, first
    assert first.endswith(f"(best fix: a smaller change than the {len(r.nodes_to_exclude)}-node list)"), first
    assert second.startswith("  also met: cosine ") and f"by keeping {len(r.nodes_to_exclude)} nodes" in second


def test_report_first_screen_shows_the_op_type_fix_when_it_ranks_first(tmp_path):
    """The fix report opens on the best-ranked fix (op types here), whole, within 900 px in Chromium."""
    from browser import chromium
    from playwright.sync_api import sync_playwright

    from diag.cli import commands as cli

    fp, npz, _ = write_fixture(tmp_path, "convnet")
    recipe = json.dumps({"mode": "static", "quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8"})
    out = tmp_path / "fix"
    argv = [str(fp), "--recipe", recipe, "--inputs", str(npz), "--batch", "8", "--target", "cosine>=0.9999"]
    assert cli.main(["exclude", *argv, "--bench-runs", "0", "--out", str(out), "--quiet"]) == 0
    best = json.loads((out / "exclusion.json").read_text())["fixes"][0]
    assert best["kind"] == "op_types_to_quantize"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto((out / "report.html").resolve().as_uri())
        text = page.locator("#best-fix-code").text_content()
        box = page.locator("#best-fix-code").bounding_box()
        browser.close()
    assert text is not None and text.startswith("op_types_to_quantize=" + json.dumps(best["op_types_to_quantize"]))
    assert box is not None and box["y"] + box["height"] <= 900
    # summary.md: the verified fix comes right after the headline, the op-type fix as its code block.
    summary = (out / "summary.md").read_text()
    block = "```python\nop_types_to_quantize=" + json.dumps(best["op_types_to_quantize"])
    assert block in summary, summary
    assert summary.index("**Verified fix**") < summary.index("| output | grade |")
    assert summary.index(block) < summary.index("2. ")  # the others listed after it, numbered
