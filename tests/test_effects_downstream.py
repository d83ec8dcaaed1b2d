"""The effect check runs only the part of each candidate model its float region changes (issue 27:
at 500M most of a compare's time was 8 candidates x 8 samples of whole-model runs). The part is
fed the INT8 model's own values at its boundary, so its figures must be the whole model's: these
tests run the check both ways on models quantized by onnxruntime and compare every figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import diag.analysis.effects
from diag.analysis.compare import CompareOptions, CompareResult, compare_models
from diag.analysis.effects import EffectBudget, EffectCheck, check_effects
from diag.core.feeds import FeedSpec, feed_source
from diag.core.outputs import output_specs
from diag.fixtures.llm_models import llama_decoder, quantize_int4, save_with_external_data


def _compared(fp32: Path, int8: Path, inputs: Path) -> CompareResult:
    return compare_models(fp32, int8, FeedSpec(inputs=str(inputs), batch=8), CompareOptions(progress=False, effects=0))


def _check(r: CompareResult, inputs: Path, downstream: bool, monkeypatch: Any) -> tuple[EffectCheck, list[int]]:
    """The effect check, and the node count of every candidate model it built a session for."""
    sizes: list[int] = []
    real = diag.analysis.effects.session_from_model

    def counting(model: Any, role: str, *args: Any, **kwargs: Any) -> Any:
        if role.startswith("INT8 model with"):
            sizes.append(len(model.graph.node))
        return real(model, role, *args, **kwargs)

    monkeypatch.setattr(diag.analysis.effects, "session_from_model", counting)
    feeds = feed_source(r.fp32.proto, FeedSpec(inputs=str(inputs), batch=8))
    specs = output_specs(r.fp32.proto)
    budget = EffectBudget(progress=False, downstream=downstream)
    check = check_effects(r.fp32, r.int8, r.matching, feeds, r.findings, r.paths, specs, budget)
    monkeypatch.setattr(diag.analysis.effects, "session_from_model", real)
    assert check is not None
    return check, sizes


def _assert_same_figures(whole: EffectCheck, part: EffectCheck, tol_db: float) -> None:
    assert part.target == whole.target
    assert part.skipped == whole.skipped
    assert {k: s.sqnr_db for k, s in part.base.items()} == {k: s.sqnr_db for k, s in whole.base.items()}
    assert [e.finding.group.label for e in part.effects] == [e.finding.group.label for e in whole.effects]
    for a, b in zip(whole.effects, part.effects, strict=True):
        assert b.recovered == pytest.approx(a.recovered, abs=1e-4), a.finding.group.label
        for out, db in a.sqnr_after.items():
            if math.isfinite(db):
                assert b.sqnr_after[out] == pytest.approx(db, abs=tol_db), (a.finding.group.label, out)
            else:
                assert b.sqnr_after[out] == db


@pytest.mark.parametrize("name", ["convnet", "transformer", "detector", "stream_outlier_transformer"])
@pytest.mark.parametrize("fmt", ["qdq", "qoperator", "dynamic"])
def test_downstream_runs_give_the_whole_models_figures(built, monkeypatch, name, fmt):
    b = built(name)
    r = _compared(b.fp32, b.int8[fmt], b.inputs_path)
    whole, whole_sizes = _check(r, b.inputs_path, False, monkeypatch)
    part, part_sizes = _check(r, b.inputs_path, True, monkeypatch)
    # Static formats: the part reads exact integers at its boundary, so every figure is equal.
    # Dynamic: onnxruntime fuses float ops across the boundary in the whole model only (rounding).
    _assert_same_figures(whole, part, 0.0 if fmt != "dynamic" else 1e-3)
    # ... and the parts really were smaller models than the whole candidates
    assert len(part_sizes) == len(whole_sizes)
    assert sum(part_sizes) < sum(whole_sizes)
    assert min(part_sizes) < min(whole_sizes)


def test_boundary_values_over_the_limit_run_every_candidate_whole(built, monkeypatch):
    b = built("transformer")
    r = _compared(b.fp32, b.int8["qdq"], b.inputs_path)
    whole, whole_sizes = _check(r, b.inputs_path, False, monkeypatch)
    monkeypatch.setattr(diag.analysis.effects, "BOUNDARY_BYTES", 0)
    limited, limited_sizes = _check(r, b.inputs_path, True, monkeypatch)
    assert limited_sizes == whole_sizes
    _assert_same_figures(whole, limited, 0.0)


def test_int4_decoder_with_external_data_checks_the_lm_head_as_one_node(tmp_path, monkeypatch):
    """The case it was built for: on an int4 decoder the lm_head candidate runs as itself, read
    from the INT8 model's external data, and every figure is the whole model's."""
    f = llama_decoder()
    fp32 = save_with_external_data(f.model, tmp_path / "fp32.onnx")
    int4 = quantize_int4(fp32, tmp_path / "int4.onnx")
    np.savez(tmp_path / "ids.npz", **f.make_inputs(4))
    r = _compared(fp32, int4, tmp_path / "ids.npz")
    whole, whole_sizes = _check(r, tmp_path / "ids.npz", False, monkeypatch)
    part, part_sizes = _check(r, tmp_path / "ids.npz", True, monkeypatch)
    _assert_same_figures(whole, part, 1e-3)
    labels = [e.finding.group.label for e in part.effects]
    assert any("lm_head" in label for label in labels), labels
    assert min(part_sizes) <= 2 < min(whole_sizes)  # the lm_head (and its output Identity at most)
