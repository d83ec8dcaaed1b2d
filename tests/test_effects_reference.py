"""The effect check measures against the FP32 outputs the main pass kept (issue 27: on the 500M
decoder, loading the FP32 model again and running it on the check's samples was ~10 s of a
compare). The kept outputs must be exactly what a fresh FP32 run gives: these tests run the whole
compare both ways on models quantized by onnxruntime and compare every effect figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import diag.analysis.effects
import diag.core.spill
import diag.core.streaming
from diag.analysis.compare import CompareOptions, CompareResult, compare_models
from diag.core.feeds import FeedSpec
from diag.core.spill import SpilledBatches
from diag.fixtures.llm_models import llama_decoder, quantize_int4, save_with_external_data


def _figures(d: dict[str, Any] | None) -> dict[str, Any]:
    """An effect check's or list estimate's JSON without its wall time."""
    assert d is not None
    return {k: v for k, v in d.items() if k != "seconds"}


def _recorded_roles(monkeypatch: Any) -> list[str]:
    """The roles of the sessions the effect check builds from now on (a list filled as they are)."""
    roles: list[str] = []
    real = diag.analysis.effects.session_from_model

    def recording(model: Any, role: str, *args: Any, **kwargs: Any) -> Any:
        roles.append(role)
        return real(model, role, *args, **kwargs)

    monkeypatch.setattr(diag.analysis.effects, "session_from_model", recording)
    return roles


def _compare(fp32: Path, int8: Path, inputs: Path, monkeypatch: Any, keep: bool) -> tuple[CompareResult, list[str]]:
    """A compare, and the roles of the sessions its effect check built; ``keep=False``: as before
    the main pass kept anything (the check runs the FP32 model itself)."""
    roles = _recorded_roles(monkeypatch)
    if not keep:
        monkeypatch.setattr(SpilledBatches, "batches", lambda self: None)
    r = compare_models(
        fp32, int8, FeedSpec(inputs=str(inputs), batch=4), CompareOptions(progress=False, effect_samples=6)
    )
    monkeypatch.undo()
    return r, roles


@pytest.mark.parametrize("fmt", ["qdq", "qoperator", "dynamic"])
def test_effect_figures_from_the_kept_outputs_equal_a_fresh_fp32_run(built, monkeypatch, fmt):
    b = built("convnet")
    kept, kept_roles = _compare(b.fp32, b.int8[fmt], b.inputs_path, monkeypatch, keep=True)
    fresh, fresh_roles = _compare(b.fp32, b.int8[fmt], b.inputs_path, monkeypatch, keep=False)
    assert "FP32 model" in fresh_roles and "FP32 model" not in kept_roles  # the FP32 model was not loaded again
    assert kept.effects is not None and fresh.effects is not None
    # 6 samples in batches of 4: the first two batches, 8 samples, as the check takes them
    assert kept.effects.samples == fresh.effects.samples == 8
    assert _figures(kept.effects.to_dict()) == _figures(fresh.effects.to_dict())
    assert kept.list_estimate is not None and fresh.list_estimate is not None
    assert _figures(kept.list_estimate.to_dict()) == _figures(fresh.list_estimate.to_dict())


def test_a_decoder_with_external_data_keeps_its_logits_and_removes_them(tmp_path, monkeypatch):
    fx = llama_decoder(layers=2)
    save_with_external_data(fx.model, tmp_path / "fp32.onnx")
    quantize_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    np.savez(tmp_path / "ids.npz", **fx.make_inputs(6, 5))
    folders: list[Path] = []
    real_add = SpilledBatches.add

    def add(self: SpilledBatches, arrays: dict[str, np.ndarray], size: int) -> None:
        real_add(self, arrays, size)
        if self._folder is not None and self._folder not in folders:
            folders.append(self._folder)

    monkeypatch.setattr(SpilledBatches, "add", add)
    kept, kept_roles = _compare(tmp_path / "fp32.onnx", tmp_path / "int4.onnx", tmp_path / "ids.npz", monkeypatch, True)
    fresh, fresh_roles = _compare(
        tmp_path / "fp32.onnx", tmp_path / "int4.onnx", tmp_path / "ids.npz", monkeypatch, False
    )
    assert "FP32 model" not in kept_roles and "FP32 model" in fresh_roles
    assert kept.effects is not None and fresh.effects is not None
    assert _figures(kept.effects.to_dict()) == _figures(fresh.effects.to_dict())
    assert len(folders) == 1 and not folders[0].exists()  # written once, removed after the analysis


def test_spilled_batches_stop_at_the_samples_asked_and_give_up_on_what_cannot_be_saved(tmp_path):
    kept = SpilledBatches(3)
    for i in range(4):
        kept.add({"out/with:odd name": np.full((2, 3), i, np.float32)}, 2)
    batches = kept.batches()
    assert kept.full and batches is not None and len(batches) == 2  # 2 + 2 samples cover 3
    assert [float(b["out/with:odd name"][0, 0]) for b in batches] == [0.0, 1.0]
    assert not batches[0]["out/with:odd name"].flags.writeable
    folder = kept._folder
    assert folder is not None and folder.exists()
    kept.close()
    assert not folder.exists() and kept.batches() is None

    odd = SpilledBatches(4)
    odd.add({"strings": np.array(["a", None], dtype=object)}, 2)  # not saved without pickle
    assert odd.full and not odd.usable and odd.batches() is None
    odd.close()


def test_kept_folders_are_removed_when_nobody_closes_them():
    kept = SpilledBatches(1)
    kept.add({"x": np.ones(4, np.float32)}, 1)
    folder = kept._folder
    assert folder is not None and folder.exists()
    del kept
    import gc

    gc.collect()
    assert not folder.exists()
    assert diag.core.spill.SpilledBatches is SpilledBatches


def test_auto_checks_effects_on_4_samples_from_1_gib_with_the_kept_outputs(tmp_path, monkeypatch):
    # --effect-samples auto: 8 samples, 4 from 1 GiB of FP32 weights (a 500M decoder: 26.7 -> 17.6 s).
    # The main pass must keep exactly the samples the check runs on: else it loads FP32 again.
    fx = llama_decoder(layers=2)
    save_with_external_data(fx.model, tmp_path / "fp32.onnx")
    quantize_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    np.savez(tmp_path / "ids.npz", **fx.make_inputs(12, 5))
    roles = _recorded_roles(monkeypatch)

    def check(**options: Any) -> CompareResult:
        feeds = FeedSpec(inputs=str(tmp_path / "ids.npz"))
        return compare_models(
            tmp_path / "fp32.onnx", tmp_path / "int4.onnx", feeds, CompareOptions(progress=False, **options)
        )

    small = check()
    assert small.effects is not None and small.effects.samples == 8
    monkeypatch.setattr(diag.core.streaming, "LARGE_MODEL_BYTES", 0)
    roles.clear()
    large = check()
    assert large.effects is not None and large.effects.samples == 4
    assert "FP32 model" not in roles
    explicit = check(effect_samples=4)
    assert _figures(large.effects.to_dict()) == _figures(explicit.effects.to_dict())
    assert check(effect_samples=6).effects.samples == 6  # a count is taken as given, large or not
