"""Pattern attribution: LayerNorm / GELU / Softmax / attention / residual / conv-act / SE / heads.

Expected counts come from how each model is built (the transformer fixture, hand-built graphs) or,
for the real PP-OCR models, from a second, deliberately different counting method (walking *up*
from every activation instead of matching *down* from every Conv).
"""

from __future__ import annotations

import math
from collections import Counter

import networkx as nx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.analysis.compare import CompareOptions, compare_models
from diag.analysis.patterns import PatternInstance, find_patterns, node_patterns, pattern_totals
from diag.core.feeds import FeedSpec
from diag.core.graph import fp_graph
from diag.core.match import node_id
from diag.core.metrics import ErrorStats
from diag.fixtures import models, thirdparty

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _kinds(instances: list[PatternInstance]) -> Counter[str]:
    return Counter(p.kind for p in instances)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _c(name: str, value: float | np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# --------------------------------------------------------------------------------------------
# The transformer fixture
# --------------------------------------------------------------------------------------------

# What fixtures/models.py `transformer()` builds: 2 layers x (attn LN, ffn LN), layer 0 decomposed,
# layer 1 fused, plus a fused final LN; one GELU (Erf form), one Softmax/attention and two residual
# Adds per layer; q/k/v/out/fc1/fc2 linear layers per layer and the classifier.
LAYERS = 2
DECOMPOSED_LN_NODES = 9  # ReduceMean Sub Pow ReduceMean Add Sqrt Div Mul Add


@pytest.fixture(scope="module")
def transformer_patterns() -> list[PatternInstance]:
    return find_patterns(models.transformer().model)


def test_transformer_fixture_has_every_layernorm_gelu_softmax_attention_and_residual(transformer_patterns):
    kinds = _kinds(transformer_patterns)
    assert kinds["layernorm"] == 2 * LAYERS + 1
    assert kinds["gelu"] == LAYERS
    assert kinds["softmax"] == LAYERS
    assert kinds["attention"] == LAYERS
    assert kinds["residual"] == 2 * LAYERS
    assert kinds["linear"] == 6 * LAYERS + 1
    assert kinds["head"] == 1
    assert set(kinds) == {"layernorm", "gelu", "softmax", "attention", "residual", "linear", "head"}


def test_transformer_labels_name_the_layer_and_the_sublayer(transformer_patterns):
    labels = {p.kind: [q.label for q in transformer_patterns if q.kind == p.kind] for p in transformer_patterns}
    assert labels["layernorm"] == [
        "LayerNorm in layer0 (attn_norm)",
        "LayerNorm in layer0 (ffn_norm)",
        "LayerNorm in layer1 (attn_norm)",
        "LayerNorm in layer1 (ffn_norm)",
        "LayerNorm in final_norm",
    ]
    assert labels["gelu"] == ["GELU in layer0 (ffn/gelu)", "GELU in layer1 (ffn/gelu)"]
    assert labels["softmax"] == ["Softmax in layer0 (attn)", "Softmax in layer1 (attn)"]
    assert labels["attention"] == ["Attention in layer0 (attn)", "Attention in layer1 (attn)"]
    assert labels["residual"] == [
        "Residual Add in layer0 (attn)",
        "Residual Add in layer0 (ffn)",
        "Residual Add in layer1 (attn)",
        "Residual Add in layer1 (ffn)",
    ]
    assert labels["head"] == ["Classification head (logits)"]
    assert "Linear in layer1 (ffn/fc1)" in labels["linear"]
    all_labels = [p.label for p in transformer_patterns]
    assert len(set(all_labels)) == len(all_labels)


def test_transformer_instances_hold_exactly_the_pattern_nodes(transformer_patterns):
    by_label = {p.label: p for p in transformer_patterns}
    ln = by_label["LayerNorm in layer0 (ffn_norm)"]
    assert len(ln.nodes) == DECOMPOSED_LN_NODES
    assert all(n.startswith("layer0/ffn_norm/") for n in ln.nodes)
    assert ln.output == "layer0/ffn_norm/Add_1_out"
    assert by_label["LayerNorm in layer1 (ffn_norm)"].nodes == ("layer1/ffn_norm/LayerNormalization",)
    gelu = by_label["GELU in layer1 (ffn/gelu)"]
    assert gelu.nodes == tuple(f"layer1/ffn/gelu/{op}" for op in ("Div", "Erf", "Add", "Mul", "Mul_1"))
    assert gelu.output == "layer1/ffn/gelu/Mul_1_out"
    att = by_label["Attention in layer1 (attn)"]
    assert att.nodes == tuple(f"layer1/attn/{op}" for op in ("Transpose", "MatMul", "Mul", "Softmax", "MatMul_1"))
    assert att.output == "layer1/attn/MatMul_1_out"
    assert by_label["Classification head (logits)"].nodes == ("pool/ReduceMean", "classifier/MatMul")
    # The embedding Add reads a constant position table: not a skip connection.
    residual_nodes = {n for p in transformer_patterns if p.kind == "residual" for n in p.nodes}
    assert "embeddings/Add" not in residual_nodes


def test_nested_patterns_are_listed_outermost_first(transformer_patterns):
    by_node = node_patterns(transformer_patterns)
    assert [p.kind for p in by_node["layer0/attn/Softmax"]] == ["attention", "softmax"]
    assert [p.kind for p in by_node["classifier/MatMul"]] == ["head", "linear"]
    assert "embeddings/Gather" not in by_node


@pytest.mark.parametrize("name", sorted(models.ALL_BUILDERS))
def test_every_fixture_gets_unique_labels_over_existing_nodes(name):
    model = models.build(name).model
    found = find_patterns(model)
    ids = {node_id(n, i) for i, n in enumerate(model.graph.node)}
    produced = {o for n in model.graph.node for o in n.output}
    assert found
    assert len({p.label for p in found}) == len(found)
    assert all(p.nodes and set(p.nodes) <= ids and p.output in produced for p in found)


def test_empty_graph_has_no_patterns():
    assert find_patterns(_model([], [_vi("x", [1])], [_vi("x", [1])])) == []


def test_matching_ignores_node_names_and_falls_back_to_ordinals():
    model = models.transformer().model
    named = find_patterns(model)
    for n in model.graph.node:
        n.name = ""
    unnamed = find_patterns(model)
    assert _kinds(unnamed) == _kinds(named)
    assert [p.label for p in unnamed if p.kind == "layernorm"] == [f"LayerNorm #{i}" for i in range(1, 6)]
    ids = {node_id(n, i) for i, n in enumerate(model.graph.node)}
    assert all(set(p.nodes) <= ids for p in unnamed)
    assert [len(p.nodes) for p in unnamed] == [len(p.nodes) for p in named]


# --------------------------------------------------------------------------------------------
# Hand-built GELU, attention and RMSNorm graphs
# --------------------------------------------------------------------------------------------


def _gelu_model(variant: str, cubic: float = 0.044715, prefix: str = "block3/mlp/act") -> onnx.ModelProto:
    """MatMul -> a decomposed GELU (tanh or erf form, several exporter spellings) -> Relu."""
    rng = np.random.default_rng(0)
    inits = [_c("w", rng.standard_normal((8, 8)) / 3), _c("c3", 3.0), _c("cub", cubic), _c("k", math.sqrt(2 / math.pi))]
    inits += [_c("one", 1.0), _c("half", 0.5), _c("sqrt2", math.sqrt(2.0)), _c("inv_sqrt2", 1 / math.sqrt(2.0))]
    nodes = [helper.make_node("MatMul", ["in", "w"], ["x"], name="block3/mlp/fc/MatMul")]

    def n(op: str, ins: list[str], out: str) -> None:
        nodes.append(helper.make_node(op, ins, [out], name=f"{prefix}/{out}" if prefix else ""))

    if variant == "tanh-pow":  # HF NewGELU: 0.5*x*(1+tanh(k*(x+0.044715*x^3)))
        n("Pow", ["x", "c3"], "p")
        n("Mul", ["cub", "p"], "cp")
        n("Add", ["x", "cp"], "s")
        n("Mul", ["s", "k"], "ks")
        core = "Tanh"
    elif variant == "tanh-cube-mul":  # x*x*x spelled as two Muls
        n("Mul", ["x", "x"], "x2")
        n("Mul", ["x2", "x"], "x3")
        n("Mul", ["x3", "cub"], "cp")
        n("Add", ["cp", "x"], "s")
        n("Mul", ["k", "s"], "ks")
        core = "Tanh"
    elif variant == "tanh-factored":  # FastGelu: tanh(k*x*(1+0.044715*x*x))
        n("Mul", ["x", "x"], "x2")
        n("Mul", ["x2", "cub"], "cx2")
        n("Add", ["cx2", "one"], "s1")
        n("Mul", ["x", "s1"], "xs")
        n("Mul", ["xs", "k"], "ks")
        core = "Tanh"
    elif variant == "erf-mul":  # x * 0.7071 instead of x / 1.4142
        n("Mul", ["x", "inv_sqrt2"], "ks")
        core = "Erf"
    else:
        raise AssertionError(variant)
    n(core, ["ks"], "t")
    n("Add", ["t", "one"], "plus")
    order = {"tanh-pow": "a", "tanh-cube-mul": "b", "tanh-factored": "c", "erf-mul": "b"}[variant]
    if order == "a":  # (x * (1 + t)) * 0.5
        n("Mul", ["x", "plus"], "xp")
        n("Mul", ["xp", "half"], "y")
    elif order == "b":  # ((1 + t) * 0.5) * x
        n("Mul", ["plus", "half"], "hp")
        n("Mul", ["hp", "x"], "y")
    else:  # (0.5 * x) * (1 + t)
        n("Mul", ["half", "x"], "hx")
        n("Mul", ["hx", "plus"], "y")
    nodes.append(helper.make_node("Relu", ["y"], ["out"], name="block3/mlp/Relu"))
    return _model(nodes, [_vi("in", [4, 8])], [_vi("out", [4, 8])], inits)


@pytest.mark.parametrize("variant", ["tanh-pow", "tanh-cube-mul", "tanh-factored", "erf-mul"])
def test_gelu_is_found_in_every_exporter_spelling(variant):
    model = _gelu_model(variant)
    # The hand-built graph really computes GELU (checked with onnxruntime), so the test checks a GELU.
    x_in = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    x = x_in @ numpy_helper.to_array(model.graph.initializer[0])
    if variant.startswith("tanh"):
        gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    else:
        gelu = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    np.testing.assert_allclose(_run(model, {"in": x_in})[0], np.maximum(gelu, 0), rtol=1e-4, atol=1e-5)

    found = [p for p in find_patterns(model) if p.kind == "gelu"]
    assert [p.label for p in found] == ["GELU in block3 (mlp/act)"]
    gelu_nodes = [node_id(n, i) for i, n in enumerate(model.graph.node) if n.name.startswith("block3/mlp/act/")]
    assert found[0].nodes == tuple(gelu_nodes)
    assert found[0].output == "y"


def test_sigmoid_form_gelu_is_found_but_a_plain_swish_is_not():
    def model(k: float) -> onnx.ModelProto:
        nodes = [
            helper.make_node("Mul", ["x", "k"], ["kx"], name="clip/mlp/Mul"),
            helper.make_node("Sigmoid", ["kx"], ["s"], name="clip/mlp/Sigmoid"),
            helper.make_node("Mul", ["x", "s"], ["y"], name="clip/mlp/Mul_1"),
        ]
        return _model(nodes, [_vi("x", [2, 4])], [_vi("y", [2, 4])], [_c("k", k)])

    assert [(p.kind, p.label, len(p.nodes)) for p in find_patterns(model(1.702))] == [("gelu", "GELU in clip/mlp", 3)]
    assert find_patterns(model(1.0)) == []


def test_tanh_with_other_constants_is_not_a_gelu():
    assert not [p for p in find_patterns(_gelu_model("tanh-pow", cubic=0.05)) if p.kind == "gelu"]


def test_unnamed_gelu_gets_an_ordinal_label():
    found = [p.label for p in find_patterns(_gelu_model("tanh-pow", prefix="")) if p.kind == "gelu"]
    assert found == ["GELU #1"]


def _attention_model() -> onnx.ModelProto:
    """Torch-style names; scale by Div, additive mask, decomposed (max-subtracted) softmax."""
    p = "/encoder/layer.3/attention/self"
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], name=f"{p}/Transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name=f"{p}/MatMul"),
        helper.make_node("Div", ["s", "scale"], ["sd"], name=f"{p}/Div"),
        helper.make_node("Add", ["sd", "mask"], ["sm"], name=f"{p}/Add"),
        helper.make_node("ReduceMax", ["sm"], ["mx"], name=f"{p}/ReduceMax", axes=[-1], keepdims=1),
        helper.make_node("Sub", ["sm", "mx"], ["z"], name=f"{p}/Sub"),
        helper.make_node("Exp", ["z"], ["e"], name=f"{p}/Exp"),
        helper.make_node("ReduceSum", ["e", "axis"], ["se"], name=f"{p}/ReduceSum", keepdims=1),
        helper.make_node("Div", ["e", "se"], ["probs"], name=f"{p}/Div_1"),
        helper.make_node("Dropout", ["probs"], ["dropped"], name=f"{p}/Dropout"),
        helper.make_node("MatMul", ["dropped", "v"], ["ctx"], name=f"{p}/MatMul_1"),
    ]
    inits = [_c("scale", 4.0), numpy_helper.from_array(np.array([-1], np.int64), "axis")]
    ins = [_vi(n, [2, 5, 16]) for n in ("q", "k", "v")] + [_vi("mask", [2, 5, 5])]
    return _model(nodes, ins, [_vi("ctx", [2, 5, 16])], inits)


def test_attention_with_mask_and_decomposed_softmax_is_found_and_labelled_by_layer():
    model = _attention_model()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 16)).astype(np.float32) for _ in range(3))
    mask = np.where(rng.random((2, 5, 5)) < 0.2, -1e4, 0).astype(np.float32)
    s = q @ k.transpose(0, 2, 1) / 4 + mask
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(_run(model, {"q": q, "k": k, "v": v, "mask": mask})[0], probs @ v, rtol=1e-4, atol=1e-5)

    found = find_patterns(model)
    assert _kinds(found) == {"softmax": 1, "attention": 1}
    att = next(p for p in found if p.kind == "attention")
    sm = next(p for p in found if p.kind == "softmax")
    assert att.label == "Attention in layer.3 (attention/self)"
    assert att.nodes == tuple(n.name for n in model.graph.node)
    assert att.output == "ctx"
    assert len(sm.nodes) == 5 and sm.output == "probs"
    # The mask Add reads a graph input that is no ancestor of the scores: not residual.
    assert "residual" not in _kinds(found)


def test_rmsnorm_is_found_and_not_taken_for_a_layernorm():
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"], name="layers.0/norm/Pow"),
        helper.make_node("ReduceMean", ["sq"], ["ms"], name="layers.0/norm/ReduceMean", axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="layers.0/norm/Add"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="layers.0/norm/Sqrt"),
        helper.make_node("Reciprocal", ["rms"], ["inv"], name="layers.0/norm/Reciprocal"),
        helper.make_node("Mul", ["x", "inv"], ["xn"], name="layers.0/norm/Mul"),
        helper.make_node("Mul", ["xn", "gamma"], ["y"], name="layers.0/norm/Mul_1"),
    ]
    inits = [_c("two", 2.0), _c("eps", 1e-6), _c("gamma", np.linspace(0.5, 1.5, 8))]
    found = find_patterns(_model(nodes, [_vi("x", [3, 8])], [_vi("y", [3, 8])], inits))
    assert [(p.kind, p.label, len(p.nodes), p.output) for p in found] == [
        ("rmsnorm", "RMSNorm in layers.0 (norm)", 7, "y")
    ]


def test_residual_add_on_a_graph_input_is_found():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Add", ["x", "r"], ["y"], name="skip"),
    ]
    found = find_patterns(_model(nodes, [_vi("x", [2, 4])], [_vi("y", [2, 4])], [_c("w", np.eye(4))]))
    assert [(p.kind, p.nodes) for p in found if p.kind == "residual"] == [("residual", ("skip",))]


# --------------------------------------------------------------------------------------------
# Real PP-OCR models from a PyPI wheel
# --------------------------------------------------------------------------------------------

_ACT_NAME = {"Relu": "ReLU", "HardSigmoid": "HardSigmoid", "Sigmoid": "Sigmoid", "Clip": "HardSwish"}


def _conv_acts_by_walking_up(model: onnx.ModelProto) -> Counter[str]:
    """Activations whose input comes from a Conv through BatchNorm / constant Mul-Add only.

    Independent of the matcher: starts at each activation and walks *up*. In PP-OCR every Clip is
    the Clip(x + 3, 0, 6) of a decomposed HardSwish, so the walk from a Clip passes the Add(3) too.
    """
    producer = {o: n for n in model.graph.node for o in n.output}
    consts = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" or (n.op_type == "Reshape" and all(t in consts for t in n.input)):
            consts.add(n.output[0])
    found: Counter[str] = Counter()
    for n in model.graph.node:
        if n.op_type not in _ACT_NAME:
            continue
        t = n.input[0]
        for _ in range(5):
            p = producer.get(t)
            if p is None:
                break
            if p.op_type in ("Conv", "ConvTranspose"):
                found[_ACT_NAME[n.op_type]] += 1
                break
            if p.op_type == "BatchNormalization" or (p.op_type in ("Add", "Mul") and any(i in consts for i in p.input)):
                t = next(i for i in p.input if i not in consts)
            else:
                break
    return found


@pytest.fixture(scope="module")
def ocr() -> dict[str, onnx.ModelProto]:
    return {w: onnx.load(str(thirdparty.rapidocr_model(w))) for w in ("det", "cls")}


@pytest.mark.parametrize("which", ["det", "cls"])
def test_conv_activation_blocks_of_real_ocr_models_match_an_independent_count(ocr, which):
    model = ocr[which]
    expected = _conv_acts_by_walking_up(model)
    found = [p for p in find_patterns(model) if p.kind == "conv-act"]
    got = Counter(p.label.split(" #")[0].split("+")[1] for p in found)
    assert got == expected
    assert sum(expected.values()) > 40  # sanity: the independent count saw the whole backbone
    ops = {node_id(n, i): n.op_type for i, n in enumerate(model.graph.node)}
    for p in found:
        assert sum(ops[n] in ("Conv", "ConvTranspose") for n in p.nodes) == 1, p


@pytest.mark.parametrize("which", ["det", "cls"])
def test_squeeze_excitation_blocks_of_real_ocr_models_are_found(ocr, which):
    model = ocr[which]
    producer = {o: n for n in model.graph.node for o in n.output}
    gates = sum(
        n.op_type == "Mul"
        and any(producer.get(t) is not None and producer[t].op_type == "HardSigmoid" for t in n.input)
        for n in model.graph.node
    )
    se = [p for p in find_patterns(model) if p.kind == "se"]
    assert len(se) == gates > 0
    ops = {node_id(n, i): n.op_type for i, n in enumerate(model.graph.node)}
    assert all(ops[p.nodes[0]] == "GlobalAveragePool" and ops[p.nodes[-1]] == "Mul" for p in se)


@pytest.mark.parametrize("which", ["det", "cls"])
def test_residual_adds_of_real_ocr_models_are_the_adds_with_one_operand_upstream_of_the_other(ocr, which):
    model = ocr[which]
    g = fp_graph(model)  # full ancestor sets here; the matcher walks a pruned window instead
    producer = {o: node_id(n, i) for i, n in enumerate(model.graph.node) for o in n.output}
    constant = {node_id(n, i) for i, n in enumerate(model.graph.node) if n.op_type in ("Constant", "Reshape")}
    expected = []
    for i, n in enumerate(model.graph.node):
        ps = [producer.get(t) for t in n.input]
        if n.op_type == "Add" and len(ps) == 2 and None not in ps and not set(ps) & constant:
            a, b = ps
            if a in nx.ancestors(g, b) or b in nx.ancestors(g, a):
                expected.append(node_id(n, i))
    found = [p.nodes for p in find_patterns(model) if p.kind == "residual"]
    assert found == [(n,) for n in expected]
    assert len(expected) >= 7  # PP-LCNet / PP-LCNetV3 blocks and the RSE neck have skip connections


def test_det_head_is_the_conv_transpose_sigmoid_chain_after_the_fpn_concat(ocr):
    model = ocr["det"]
    heads = [p for p in find_patterns(model) if p.kind == "head"]
    out = model.graph.output[0].name
    assert [(p.label, p.output) for p in heads] == [(f"Detection/segmentation head ({out})", out)]
    ids = {node_id(n, i): n for i, n in enumerate(model.graph.node)}
    head_ops = [ids[n].op_type for n in heads[0].nodes]
    assert head_ops[-1] == "Sigmoid" and head_ops.count("ConvTranspose") == 2 and head_ops[0] == "Conv"
    producer = {o: n for n in model.graph.node for o in n.output}
    assert producer[ids[heads[0].nodes[0]].input[0]].op_type == "Concat"


def test_cls_head_is_pool_reshape_matmul_softmax(ocr):
    model = ocr["cls"]
    heads = [p for p in find_patterns(model) if p.kind == "head"]
    out = model.graph.output[0].name
    assert [(p.label, p.output) for p in heads] == [(f"Classification head ({out})", out)]
    ids = {node_id(n, i): n.op_type for i, n in enumerate(model.graph.node)}
    assert [ids[n] for n in heads[0].nodes] == ["GlobalAveragePool", "Reshape", "MatMul", "Add", "Softmax", "Identity"]


# --------------------------------------------------------------------------------------------
# Totals
# --------------------------------------------------------------------------------------------


def _stats(mse: float, count: int, sqnr: float) -> ErrorStats:
    rmse = math.sqrt(mse)
    return ErrorStats(count, sqnr, 0.99, mse, rmse, rmse, rmse, 0.1, None, 1.0, 0, 0)


def test_pattern_totals_shares_on_known_error_energies():
    # Local error energy (mse * count): t1 2, t2 6, t3 2, t5 4 (read by two fused nodes), t4 6 (no pattern).
    local = {
        "t1": _stats(0.5, 4, 20.0),
        "t2": _stats(1.0, 6, 8.0),
        "t3": _stats(0.25, 8, 15.0),
        "t4": _stats(1.5, 4, 30.0),
        "t5": _stats(0.5, 8, 12.0),
    }
    accumulated = {t: _stats(s.mse * 2, s.count, s.sqnr_db - 3) for t, s in local.items()}
    tensor_of_node = {"n1": "t1", "n2": "t2", "n3": "t3", "n4": "t4", "n5": "t5", "n6": "t5"}
    instances = [
        PatternInstance("gelu", "A", ("n1", "n2"), "t2"),
        PatternInstance("attention", "B", ("n2", "n3"), "t3"),
        PatternInstance("gelu", "C", ("n3", "n5", "n6", "n7"), "t5"),  # n7: not measured
    ]
    per_instance, per_kind = pattern_totals(instances, accumulated, local, tensor_of_node)
    total = 2 + 6 + 2 + 6 + 4
    rows = {t.label: t for t in per_instance}
    assert rows["A"].local_energy == pytest.approx(8.0) and rows["A"].local_share == pytest.approx(8 / total)
    assert rows["B"].local_share == pytest.approx(8 / total)
    assert rows["C"].local_energy == pytest.approx(6.0)  # t5 once although two nodes read it
    assert (rows["C"].nodes, rows["C"].measured) == (4, 3)
    assert rows["A"].worst_local_sqnr_db == 8.0 and rows["A"].worst_local_node == "n2"
    assert rows["A"].worst_accumulated_sqnr_db == 5.0
    assert rows["C"].output_accumulated_sqnr_db == 9.0
    kinds = {t.kind: t for t in per_kind}
    assert kinds["gelu"].label == "GELU" and kinds["gelu"].instances == 2
    assert kinds["gelu"].local_share == pytest.approx((2 + 6 + 2 + 4) / total)
    assert kinds["attention"].local_share == pytest.approx(8 / total)
    assert [t.label for t in per_kind] == ["GELU", "Attention"]
    assert [t.local_energy for t in per_instance] == sorted((t.local_energy for t in per_instance), reverse=True)


def test_pattern_totals_without_any_local_error_give_zero_shares():
    per_instance, per_kind = pattern_totals([PatternInstance("gelu", "A", ("n1",), "t1")], {}, {}, {"n1": "t1"})
    assert per_instance[0].local_share == 0.0 and per_instance[0].worst_local_sqnr_db is None
    assert per_kind[0].measured == 0


@pytest.mark.parametrize("fmt", ["dynamic", "qdq", "qoperator"])
def test_injected_transformer_defect_is_attributed_to_the_fc1_linear_layer(built, fmt):
    b = built("transformer")
    r = compare_models(
        b.fp32, b.int8[fmt], FeedSpec(inputs=str(b.inputs_path), samples=8), CompareOptions(progress=False)
    )
    tensor_of_node = {n: f.tensor for f in r.findings for n in f.group.fp_nodes}
    per_instance, per_kind = pattern_totals(
        find_patterns(onnx.load(str(b.fp32))), r.accumulated, r.local, tensor_of_node
    )
    assert per_instance[0].label == "Linear in layer1 (ffn/fc1)"
    assert per_instance[0].worst_local_node == b.fixture.expected.culprit_node
    assert per_kind[0].label == "Linear"
    linear_rows = [t for t in per_instance if t.kind == "linear"]
    assert sum(t.local_share for t in linear_rows) == pytest.approx(per_kind[0].local_share)
    assert 0.5 < per_kind[0].local_share <= 1.0


def test_constants_from_constant_nodes_count_and_constant_nodes_stay_out_of_instances():
    nodes = [
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
        helper.make_node("Constant", [], ["s2"], value=_c("s2v", math.sqrt(2.0))),
        helper.make_node("Div", ["x", "s2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["p"]),
        helper.make_node("Mul", ["x", "p"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    found = find_patterns(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))
    assert found == [PatternInstance("gelu", "GELU #1", ("Div#3", "Erf#4", "Add#5", "Mul#6", "Mul#7"), "y")]


def test_convnet_fixture_has_three_conv_relu_blocks_and_a_pool_flatten_gemm_head():
    found = find_patterns(models.convnet().model)
    assert [(p.label, p.nodes) for p in found if p.kind == "conv-act"] == [
        (f"Conv+ReLU #{i}", (f"conv{i}", f"relu{i}")) for i in (1, 2, 3)
    ]
    assert [(p.label, p.nodes) for p in found if p.kind == "head"] == [
        ("Classification head (logits)", ("pool", "flatten", "fc"))
    ]


def test_a_projection_without_pooling_or_conv_is_an_output_head():
    nodes = [
        helper.make_node("LayerNormalization", ["h", "g", "b"], ["hn"], name="final/LayerNorm", axis=-1),
        helper.make_node("MatMul", ["hn", "w"], ["logits"], name="lm_head/MatMul"),
    ]
    inits = [_c("g", np.ones(4)), _c("b", np.zeros(4)), _c("w", np.ones((4, 10)))]
    found = find_patterns(_model(nodes, [_vi("h", [2, 3, 4])], [_vi("logits", [2, 3, 10])], inits))
    heads = [(p.label, p.nodes) for p in found if p.kind == "head"]
    assert heads == [("Output head (logits)", ("lm_head/MatMul",))]
