"""`--scheduler`: compare, exclude and sweep on a real Dask LocalCluster give the answers of a local run.

One LocalCluster (2 worker processes, 1 thread each) serves the whole module: starting one costs
seconds, and the suite's time budget is tight.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from diag.analysis.compare import CompareOptions
from diag.cli import commands as cli
from diag.cli.verbs import diagnose, sweep_to_dir
from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fix.cluster import ClusterTrialRunner, parse_scheduler
from diag.fix.exclude import ExcludeOptions, derive_exclusions
from diag.fix.quantize import quantize_model
from diag.fix.sweep import SweepOptions
from diag.fixtures import models
from diag.foundations.errors import DiagError
from diag.report.document import document_from_result

distributed = pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
# NOTE: QUInt8 weights, as in test_exclude: QInt8 saturates on CPUs without VNNI, so which nodes
# a search keeps would depend on the machine.
DYNAMIC = Recipe(mode="dynamic", weight_type="QUInt8")
#: On the transformer fixture: estimates, then a verified guess and its pruning tries as tasks
#: (the plain prefix search and block pruning are replayed in the planning test below).
STRICT = "cosine>=0.9997"


@pytest.fixture(scope="module")
def cluster():
    lc = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40
    )
    client = distributed.Client(lc, set_as_default=False)
    yield lc, client
    client.close()
    lc.close()


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    fx = models.build("transformer")
    fp = tmp / "transformer.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp / "inputs.npz", **fx.make_inputs(32, 12))
    return fp, tmp / "inputs.npz"


@pytest.fixture(scope="module")
def serial_exclusion(transformer):
    fp, npz = transformer
    return derive_exclusions(
        fp, DYNAMIC, FeedSpec(inputs=str(npz), batch=8), ExcludeOptions(STRICT, bench_runs=0, progress=False)
    )


def _numbers_equal(a, b, path=""):
    """Every key and every value equal; floats to rounding (sums are added in another order)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _numbers_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _numbers_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _scrub(doc):
    (doc.get("sensitivity") or {}).pop("seconds", None)
    run = doc["run"]
    run.pop("cluster", None)
    run.pop("seconds")
    doc["environment"].pop("date")
    (doc.get("effects") or {}).pop("seconds", None)
    return doc


def test_compare_on_a_cluster_writes_the_numbers_of_a_local_run(cluster, transformer, tmp_path, monkeypatch):
    import diag.fix.cluster

    fp, npz = transformer
    trials = []
    run_trials = diag.fix.cluster.run_trials
    monkeypatch.setattr(diag.fix.cluster, "run_trials", lambda *a: trials.append(a[4]) or run_trials(*a))
    q = tmp_path / "int8.onnx"
    quantize_model(fp, DYNAMIC, q, progress=False)
    spec = FeedSpec(inputs=str(npz), batch=4, samples=16)
    # effects=0: the effect check runs on this machine after the merge, the same code either way;
    # sensitivity: its 2 skip-one trials are tasks too
    kw = {"progress": False, "effects": 0, "sensitivity": 2, "recipe": DYNAMIC}
    local = diagnose(fp, q, spec, CompareOptions(**kw))
    remote = diagnose(fp, q, spec, CompareOptions(**kw, scheduler=cluster[0].scheduler_address))
    assert [r.to_dict() for r in remote.sensitivity.rows] == [r.to_dict() for r in local.sensitivity.rows]
    assert len(trials) == 1 and len(trials[0]) == 2, "the skip-one trials ran as 2 tasks"
    # diag.json's content (rendering the HTML report would only add seconds)
    a = json.loads(json.dumps(document_from_result(local)))
    b = json.loads(json.dumps(document_from_result(remote)))
    assert remote.cluster["shards"] == 2 and remote.cluster["tasks"] == 3  # 2 shards + 1 merge
    assert remote.samples == local.samples == 16 and remote.batches == 4
    assert remote.findings[0].group.label == local.findings[0].group.label
    # histograms are integer bins: equal exactly, not to tolerance
    for name, h in local.state.distributions.items():
        assert h.fp.to_state() == remote.state.distributions[name].fp.to_state(), name
    _numbers_equal(_scrub(a), _scrub(b))


def test_shard_and_scheduler_together_are_refused(cluster, transformer, tmp_path):
    fp, npz = transformer
    q = tmp_path / "int8.onnx"
    quantize_model(fp, DYNAMIC, q, progress=False)
    options = CompareOptions(progress=False, shard=(0, 2), scheduler=cluster[0].scheduler_address)
    with pytest.raises(DiagError, match="both split the batches") as e:
        diagnose(fp, q, FeedSpec(inputs=str(npz), batch=8), options)
    assert e.value.slug == "bad-option"


def test_exclude_on_a_cluster_takes_the_serial_searchs_every_step(cluster, transformer, serial_exclusion):
    fp, npz = transformer
    spec = FeedSpec(inputs=str(npz), batch=8)
    options = ExcludeOptions(STRICT, bench_runs=0, progress=False, scheduler=cluster[0].scheduler_address)
    trials = ClusterTrialRunner(cluster[0].scheduler_address, fp, DYNAMIC, spec, options)
    r = derive_exclusions(fp, DYNAMIC, spec, options, trials=trials)
    s = serial_exclusion
    real = [t for t in s.trajectory if not t.phase.startswith("estimate")]
    assert len(real) >= 4 and {t.phase for t in real} == {"baseline", "verify", "prune"}
    assert r.nodes_to_exclude == s.nodes_to_exclude
    assert [(t.phase, t.excluded_nodes, t.metric, t.met) for t in r.trajectory] == [
        (t.phase, t.excluded_nodes, t.metric, t.met) for t in s.trajectory
    ]
    assert r.after.to_dict() == s.after.to_dict() and r.quantizations == s.quantizations
    info = r.cluster
    assert info["workers"] == 2 and info["retries"] == 0
    # every trial but the local baseline and op-type checks ran as a task, plus those computed ahead
    remote = sum(1 for t in s.trajectory if t.phase in ("search", "verify", "prune"))
    assert info["tasks"] == remote + info["unused_tasks"]
    assert "latency_measured_on" not in info, "--bench-runs 0: no latency was measured anywhere"
    from diag.report.exclude_view import report_section

    assert "trials on a Dask cluster of 2 worker(s)" in report_section(r.to_dict())["counts"]


class _KillOnce(distributed.WorkerPlugin):
    """SIGKILLs the worker process that starts the first exclusion trial (once: a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def transition(self, key, start, finish, **kwargs):
        if finish == "executing" and "_exclusion_trial" in str(key) and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_trial_is_retried_and_the_answer_is_unchanged(cluster, transformer, tmp_path):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests
    fp, npz = transformer
    spec = FeedSpec(inputs=str(npz), batch=8)
    serial = derive_exclusions(fp, DYNAMIC, spec, ExcludeOptions("cosine>=0.999", bench_runs=0, progress=False))
    lc, client = cluster
    marker = tmp_path / "killed"
    client.register_plugin(_KillOnce(str(marker)), name="kill-once")
    try:
        options = ExcludeOptions("cosine>=0.999", bench_runs=0, progress=False, scheduler=lc.scheduler_address)
        trials = ClusterTrialRunner(lc.scheduler_address, fp, DYNAMIC, spec, options)
        r = derive_exclusions(fp, DYNAMIC, spec, options, trials=trials)
    finally:
        client.unregister_worker_plugin("kill-once")
    assert marker.exists(), "a worker process was killed during a trial"
    assert r.cluster["retries"] >= 1
    assert r.nodes_to_exclude == serial.nodes_to_exclude == [models.transformer().expected.culprit_node]
    assert r.after.to_dict() == serial.after.to_dict()


def test_sweep_on_a_cluster_ranks_and_measures_as_the_serial_sweep(cluster, transformer, tmp_path):
    fp, npz = transformer
    # static: calibrated by each worker on the same split as the serial sweep
    grid = json.dumps({"mode": ["dynamic", "static"], "weight_type": "QUInt8", "activation_type": "QUInt8"})
    spec = FeedSpec(inputs=str(npz), batch=8)
    serial = sweep_to_dir(fp, spec, tmp_path / "a", SweepOptions(grid=grid, runs=0, progress=False)).result
    swept = sweep_to_dir(
        fp,
        spec,
        tmp_path / "b",
        SweepOptions(grid=grid, runs=2, repeats=1, progress=False, scheduler=cluster[0].scheduler_address),
    )
    remote, files = swept.result, swept.files
    assert [(e.recipe, e.metrics, e.model_sha256) for e in remote.entries] == [
        (e.recipe, e.metrics, e.model_sha256) for e in serial.entries
    ]
    assert [label for label, _ in remote.ranked] == [label for label, _ in serial.ranked]
    assert remote.best.recipe == serial.best.recipe
    assert all(e.ok for e in remote.entries)
    assert all(e.latency is not None for e in remote.entries), "every recipe timed, on this machine"
    info = json.loads(files["sweep.json"].read_text())["cluster"]
    assert info["tasks"] == 2 and "not the workers" in info["latency_measured_on"]
    assert "not the workers" in files["sweep.md"].read_text(), "the report says where latency was measured"


def test_a_cluster_sweep_interrupted_after_one_recipe_resumes_where_it_stopped(cluster, transformer, tmp_path):
    fp, npz = transformer
    grid = json.dumps({"mode": "dynamic", "weight_type": "QUInt8", "per_channel": [False, True]})
    spec = FeedSpec(inputs=str(npz), batch=8)

    def ctrl_c(entry):
        raise KeyboardInterrupt

    kw = {"grid": grid, "runs": 0, "progress": False}
    with pytest.raises(KeyboardInterrupt):  # without latency, entries are written as tasks come back
        sweep_to_dir(fp, spec, tmp_path, SweepOptions(scheduler=cluster[0].scheduler_address, **kw), on_entry=ctrl_c)
    lines = (tmp_path / "sweep.jsonl").read_text().splitlines()
    assert len(lines) == 1, "the first recipe, written before the interruption"
    again = sweep_to_dir(fp, spec, tmp_path, SweepOptions(**kw)).result  # serial: the same keys
    assert (again.resumed, again.measured) == (1, 1)


def test_ctrl_c_cancels_the_cluster_tasks_and_exits_130_with_no_output(cluster, transformer, tmp_path, monkeypatch):
    import diag.fix.cluster

    fp, npz = transformer
    lc, client = cluster

    def interrupted(self):
        time.sleep(0.2)  # the trials were submitted and are running
        raise KeyboardInterrupt

    monkeypatch.setattr(diag.fix.cluster.ClusterTrials, "_wait_any", interrupted)
    out = tmp_path / "out"
    argv = ["exclude", str(fp), "--inputs", str(npz), "--batch", "8", "--target", STRICT, "--bench-runs", "0"]
    argv += ["--recipe", json.dumps(DYNAMIC.to_dict()), "--out", str(out), "--quiet"]
    code = cli.main([*argv, "--scheduler", lc.scheduler_address])
    assert code == 130
    assert not (out / "exclusion.json").exists()
    deadline = time.monotonic() + 10
    while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0, "every task cancelled"


def test_an_unreachable_scheduler_is_a_slugged_error_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("diag.fix.cluster.CONNECT_TIMEOUT", 1.0)
    missing = tmp_path / "not-yet-loaded.onnx"  # never read: the scheduler is checked first
    t0 = time.perf_counter()
    argv = ["exclude", str(missing), "--random", "--target", "cosine>=0.99", "--out", str(tmp_path / "out")]
    code = cli.main([*argv, "--scheduler", "tcp://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("diag: error[no-scheduler]: --scheduler tcp://127.0.0.1:9 | cannot be reached")
    assert len(err.strip().splitlines()) == 1 and time.perf_counter() - t0 < 15


def test_scheduler_without_the_dask_extra_names_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # what `import distributed` does when absent
    fp = tmp_path / "never-read.onnx"
    for argv in (
        ["compare", str(fp), str(fp), "--random"],
        ["exclude", str(fp), "--random", "--target", "cosine>=0.99"],
        ["sweep", str(fp), "--random"],
    ):
        code = cli.main([*argv, "--scheduler", "local:2", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("diag: error[missing-extra]: --scheduler | needs Dask"), err
        assert 'pip install "diag[dask]"' in err


def test_the_base_install_does_not_pull_dask_and_the_test_extra_does():
    from diag.core.recipe import _tomllib

    project = _tomllib().loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("dask" in d or "distributed" in d for d in project["dependencies"])
    assert any(d.startswith("dask[distributed]") for d in project["optional-dependencies"]["dask"])
    assert any(d.startswith("dask[distributed]") for d in project["optional-dependencies"]["test"])
    # and diag itself never imports Dask unless --scheduler asks for it
    code = "import sys, diag.cli.commands, diag.fix.cluster; print('distributed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("local:3", ("local", 3)), ("tcp://10.0.0.5:8786", ("address", "tcp://10.0.0.5:8786"))],
)
def test_scheduler_option_is_an_address_or_a_local_cluster_size(text, parsed):
    assert parse_scheduler(text) == parsed
    with pytest.raises(DiagError, match="worker count"):
        parse_scheduler("local:0")


@pytest.mark.parametrize(
    ("verb", "target", "argv"),
    [
        ("compare", "diag.cli.verbs.compare_to_dir", ["a.onnx", "b.onnx", "--random"]),
        ("exclude", "diag.cli.verbs.exclude_to_dir", ["a.onnx", "--random", "--target", "cosine>=0.99"]),
        ("sweep", "diag.cli.verbs.sweep_to_dir", ["a.onnx", "--random"]),
    ],
)
def test_scheduler_flag_reaches_the_one_library_call(verb, target, argv, monkeypatch):
    seen = {}

    def fake(*args, **kwargs):
        options = next((a for a in args if isinstance(a, (CompareOptions, ExcludeOptions, SweepOptions))), None)
        seen["scheduler"] = options.scheduler if options is not None else kwargs.get("scheduler")
        raise SystemExit(0)

    monkeypatch.setattr(target, fake)
    with pytest.raises(SystemExit):
        cli.main([verb, *argv, "--scheduler", "tcp://10.0.0.5:8786"])
    assert seen == {"scheduler": "tcp://10.0.0.5:8786"}
