"""Activation distributions: outliers found by index, no false alarms, analytic health figures,
exact shard merge, and remedies that really improve the named tensor when applied with onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from diag.analysis.compare import CompareOptions, compare_models
from diag.core.distributions import (
    BINS,
    SAMPLE_MAX,
    DistributionAccumulator,
    GridInfo,
    Pow2Histogram,
    persistent_outliers,
)
from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fixtures.quantize import _ArrayReader, lift_constants

FORMATS = ("dynamic", "qdq", "qoperator")


def _compare(built, name: str, fmt: str, int8=None, samples: int = 32):
    b = built(name)
    if int8 is None:
        return b.compared(fmt, samples)  # the built pair: run once per session (conftest)
    return compare_models(
        b.fp32, int8, FeedSpec(inputs=str(b.inputs_path), samples=samples, batch=8), CompareOptions(progress=False)
    )


def _flagged(r) -> dict[str, list[int]]:
    return {name: [o.index for o in h.outliers] for name, h in r.health.items() if h.outliers}


# ----------------------------------------------------------------- ground truth on fixtures


@pytest.mark.parametrize("fmt", FORMATS)
def test_outlier_hidden_dim_of_the_transformer_is_found_by_index(built, fmt):
    exp = built("transformer").fixture.expected
    r = _compare(built, "transformer", fmt)
    flagged = _flagged(r)
    assert flagged[exp.outlier_tensor] == [exp.outlier_channel]
    h = r.health[exp.outlier_tensor]
    assert h.axis == 2  # [batch, seq, hidden]: the last axis
    assert h.outliers[0].times_median > 20
    # Only the tensor that carries the injected dimension is flagged.
    assert set(flagged) == {exp.outlier_tensor}, flagged


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_conv_channel_is_found_by_index(built, fmt):
    exp = built("convnet").fixture.expected
    r = _compare(built, "convnet", fmt)
    flagged = _flagged(r)
    assert flagged[exp.outlier_tensor] == [exp.outlier_channel]
    assert r.health[exp.outlier_tensor].axis == 1  # NCHW
    assert set(flagged) <= {exp.outlier_tensor, "conv2_out"}, flagged


@pytest.mark.parametrize("name", ["clean_transformer", "clean_convnet"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_models_without_outliers_raise_no_outlier_alarm(built, name, fmt):
    r = _compare(built, name, fmt)
    assert _flagged(r) == {}
    assert r.persistent == []
    assert not [s for s in r.suggestions if s.remedy in ("qint16-activation", "smoothquant")]


def test_persistent_outlier_dimension_is_tracked_across_layers(built):
    exp = built("stream_outlier_transformer").fixture.expected
    r = _compare(built, "stream_outlier_transformer", "dynamic")
    flagged = _flagged(r)
    dim = exp.outlier_channel
    # The dimension rides the residual stream: every residual Add and every LayerNorm output.
    must = [
        "embeddings/Add_out",
        "layer0/attn/residual_out",
        "layer0/ffn/residual_out",
        "layer1/attn/residual_out",
        "layer1/ffn/residual_out",
        "layer0/attn_norm/Add_1_out",
        "layer0/ffn_norm/Add_1_out",
        "layer1/attn_norm/LayerNormalization_out",
        "layer1/ffn_norm/LayerNormalization_out",
        "final_norm/LayerNormalization_out",
    ]
    for t in must:
        assert flagged.get(t, [None])[0] == dim, (t, flagged.get(t))
    (p,) = [p for p in r.persistent if p.index == dim]
    assert set(must) <= set(p.tensors)
    assert p.channels == 32


# ----------------------------------------------------------------- analytic figures


def test_clip_fraction_and_effective_bits_match_the_analytic_values_for_a_uniform_tensor():
    x = np.random.default_rng(0).uniform(-1, 1, size=(400, 2500)).astype(np.float32)
    # int8 grid of step 1/255: represents [-128.5/255, 127.5/255] = [-0.5039, 0.5]
    acc = DistributionAccumulator(GridInfo(1 / 255, 0.0, -128, 127))
    acc.update(x, x)
    h = acc.finalize()
    analytic_clip = (1 - 0.5) / 2 + (1 - 128.5 / 255) / 2
    assert h.clip_fraction == pytest.approx(analytic_clip, abs=2e-3)
    assert h.effective_bits == pytest.approx(8.0, abs=1e-9)  # the bulk overflows the grid: capped
    # Same tensor on a grid that covers [-1, 1]: the bulk P0.1..P99.9 spans 0.998 of it.
    acc = DistributionAccumulator(GridInfo(2 / 255, 0.0, -128, 127))
    acc.update(x, x)
    h = acc.finalize()
    assert h.clip_fraction < 1e-6
    assert h.effective_bits == pytest.approx(math.log2(1 + 0.998 * 2 / (2 / 255)), abs=0.01)
    assert h.kurtosis == pytest.approx(-1.2, abs=0.02)  # uniform distribution


def test_clip_fraction_effective_bits_and_kurtosis_match_the_analytic_values_for_a_gaussian():
    x = np.random.default_rng(1).standard_normal((1000, 1000)).astype(np.float32)
    scale = 8 / 255  # grid of +-4 sigma
    acc = DistributionAccumulator(GridInfo(scale, 0.0, -128, 127))
    acc.update(x, x)
    h = acc.finalize()
    high, low = 127.5 * scale, 128.5 * scale
    analytic_clip = 0.5 * math.erfc(high / math.sqrt(2)) + 0.5 * math.erfc(low / math.sqrt(2))
    assert h.clip_fraction == pytest.approx(analytic_clip, rel=0.25)  # ~63 of 1e6 values
    p999 = 3.090232  # standard normal quantile of 0.999
    # The histogram holds a strided subsample of SAMPLE_MAX values of this 1e6-value batch: P99.9
    # estimated from n = 65536 values has a standard error of sqrt(p(1-p)/n) / pdf(3.09) = 0.037
    # sigma, i.e. about 0.012 bits on the bulk's width; the tolerance is 3.5 standard errors.
    assert SAMPLE_MAX == 1 << 16
    assert h.effective_bits == pytest.approx(math.log2(1 + 2 * p999 / scale), abs=0.04)
    assert h.kurtosis == pytest.approx(0.0, abs=0.02)
    assert h.range_over_bulk == pytest.approx((x.max() - x.min()) / (2 * p999), rel=0.03)  # same bulk estimate


def test_clipping_within_rounding_noise_is_not_reported_but_real_clipping_is():
    x = np.random.default_rng(2).standard_normal(200_000).astype(np.float32)
    wide = DistributionAccumulator(GridInfo(4.4 / 127.5, 0.0, -128, 127))  # clips ~1e-5 of values
    wide.update(x, x)
    assert not wide.finalize().clips
    narrow = DistributionAccumulator(GridInfo(1.0 / 127.5, 0.0, -128, 127))  # clips a third
    narrow.update(x, x)
    h = narrow.finalize()
    assert h.clips and h.clip_noise_ratio > 100
    assert "clipped" in h.unhealthy_reasons[0]


# ----------------------------------------------------------------- streaming and merging


def test_histogram_of_two_shards_merged_equals_one_run_exactly():
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal((4, 8, 16)).astype(np.float32) * (i + 1) ** 2 for i in range(9)]
    one = DistributionAccumulator(GridInfo(0.05, 3.0, 0, 255), "MatMul")
    a = DistributionAccumulator(GridInfo(0.05, 3.0, 0, 255), "MatMul")
    b = DistributionAccumulator(GridInfo(0.05, 3.0, 0, 255), "MatMul")
    for i, x in enumerate(batches):
        one.update(x, x * 1.01)
        (a if i % 3 == 0 else b).update(x, x * 1.01)
    a.merge(b)
    assert a.fp.exponent == one.fp.exponent
    assert np.array_equal(a.fp.counts, one.fp.counts)
    assert np.array_equal(a.int8.counts, one.int8.counts)
    assert np.array_equal(a.ch_max, one.ch_max) and np.array_equal(a.ch_min, one.ch_min)
    assert np.allclose(a.ch_sum, one.ch_sum)
    assert (a.clipped_low, a.clipped_high, a.count) == (one.clipped_low, one.clipped_high, one.count)
    ha, h1 = a.finalize(), one.finalize()
    assert ha.effective_bits == h1.effective_bits and ha.clip_fraction == h1.clip_fraction


def test_compare_states_of_two_shards_merge_to_one_runs_distributions(built):
    from diag.analysis.compare import load_pair, run_comparison
    from diag.core.feeds import feeds_from_npz, input_specs
    from diag.core.match import match_models

    b = built("convnet")
    fp, q = load_pair(b.fp32, b.int8["qdq"])
    matching = match_models(fp.proto, q.proto)
    opts = CompareOptions(progress=False, local=False)

    def run(skip: int, samples: int):
        src = feeds_from_npz(b.inputs_path, input_specs(fp.proto), samples, 4, skip)
        return run_comparison(fp, q, matching, src, opts)[0]

    one = run(0, 16)
    merged = run(0, 8).merge(run(8, 8))
    assert set(one.distributions) == set(merged.distributions)
    for name, acc in one.distributions.items():
        other = merged.distributions[name]
        assert np.array_equal(acc.fp.counts, other.fp.counts), name
        assert np.array_equal(acc.int8.counts, other.int8.counts), name


def test_histogram_memory_does_not_grow_with_samples():
    h = Pow2Histogram()
    rng = np.random.default_rng(4)
    for i in range(50):
        h.update(rng.standard_normal(10_000).astype(np.float32) * (1 + i))
    assert h.counts.shape == (BINS,) and h.total == 500_000
    assert h.limit >= 50 * 4  # grew to cover the widest batch
    assert persistent_outliers({}) == []


def test_histogram_state_round_trips_for_shard_files():
    h = Pow2Histogram()
    h.update(np.array([-3.0, 0.1, 0.2, 7.5], np.float32))
    again = Pow2Histogram.from_state(h.to_state())
    assert again.exponent == h.exponent and np.array_equal(again.counts, h.counts)


# ----------------------------------------------------------------- remedies applied for real


def _consumer_local_sqnr(r, consumers: list[str]) -> float:
    found = [f for f in r.findings if consumers[0] in f.group.fp_nodes]
    if not found or found[0].local is None:
        return math.inf  # kept in float: no quantization error of its own
    return found[0].local.sqnr_db


def _requantize(built, name: str, fmt: str, delta: dict, out) -> None:
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static

    b = built(name)
    base = (
        Recipe(mode="dynamic")
        if fmt == "dynamic"
        else Recipe(mode="static", quant_format="QDQ" if fmt == "qdq" else "QOperator")
    )
    recipe = Recipe.from_dict({**base.to_dict(), **delta})
    kwargs = recipe.ort_kwargs()
    src = out.with_suffix(".fp32.onnx")
    onnx.save(lift_constants(onnx.load(b.fp32)), src)
    if fmt == "dynamic":
        quantize_dynamic(src, out, **kwargs)
    else:
        assert kwargs["quant_format"] in (QuantFormat.QDQ, QuantFormat.QOperator)
        quantize_static(src, out, _ArrayReader(b.calib), **kwargs)


@pytest.mark.parametrize(
    ("name", "fmt"), [("convnet", "qdq"), ("convnet", "qoperator"), ("transformer", "dynamic"), ("transformer", "qdq")]
)
def test_every_runnable_suggestion_improves_the_named_tensor_when_applied_with_onnxruntime(built, name, fmt, tmp_path):
    exp = built(name).fixture.expected
    before = _compare(built, name, fmt)
    mine = [s for s in before.suggestions if s.tensor == exp.outlier_tensor]
    kinds = {s.remedy for s in mine}
    assert "exclude-consumers" in kinds
    assert ("qint16-activation" in kinds) == (fmt != "dynamic")
    tried = 0
    for s in mine:
        if s.remedy == "smoothquant":
            # Suggested with its caveat only: it needs the separate neural-compressor package.
            assert "neural-compressor" in s.note
            continue
        out = tmp_path / f"{s.remedy}.onnx"
        _requantize(built, name, fmt, s.recipe, out)
        after = _compare(built, name, fmt, int8=out)
        old, new = _consumer_local_sqnr(before, s.consumers), _consumer_local_sqnr(after, s.consumers)
        # The consumer's *local* error is what the remedy targets (upstream error is not its business).
        assert new > old + 6.0, (s.remedy, s.python, old, new)
        tried += 1
    assert tried >= 1 + (fmt != "dynamic")


def test_calibration_range_override_removes_the_clipping_it_reports(built, tmp_path):
    before = _compare(built, "clean_transformer", "qdq")
    clip = [s for s in before.suggestions if s.remedy == "calibration-range"]
    assert clip, [s.remedy for s in before.suggestions]
    s = clip[0]
    out = tmp_path / "range.onnx"
    _requantize(built, "clean_transformer", "qdq", s.recipe, out)
    after = _compare(built, "clean_transformer", "qdq", int8=out)
    assert before.health[s.tensor].clips
    assert after.health[s.tensor].clip_fraction < before.health[s.tensor].clip_fraction / 10
    assert not after.health[s.tensor].clips


def test_sections_for_analyses_that_did_not_run_are_absent_not_empty(built, tmp_path):
    from diag.cli.verbs import compare_to_dir

    b = built("convnet")
    feeds = FeedSpec(inputs=str(b.inputs_path), samples=8, batch=8)
    files = compare_to_dir(
        b.fp32, b.int8["qdq"], feeds, tmp_path / "off", CompareOptions(progress=False, distributions=False)
    ).files
    html = files["report.html"].read_text()
    for section in ("Outlier channels", "Quantization health", "Distributions of the worst", "Sensitivity"):
        assert section not in html, section
    assert "Weights" in html and "Error by pattern" in html  # static analyses still ran
    files = compare_to_dir(b.fp32, b.int8["qdq"], feeds, tmp_path / "on", CompareOptions(progress=False)).files
    html = files["report.html"].read_text()
    assert "Outlier channels" in html and "Quantization health" in html and 'id="distribution-plots"' in html


def test_an_axis_proven_by_the_graph_wins_in_both_reduction_engines():
    """A detector output's parts prove its channel axis (1); the rank-3 guess would be 2. numpy's
    update and the diagnostic graph's update_from_sums must both keep the proof, or the shard
    state of a --reductions graph run differs from a numpy run's."""
    from diag.core.distributions import BatchSummary, DistributionAccumulator, channel_axis

    x = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    assert channel_axis(3, None) != 1
    numpy_run = DistributionAccumulator(axis=1)
    numpy_run.update(x, x)
    graph_run = DistributionAccumulator(axis=1)
    other = tuple(a for a in range(3) if a != 1)
    channels = (x.min(axis=other), x.max(axis=other), x.sum(axis=other, dtype=np.float64))
    graph_run.update_from_sums(BatchSummary(x.size, 3, float(x.min()), float(x.max()), channels, x.ravel(), x.ravel()))
    assert numpy_run.axis == graph_run.axis == 1
    assert numpy_run.to_state()["axis"] == graph_run.to_state()["axis"]


def test_attention_heads_and_key_positions_are_not_channels_hidden_dims_are(tmp_path, capsys):
    """Issue 42 item 5: MiniLM's 12 attention heads were reported as outlier "channels" (axis 1 of
    every rank-4 tensor was taken for NCHW channels). A 12-head tensor with one head 100x louder:
    the head is no channel, while the same values back in ``[batch, seq, hidden]`` are 4 outlier
    hidden dimensions; attention scores (key positions last) have no channel axis either."""
    import json

    from onnx import TensorProto, helper, numpy_helper

    from diag.cli import commands as cli
    from diag.core.distributions import layout_hints
    from diag.fixtures.quantize import quantize

    rng = np.random.default_rng(0)
    gain = np.ones((1, 12, 1, 1), np.float32)
    gain[0, 5] = 100.0
    inits = [
        numpy_helper.from_array(np.array([0, 16, 12, 4], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array([0, 16, 48], np.int64), "hidden_shape"),
        numpy_helper.from_array(gain, "gain"),
        numpy_helper.from_array(rng.normal(size=(48, 8)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "heads_shape"], ["split"], name="split"),
        helper.make_node("Transpose", ["split"], ["heads"], name="to_heads", perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["heads", "gain"], ["scaled"], name="scale_heads"),
        helper.make_node("MatMul", ["scaled", "scaled_t"], ["scores"], name="scores"),
        helper.make_node("Transpose", ["scaled"], ["scaled_t"], name="keys_t", perm=[0, 1, 3, 2]),
        helper.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "scaled"], ["context"], name="context"),
        helper.make_node("Transpose", ["context"], ["merged"], name="from_heads", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["merged", "hidden_shape"], ["hidden"], name="merge"),
        helper.make_node("MatMul", ["hidden", "w"], ["y"], name="proj"),
    ]
    nodes = [nodes[0], nodes[1], nodes[2], nodes[4], nodes[3], *nodes[5:]]
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16, 48])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    hints = layout_hints(model.graph)
    assert hints["scores"] == hints["probs"] == "positions" and hints["context"] == "MatMul"
    fp, q, x = tmp_path / "h.fp32.onnx", tmp_path / "h.int8.onnx", tmp_path / "x.npz"
    onnx.save(model, fp)
    quantize(fp, q, "dynamic")
    np.savez(x, x=rng.normal(size=(8, 16, 48)).astype(np.float32))
    out = tmp_path / "o"
    assert cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "4", "--quiet", "--out", str(out)]) in (
        0,
        3,
    )
    capsys.readouterr()
    tensors = json.loads((out / "diag.json").read_text())["distributions"]["tensors"]
    for name in ("scaled", "scores", "probs"):  # heads on axis 1, key positions last: no channel axis
        assert tensors[name]["axis"] is None and not tensors[name]["outliers"], (name, tensors[name]["axis"])
    hidden = tensors["hidden"]
    assert hidden["axis"] == 2 and hidden["channels"] == 48
    assert sorted(o["index"] for o in hidden["outliers"]) == [20, 21, 22, 23], hidden["outliers"]
