"""Local error measured on the first N samples (``--local-samples``; issue 27: on a weight-only
decoder the cut model is every quantized MatMul again, a whole model run per sample).

The limited run must give exactly the local figures of a run over those first samples, and
exactly the accumulated and output figures of a full run (after the limit the INT8 session that
held the cut is replaced by a plain one: its values must not change). Merged and separate cut
sessions, shards, the ``auto`` rule for large models and the CLI are covered.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

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


def test_the_cli_says_where_local_error_was_measured_and_refuses_a_bad_count(decoder, tmp_path):
    folder, _ = decoder
    cmd = [sys.executable, "-m", "diag", "compare", str(folder / "fp32.onnx"), str(folder / "int4.onnx")]
    cmd += ["--inputs", str(folder / "ids.npz"), "--effects", "0", "--quiet"]
    run = subprocess.run([*cmd, "--local-samples", "2", "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert run.returncode in (0, 1), run.stderr
    assert f"{SAMPLES} samples in" in run.stdout
    assert "(local error on the first 2; --local-samples all for every one)" in run.stdout
    doc = json.loads((tmp_path / "a" / "diag.json").read_text())
    assert doc["run"]["local_samples"] == 2 and doc["run"]["samples"] == SAMPLES
    assert "local error on the first 2 samples" in (tmp_path / "a" / "summary.md").read_text()
    assert "local error on the first 2 samples" in (tmp_path / "a" / "report.html").read_text()
    every = subprocess.run([*cmd, "--out", str(tmp_path / "b")], capture_output=True, text=True)
    assert "local error on the first" not in every.stdout
    assert json.loads((tmp_path / "b" / "diag.json").read_text())["run"]["local_samples"] == SAMPLES
    bad = subprocess.run([*cmd, "--local-samples", "0", "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert bad.returncode == 2 and "bad-option" in bad.stderr and "--local-samples '0'" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "c").exists()
    bad = subprocess.run([*cmd, "--effect-samples", "x", "--out", str(tmp_path / "d")], capture_output=True, text=True)
    assert bad.returncode == 2 and "bad-option" in bad.stderr and "--effect-samples 'x'" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "d").exists()
