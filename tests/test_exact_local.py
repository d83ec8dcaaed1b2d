"""Nodes whose local value is the FP32 value by construction are not recomputed, and that changes nothing.

``diag.core.instrument.exact_locally`` proves, from the graphs alone, that a node of the cut model
would run the FP32 node's kernel on the FP32 node's inputs; ``run_comparison`` then prunes it
from the cut model and records zero local error. These tests run the same comparison with the
proof switched off (every node recomputed, as before) and require identical local figures, on
every fixture and format: a proof that admits one node it should not fails here.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

import diag.core.streaming
from diag.analysis.compare import CompareOptions, load_pair, run_comparison
from diag.core.feeds import feeds_from_arrays, input_specs
from diag.core.match import match_models
from diag.core.streaming import _local_model
from diag.fixtures import llm_models

FIXTURES = ("transformer", "convnet", "embedding", "if_model", "two_outputs", "ctc", "nan_on_exclusion")


def _local_figures(fp, q, matching, inputs):
    state, _ = run_comparison(
        fp, q, matching, feeds_from_arrays(inputs, input_specs(fp.proto), 8, 4, "x"), CompareOptions(progress=False)
    )
    return {name: acc.finalize() for name, acc in state.local.items()}


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("fmt", ("dynamic", "qdq", "qoperator"))
def test_skipping_exact_nodes_leaves_every_local_figure_unchanged(built, monkeypatch, fixture, fmt):
    b = built(fixture)
    fp, q = load_pair(b.fp32, b.int8[fmt])
    matching = match_models(fp.proto, q.proto)
    pruned = _local_figures(fp, q, matching, b.inputs)
    proofs: list[bool] = []

    def proves_nothing(*_):
        proofs.append(True)
        return set()

    # The engine's own name (diag.core.streaming): a patch elsewhere would compare the pruned run with itself.
    monkeypatch.setattr(diag.core.streaming, "exact_locally", proves_nothing)
    recomputed = _local_figures(fp, q, matching, b.inputs)
    assert proofs, "the proof was not switched off"
    assert pruned.keys() == recomputed.keys()
    for name, want in recomputed.items():
        got = pruned[name]
        assert (got.sqnr_db, got.max_abs, got.cosine) == (want.sqnr_db, want.max_abs, want.cosine), name
        assert got.nonfinite_int8 == want.nonfinite_int8, name


def test_dynamic_transformer_recomputes_only_its_quantized_nodes(built):
    b = built("transformer")
    fp, q = load_pair(b.fp32, b.int8["dynamic"])
    matching = match_models(fp.proto, q.proto)
    cut, unchanged = _local_model(fp, q, dict(matching.pairs))
    assert cut is not None
    writer = {o: n.op_type for n in cut.model.graph.node for o in n.output}
    recomputed = Counter(writer.get(o.name.split("__diag_int8")[0], writer.get(o.name)) for o in cut.outputs)
    # Dynamic quantization rewrites each MatMul as DynamicQuantizeLinear + MatMulInteger (+ Mul,
    # Add for the scale and bias); everything else (LayerNorm pieces, Softmax, Gelu) is exact.
    assert unchanged and len(unchanged) > len(cut.outputs)
    assert not {"Softmax", "Erf", "ReduceMean", "Div", "Sqrt"} & set(recomputed)


def test_int4_decoder_cut_model_runs_its_matmulnbits_and_little_else(tmp_path):
    fx = llm_models.llama_decoder(layers=2)
    llm_models.save_with_external_data(fx.model, tmp_path / "fp32.onnx")
    llm_models.quantize_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    fp, q = load_pair(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    matching = match_models(fp.proto, q.proto)
    cut, unchanged = _local_model(fp, q, dict(matching.pairs))
    assert cut is not None
    ops = Counter(n.op_type for n in cut.model.graph.node)
    # 7 projections per layer + lm_head; the rest are nodes reading external initializers
    # (not compared byte for byte: recomputed, conservatively).
    assert ops["MatMulNBits"] == 15
    assert sum(ops.values()) - ops["MatMulNBits"] <= 3, ops
    figures = _local_figures(fp, q, matching, fx.make_inputs(4, 3))
    assert all(figures[name].sqnr_db == math.inf for name in unchanged if name in figures)
    worst = min(figures, key=lambda n: figures[n].sqnr_db)
    assert "layers.1" in worst or "lm_head" in worst or "down_proj" in worst, worst
