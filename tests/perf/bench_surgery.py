"""Benchmark: `diag exclude --int8` splicing float regions vs re-quantizing every trial (issue 41).

Not collected by pytest (no ``test_`` prefix). Run::

    python tests/perf/bench_surgery.py --repeat 3
    python tests/perf/bench_surgery.py --layers 6 --hidden 384 --seq 64 --samples 64 --repeat 3

It builds a BERT-sized encoder in code (the bundled transformer fixture with ``--layers`` layers of
``--hidden`` width: 6 x 384 is MiniLM-L6's shape; random weights, no download), quantizes it the
way a popular guide does (``quantize_dynamic``, QUInt8 per-channel weights, MatMulConstBOnly=False:
the attention MatMuls quantized too), and times, each in a fresh ``diag`` process, alternating
within each round so that a machine slowing down for a minute slows both:

* ``surgical``: ``diag exclude FP32 --int8 INT8`` (every trial is the user's model with float regions
  spliced in; no quantizer runs);
* ``requantize``: the same with ``--requantize`` (the recipe read back from the model is proven to
  rebuild it, then every trial is quantized by onnxruntime).

The target defaults to removing three quarters of the baseline's error (``cosine >= 1 - (1 - c) * 0.25``,
``c`` the user's model's held-out min cosine), so the search has work to do. Both runs must end with
the same verdict; the ratio printed is the median of the per-round ratios, with their range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(folder: Path, layers: int, hidden: int, seq: int, samples: int) -> tuple[Path, Path, Path]:
    import numpy as np
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from diag.fixtures import models

    fx = models.transformer(hidden=hidden, seq=seq, vocab=4096, layers=layers)
    fp, q, x = folder / "bert.fp32.onnx", folder / "bert.int8.onnx", folder / "inputs.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(
        str(fp), str(q), weight_type=QuantType.QUInt8, per_channel=True, extra_options={"MatMulConstBOnly": False}
    )
    np.savez(x, **fx.make_inputs(samples, 12))
    return fp, q, x


def run(args: list[str], out: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "diag", "exclude", *args, "--out", str(out)], capture_output=True)
    seconds = time.perf_counter() - t0
    if done.returncode not in (0, 3):
        raise SystemExit(done.stderr.decode())
    return seconds, json.loads((out / "exclusion.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target", help="default: cosine >= 1 - (1 - baseline) * --left")
    p.add_argument("--left", type=float, default=0.25, help="share of the baseline's cosine error the target leaves")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-surgery-"))
    fp, q, x = build(work, a.layers, a.hidden, a.seq, a.samples)
    common = [str(fp), "--int8", str(q), "--inputs", str(x), "--batch", str(a.batch), "--bench-runs", "0", "--quiet"]
    target = a.target
    if target is None:
        _, probe = run([*common, "--target", "cosine>=0.99999999"], work / "probe")
        before = probe["metrics"]["before"]["cosine"]
        target = f"cosine>={1 - (1 - before) * a.left:.6f}"
        print(f"baseline held-out min cosine {before:.6f}; target {target}")
    times: dict[str, list[float]] = {"surgical": [], "requantize": []}
    for r in range(a.repeat):
        for mode in times:
            extra = ["--requantize"] if mode == "requantize" else []
            seconds, doc = run([*common, "--target", target, *extra], work / f"{mode}{r}")
            times[mode].append(seconds)
            s = doc["search"]
            print(
                f"round {r} {mode:<10} {seconds:7.1f} s  verdict {doc['verdict']}, {len(doc['nodes_to_exclude'])} "
                f"node(s), {s['quantizations']} quantizations, {s.get('splices', 0)} splices, "
                f"{s['evaluations']} evaluations"
            )
    ratios = [b / a for a, b in zip(times["surgical"], times["requantize"], strict=True)]
    med = {mode: statistics.median(t) for mode, t in times.items()}
    print(
        f"surgical {med['surgical']:.1f} s, requantize {med['requantize']:.1f} s "
        f"(medians of {a.repeat}); requantize / surgical x{statistics.median(ratios):.2f} "
        f"(rounds x{min(ratios):.2f}-x{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
