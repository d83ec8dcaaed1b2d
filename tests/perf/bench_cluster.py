"""Benchmark: diag exclude and diag sweep, serial vs on a Dask LocalCluster (``--scheduler local:N``).

Not collected by pytest (no ``test_`` prefix). Needs ``pip install "diag[dask]"``. Run::

    python tests/perf/bench_cluster.py --workers 2 --repeat 3
    python tests/perf/bench_cluster.py --model bert.fp32.onnx --inputs bert.npz --target cosine>=0.99

Without ``--model`` it builds the bundled transformer fixture (32 samples) and searches for
``cosine>=0.9999``, a 34-trial search (binary search, then block and single pruning). It prints,
per workload, the median wall time (and min-max) of the serial run and of the cluster run, the
trial count (quantizations the search read; tasks submitted, including those computed ahead and
not needed), the speed-up and the speed-up per worker. The cluster is started once, before the
timed runs, and its start-up time is printed on its own: it is paid once per ``diag`` command
with ``local:N``, once per cluster with an existing scheduler.

Runs alternate serial / cluster within each round, so a machine that slows down for a minute
slows both. Every cluster answer is checked against the serial one (same list / same ranking).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _fixture(folder: Path) -> tuple[Path, Path]:
    import numpy as np
    import onnx

    from diag.fixtures import models

    fx = models.build("transformer")
    fp = folder / "transformer.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(folder / "inputs.npz", **fx.make_inputs(32, 12))
    return fp, folder / "inputs.npz"


def _exclude(fp: Path, npz: Path, target: str, batch: int, threads: int | None, scheduler: str | None) -> Any:
    from diag.core.feeds import FeedSpec
    from diag.core.recipe import Recipe
    from diag.fix.cluster import ClusterTrialRunner
    from diag.fix.exclude import ExcludeOptions, derive_exclusions

    recipe = Recipe(mode="dynamic", weight_type="QUInt8")
    spec = FeedSpec(inputs=str(npz), batch=batch)
    options = ExcludeOptions(target, bench_runs=0, progress=False, threads=threads, scheduler=scheduler)
    trials = ClusterTrialRunner(scheduler, fp, recipe, spec, options) if scheduler else None
    return derive_exclusions(fp, recipe, spec, options, trials=trials)


def _sweep(fp: Path, npz: Path, out: Path, batch: int, threads: int | None, scheduler: str | None) -> Any:
    from diag.core.feeds import FeedSpec
    from diag.fix.cluster import ClusterRecipes
    from diag.fix.sweep import SweepOptions, sweep_model

    grid = {
        "mode": ["dynamic", "static"],
        "weight_type": "QUInt8",
        "activation_type": "QUInt8",
        "per_channel": [False, True],
        "reduce_range": [False, True],
    }
    if out.exists():
        for f in out.iterdir():
            if f.is_file():
                f.unlink()  # no resuming between timed runs
    spec = FeedSpec(inputs=str(npz), batch=batch)
    options = SweepOptions(grid=json.dumps(grid), runs=0, threads=threads or 1, progress=False, scheduler=scheduler)
    runner = ClusterRecipes(scheduler, spec, options) if scheduler else None
    return sweep_model(fp, spec, out, options, runner=runner)


def _row(name: str, serial: list[float], cluster: list[float], workers: int, trials: str) -> str:
    s, c = statistics.median(serial), statistics.median(cluster)
    return (
        f"| {name} | {s:.2f} s ({min(serial):.2f}-{max(serial):.2f}) "
        f"| {c:.2f} s ({min(cluster):.2f}-{max(cluster):.2f}) | {trials} | x{s / c:.2f} | x{s / c / workers:.2f} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of serial + cluster runs (default 3)")
    ap.add_argument("--model", help="an FP32 model (default: the bundled transformer fixture)")
    ap.add_argument("--inputs", help=".npz for --model")
    ap.add_argument("--target", default="cosine>=0.9999", help="exclusion target (default cosine>=0.9999)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per session, both sides (default 1)")
    ap.add_argument("--skip-sweep", action="store_true")
    args = ap.parse_args()

    from distributed import LocalCluster

    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        if args.model:
            fp, npz = Path(args.model), Path(args.inputs)
        else:
            fp, npz = _fixture(folder)
        t0 = time.perf_counter()
        cluster = LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40
        )
        started = time.perf_counter() - t0
        address = cluster.scheduler_address
        try:
            # warm-up: every worker imports diag + onnxruntime and builds its evaluator once
            _exclude(fp, npz, args.target, args.batch, args.threads, address)
            times: dict[str, list[float]] = {
                "exclude-serial": [],
                "exclude-cluster": [],
                "sweep-serial": [],
                "sweep-cluster": [],
            }
            counts: dict[str, Any] = {}
            for _ in range(args.repeat):
                t = time.perf_counter()
                serial = _exclude(fp, npz, args.target, args.batch, args.threads, None)
                times["exclude-serial"].append(time.perf_counter() - t)
                t = time.perf_counter()
                remote = _exclude(fp, npz, args.target, args.batch, args.threads, address)
                times["exclude-cluster"].append(time.perf_counter() - t)
                assert remote.nodes_to_exclude == serial.nodes_to_exclude, "the cluster changed the answer"
                counts["exclude"] = (serial.quantizations, remote.cluster)
                if not args.skip_sweep:
                    t = time.perf_counter()
                    s = _sweep(fp, npz, folder / "sweep-serial", args.batch, args.threads, None)
                    times["sweep-serial"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    r = _sweep(fp, npz, folder / "sweep-cluster", args.batch, args.threads, address)
                    times["sweep-cluster"].append(time.perf_counter() - t)
                    assert [e.metrics for e in r.entries] == [e.metrics for e in s.entries], (
                        "the cluster changed a metric"
                    )
                    counts["sweep"] = (len(s.entries), r.cluster)
        finally:
            cluster.close()
    print(
        f"model: {'transformer fixture' if not args.model else args.model}; target {args.target}; "
        f"--threads {args.threads}; {args.workers} workers; {args.repeat} rounds (median, min-max)"
    )
    print(f"LocalCluster start-up: {started:.2f} s (once per `diag --scheduler local:N` command)")
    print()
    print(f"| workload | serial | local:{args.workers} | trials | speed-up | per worker |")
    print("|---|---|---|---|---|---|")
    n, info = counts["exclude"]
    print(
        _row(
            "exclude",
            times["exclude-serial"],
            times["exclude-cluster"],
            args.workers,
            f"{n} read; {info['tasks']} tasks ({info['unused_tasks']} ahead, unused)",
        )
    )
    if not args.skip_sweep:
        n, info = counts["sweep"]
        print(
            _row(
                "sweep (runs 0)",
                times["sweep-serial"],
                times["sweep-cluster"],
                args.workers,
                f"{n} recipes; {info['tasks']} tasks",
            )
        )
    print()
    print(json.dumps({k: [round(x, 3) for x in v] for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
