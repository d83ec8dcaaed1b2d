"""Memory at scale: the cut model runs inside the INT8 session (weights held once) with the same
figures, and large models skip the allocator tuning.

``diag.core.instrument.merged_with_cut`` appends the cut model, renamed, to the exposed INT8 model so
that onnxruntime loads (and prepacks) each INT8 weight once; ``run_comparison`` does that from
:data:`diag.core.streaming.SHARED_CUT_BYTES` of INT8 weights on. These tests run the same comparison
merged (threshold 0) and as two sessions (threshold out of reach) and require identical figures,
accumulated and local, on every fixture and format, and show what merging saves on a decoder
with external data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import diag.core.streaming
from diag.analysis.compare import CompareOptions, load_pair, run_comparison
from diag.core.feeds import feeds_from_arrays, input_specs
from diag.core.instrument import exposed_model, merged_with_cut
from diag.core.load import initializer_bytes
from diag.core.match import match_models
from diag.core.run import drop_mapped_pages
from diag.core.streaming import _local_model
from diag.fixtures import llm_models

FIXTURES = ("transformer", "convnet", "embedding", "two_outputs", "ctc")


def _figures(fp, q, inputs, options=None, batch=4):
    matching = match_models(fp.proto, q.proto)
    feeds = feeds_from_arrays(inputs, input_specs(fp.proto), 8, batch, "x")
    state, _ = run_comparison(fp, q, matching, feeds, options or CompareOptions(progress=False))
    figures = {}
    for kind, accs in (("accumulated", state.accumulated), ("local", state.local)):
        for name, acc in accs.items():
            s = acc.finalize()
            figures[kind, name] = (s.sqnr_db, s.max_abs, s.cosine, s.nonfinite_int8)
    for name, acc in state.outputs.items():
        figures["output", name] = repr(acc.finalize())
    return figures


def _both_ways(monkeypatch, fp, q, inputs, options=None):
    made = []

    def merging(*args):
        made.append(merged_with_cut(*args))
        return made[-1]

    # The engine's own names (diag.core.streaming): a patch elsewhere would leave both runs alike.
    monkeypatch.setattr(diag.core.streaming, "merged_with_cut", merging)
    monkeypatch.setattr(diag.core.streaming, "SHARED_CUT_BYTES", 0)
    merged = _figures(fp, q, inputs, options)
    assert made and all(m is not None for m in made), "the cut model was not merged"
    merges = len(made)
    monkeypatch.setattr(diag.core.streaming, "SHARED_CUT_BYTES", 1 << 62)
    separate = _figures(fp, q, inputs, options)
    assert len(made) == merges, "the cut model was merged above the threshold"
    return merged, separate


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("fmt", ("dynamic", "qdq", "qoperator"))
def test_merged_cut_gives_every_figure_of_two_sessions(built, monkeypatch, fixture, fmt):
    b = built(fixture)
    fp, q = load_pair(b.fp32, b.int8[fmt])
    merged, separate = _both_ways(monkeypatch, fp, q, b.inputs)
    assert merged.keys() == separate.keys()
    assert any(kind == "local" for kind, _ in merged)
    for key, want in separate.items():
        assert merged[key] == want, key


def test_merged_cut_under_a_memory_budget_gives_the_same_figures(built, monkeypatch):
    b = built("transformer")
    fp, q = load_pair(b.fp32, b.int8["qdq"])
    options = CompareOptions(progress=False, max_memory=200_000)
    merged, separate = _both_ways(monkeypatch, fp, q, b.inputs, options)
    assert merged == separate


def test_int4_decoder_with_external_data_holds_its_weights_once(tmp_path, monkeypatch):
    fx = llm_models.llama_decoder(layers=2)
    llm_models.save_with_external_data(fx.model, tmp_path / "fp32.onnx")
    llm_models.quantize_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    fp, q = load_pair(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    assert q.has_external_data
    pairs = dict(match_models(fp.proto, q.proto).pairs)
    cut, _ = _local_model(fp, q, pairs)
    assert cut is not None
    exposed = exposed_model(q.proto, [p.int8_name for p in pairs.values()])
    merged = merged_with_cut(exposed, cut)
    assert merged is not None
    model, local = merged
    # one copy of every weight: the cut's nodes read the INT8 model's own initializers
    assert initializer_bytes(model) == initializer_bytes(q.proto)
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names))
    cut_nodes = [n for n in model.graph.node if n.name.startswith("diag_local::")]
    assert sum(n.op_type == "MatMulNBits" for n in cut_nodes) == 15
    # every cut input and output is renamed apart from the INT8 graph's tensors
    int8_tensors = {o for n in q.proto.graph.node for o in n.output} | {i.name for i in q.proto.graph.input}
    assert not {ci.name for ci in local.inputs} & int8_tensors
    assert not {lo.name for lo in local.outputs} & int8_tensors
    merged_figures, separate = _both_ways(monkeypatch, fp, q, fx.make_inputs(3, 5))
    assert merged_figures == separate


@pytest.mark.parametrize(("limit", "tuned"), [(1 << 62, True), (0, False)])
def test_glibc_keeps_freed_memory_only_below_the_weight_limit(built, monkeypatch, limit, tuned):
    """Large models skip the allocator tuning (it held 250 MB more at peak on the 500M decoder)."""
    calls: list[bool] = []
    monkeypatch.setattr(diag.core.streaming, "reuse_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(diag.core.streaming, "REUSE_FREED_BELOW", limit)
    b = built("convnet")
    fp, q = load_pair(b.fp32, b.int8["dynamic"])
    _figures(fp, q, b.inputs)
    assert bool(calls) is tuned


def _rss_file_mb() -> int:
    text = Path("/proc/self/status").read_text()
    return int(text.split("RssFile:")[1].split()[0]) // 1024


def test_dropping_mapped_pages_lowers_resident_size_and_keeps_every_byte(tmp_path):
    data = np.arange(16 << 20, dtype=np.float32)  # 64 MB
    path = tmp_path / "w.data"
    data.tofile(path)
    shared = np.memmap(path, np.float32, "r")
    private = np.memmap(path, np.float32, "c")  # copy-on-write, as onnxruntime maps external data
    private[0] = -1.0  # a private page: never discarded
    before = _rss_file_mb()
    assert float(shared.sum(dtype=np.float64)) == float(data.sum(dtype=np.float64))
    assert _rss_file_mb() >= before + 48
    assert drop_mapped_pages([path]) >= 1
    assert _rss_file_mb() <= before + 16
    assert np.array_equal(shared, data)  # mapped again from the page cache
    assert private[0] == -1.0 and np.array_equal(private[1:], data[1:])
    assert drop_mapped_pages([tmp_path / "other.data"]) == 0


def test_a_large_models_pass_drops_mapped_pages_without_changing_a_figure(tmp_path, monkeypatch):
    fx = llm_models.llama_decoder(layers=2)
    llm_models.save_with_external_data(fx.model, tmp_path / "fp32.onnx")
    llm_models.quantize_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    fp, q = load_pair(tmp_path / "fp32.onnx", tmp_path / "int4.onnx")
    inputs = fx.make_inputs(3, 5)
    dropped: list[int] = []

    def counting(files):
        dropped.append(drop_mapped_pages(files))
        return dropped[-1]

    monkeypatch.setattr(diag.core.streaming, "drop_mapped_pages", counting)
    monkeypatch.setattr(diag.core.streaming, "REUSE_FREED_BELOW", 0)
    monkeypatch.setattr(diag.core.streaming, "DROP_MAPPED_AFTER", -(1 << 62))  # after every batch but the first
    with_drops = _figures(fp, q, inputs, batch=1)
    assert dropped and max(dropped) > 0  # onnxruntime mapped the int4 model's external data
    monkeypatch.setattr(diag.core.streaming, "REUSE_FREED_BELOW", 1 << 62)
    dropped.clear()
    assert _figures(fp, q, inputs, batch=1) == with_drops
    assert not dropped
    # a large model whose mapped pages have not grown by DROP_MAPPED_AFTER is not searched
    monkeypatch.setattr(diag.core.streaming, "REUSE_FREED_BELOW", 0)
    monkeypatch.setattr(diag.core.streaming, "DROP_MAPPED_AFTER", 1 << 62)
    assert _figures(fp, q, inputs, batch=1) == with_drops
    assert not dropped
