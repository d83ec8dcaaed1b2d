"""The latency bench: real onnxruntime sessions, real timings, settings recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.cli import commands as cli
from diag.core.feeds import Batch, FeedSource, FeedSpec, input_specs
from diag.fix.bench import BenchOptions, LatencyStats, bench_models, format_table, physical_cores
from diag.foundations.errors import DiagError

WIDTH = 256


def _model(path: Path, matmuls: int, input_name: str = "x") -> Path:
    """``x + 1`` (matmuls=0) or a chain of ``matmuls`` 256x256 MatMuls: same inputs and outputs."""
    rng = np.random.default_rng(0)
    nodes = []
    inits = [numpy_helper.from_array(np.ones((1, WIDTH), np.float32), "one")]
    cur = input_name
    for i in range(matmuls):
        w = f"w{i}"
        inits.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 16).astype(np.float32), w))
        nodes.append(helper.make_node("MatMul", [cur, w], [f"h{i}"], name=f"mm{i}"))
        cur = f"h{i}"
    nodes.append(helper.make_node("Add", [cur, "one"], ["y"], name="add"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["n", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def light_heavy(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("bench")
    return _model(d / "light.onnx", 0), _model(d / "heavy.onnx", 24)


def _source(model_path: Path, sizes: list[int]) -> FeedSource:
    specs = input_specs(onnx.load(str(model_path)))
    rng = np.random.default_rng(1)
    batches = [Batch(i, {"x": rng.standard_normal((n, WIDTH)).astype(np.float32)}, n) for i, n in enumerate(sizes)]
    return FeedSource("three batches", batches, sum(sizes), specs)


def test_model_doing_far_more_work_is_measured_slower(light_heavy):
    light, heavy = light_heavy
    stats = bench_models(
        [light, heavy], _source(light, [8]), BenchOptions(runs=15, warmup=2, threads=1, progress=False)
    )
    assert [Path(s.model).name for s in stats] == ["light.onnx", "heavy.onnx"]
    assert stats[0].speedup is None
    assert stats[1].speedup is not None and stats[1].speedup < 0.5
    assert stats[1].p50_ms > stats[0].p50_ms


def test_stats_are_ordered_and_settings_recorded(light_heavy):
    light, heavy = light_heavy
    stats = bench_models(
        [light, heavy, light], _source(light, [4]), BenchOptions(runs=9, warmup=1, threads=1, progress=False)
    )
    assert len(stats) == 3
    for s in stats:
        assert (s.runs, s.warmup, s.threads) == (9, 1, 1)
        assert 0 < s.min_ms <= s.p50_ms <= s.p90_ms <= s.p99_ms <= s.max_ms
        assert s.min_ms <= s.mean_ms <= s.max_ms
    assert stats[2].speedup == pytest.approx(stats[0].p50_ms / stats[2].p50_ms)
    d = stats[1].to_dict()
    assert set(d) == {f for f in LatencyStats.__dataclass_fields__}
    assert json.loads(json.dumps(d)) == d


def test_batches_are_cycled_and_throughput_counts_their_samples(light_heavy):
    light, _ = light_heavy
    # 2 warm-up + 7 timed rounds over batches of 1, 2, 3 samples: timed rounds 2..8 take
    # batches 2,0,1,2,0,1,2 -> 3+1+2+3+1+2+3 = 15 samples.
    (s,) = bench_models([light], _source(light, [1, 2, 3]), BenchOptions(runs=7, warmup=2, threads=1, progress=False))
    seconds = s.mean_ms * s.runs / 1000
    assert s.throughput_per_s * seconds == pytest.approx(15, rel=1e-6)


def test_default_threads_are_the_physical_cores(light_heavy):
    light, _ = light_heavy
    (s,) = bench_models([light], _source(light, [1]), BenchOptions(runs=2, warmup=0, progress=False))
    assert s.threads == physical_cores()
    assert 1 <= physical_cores() <= (os.cpu_count() or 1)


def test_models_with_different_inputs_are_refused(light_heavy, tmp_path):
    light, _ = light_heavy
    other = _model(tmp_path / "other.onnx", 1, input_name="pixels")
    with pytest.raises(DiagError) as e:
        bench_models([light, other], _source(light, [1]), BenchOptions(runs=2, progress=False))
    assert e.value.slug == "model-mismatch"
    assert "pixels" in str(e.value)


@pytest.mark.parametrize(
    ("kw", "flag"), [({"runs": 0}, "--runs"), ({"warmup": -1}, "--warmup"), ({"threads": 0}, "--threads")]
)
def test_bad_counts_are_refused_before_anything_runs(light_heavy, kw, flag):
    light, _ = light_heavy
    with pytest.raises(DiagError) as e:
        bench_models([light], _source(light, [1]), BenchOptions(progress=False, **kw))
    assert e.value.slug == "bad-option" and e.value.obj == flag


def test_table_shows_every_model_noise_and_threads():
    a = LatencyStats("m/fp32.onnx", 20, 5, 2, 2.0, 2.5, 2.9, 1.9, 3.0, 2.1, 476.2, None)
    b = LatencyStats("m/int8.onnx", 20, 5, 2, 1.0, 1.2, 1.3, 0.9, 1.4, 1.05, 952.4, 2.0)
    lines = format_table([a, b]).splitlines()
    assert lines[1].split() == ["fp32.onnx", "2.00", "2.50", "2.90", "1.90-3.00", "476.2", "ref"]
    assert lines[2].split() == ["int8.onnx", "1.00", "1.20", "1.30", "0.90-1.40", "952.4", "2.00x"]
    assert "intra_op_num_threads=2" in lines[3] and "20 timed runs" in lines[3]


def test_cli_bench_prints_the_table_and_writes_json(light_heavy, tmp_path, capsys):
    light, heavy = light_heavy
    out = tmp_path / "bench.json"
    args = ["bench", light, heavy, "--random", "--samples", "2", "--runs", "3", "--warmup", "1"]
    code = cli.main([str(a) for a in [*args, "--threads", "1", "--json", out, "--quiet"]])
    text = capsys.readouterr().out.splitlines()
    assert code == 0
    assert text[1].startswith("light.onnx") and text[2].startswith("heavy.onnx")
    assert text[-1] == f"wrote {out}"
    doc = json.loads(out.read_text())
    assert doc["schema"] == "diag/bench" and doc["opt_level"] == "all"
    assert [m["runs"] for m in doc["models"]] == [3, 3]
    assert doc["models"][0]["speedup"] is None and doc["models"][1]["speedup"] > 0


def test_feed_spec_is_resolved_against_the_first_model(light_heavy):
    light, heavy = light_heavy
    stats = bench_models(
        [light, heavy], FeedSpec(random=True, samples=3), BenchOptions(runs=3, warmup=0, threads=1, progress=False)
    )
    assert [s.runs for s in stats] == [3, 3]
