"""The held-out evaluator keeps FP32 outputs, not the FP32 session, through a search.

Every fixing verb builds a :class:`HeldOutEvaluator` (two, with the deploy-level check) and keeps
it alive through each re-quantization. At 500M parameters its FP32 session held 2 GB beside the
quantizer's own copy of the FP32 model (tiers peaked at 8.9 GB for 2.4 GB of model files). The
evaluator now computes the FP32 outputs once, keeps them (in memory when small, on disk when
large) and releases the session; these tests pin that the figures do not change with where the
outputs live, that no session outlives construction, and the fallback when the disk refuses.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import diag.fix.evaluate
from diag.core.feeds import FeedSpec
from diag.core.load import model_from_path
from diag.core.recipe import Recipe
from diag.core.spill import SpilledBatches
from diag.fix.evaluate import HeldOutEvaluator
from diag.fix.quantize import quantize_model
from diag.fixtures import models


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, np.ndarray]:
    tmp = tmp_path_factory.mktemp("heldout")
    fx = models.build("convnet")
    fp = tmp / "convnet.onnx"
    onnx.save(fx.model, fp)
    q = tmp / "convnet.int8.onnx"
    quantize_model(fp, Recipe(mode="dynamic", weight_type="QUInt8"), q)
    np.savez(tmp / "x.npz", **fx.make_inputs(24, 5))
    labels = np.random.default_rng(0).integers(0, 10, size=24)
    return fp, q, tmp / "x.npz", labels


def _evaluator(fp: Path, inputs: Path, labels: np.ndarray, opt_level: str = "disabled") -> HeldOutEvaluator:
    loaded = model_from_path(fp, "FP32")
    source = FeedSpec(inputs=str(inputs), batch=4).source(loaded.proto)
    return HeldOutEvaluator(loaded, source, 0, labels, None, opt_level=opt_level)


def _live_sessions() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, ort.InferenceSession))


def test_outputs_on_disk_give_the_figures_of_outputs_in_memory(convnet, monkeypatch):
    fp, q, inputs, labels = convnet
    in_memory = _evaluator(fp, inputs, labels)
    # 160 B a batch (4 x 10 logits): moves to disk at the 4th
    monkeypatch.setattr(diag.fix.evaluate, "IN_MEMORY_BYTES", 500)
    on_disk = _evaluator(fp, inputs, labels)
    assert in_memory._on_disk is None and len(in_memory._in_memory) == 6
    assert on_disk._on_disk is not None and on_disk._in_memory == []
    assert on_disk._on_disk.taken == 24  # the batches kept in memory before the limit moved to disk too
    first, second = in_memory.evaluate(q).to_dict(), on_disk.evaluate(q).to_dict()
    assert first == second
    assert first["samples"] == 24 and first["accuracy_fp32"] is not None  # labels were read through both
    assert on_disk.evaluate(q).to_dict() == first  # evaluations after the first read the same files


def test_no_fp32_session_outlives_the_evaluators(convnet, monkeypatch):
    fp, _, inputs, labels = convnet
    before = _live_sessions()
    exact = _evaluator(fp, inputs, labels)
    monkeypatch.setattr(diag.fix.evaluate, "IN_MEMORY_BYTES", 0)
    deployed = _evaluator(fp, inputs, labels, opt_level="all")
    assert exact._fp_sess is None and deployed._fp_sess is None
    assert _live_sessions() == before


def test_when_the_disk_refuses_the_outputs_the_session_stays_and_runs_again(convnet, monkeypatch):
    fp, q, inputs, labels = convnet
    expected = _evaluator(fp, inputs, labels).evaluate(q).to_dict()

    def refuse(self: SpilledBatches, arrays: dict[str, np.ndarray], size: int) -> None:
        self.usable = False

    monkeypatch.setattr(diag.fix.evaluate, "IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(SpilledBatches, "add", refuse)
    ev = _evaluator(fp, inputs, labels)
    assert ev._on_disk is None and ev._fp_sess is not None
    assert ev.evaluate(q).to_dict() == expected


def test_one_spilled_batch_is_read_alone(tmp_path):
    kept = SpilledBatches(10)
    kept.add({"a": np.arange(3, dtype=np.float32), "b": np.ones(2)}, 1)
    kept.add({"a": np.arange(3, 6, dtype=np.float32), "b": np.zeros(2)}, 1)
    second = kept.batch(1)
    assert list(second) == ["a", "b"] and second["a"].tolist() == [3.0, 4.0, 5.0]
    assert isinstance(second["a"], np.memmap) and not second["a"].flags.writeable
    kept.close()
    with pytest.raises(ValueError):
        kept.batch(0)


INPLACE_METRIC = """
import numpy as np


class M:
    better = {"err": "lower"}

    def __init__(self):
        self.worst = 0.0

    def update(self, fp32, int8, labels):
        for k, x in fp32.items():
            x -= x.max(axis=-1, keepdims=True)  # stabilised in place, as softmax code does
            y = int8[k]
            y -= y.max(axis=-1, keepdims=True)
            self.worst = max(self.worst, float(np.abs(x - y).max()))

    def merge(self, other):
        self.worst = max(self.worst, other.worst)
        return self

    def finalize(self):
        return {"err": self.worst}


def m():
    return M()
"""


@pytest.mark.parametrize("limit", [diag.fix.evaluate.IN_MEMORY_BYTES, 0], ids=["in-memory", "on-disk"])
def test_a_metric_plugin_that_writes_into_its_arrays_changes_nothing_kept(convnet, tmp_path, monkeypatch, limit):
    """A --metric plugin gets arrays of its own (as in diag compare): writing into them neither
    corrupts the FP32 outputs every later evaluation reads nor fails on the read-only maps."""
    fp, q, inputs, _ = convnet
    (tmp_path / "inplace_metric.py").write_text(INPLACE_METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(diag.fix.evaluate, "IN_MEMORY_BYTES", limit)
    loaded = model_from_path(fp, "FP32")
    source = FeedSpec(inputs=str(inputs), batch=4).source(loaded.proto)
    ev = HeldOutEvaluator(loaded, source, 0, None, None, metric="inplace_metric:m")
    first, second = ev.evaluate(q).to_dict(), ev.evaluate(q).to_dict()
    assert first == second and first["task"]["err"] > 0
