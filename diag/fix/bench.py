"""Latency bench: the same inputs through FP32, INT8 (and mixed) models, timed run by run.

Quantization is sold on speed, and on CPU it often is not faster (a dynamic conv net can be 30 %
*slower* than FP32). Speed claims must be measured on the user's own machine, with the settings
deployment uses, and with the noise shown next to the numbers.

NOTE: Sessions use onnxruntime's default optimization level ``all`` (what ``InferenceSession``
does when nobody asks otherwise, i.e. what really runs in deployment), not ``diag compare``'s
exact mode, which disables fusions and would make every model look slower than it is.

NOTE: Models are *interleaved*: every round takes the next batch and runs it through each model
once, rotating which model goes first. On a noisy machine (2 cores shared with other jobs) a burst
of background load then hits every model alike instead of whichever model happened to run during
it, and each model sees exactly the same batches. Running the models one after another would
compare them under different machine conditions. The cost is that caches are shared between
models; the warm-up rounds and the rotation keep that symmetric.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.core.feeds import FeedSource, FeedSpec, input_specs, validate_feed
from diag.core.load import LoadedModel, model_from_path
from diag.core.run import session_from_model
from diag.foundations.errors import DiagError
from diag.foundations.ortfacts import DEPLOY_LEVEL
from diag.foundations.progress import Progress

#: onnxruntime's own default graph optimization level: what a deployed session runs.
DEPLOY_OPT_LEVEL = DEPLOY_LEVEL


@dataclass(frozen=True)
class LatencyStats:
    """Latency of one model over ``runs`` timed runs (one batch each), in milliseconds.

    Attributes:
        model: the model's path as given.
        runs: timed runs (warm-up excluded).
        warmup: untimed runs before timing started.
        threads: ``intra_op_num_threads`` of the session (the same for every model in a bench).
        p50_ms, p90_ms, p99_ms: latency percentiles (numpy's linear interpolation).
        min_ms, max_ms: the noise band: fastest and slowest run.
        mean_ms: mean latency.
        throughput_per_s: samples per second over all timed runs (batch sizes counted).
        speedup: the first model's p50 divided by this model's p50 (> 1 = faster than the first
            model, normally FP32); ``None`` for the first model itself.
    """

    model: str
    runs: int
    warmup: int
    threads: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    throughput_per_s: float
    speedup: float | None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the ``--json`` file holds a list of these).

        Example:
            >>> s = LatencyStats("a.onnx", 2, 1, 1, 1.0, 1.5, 1.6, 0.9, 1.6, 1.2, 800.0, None)
            >>> s.to_dict()["p50_ms"]
            1.0
        """
        return asdict(self)


def physical_cores() -> int:
    """Physical CPU cores this process may use (hyper-threads do not speed up GEMMs).

    Reads ``/proc/cpuinfo`` on Linux (unique ``physical id``/``core id`` pairs), capped by the
    CPU affinity mask; falls back to ``os.cpu_count()``.

    Example:
        >>> physical_cores() >= 1
        True
    """
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    try:
        phys = core = ""
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                phys = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not line.strip():
                if core:
                    cores.add((phys, core))
                phys = core = ""
        if core:
            cores.add((phys, core))
    except OSError:
        pass
    return max(1, min(len(cores), logical) if cores else logical)


@dataclass(frozen=True)
class BenchOptions:
    """What `diag bench` takes besides the models and the inputs.

    Attributes:
        runs: timed runs per model (``--runs``).
        warmup: untimed runs per model first: allocator, thread pool and cache warm-up (``--warmup``).
        threads: intra-op threads per session; None: the physical cores (``--threads``).
        progress: progress bar on stderr, only on a terminal (``--quiet`` turns it off).
        json_path: also write the numbers as JSON here (``--json``; :func:`diag.cli.verbs.bench_to_json`).
        opt_level: onnxruntime graph optimization level (default ``all``, as deployed).

    Example:
        >>> BenchOptions(runs=20).warmup
        5
    """

    runs: int = 50
    warmup: int = 5
    threads: int | None = None
    progress: bool = True
    json_path: str | None = None
    opt_level: str = DEPLOY_OPT_LEVEL


def bench_models(
    paths: list[str | Path], feeds: FeedSource | FeedSpec, options: BenchOptions | None = None
) -> list[LatencyStats]:
    """Time every model on the same batches; one batch = one timed ``session.run``.

    Batches are cycled when ``runs`` exceeds the number of batches the feeds hold; only one
    batch is in memory at a time. Only ``session.run`` is timed (``time.perf_counter``), not
    reading the inputs. Every session gets the same ``intra_op_num_threads`` (default: the
    physical cores, see :func:`physical_cores`) and one inter-op thread, and the setting is
    recorded in the result. See the module notes for why models are interleaved.

    Args:
        paths: the models; the first is the reference for ``speedup`` (put FP32 first).
        feeds: inputs, resolved against the first model when a :class:`FeedSpec`; every model
            must accept them (same input names and dtypes).
        options: runs, warm-up, threads, progress and optimization level (:class:`BenchOptions`).

    Example:
        >>> from diag.core.feeds import FeedSpec
        >>> stats = bench_models(["fp32.onnx", "int8.onnx"], FeedSpec(random=True),
        ...                      BenchOptions(runs=20))  # doctest: +SKIP
        >>> stats[1].speedup  # doctest: +SKIP
        1.7
    """
    o = options if options is not None else BenchOptions()
    _check_options(paths, o)
    threads = o.threads or physical_cores()
    models = [model_from_path(p, f"model {i + 1}") for i, p in enumerate(paths)]
    source = feeds.source(models[0].proto) if isinstance(feeds, FeedSpec) else feeds
    _check_same_inputs(models)
    sessions = []
    for m in models:
        sessions.append(session_from_model(m.proto, f"model '{m.path}'", o.opt_level, threads, m.external_dir))
    specs = [input_specs(m.proto) for m in models]
    del models  # the protos (weights included) are no longer needed; sessions hold their own copy
    times, samples = _time_interleaved(paths, sessions, specs, source, o)
    stats = [_stats(str(p), t, n, o.runs, o.warmup, threads) for p, t, n in zip(paths, times, samples, strict=True)]
    ref = stats[0].p50_ms
    return [stats[0]] + [_with_speedup(s, ref) for s in stats[1:]]


def _check_options(paths: list[str | Path], o: BenchOptions) -> None:
    if not paths:
        raise DiagError("bad-option", "models", "none given", "pass at least one model: diag bench fp32.onnx int8.onnx")
    if o.runs < 1:
        raise DiagError("bad-option", "--runs", "must be at least 1", "pass --runs 50")
    if o.warmup < 0:
        raise DiagError("bad-option", "--warmup", "must be 0 or more", "pass --warmup 5")
    if o.threads is not None and o.threads < 1:
        raise DiagError("bad-option", "--threads", "must be at least 1", "omit it to use the physical cores")


def _time_interleaved(
    paths: list[str | Path], sessions: list[Any], specs: list[Any], source: FeedSource, o: BenchOptions
) -> tuple[list[np.ndarray], list[int]]:
    """Seconds of every timed run per model, and the samples each timed; models rotate per round."""
    times = [np.empty(o.runs, dtype=np.float64) for _ in paths]
    samples = [0 for _ in paths]
    bar = Progress(None, "bench", enabled=o.progress)
    batches = _cycle(source)
    checked = False
    try:
        for r in range(o.warmup + o.runs):
            batch = next(batches)
            if not checked:  # fixed dims may differ between files: the first batch must fit every model
                for p, sp in zip(paths[1:], specs[1:], strict=True):
                    validate_feed(batch.feeds, sp, f"first batch for '{Path(p).name}'")
                checked = True
            start_at = r % len(sessions)
            for k in range(len(sessions)):
                i = (start_at + k) % len(sessions)
                elapsed = _timed_run(sessions[i], batch.feeds, paths[i])
                if r >= o.warmup:
                    times[i][r - o.warmup] = elapsed
                    samples[i] += batch.size
            bar.advance(batch.size)
    finally:
        bar.close()
    return times, samples


def _timed_run(sess: Any, feeds: dict[str, np.ndarray], path: str | Path) -> float:
    t0 = time.perf_counter()
    try:
        sess.run(None, feeds)
    except Exception as e:
        raise DiagError(
            "runtime-failure",
            f"model '{path}'",
            f"onnxruntime failed: {str(e).strip().splitlines()[0][:300] if str(e).strip() else e}",
            "check the model runs on these inputs (diag compare shows the failing node)",
        ) from e
    return time.perf_counter() - t0


def format_table(stats: list[LatencyStats]) -> str:
    """The bench as a fixed-width text table (what ``diag bench`` prints).

    Example:
        >>> s = LatencyStats("fp32.onnx", 20, 5, 2, 1.0, 1.2, 1.3, 0.9, 1.3, 1.05, 952.4, None)
        >>> print(format_table([s]).splitlines()[0].split())
        ['model', 'p50', 'ms', 'p90', 'ms', 'p99', 'ms', 'min-max', 'ms', 'samples/s', 'speedup']
    """
    name_w = max(5, *(len(Path(s.model).name) for s in stats))
    head = f"{'model':<{name_w}}  {'p50 ms':>8}  {'p90 ms':>8}  {'p99 ms':>8}  {'min-max ms':>17}  "
    head += f"{'samples/s':>10}  {'speedup':>7}"
    lines = [head]
    for s in stats:
        noise = f"{s.min_ms:.2f}-{s.max_ms:.2f}"
        speed = "ref" if s.speedup is None else f"{s.speedup:.2f}x"
        lines.append(
            f"{Path(s.model).name:<{name_w}}  {s.p50_ms:>8.2f}  {s.p90_ms:>8.2f}  {s.p99_ms:>8.2f}  {noise:>17}  "
            f"{s.throughput_per_s:>10.1f}  {speed:>7}"
        )
    first = stats[0]
    lines.append(
        f"{first.runs} timed runs per model after {first.warmup} warm-up, interleaved; "
        f"intra_op_num_threads={first.threads}; speedup = p50 of {Path(first.model).name} / p50"
    )
    return "\n".join(lines)


def _check_same_inputs(models: list[LoadedModel]) -> None:
    ref = {s.name: s.dtype for s in input_specs(models[0].proto)}
    for m in models[1:]:
        have = {s.name: s.dtype for s in input_specs(m.proto)}
        if have != ref:
            raise DiagError(
                "model-mismatch",
                f"models '{models[0].path.name}' / '{m.path.name}'",
                f"have different inputs ({_describe(ref)} vs {_describe(have)})",
                "bench versions of the same model (FP32, INT8, mixed) on the same inputs",
            )


def _describe(inputs: dict[str, np.dtype]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(inputs.items()))


def _cycle(source: FeedSource) -> Any:
    """Batches forever: restart the source when it runs out (it is restartable by contract)."""
    while True:
        empty = True
        for batch in source:
            empty = False
            yield batch
        if empty:
            raise DiagError("bad-inputs", "inputs", "yielded zero samples", "provide at least one sample")


def _stats(model: str, seconds: np.ndarray, samples: int, runs: int, warmup: int, threads: int) -> LatencyStats:
    ms = seconds * 1000.0
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    total = float(seconds.sum())
    return LatencyStats(
        model=model,
        runs=runs,
        warmup=warmup,
        threads=threads,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        mean_ms=float(ms.mean()),
        throughput_per_s=samples / total if total > 0 else float("inf"),
        speedup=None,
    )


def _with_speedup(s: LatencyStats, ref_p50: float) -> LatencyStats:
    d = s.to_dict()
    d["speedup"] = ref_p50 / s.p50_ms if s.p50_ms > 0 else None
    return LatencyStats(**d)
