"""Local error measured on the first N samples (``--local-samples``; issue 27: on a weight-only
decoder the cut model is every quantized MatMul again, a whole model run per sample).

The limited run must give exactly the local figures of a run over those first samples, and
exactly the accumulated and output figures of a full run (after the limit the INT8 session that
held the cut is replaced by a plain one: its values must not change). Merged and separate cut
sessions, shards, the ``auto`` rule for large models and the CLI are covered.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_run import run_cli

import diag.core.streaming
from diag.analysis.compare import CompareOptions, load_pair, run_comparison
from diag.core.feeds import feeds_from_arrays, input_specs
from diag.core.match import match_models
from diag.core.streaming import _local_model
from diag.fixtures import llm_models

SAMPLES = 6


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decoder")
    fx = llm_models.llama_decoder(layers=2)
    llm_models.save_with_external_data(fx.model, folder / "fp32.onnx")
    llm_models.quantize_int4(folder / "fp32.onnx", folder / "int4.onnx")
    inputs = fx.make_inputs(SAMPLES, 5)
    np.savez(folder / "ids.npz", **inputs)
    return folder, inputs


def _state(fp, q, inputs, samples=SAMPLES, shard=None, **options):
    feeds = feeds_from_arrays(inputs, input_specs(fp.proto), samples, 1, "x")
    opts = CompareOptions(progress=False, effects=0, shard=shard, **options)
    return run_comparison(fp, q, match_models(fp.proto, q.proto), feeds, opts)[0]


def _sums(accs, skip=frozenset()):
    return {k: a.to_state() for k, a in accs.items() if k not in skip}


def _unchanged(fp, q):
    """Tensors whose local value is the FP32 value (zero error over the accumulated samples, all of them)."""
    return frozenset(_local_model(fp, q, dict(match_models(fp.proto, q.proto).pairs))[1])


@pytest.mark.parametrize("merged", [True, False])
def test_local_error_of_the_first_samples_and_everything_else_of_all(decoder, monkeypatch, merged):
    folder, inputs = decoder
    fp, q = load_pair(folder / "fp32.onnx", folder / "int4.onnx")
    monkeypatch.setattr(diag.core.streaming, "SHARED_CUT_BYTES", 0 if merged else 1 << 62)
    limited = _state(fp, q, inputs, local_samples=2)
    full = _state(fp, q, inputs, local_samples="all")
    first_two = _state(fp, q, inputs, samples=2, local_samples="all")
    assert (limited.samples, limited.local_samples, full.local_samples) == (SAMPLES, 2, SAMPLES)
    same = _unchanged(fp, q)
    assert limited.local.keys() - same and _sums(limited.local, same) == _sums(first_two.local, same)
    assert _sums(limited.local, same) != _sums(full.local, same)  # the limit was applied
    assert _sums(limited.accumulated) == _sums(full.accumulated)
    assert {k: a.to_state() for k, a in limited.outputs.items() if k} == {
        k: a.to_state() for k, a in full.outputs.items() if k
    }


def test_auto_limits_only_large_models_and_shards_add_up(decoder, monkeypatch):
    folder, inputs = decoder
    fp, q = load_pair(folder / "fp32.onnx", folder / "int4.onnx")
    assert _state(fp, q, inputs).local_samples == SAMPLES  # a few MB: every sample
    monkeypatch.setattr(diag.core.streaming, "LARGE_MODEL_BYTES", 0)
    monkeypatch.setattr(diag.core.streaming, "LARGE_MODEL_LOCAL_SAMPLES", 3)
    one = _state(fp, q, inputs)
    assert one.local_samples == 3
    shards = [_state(fp, q, inputs, shard=(k, 2)) for k in range(2)]
    merged = shards[0].merge(shards[1])
    assert merged.local_samples == 3
    for name, acc in one.local.items():
        if name in _unchanged(fp, q):
            continue
        assert merged.local[name].n == acc.n
        assert merged.local[name].s_ee == pytest.approx(acc.s_ee, rel=1e-12)
    assert _state(fp, q, inputs, local=False).local_samples == 0


def test_the_cli_says_where_local_error_was_measured_and_refuses_a_bad_count(decoder, tmp_path, capsys):
    folder, _ = decoder
    cmd = ["compare", folder / "fp32.onnx", folder / "int4.onnx", "--inputs", folder / "ids.npz", "--effects", "0"]
    cmd += ["--quiet"]
    code, printed, err = run_cli([*cmd, "--local-samples", "2", "--out", tmp_path / "a"], capsys)
    assert code in (0, 1), err
    assert f"{SAMPLES} samples in" in printed
    assert "(local error on the first 2; --local-samples all for every one)" in printed
    doc = json.loads((tmp_path / "a" / "diag.json").read_text())
    assert doc["run"]["local_samples"] == 2 and doc["run"]["samples"] == SAMPLES
    assert "local error on the first 2 samples" in (tmp_path / "a" / "summary.md").read_text()
    assert "local error on the first 2 samples" in (tmp_path / "a" / "report.html").read_text()
    _, printed, _ = run_cli([*cmd, "--out", tmp_path / "b"], capsys)
    assert "local error on the first" not in printed
    assert json.loads((tmp_path / "b" / "diag.json").read_text())["run"]["local_samples"] == SAMPLES
    code, _, err = run_cli([*cmd, "--local-samples", "0", "--out", tmp_path / "c"], capsys)
    assert code == 2 and "bad-option" in err and "--local-samples '0'" in err
    assert "Traceback" not in err and not (tmp_path / "c").exists()
    code, _, err = run_cli([*cmd, "--effect-samples", "x", "--out", tmp_path / "d"], capsys)
    assert code == 2 and "bad-option" in err and "--effect-samples 'x'" in err
    assert "Traceback" not in err and not (tmp_path / "d").exists()
