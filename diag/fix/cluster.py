"""Scale out on Dask (``--scheduler ADDRESS|local[:N]``): the same answers as one local run, sooner.

Three verbs fan out, each through the machinery it already has for doing work in parts:

* ``compare``: the batches are split into shards exactly as ``--shard k/n`` splits them; each
  worker reads the inputs from the same path (no sample travels through the scheduler), runs the
  pipeline on its shard and returns the shard state ``diag merge`` reads (:mod:`diag.analysis.merge`);
  the states are tree-reduced on the cluster with :meth:`diag.analysis.compare.CompareState.merge`.
* ``exclude``: every trial (re-quantize with a list kept in float, evaluate on the held-out
  split) is a task. The search itself still runs here, unchanged; while it waits for the trial it
  needs, the trials it *may* need next are computed ahead (see :func:`diag.fix.search.plan_ahead`),
  so its choices, its trajectory and its answer are those of the serial search, whatever order
  the tasks finish in.
* ``sweep``: every recipe's quantization and held-out metrics is a task; latency is measured
  afterwards on this machine, one recipe at a time, with the cluster idle.

NOTE: latency is never measured on a worker: workers may be other machines, and on a
``local:N`` cluster they share this machine's cores with each other.

NOTE: Dask is an optional extra (``pip install "diag[dask]"``); this module imports it inside
functions only, so ``import diag.fix.cluster`` works without it and fails with a slugged error when a
cluster is actually asked for.

Faults: a worker that dies mid-task has its task re-run elsewhere by the scheduler (up to
``distributed.scheduler.allowed-failures`` times); the answer does not change and the re-runs
are counted (``retries``). An unreachable scheduler is a ``no-scheduler`` error before any
work. Ctrl-C cancels every task this run submitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.analysis.compare import CompareOptions, CompareState, load_pair, run_comparison
from diag.analysis.merge import state_from_json, state_to_json
from diag.core.feeds import FeedSource, FeedSpec, load_labels
from diag.core.load import float_model_from_path
from diag.core.match import match_models
from diag.core.recipe import Recipe
from diag.fix.evaluate import HeldOutEvaluator, HeldOutMetrics, split_feeds
from diag.fix.exclude import ExcludeOptions
from diag.fix.quantize import quantize_model
from diag.fix.search import plan_ahead
from diag.fix.sweep import MeasureContext, SweepEntry, SweepOptions, SweepRun, measure_recipe, time_against_fp32
from diag.foundations.errors import DiagError
from diag.foundations.progress import Progress

#: Seconds to wait for a scheduler given by address to answer.
CONNECT_TIMEOUT = 10.0
#: Seconds to wait for a reachable scheduler to have at least one worker.
WORKER_TIMEOUT = 60.0
INSTALL_HINT = 'pip install "diag[dask]"'


# ---------------------------------------------------------------- connecting


def parse_scheduler(text: str) -> tuple[str, int | str]:
    """``local`` / ``local:N`` -> ``("local", N)``; anything else is a scheduler address.

    Example:
        >>> parse_scheduler("local:3"), parse_scheduler("tcp://10.0.0.5:8786")
        (('local', 3), ('address', 'tcp://10.0.0.5:8786'))
    """
    text = text.strip()
    if text == "local" or text.startswith("local:"):
        count = text.partition(":")[2]
        if not count:
            return "local", os.cpu_count() or 1
        if not count.isdigit() or int(count) < 1:
            raise DiagError(
                "bad-option", f"--scheduler {text}", "needs a worker count of at least 1", "e.g. --scheduler local:2"
            )
        return "local", int(count)
    if not text:
        raise DiagError("bad-option", "--scheduler", "is empty", "give ADDRESS (tcp://host:8786) or local[:N]")
    return "address", text


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError as e:
        raise DiagError(
            "missing-extra",
            "--scheduler",
            f"needs Dask, which is not installed ({e})",
            f"{INSTALL_HINT}, or run without --scheduler",
        ) from e
    if not os.environ.get("DIAG_DASK_LOGS"):
        # NOTE: distributed logs worker restarts and retries at INFO/WARNING on stderr; diag's
        # contract is one line per problem, and the retries are counted in the report instead.
        for name in ("distributed", "distributed.nanny", "distributed.scheduler", "distributed.worker"):
            logging.getLogger(name).setLevel(logging.ERROR)
    return distributed


def require_scheduler(text: str) -> None:
    """Fail before any work when ``--scheduler`` cannot be used: bad syntax, no Dask, no answer.

    A ``local[:N]`` cluster is started later, by the verb; an address is connected to and
    dropped again (a second connection costs milliseconds, a failed search costs minutes).

    Example:
        >>> require_scheduler("tcp://127.0.0.1:1")  # doctest: +SKIP
        Traceback (most recent call last):
        diag.foundations.errors.DiagError: --scheduler tcp://127.0.0.1:1 | cannot be reached ...
    """
    kind, value = parse_scheduler(text)
    _import_distributed()
    if kind == "address":
        _connect(str(value)).close()


def _connect(address: str) -> Any:
    distributed = _import_distributed()
    try:
        return distributed.Client(address, timeout=CONNECT_TIMEOUT, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as e:
        raise DiagError(
            "no-scheduler",
            f"--scheduler {address}",
            f"cannot be reached ({type(e).__name__}: {e})",
            "start one (`dask scheduler`, then `dask worker ADDRESS` on each machine), check the address and "
            "firewall, or use --scheduler local:2",
        ) from e


@dataclass
class Cluster:
    """A connected Dask client and what this run did with it (tasks, retries)."""

    client: Any
    address: str
    dashboard: str | None
    workers: int
    #: Worker threads: how many tasks run at once.
    slots: int
    local: Any = None
    tasks: int = 0
    retries: int = 0
    #: Tasks computed ahead that the run did not need (exclude's speculation).
    unused: int = 0
    #: Tasks cancelled before they finished (never counted as done).
    cancelled: int = 0

    def info(self, latency: bool = False) -> dict[str, Any]:
        """What the report says about the cluster; with ``latency``, where latency was measured."""
        info = {
            "scheduler": "local" if self.local is not None else self.address,
            "workers": self.workers,
            "threads": self.slots,
            "tasks": self.tasks,
            "unused_tasks": self.unused,
            "retries": self.retries,
        }
        if latency:
            info["latency_measured_on"] = f"{socket.gethostname()} (the machine that ran diag, not the workers)"
        return info

    def close(self) -> None:
        self.client.close()
        if self.local is not None:
            self.local.close()

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.tasks += 1
        # pure=False: two trials with equal arguments are still two tasks (a retried one included).
        return self.client.submit(fn, *args, pure=False, **kw)

    def count_retries(self, futures: list[Any]) -> None:
        """Add how often each finished future's task was re-run because its worker died.

        The scheduler counts that per task (``TaskState.suspicious``) while the future is held.
        """
        keys = [f.key for f in futures]
        if keys:
            self.retries += sum(self.client.run_on_scheduler(_suspicious, keys).values())

    def fetch(self, future: Any) -> Any:
        """A finished task's result (a failure of the cluster itself is a ``cluster-failure`` error),
        its re-runs counted; a DiagError the task returned as data is still to be raised by the caller."""
        try:
            result = future.result()
        except DiagError:
            raise
        except Exception as e:
            raise _cluster_failure(e) from e
        self.count_retries([future])
        return result

    def cancel(self, futures: list[Any]) -> None:
        """Cancel tasks, counting the re-runs they already cost (a speculative trial can be retried too)."""
        if futures:
            with contextlib.suppress(OSError, TimeoutError):  # the scheduler went away: nothing to count
                self.count_retries(futures)
            self.client.cancel(futures)
            self.cancelled += len(futures)


def _suspicious(keys: list[Any], dask_scheduler: Any = None) -> dict[str, int]:
    out = {}
    for k in keys:
        ts = dask_scheduler.tasks.get(k)
        out[str(k)] = ts.suspicious if ts is not None else 0
    return out


def open_cluster(text: str, progress: bool = True) -> Cluster:
    """Start a ``LocalCluster`` (``local[:N]``: N worker processes, one thread each) or connect.

    Prints the Dask dashboard link on stderr when there is one.

    Example:
        >>> c = open_cluster("local:2")  # doctest: +SKIP
        >>> c.workers, c.slots  # doctest: +SKIP
        (2, 2)
    """
    kind, value = parse_scheduler(text)
    distributed = _import_distributed()
    local = None
    if kind == "local":
        local = distributed.LocalCluster(
            n_workers=int(value),
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        )
        client = distributed.Client(local, set_as_default=False)
    else:
        client = _connect(str(value))
    try:
        client.wait_for_workers(1, timeout=WORKER_TIMEOUT)
    except (TimeoutError, OSError) as e:
        client.close()
        raise DiagError(
            "no-scheduler",
            f"--scheduler {text}",
            f"has no worker after {WORKER_TIMEOUT:.0f} s",
            "start workers with `dask worker ADDRESS`",
        ) from e
    info = client.scheduler_info()
    workers = info.get("workers", {})
    dashboard = None
    if "dashboard" in info.get("services", {}):
        dashboard = client.dashboard_link
    cluster = Cluster(
        client,
        info.get("address", str(value)),
        dashboard,
        len(workers),
        sum(int(w.get("nthreads", 1)) for w in workers.values()) or 1,
        local,
    )
    lines = Progress(None, "dask", enabled=False)
    if dashboard:
        lines.note(f"dask: dashboard at {dashboard}")
    elif progress:
        lines.note(f"dask: {cluster.workers} worker(s), {cluster.slots} thread(s) at {cluster.address}")
    return cluster


# ---------------------------------------------------------------- progress


class TaskBar:
    """One progress bar over every task of the run: done / submitted, running, retried.

    Also stands in for the bar of :class:`diag.fix.exclude._Search`, whose per-trial lines it prints
    (``note``) while the count comes from the tasks themselves.
    """

    def __init__(self, cluster: Cluster, label: str, enabled: bool) -> None:
        self.cluster = cluster
        self._bar = Progress(0, label, enabled=enabled, unit="tasks")
        self._closed = False

    # The search sets its bar's total to its own estimate; the tasks know better.
    @property
    def total(self) -> int | None:
        return self._bar.total

    @total.setter
    def total(self, value: int | None) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        """Ignored: the search advances per trial it reads, this bar per task that finished."""

    def finished(self, done: int, running: int) -> None:
        self._bar.total = self.cluster.tasks - self.cluster.cancelled
        self._bar.unit = f"tasks ({running} running, {self.cluster.retries} retried)"
        self._bar.advance(done)

    def note(self, line: str) -> None:
        self._bar.note(line)

    def finish(self) -> None:
        if not self._closed:
            self._closed = True
            self._bar.finish()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bar.close()


def _raise_task_error(result: Any) -> Any:
    """Worker functions return ``{"error": [...]}`` for a DiagError (it does not pickle by value).

    The object says it happened on a worker: a path that exists here may not exist there."""
    if isinstance(result, dict) and "error" in result:
        slug, obj, problem, hint = result["error"]
        raise DiagError(slug, f"{obj} (on a Dask worker)", problem, hint)
    return result


def _cluster_failure(e: BaseException) -> DiagError:
    return DiagError(
        "cluster-failure",
        "a Dask task",
        f"failed on the cluster ({type(e).__name__}: {e})",
        "check that every worker can read the models and inputs at the same paths and has diag installed; "
        "a task whose workers keep dying is given up after distributed.scheduler.allowed-failures retries",
    )


def _worker_task(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` on a worker; a DiagError comes back as data, re-raised by the client."""

    @functools.wraps(fn)
    def run(*args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except DiagError as e:
            return {"error": [e.slug, e.obj, e.problem, e.hint]}

    return run


def gather_as_done(
    cluster: Cluster, futures: list[Any], bar: TaskBar, wanted: set[int] | None = None
) -> Generator[tuple[int, Any], None, None]:
    """Yield ``(index, result)`` as tasks finish, in whatever order (only ``wanted`` indexes fetch
    their result; the others are counted); on Ctrl-C or an error every task is cancelled.

    Callers put results back in their own order: nothing downstream depends on completion order."""
    distributed = _import_distributed()
    pending = {f: i for i, f in enumerate(futures)}
    try:
        with cluster.client.as_current():
            finished = distributed.as_completed(list(pending))
        for future in finished:
            i = pending.pop(future)
            if future.status == "error" or wanted is None or i in wanted:
                result = cluster.fetch(future)
                bar.finished(1, sum(1 for f in pending if f.status == "pending"))
                yield i, _raise_task_error(result)
            else:
                cluster.count_retries([future])
                bar.finished(1, sum(1 for f in pending if f.status == "pending"))
    except BaseException:
        cluster.cancel(list(pending))
        raise


# ---------------------------------------------------------------- worker context

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: dict[str, Any] = {}


def _context(key: str, build: Callable[[], Any]) -> Any:
    """A per-worker-process cache of the expensive set-up of a run (FP32 held-out outputs).

    Only the latest run's context is kept: memory stays one evaluator per worker.
    """
    with _CONTEXT_LOCK:
        if key not in _CONTEXT:
            _CONTEXT.clear()
            _CONTEXT[key] = build()
        return _CONTEXT[key]


def _absolute(spec: Any) -> Any:
    """A FeedSpec whose paths do not depend on the worker's working directory."""
    if spec is None or not spec.inputs:
        return spec
    return dataclasses.replace(spec, inputs=str(Path(spec.inputs).resolve()))


def _model_files(folder: Path, stem: str) -> dict[str, bytes]:
    """The model file and its external data files, to be written again under the same names."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith(stem)}


# ---------------------------------------------------------------- compare


@_worker_task
def _compare_shard(fp32: str, int8: str, spec: Any, options: Any) -> dict[str, Any]:
    fp, q = load_pair(fp32, int8)
    matching = match_models(fp.proto, q.proto)
    state, unmatched = run_comparison(fp, q, matching, spec.source(fp.proto), options)
    return {"state": state_to_json(state), "unmatched": unmatched}


@_worker_task
def _merge_shards(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if "error" in a:
        return a
    if "error" in b:
        return b
    state = state_from_json(a["state"]).merge(state_from_json(b["state"]))
    return {"state": state_to_json(state), "unmatched": {**a["unmatched"], **b["unmatched"]}}


def compare_on_cluster(
    fp32_path: str | Path, int8_path: str | Path, spec: FeedSpec | None, feeds: FeedSource, options: CompareOptions
) -> tuple[CompareState, dict[str, str], dict[str, Any]]:
    """Run a comparison as shards on the cluster; return the merged state as ``run_comparison`` does.

    ``min(batches, worker threads)`` shards: shard k runs batches k, k + n, ... exactly as
    ``diag compare --shard k/n`` would, reading the inputs itself from ``spec`` (a path, a
    reader module or the random seed: no sample travels through the scheduler). Their states are
    merged pairwise on the cluster in a fixed order; histograms and counts equal one local run's
    exactly, float sums to rounding. ``feeds`` (the same inputs, opened here) is read once to
    count the batches.

    Example:
        >>> state, unmatched, info = compare_on_cluster("fp.onnx", "q.onnx", spec, feeds, options)  # doctest: +SKIP
        >>> state.samples, info["shards"]  # doctest: +SKIP
        (32, 2)
    """
    if spec is None:
        raise DiagError(
            "bad-option",
            "--scheduler",
            "needs inputs every worker can open itself (a FeedSpec: path, reader or --random), not a stream",
            "pass FeedSpec(inputs=...) instead of a FeedSource",
        )
    if options.shard is not None:
        raise DiagError(
            "bad-option",
            "--shard with --scheduler",
            "both split the batches",
            "use --scheduler alone (it shards and merges), or --shard + diag merge without Dask",
        )
    assert options.scheduler is not None, "diag.cli.verbs.diagnose calls this only with --scheduler"
    batches = sum(1 for _ in feeds)
    if batches == 0:
        raise DiagError("bad-inputs", "inputs", "yielded zero samples", "provide at least one sample")
    cluster = open_cluster(options.scheduler, options.progress)
    bar = TaskBar(cluster, "compare", options.progress)
    futures: list[Any] = []
    try:
        n = max(1, min(batches, cluster.slots))
        shard_options = dataclasses.replace(
            options,
            shard=(0, n),
            progress=False,
            scheduler=None,
            effects=0,
            sensitivity=0,
            labels=str(Path(options.labels).resolve()) if options.labels else None,
        )
        spec = _absolute(spec)
        fp32, int8 = str(Path(fp32_path).resolve()), str(Path(int8_path).resolve())
        level = [
            cluster.submit(_compare_shard, fp32, int8, spec, dataclasses.replace(shard_options, shard=(k, n)))
            for k in range(n)
        ]
        futures.extend(level)
        while len(level) > 1:  # a tree: log2(n) rounds of pairwise merges, on the workers
            pairs = [level[i : i + 2] for i in range(0, len(level), 2)]
            level = [cluster.submit(_merge_shards, *p) if len(p) == 2 else p[0] for p in pairs]
            futures.extend(f for f in level if f not in futures)
        final = futures.index(level[0])
        merged = dict(gather_as_done(cluster, futures, bar, wanted={final}))[final]
        bar.finish()
        return state_from_json(merged["state"]), dict(merged["unmatched"]), cluster.info() | {"shards": n}
    finally:
        bar.close()
        cluster.close()


# ---------------------------------------------------------------- exclude


@dataclass(frozen=True)
class TrialJob:
    """What a worker needs to run exclusion trials: paths and settings, never arrays."""

    fp32: str
    recipe: Any
    feeds: Any
    #: The held-out share, as ``diag exclude`` splits; None: evaluate on every sample (sensitivity).
    holdout: float | None
    labels: str | None
    threads: int | None
    metric: str | None
    #: Static recipe without calibration data: calibrate on the ranking split (every sample
    #: when ``holdout`` is None); only when the shipped calibration cache cannot be used.
    calibrate_on_ranking: bool
    #: What "met" means (the model comes back only then); None: never.
    target: Any

    def key(self) -> str:
        return repr(self)


def _trial_context(job: TrialJob) -> tuple[Any, Any]:
    fp = float_model_from_path(Path(job.fp32))
    source = job.feeds.source(fp.proto)
    labels = load_labels(job.labels) if job.labels else None
    if job.holdout is None:
        evaluator = HeldOutEvaluator(fp, source, 0, labels, job.threads, job.metric)
        return evaluator, source if job.calibrate_on_ranking else None
    split = split_feeds(source, job.holdout)
    evaluator = HeldOutEvaluator(fp, split.held_out, split.held_out_first, labels, job.threads, job.metric)
    return evaluator, split.ranking if job.calibrate_on_ranking else None


@_worker_task
def _exclusion_trial(job: TrialJob, nodes: list[str], stem: str, calibration_cache: bytes | None) -> dict[str, Any]:
    """One trial on a worker: quantize with ``nodes`` kept in float, evaluate on the held-out split.

    The model comes back (as bytes) only when it met the target: the search reads met lists again
    (the answer is one of them) and never the others.
    """
    evaluator, calibration = _context(job.key(), lambda: _trial_context(job))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diag-trial-") as d:
        cache = Path(d) / "calibration.json"
        if calibration_cache is not None:
            cache.write_bytes(calibration_cache)
        out = Path(d) / f"{stem}.onnx"
        report = quantize_model(
            job.fp32,
            job.recipe.with_excluded(nodes),
            out,
            calibration=calibration,
            progress=False,
            calibration_cache=cache,
        )
        metrics = evaluator.evaluate(out)
        met = job.target is not None and metrics.meets(job.target)
        files = _model_files(Path(d), stem) if met else {}
    return {
        "metrics": metrics,
        "met": met,
        "calibrations": report.calibrations,
        "steps": report.steps,
        "files": files,
        "seconds": time.perf_counter() - t0,
    }


class ClusterTrials:
    """Runs an exclusion search's trials on the cluster; plugged into ``_Search.remote``.

    Called by ``_Search.try_groups`` with the groups it needs now; returns their metrics (and
    writes the model to ``path`` when it met the target) once that task is done. While waiting,
    keeps every worker thread busy with :func:`plan_ahead`'s next trials and cancels those the
    answers that came in made unreachable.
    """

    def __init__(self, cluster: Cluster, search: Any, job: TrialJob, progress: bool) -> None:
        self.cluster = cluster
        self.search = search
        self.job = job
        cache = search.calibration_cache
        self.calibration_cache = cache.read_bytes() if cache.exists() else None
        self.futures: dict[frozenset[int], Any] = {}
        self.results: dict[frozenset[int], dict[str, Any]] = {}
        self.bar = TaskBar(cluster, "exclude", progress)
        search.bar.close()
        search.bar = self.bar

    def __call__(self, groups: frozenset[int], path: Path) -> Any:
        try:
            while groups not in self.results:
                self._submit_ahead(groups)
                self._wait_any()
        except BaseException:
            self._cancel_all()
            raise
        result = self.results[groups]
        search = self.search
        search.quantizations += 1
        search.evaluations += 1
        search.calibrations += result["calibrations"]
        search.steps = result["steps"]
        for name, data in result["files"].items():
            # The model under the search's own name, its external data under the names it refers to.
            (path if name == f"{_stem(groups)}.onnx" else path.parent / name).write_bytes(data)
        return result["metrics"]

    def _submit_ahead(self, needed: frozenset[int]) -> None:
        search = self.search
        known = {g: search.met(g) for g in search.cache}
        known.update((g, r["met"]) for g, r in self.results.items())
        if search.estimating:
            # A trial the estimates could not answer: the real search has not started, nothing to plan.
            ahead = [needed]
        else:
            ahead = plan_ahead(
                search.candidates,
                known,
                set(search.cache),
                search.quantizations,
                search.max_trials,
                self.cluster.slots,
                search.guess,
            )
        if needed not in ahead:  # the replay and the search disagree: never the case, but never wait forever
            ahead.insert(0, needed)
        for g in [g for g in self.futures if g not in ahead and g != needed]:
            self.cluster.cancel([self.futures.pop(g)])
            self.cluster.unused += 1
        for g in ahead:
            if len(self.futures) >= self.cluster.slots and g != needed:
                break
            if g not in self.futures and g not in self.results:
                nodes = search.nodes(g)
                self.futures[g] = self.cluster.submit(
                    _exclusion_trial, self.job, nodes, _stem(g), self.calibration_cache
                )

    def _wait_any(self) -> None:
        distributed = _import_distributed()
        with self.cluster.client.as_current():
            done, _ = distributed.wait(list(self.futures.values()), return_when="FIRST_COMPLETED")
        for g, f in list(self.futures.items()):
            if f not in done:
                continue
            result = self.cluster.fetch(f)
            del self.futures[g]
            f.release()
            self.results[g] = _raise_task_error(result)
            self.bar.finished(1, len(self.futures))

    def _cancel_all(self) -> None:
        self.cluster.cancel(list(self.futures.values()))
        self.futures.clear()

    def close(self) -> None:
        """Cancel what is still running; count what was computed and never read."""
        self.cluster.unused += len(self.futures) + sum(1 for g in self.results if g not in self.search.cache)
        self._cancel_all()
        self.bar.close()
        self.cluster.close()


def _stem(groups: frozenset[int]) -> str:
    return "trial-" + "-".join(str(i) for i in sorted(groups)) if groups else "trial-baseline"


def _static_without_calibration(recipe: Any) -> bool:
    """A static recipe with no calibration data of its own (it calibrates on the inputs)."""
    return getattr(recipe.mode, "name", recipe.mode) == "static" and not getattr(recipe, "calibration", None)


class ClusterTrialRunner:
    """``diag exclude --scheduler``: the search's trials as Dask tasks (a :class:`diag.fix.exclude.TrialRunner`).

    :meth:`start` is called after the baseline trial and the ranking pass, which stay local:
    everything else depends on them, and a static recipe's calibration is done once, by the
    baseline; its cached ranges travel with every task.

    Example:
        >>> options = ExcludeOptions("cosine>=0.99", scheduler="local:2")
        >>> runner = ClusterTrialRunner("local:2", "fp32.onnx", recipe, spec, options)  # doctest: +SKIP
        >>> derive_exclusions("fp32.onnx", recipe, spec, options, trials=runner)  # doctest: +SKIP
    """

    def __init__(self, scheduler: str, fp32: str | Path, recipe: Recipe, feeds: Any, options: ExcludeOptions) -> None:
        self.scheduler = scheduler
        self.fp32 = Path(fp32)
        self.recipe = recipe
        self.feeds = feeds
        self.options = options
        self.trials: ClusterTrials | None = None

    def check(self) -> None:
        """No Dask, no scheduler, bad syntax: a slugged error before any work."""
        require_scheduler(self.scheduler)

    def start(self, search: Any) -> None:
        """Connect and make ``search`` run its trials on the cluster (``search.remote``)."""
        if not hasattr(self.feeds, "source"):
            raise DiagError(
                "bad-option",
                "--scheduler",
                "needs the inputs as a path or reader every worker can open (a FeedSpec), not a stream",
                "pass FeedSpec(inputs=...) instead of a FeedSource",
            )
        o = self.options
        recipe = _located(self.recipe)
        job = TrialJob(
            str(self.fp32.resolve()),
            recipe,
            _absolute(self.feeds),
            o.holdout,
            str(Path(o.labels).resolve()) if o.labels else None,
            o.threads,
            o.metric,
            _static_without_calibration(recipe),
            search.target,
        )
        self.trials = ClusterTrials(open_cluster(self.scheduler, o.progress), search, job, o.progress)
        search.remote = self.trials

    def close(self) -> None:
        if self.trials is not None:
            self.trials.close()

    def info(self, latency: bool) -> dict[str, Any]:
        return self.trials.cluster.info(latency=latency) if self.trials is not None else {}


class ClusterSkipOne:
    """``diag compare --sensitivity K --scheduler``: the skip-one trials as Dask tasks
    (a :class:`diag.fix.sensitivity.SkipOneTrials`), read from ``feeds`` (a FeedSpec) on every worker."""

    def __init__(self, scheduler: str, feeds: Any) -> None:
        self.scheduler = scheduler
        self.feeds = feeds

    def __call__(
        self,
        fp32: Path,
        recipe: Recipe,
        node_lists: list[list[str]],
        calibration_cache: Path,
        threads: int | None,
        progress: bool,
    ) -> list[HeldOutMetrics]:
        return run_trials(self.scheduler, fp32, recipe, self.feeds, node_lists, calibration_cache, threads, progress)


def run_trials(
    scheduler: str,
    fp32: Path,
    recipe: Recipe,
    feeds: FeedSpec,
    node_lists: list[list[str]],
    calibration_cache: Path,
    threads: int | None,
    progress: bool,
) -> list[Any]:
    """Independent trials (``recipe`` + each node list kept in float), evaluated on every sample of
    ``feeds``; their metrics in the order given. What skip-one sensitivity runs on a cluster.

    Example:
        >>> ms = run_trials("local:2", fp, recipe, spec, [["mm1"], ["mm2"]], cache, None, True)  # doctest: +SKIP
        >>> len(ms)  # doctest: +SKIP
        2
    """
    if feeds is None:
        raise DiagError(
            "bad-option",
            "--scheduler",
            "needs inputs every worker can open itself (a FeedSpec: path, reader or --random), not a stream",
            "pass FeedSpec(inputs=...) instead of a FeedSource",
        )
    recipe = _located(recipe)
    job = TrialJob(
        str(Path(fp32).resolve()),
        recipe,
        _absolute(feeds),
        None,
        None,
        threads,
        None,
        _static_without_calibration(recipe),
        None,
    )
    cache = calibration_cache.read_bytes() if calibration_cache.exists() else None
    cluster = open_cluster(scheduler, progress)
    bar = TaskBar(cluster, "sensitivity", progress)
    try:
        futures = [
            cluster.submit(_exclusion_trial, job, nodes, f"trial-{i}", cache) for i, nodes in enumerate(node_lists)
        ]
        results = dict(gather_as_done(cluster, futures, bar))
        bar.finish()
        return [results[i]["metrics"] for i in range(len(node_lists))]
    finally:
        bar.close()
        cluster.close()


# ---------------------------------------------------------------- sweep


@dataclass(frozen=True)
class SweepJob:
    """What a worker needs to measure sweep recipes: paths and settings, never arrays."""

    fp32: str
    feeds: Any
    calib: Any
    holdout: float
    labels: str | None
    threads: int
    #: Some static recipe has no calibration data: split the inputs as the serial sweep does.
    split_for_calibration: bool

    def key(self) -> str:
        return repr(self)


def _sweep_context(job: SweepJob) -> tuple[Any, Any, Any]:
    fp = float_model_from_path(Path(job.fp32))
    source = job.feeds.source(fp.proto)
    # NOTE: the same split as diag.fix.sweep.sweep_model makes (kept in step with it by the test that
    # compares a cluster sweep with a serial one).
    if job.calib is not None:
        calibration, held, first = job.calib.source(fp.proto), source, 0
    elif job.split_for_calibration:
        s = split_feeds(source, job.holdout)
        calibration, held, first = s.ranking, s.held_out, s.held_out_first
    else:
        calibration, held, first = None, source, 0
    labels = load_labels(job.labels) if job.labels else None
    return HeldOutEvaluator(fp, held, first, labels, job.threads), held, calibration


@_worker_task
def _sweep_recipe(job: SweepJob, recipe: Any, key: str, stem: str) -> dict[str, Any]:
    """Quantize and evaluate one recipe on a worker (no latency); the model comes back for timing."""
    evaluator, held, calibration = _context(job.key(), lambda: _sweep_context(job))
    with tempfile.TemporaryDirectory(prefix="diag-sweep-") as d:
        path = Path(d) / f"{stem}.onnx"
        ctx = MeasureContext(Path(job.fp32), calibration, evaluator, held, 0, 0, 1, job.threads)
        entry = measure_recipe(recipe, key, path, ctx, {}, keep=True)
        files = _model_files(Path(d), stem) if entry.ok else {}
    return {"entry": entry.to_dict(), "files": files}


class SweepOnCluster:
    """Recipes submitted to the cluster; :meth:`entry` hands them out in grid order.

    With ``wait_all`` every task is back before the first entry is read (latency is then timed
    with the cluster idle); otherwise :meth:`entry` waits for the recipe it is asked for only, so
    a sweep without latency writes each entry as soon as it and those before it are done.
    """

    def __init__(self, cluster: Cluster, fp32: Path, work: Path, indexes: list[int], futures: list[Any], bar: TaskBar):
        self.cluster = cluster
        self.fp32 = fp32
        self.work = work
        self.bar = bar
        self.measured: dict[int, tuple[dict[str, Any], Path | None]] = {}
        self._indexes = indexes
        self._futures = futures
        self._done = gather_as_done(cluster, futures, bar)

    def wait_all(self) -> None:
        for n, result in self._done:
            self._store(n, result)
        self.bar.finish()

    def _store(self, n: int, result: dict[str, Any]) -> None:
        i = self._indexes[n]
        path = None
        for name, data in result["files"].items():
            (self.work / name).write_bytes(data)
            if name == f"{i:03d}.onnx":
                path = self.work / name
        self.measured[i] = (result["entry"], path)

    def entry(self, i: int, by_hash: dict[str, Any], held: Any, timing: MeasureContext) -> SweepEntry:
        """Recipe ``i`` as the serial sweep records it: a byte-identical model reuses the earlier
        entry's numbers; latency is measured now, on this machine, FP32 and INT8 interleaved
        (``timing.runs`` 0: none)."""
        while i not in self.measured:
            n, result = next(self._done)
            self._store(n, result)
        d, path = self.measured.pop(i)
        entry = SweepEntry.from_dict(d)
        try:
            if not entry.ok or path is None:
                return entry
            same = by_hash.get(entry.model_sha256 or "")
            if same is not None:
                return dataclasses.replace(entry, metrics=same.metrics, latency=same.latency, identical_to=same.key)
            if timing.runs > 0:
                try:
                    latency = time_against_fp32(self.fp32, path, held, timing)
                except DiagError as e:
                    if e.slug not in ("runtime-failure", "invalid-model"):
                        raise
                    return dataclasses.replace(
                        entry,
                        status="skipped",
                        reason=f"quantized, but onnxruntime cannot run it: {e.problem}",
                        metrics=None,
                        latency=None,
                    )
                entry = dataclasses.replace(entry, latency=latency)
            return entry
        finally:
            if path is not None:
                for p in path.parent.glob(path.stem + "*"):
                    p.unlink(missing_ok=True)

    def close(self) -> None:
        """Cancel what is still running (Ctrl-C, an error) and disconnect."""
        self._done.close()
        self.cluster.cancel([f for f in self._futures if f.status == "pending"])
        self.bar.close()
        self.cluster.close()


class ClusterRecipes:
    """``diag sweep --scheduler``: every recipe's quantization and held-out metrics as a Dask task
    (a :class:`diag.fix.sweep.RecipeRunner`); latency is timed here afterwards, one recipe at a time.

    Every recipe is independent, so all are submitted together; the models come back into the
    sweep's work folder for the latency runs :meth:`entry` does, after every task is back (when
    latency is measured at all).

    Example:
        >>> runner = ClusterRecipes("local:2", spec, SweepOptions(scheduler="local:2"))  # doctest: +SKIP
        >>> sweep_model("fp32.onnx", spec, "out", options, runner=runner)  # doctest: +SKIP
    """

    def __init__(self, scheduler: str, feeds: Any, options: SweepOptions) -> None:
        self.scheduler = scheduler
        self.feeds = feeds
        self.options = options
        self.remote: SweepOnCluster | None = None
        self.run: SweepRun | None = None
        self.lines: Progress | TaskBar = Progress(None, "sweep", enabled=False)

    def check(self) -> None:
        """No Dask, no scheduler, bad syntax: a slugged error before any work."""
        require_scheduler(self.scheduler)

    def start(self, run: SweepRun, todo: list[tuple[int, Recipe, str]]) -> None:
        o = self.options
        self.run = run
        cluster = open_cluster(self.scheduler, o.progress)
        job = SweepJob(
            str(run.fp32.resolve()),
            _absolute(self.feeds),
            _absolute(o.calib),
            o.holdout,
            str(Path(o.labels).resolve()) if o.labels else None,
            run.threads,
            run.split_needed,
        )
        bar = TaskBar(cluster, "sweep", o.progress)
        try:
            futures = [cluster.submit(_sweep_recipe, job, _located(r), key, f"{i:03d}") for i, r, key in todo]
        except BaseException:
            bar.close()
            cluster.close()
            raise
        self.remote = SweepOnCluster(cluster, run.fp32, run.work, [i for i, _, _ in todo], futures, bar)
        self.lines = bar
        if o.runs > 0:  # latency is timed with the cluster idle
            self.remote.wait_all()

    def entry(self, i: int, recipe: Recipe, key: str, by_hash: dict[str, SweepEntry]) -> SweepEntry:
        assert self.remote is not None and self.run is not None
        o, run = self.options, self.run
        timing = MeasureContext(run.fp32, None, None, run.held, o.runs, o.warmup, o.repeats, run.threads)
        return self.remote.entry(i, by_hash, run.held, timing)

    def note(self, line: str) -> None:
        """Above the task bar, which is drawn again below it."""
        self.lines.note(line)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()

    def info(self, latency: bool) -> dict[str, Any]:
        return self.remote.cluster.info(latency=latency) if self.remote is not None else {}


def _located(recipe: Any) -> Any:
    """A recipe whose relative ``calibration`` path is read from this folder on every worker."""
    return recipe if recipe.base_dir else dataclasses.replace(recipe, base_dir=os.getcwd())
