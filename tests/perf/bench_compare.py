"""Benchmark: diag compare vs the floor vs onnxruntime's qdq_loss_debug, each in its own process.

Not collected by pytest (no ``test_`` prefix). Run from anywhere after ``pip install .``::

    python tests/perf/bench_compare.py --size 320 --samples 8 --repeat 2

It fetches RapidOCR's PP-OCRv4 detector from its PyPI wheel (cached), quantizes it to QDQ with
onnxruntime, draws text-like images, and prints wall time and peak RSS of:

* floor: the instrumented FP32 and INT8 models run once over the inputs, every output touched,
  nothing kept;
* diag: ``diag.compare_models`` (accumulated + local error), exact mode;
* ort: ``modify_model_output_intermediate_tensors`` + ``collect_activations`` +
  ``create_activation_matching`` + ``compute_activation_error``.
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

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np
mode, folder, samples = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
fp, q, inputs = folder / "fp32.onnx", folder / "qdq.onnx", folder / "inputs.npz"
start = time.perf_counter()
if mode == "diag":
    from diag.compare import CompareOptions, compare_models
    from diag.feeds import FeedSpec
    compare_models(fp, q, FeedSpec(inputs=str(inputs), samples=samples), CompareOptions(progress=False))
elif mode == "floor":
    import onnx, onnxruntime as ort
    from diag.instrument import exposed_model
    data = np.load(inputs)
    name = data.files[0]
    so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = []
    for path in (fp, q):
        m = onnx.load(str(path))
        names = [o for n in m.graph.node for o in n.output if o]
        sessions.append(ort.InferenceSession(exposed_model(m, names).SerializeToString(), so,
                                             providers=["CPUExecutionProvider"]))
    for i in range(samples):
        for s in sessions:
            for v in s.run(None, {name: data[name][i:i + 1]}):
                float(np.asarray(v).ravel()[:1].sum()) if v.size else 0.0
elif mode == "ort":
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations, compute_activation_error, create_activation_matching,
        modify_model_output_intermediate_tensors)
    data = np.load(inputs)
    name = data.files[0]
    from onnxruntime.quantization import CalibrationDataReader
    class R(CalibrationDataReader):
        def __init__(self):
            self.i = 0
        def get_next(self):
            if self.i >= samples:
                return None
            self.i += 1
            return {name: data[name][self.i - 1:self.i]}
    modify_model_output_intermediate_tensors(str(fp), str(folder / "fp_aug.onnx"))
    modify_model_output_intermediate_tensors(str(q), str(folder / "q_aug.onnx"))
    a = collect_activations(str(folder / "fp_aug.onnx"), R())
    b = collect_activations(str(folder / "q_aug.onnx"), R())
    compute_activation_error(create_activation_matching(b, a))
print(json.dumps({"seconds": time.perf_counter() - start,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def prepare(folder: Path, size: int, samples: int) -> None:
    import numpy as np
    import onnx

    from diag.fixtures import quantize, thirdparty

    src = onnx.load(str(thirdparty.rapidocr_model("det")))
    name = src.graph.input[0].name
    onnx.save(quantize.lift_constants(src), folder / "fp32.onnx")
    images = thirdparty.text_images(samples + 4, size, size, seed=5)
    quantize.quantize(folder / "fp32.onnx", folder / "qdq.onnx", "qdq", {name: images[:4]})
    np.savez(folder / "inputs.npz", **{name: images[4:]})


def measure(mode: str, folder: Path, samples: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(folder), str(samples)], capture_output=True, text=True, cwd=folder
    )
    if out.returncode != 0:
        return {"seconds": float("nan"), "peak_mb": float("nan"), "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=320, help="image side (PP-OCR det takes any multiple of 32)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="runs per mode; min-max shown as noise")
    ap.add_argument("--modes", default="floor,diag,ort")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        t = time.perf_counter()
        prepare(folder, args.size, args.samples)
        print(
            f"prepared PP-OCRv4 det QDQ at {args.size}x{args.size}, {args.samples} samples "
            f"in {time.perf_counter() - t:.0f} s"
        )
        results: dict[str, list[dict[str, float]]] = {}
        for mode in args.modes.split(","):
            results[mode] = [measure(mode, folder, args.samples) for _ in range(args.repeat)]
            runs = results[mode]
            secs = [r["seconds"] for r in runs]
            peaks = [r["peak_mb"] for r in runs]
            err = next((r["error"] for r in runs if "error" in r), "")
            print(
                f"{mode:6s} wall {statistics.median(secs):7.2f} s (min {min(secs):.2f}, max {max(secs):.2f})"
                f"   peak RSS {statistics.median(peaks):8.0f} MB (min {min(peaks):.0f}, max {max(peaks):.0f})"
                + (f"   FAILED: {err}" if err else "")
            )

        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in results[mode])

        if "diag" in results and "floor" in results:
            print(
                f"diag / floor:  wall x{med('diag', 'seconds') / med('floor', 'seconds'):.2f}, "
                f"peak RSS x{med('diag', 'peak_mb') / med('floor', 'peak_mb'):.2f}"
            )
        if "diag" in results and "ort" in results:
            print(
                f"ort / diag:    wall x{med('ort', 'seconds') / med('diag', 'seconds'):.2f}, "
                f"peak RSS x{med('ort', 'peak_mb') / med('diag', 'peak_mb'):.2f}"
            )


if __name__ == "__main__":
    main()
