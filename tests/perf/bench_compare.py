"""Benchmark: diag compare vs the floor vs onnxruntime's qdq_loss_debug, each in its own process.

Not collected by pytest (no ``test_`` prefix). Run from anywhere after ``pip install .``::

    python tests/perf/bench_compare.py --size 320 --samples 8 --repeat 3

It fetches RapidOCR's PP-OCRv4 detector from its PyPI wheel (cached), quantizes it with
onnxruntime (QDQ and dynamic, ``--formats``), draws text-like images, and prints wall time and
peak RSS (min-max over ``--repeat`` runs, each in a fresh process) of:

* floor: the instrumented FP32 and INT8 models run once over the inputs, every output touched,
  nothing kept (the unavoidable cost of looking at every tensor);
* floor+ (``--modes`` must name it): the floor with the allocator setting diag applies to itself
  (``diag.core.run.reuse_freed_memory``), to show how much of diag's lead comes from that setting;
* diag: ``diag.compare_models`` (accumulated + local error + histograms + outliers), exact mode,
  ``--reductions numpy`` (every tensor exposed and reduced in numpy);
* diag-graph: the same with ``--reductions graph`` (statistics computed inside onnxruntime, one
  diagnostic graph per pass); graph-nolocal: diag-graph without local error, to print the
  local-error share of a diag-graph run;
* ort (QDQ only; it matches no tensor of a dynamic model): ``modify_model_output_intermediate_tensors``
  + ``collect_activations`` + ``create_activation_matching`` + ``compute_activation_error``.

Then the ratios the issue sets targets for (diag / floor wall <= 1.5, RSS <= 1.25; ort / diag
wall >= 5, RSS >= 3), the time of one local-error pass (the cut model) over one INT8 pass with
every tensor exposed (<= 2), and with ``--flat 4,64`` diag's peak RSS at 64 samples over 4.
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
import json, sys, time
def _peak_kb():
    # VmHWM: this process's own peak RSS. ru_maxrss would also count the forking parent's RSS
    # (Linux keeps it across fork + exec), i.e. whatever the test runner held at that moment.
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
from pathlib import Path
import numpy as np
mode, folder, samples, fmt = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fp, q, inputs = folder / "fp32.onnx", folder / f"{fmt}.onnx", folder / "inputs.npz"
start = time.perf_counter()
extra = {}
if mode in ("diag", "diag-graph", "graph-nolocal"):
    from diag.analysis.compare import CompareOptions, compare_models
    from diag.core.feeds import FeedSpec
    how = "numpy" if mode == "diag" else "graph"
    r = compare_models(fp, q, FeedSpec(inputs=str(inputs), samples=samples),
                       CompareOptions(progress=False, reductions=how, local=mode != "graph-nolocal", effects=0))
    assert not r.state.numpy_reduced, r.state.numpy_reduced  # the graph computed every statistic
elif mode in ("floor", "floor+"):
    import onnx, onnxruntime as ort
    if mode == "floor+":  # the floor with diag's allocator setting (see diag.core.run.reuse_freed_memory)
        from diag.core.run import reuse_freed_memory
        reuse_freed_memory()
    from diag.core.instrument import exposed_model
    with np.load(inputs) as npz:  # read once: indexing an NpzFile re-reads the whole array
        name = npz.files[0]
        data = {name: npz[name]}
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
elif mode == "passes":
    # One INT8 pass with every matched tensor exposed vs one pass of the cut model (local error),
    # built exactly as diag builds them; feeds of the cut model are the FP32 values.
    import onnx
    from diag.analysis.compare import load_pair
    from diag.core.instrument import cut_model, exposed_model
    from diag.core.match import match_models
    from diag.core.run import default_threads, reuse_freed_memory, run_batch, session_from_model
    reuse_freed_memory()  # as diag compare does
    f, qm = load_pair(fp, q)
    pairs = match_models(f.proto, qm.proto).pairs
    th = default_threads()
    fs = session_from_model(exposed_model(f.proto, list(pairs)), "fp", threads=th, takes_turns=True)
    names = [p.int8_name for p in pairs.values()] + [p.dynamic_scale for p in pairs.values() if p.dynamic_scale]
    qs = session_from_model(exposed_model(qm.proto, names), "int8", threads=th, takes_turns=True)
    cut = cut_model(qm.proto, [p for p in pairs.values() if p.producer is not None])
    cs = session_from_model(cut.model, "cut", threads=th, takes_turns=True)
    with np.load(inputs) as npz:  # read once: indexing an NpzFile re-reads the whole array
        name = npz.files[0]
        data = {name: npz[name]}
    t_fp = t_q = t_cut = 0.0
    for i in range(samples + 1):
        feeds = {name: data[name][i % len(data[name]):i % len(data[name]) + 1]}
        t = time.perf_counter(); fo = run_batch(fs, feeds, "fp"); a = time.perf_counter() - t
        t = time.perf_counter(); run_batch(qs, feeds, "int8"); b = time.perf_counter() - t
        cf = dict(feeds)
        for ci in cut.inputs:
            v = fo[ci.fp_name]
            cf[ci.name] = ci.quant.quantize(v, onnx.helper.tensor_dtype_to_np_dtype(ci.dtype)) if ci.quant else v
        t = time.perf_counter(); run_batch(cs, cf, "cut"); c = time.perf_counter() - t
        if i:  # the first run warms up
            t_fp += a; t_q += b; t_cut += c
    extra = {"fp32_s": t_fp, "int8_s": t_q, "cut_s": t_cut}
elif mode == "ort":
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations, compute_activation_error, create_activation_matching,
        modify_model_output_intermediate_tensors)
    with np.load(inputs) as npz:  # read once: indexing an NpzFile re-reads the whole array
        name = npz.files[0]
        data = {name: npz[name]}
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
                  "peak_mb": _peak_kb() / 1024, **extra}))
"""


def prepare(folder: Path, size: int, samples: int, formats: list[str]) -> None:
    import numpy as np
    import onnx

    from diag.fixtures import quantize, thirdparty

    src = onnx.load(str(thirdparty.rapidocr_model("det")))
    name = src.graph.input[0].name
    onnx.save(quantize.lift_constants(src), folder / "fp32.onnx")
    images = thirdparty.text_images(samples + 4, size, size, seed=5)
    for fmt in formats:
        quantize.quantize(folder / "fp32.onnx", folder / f"{fmt}.onnx", fmt, {name: images[:4]})
    np.savez(folder / "inputs.npz", **{name: images[4:]})


def measure(mode: str, folder: Path, samples: int, fmt: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(folder), str(samples), fmt],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    if out.returncode != 0:
        return {"seconds": float("nan"), "peak_mb": float("nan"), "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _span(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def _ratio(num: list[float], den: list[float]) -> str:
    """Median of the per-round ratios (each round runs every mode back to back), and their range."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return f"x{statistics.median(ratios):.2f} (rounds x{min(ratios):.2f}-x{max(ratios):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=320, help="image side (PP-OCR det takes any multiple of 32)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode, each in a fresh process; min-max shown")
    ap.add_argument("--modes", default="floor,diag,diag-graph,graph-nolocal,ort")
    ap.add_argument("--formats", default="qdq,dynamic", help="INT8 formats to benchmark")
    ap.add_argument("--flat", metavar="A,B", help="also diag's peak RSS at A and at B samples, e.g. 4,64")
    args = ap.parse_args()
    formats = args.formats.split(",")
    flat = [int(x) for x in args.flat.split(",")] if args.flat else []
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        t = time.perf_counter()
        prepare(folder, args.size, max([args.samples, *flat]), formats)
        print(
            f"prepared PP-OCRv4 det ({', '.join(formats)}) at {args.size}x{args.size}, {args.samples} samples "
            f"in {time.perf_counter() - t:.0f} s"
        )
        for fmt in formats:
            modes = [m for m in args.modes.split(",") if m != "ort" or fmt == "qdq"]  # ort: QDQ names only
            results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            # NOTE: rounds interleave the modes (floor, diag, ort, floor, diag, ...) so that a
            # machine that slows down for a minute slows every mode, not one of them.
            for _ in range(args.repeat):
                for mode in modes:
                    results[mode].append(measure(mode, folder, args.samples, fmt))
            for mode in modes:
                runs = results[mode]
                err = next((r["error"] for r in runs if "error" in r), "")
                print(
                    f"{fmt:8s} {mode:13s} wall {_span([r['seconds'] for r in runs], '6.2f')} s"
                    f"   peak RSS {_span([r['peak_mb'] for r in runs], '5.0f')} MB"
                    + (f"   FAILED: {err}" if err else "")
                )

            def col(mode: str, key: str, results: dict[str, list[dict[str, float]]] = results) -> list[float]:
                return [r[key] for r in results[mode]]

            for mode in ("diag-graph",):
                if mode in results and "floor" in results:
                    print(
                        f"{fmt:8s} {mode} / floor:  wall {_ratio(col(mode, 'seconds'), col('floor', 'seconds'))}, "
                        f"peak RSS {_ratio(col(mode, 'peak_mb'), col('floor', 'peak_mb'))}"
                    )
                if mode in results and "diag" in results:
                    print(
                        f"{fmt:8s} {mode} / diag (numpy): wall {_ratio(col(mode, 'seconds'), col('diag', 'seconds'))}, "
                        f"peak RSS {_ratio(col(mode, 'peak_mb'), col('diag', 'peak_mb'))}"
                    )
                if mode in results and "ort" in results:
                    print(
                        f"{fmt:8s} ort / {mode}: wall {_ratio(col('ort', 'seconds'), col(mode, 'seconds'))}, "
                        f"peak RSS {_ratio(col('ort', 'peak_mb'), col(mode, 'peak_mb'))}"
                    )
            if "diag-graph" in results and "graph-nolocal" in results:
                with_local, without = col("diag-graph", "seconds"), col("graph-nolocal", "seconds")
                shares = [(a - b) / a for a, b in zip(with_local, without, strict=True)]
                print(
                    f"{fmt:8s} local-error share of a diag-graph run: {statistics.median(shares):.2f} "
                    f"(rounds {min(shares):.2f}-{max(shares):.2f})"
                )
            if "diag" in results and "floor" in results:
                print(
                    f"{fmt:8s} diag / floor:  wall {_ratio(col('diag', 'seconds'), col('floor', 'seconds'))}, "
                    f"peak RSS {_ratio(col('diag', 'peak_mb'), col('floor', 'peak_mb'))}"
                )
            if "diag" in results and "floor+" in results:
                print(
                    f"{fmt:8s} diag / floor+: wall {_ratio(col('diag', 'seconds'), col('floor+', 'seconds'))}, "
                    f"peak RSS {_ratio(col('diag', 'peak_mb'), col('floor+', 'peak_mb'))}"
                )
            if "diag" in results and "ort" in results:
                print(
                    f"{fmt:8s} ort / diag:    wall {_ratio(col('ort', 'seconds'), col('diag', 'seconds'))}, "
                    f"peak RSS {_ratio(col('ort', 'peak_mb'), col('diag', 'peak_mb'))}"
                )
            if "passes" in results and "error" not in results["passes"][0]:
                print(
                    f"{fmt:8s} local-error pass / INT8 pass (all tensors exposed): "
                    f"{_ratio(col('passes', 'cut_s'), col('passes', 'int8_s'))}; "
                    f"INT8 / FP32 pass: {_ratio(col('passes', 'int8_s'), col('passes', 'fp32_s'))}"
                )
            if flat:
                flat_mode = "diag-graph" if "diag-graph" in results else "diag"
                peaks = {n: [measure(flat_mode, folder, n, fmt)["peak_mb"] for _ in range(args.repeat)] for n in flat}
                a, b = flat[0], flat[-1]
                print(
                    f"{fmt:8s} {flat_mode} peak RSS at {a} samples {_span(peaks[a], '5.0f')} MB, at {b}: "
                    f"{_span(peaks[b], '5.0f')} MB; {b} / {a}: {_ratio(peaks[b], peaks[a])}"
                )


if __name__ == "__main__":
    main()
