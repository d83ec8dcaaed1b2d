"""Recipe inference: from an INT8 model alone, the onnxruntime settings that made it.

Users inherit INT8 models (a colleague's, a model zoo's) and need the recipe to reproduce or
change them: quantize again with one more node excluded, or per-channel instead of per-tensor.
Everything onnxruntime decides leaves a trace in the graph:

* mode and format: the quantized op types (``diag.core.load.detect_format``);
* weight / activation types: the dtype of weight initializers and of activation zero points;
* per_channel: a weight scale with more than one element;
* symmetric: every zero point is 0 (signed) or the midpoint 128 / 32768 (unsigned). Written as
  ``WeightSymmetric`` / ``ActivationSymmetric`` only where it differs from onnxruntime's default
  (weights: symmetric for signed types; activations: asymmetric);
* reduce_range: every weight fits in 7 bits (onnxruntime's reduced ranges);
* MatMulConstBOnly (dynamic): a MatMulInteger reading B from a DynamicQuantizeLinear output
  quantizes two activations, which ``quantize_dynamic`` does only with ``MatMulConstBOnly: False``
  (its default is True); written only then;
* nodes_to_exclude: nodes of an op type onnxruntime's registry would quantize still in float.

NOTE: Exclusions are inferred only where the graph holds proof. Weighted ops (Conv,
ConvTranspose, MatMul, Gemm with a constant weight), all formats: a float weight initializer
feeding them. QOperator Add / Mul / Softmax / activation MatMul on float tensors: onnxruntime's
QLinear quantizers for them quantize any float input themselves, so a float one was skipped.
Other weightless ops are not listed: onnxruntime quantizes Reshape, Transpose, Relu... only when
their input is quantized, and in QDQ a Q/DQ pair is shared by quantized and skipped consumers
alike. Guessing there would produce exclusion lists nobody asked for.

NOTE: A MatMul reading two activations (attention's Q·Kᵀ and P·V) is left in float by the
``MatMulConstBOnly`` lever, not by the user, wherever the lever is on: it is never an exclusion in a
dynamic model that quantizes no such MatMul (the default). Where the graph proves the lever off (a
MatMulInteger reads two activations), a float one beside it was excluded. QOperator reads the lever
too (its default is off), but a QOperator model whose every such MatMul is float could have been
made either way (the lever on, or each one excluded): diag lists them in nodes_to_exclude, which
rebuilds the same graph, and says so in the evidence. QDQ ignores the lever.

NOTE: What the graph cannot tell is said, not guessed: ``calibrate_method`` (MinMax, Entropy and
Percentile all end as a scale), calibration data, ``preprocess``, and whether a whole op type was
skipped via ``op_types_to_quantize`` or node by node (both give the same graph; diag writes node
names, which reproduce it either way). A QDQ model that leaves every node of some types of
onnxruntime's QDQ registry unquantized (``op_types_to_quantize=["MatMul"]`` leaves Add, Mul,
Softmax, LayerNormalization, Gather...) gets ``op_types_to_quantize``: no node list can say it.

NOTE: onnxruntime decides some things whatever the recipe says, and they are no evidence of it: QDQ
makes every per-channel weight symmetric (only per-tensor weights tell ``WeightSymmetric``), and
QOperator's per-channel QLinearConv weights are int8 (only its other weights tell
``weight_type``). A grid of 24 recipes x 3 formats round-trips byte for byte
(tests/test_roundtrip.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from diag.core.encodings import encodings_of, model_from_encodings, not_quantized
from diag.core.load import model_from_path
from diag.core.precision import activation_overrides
from diag.core.protos import value_dtypes  # element types via shape inference on a weight-free copy
from diag.core.recipe import Recipe, recipe_from_option
from diag.fix.fp16convert import infer_fp16_recipe
from diag.fix.lint import DIAG_ONLY_KEYS, RECIPE_KEYS, quantizable_op_types
from diag.fix.weightonly import infer_weight_only
from diag.foundations.errors import DiagError
from diag.foundations.files import output_file, write_set
from diag.foundations.ortfacts import FORMATS, QUANTIZED_OPS, families_where, weight_operands

#: ops whose weight (input 1) onnxruntime quantizes when it quantizes the op.
WEIGHTED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
#: integer dtype -> onnxruntime QuantType name.
QUANT_TYPE_NAMES: dict[int, str] = {
    onnx.TensorProto.INT8: "QInt8",
    onnx.TensorProto.UINT8: "QUInt8",
    onnx.TensorProto.INT16: "QInt16",
    onnx.TensorProto.UINT16: "QUInt16",
    onnx.TensorProto.FLOAT8E4M3FN: "QFLOAT8E4M3FN",
}
#: zero points of symmetric quantization: the midpoint of the full or the reduced range (quant_utils).
SYMMETRIC_ZERO_POINTS: dict[int, tuple[int, ...]] = {
    onnx.TensorProto.INT8: (0,),
    onnx.TensorProto.INT16: (0,),
    onnx.TensorProto.UINT8: (128, 64),
    onnx.TensorProto.UINT16: (32768, 16384),
}
#: widest span (max q - min q) of one weight quantized with reduce_range: 7 bits (+1 for the
#: symmetric ranges -64..64 and 0..128). Full-range weights span 127 (symmetric) to 255.
REDUCED_SPAN: dict[int, int] = {
    onnx.TensorProto.INT8: 128,
    onnx.TensorProto.UINT8: 128,
    onnx.TensorProto.INT16: 32768,
    onnx.TensorProto.UINT16: 32768,
}
#: input index of the quantized weight, its scale and zero point, for quantized weighted ops.
_WEIGHT_INPUTS = {
    op: (w.index, w.scale, w.zero_point)
    for op, w in weight_operands(lambda op: op.family in families_where(lambda f: f.integer_weights)).items()
}

UNKNOWN_FIELDS = {
    "calibrate_method": "MinMax, Entropy, Percentile and Distribution all end as a scale in the model",
    "calibration": "the calibration data is not stored in the model",
    "preprocess": "quant_pre_process leaves no mark that survives quantization",
}
#: quantized ops computing a MatMul, with the input index of their second operand (B).
_MATMUL_B = {
    op.op_type: op.operand(1).index for op in QUANTIZED_OPS.values() if op.float_op == "MatMul" and op.operands
}


@dataclass
class InferredRecipe:
    """A recipe read back from an INT8 model, with the evidence and what stays unknown.

    Attributes:
        recipe: the recipe as a plain dict in recipe-file form (``diag.core.recipe`` key names).
        unknown: recipe field -> why the model cannot tell it.
        evidence: one line per inferred field saying what in the graph decided it.
    """

    recipe: dict[str, Any]
    unknown: dict[str, str] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)

    def to_toml(self) -> str:
        """The recipe as a TOML recipe file; unknown fields are comments with the reason.

        Example:
            >>> print(InferredRecipe({"mode": "dynamic", "weight_type": "QInt8"}).to_toml())
            mode = "dynamic"
            weight_type = "QInt8"
        """
        lines = [f"{k} = {_toml(v)}" for k, v in self.recipe.items() if k != "extra_options"]
        for key, why in self.unknown.items():
            lines.append(toml_comment(f"{key}: cannot be inferred from the model ({why})"))
        extra = self.recipe.get("extra_options") or {}
        if extra:
            lines += ["", "[extra_options]"] + [f"{k} = {_toml(v)}" for k, v in extra.items()]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The recipe as a JSON recipe file (JSON has no comments: unknown fields are left out)."""
        return json.dumps(self.recipe, indent=2) + "\n"


def infer_recipe(path: str | os.PathLike[str]) -> InferredRecipe:
    """Infer the quantization recipe that produced the INT8 model at ``path``.

    Reads weights (zero points, scales, quantized weights) but never modifies the file.

    Example:
        >>> r = infer_recipe("int8.onnx")  # doctest: +SKIP
        >>> r.recipe["mode"], r.recipe.get("quant_format")  # doctest: +SKIP
        ('static', 'QDQ')
    """
    loaded = model_from_path(path, "INT8 model")
    kind: str = loaded.format.kind
    obj = f"INT8 model '{loaded.path}'"
    if kind == "fp32":
        raise not_quantized(loaded)
    if loaded.format.family == "fp16":
        recipe, evidence = infer_fp16_recipe(loaded.proto)
        return InferredRecipe(recipe, {}, evidence)
    kind = loaded.format.family  # qdq-a16w8 / qdq16 / a mixed-precision QDQ model: onnxruntime's QDQ
    if kind == "mixed":
        ev = ", ".join(loaded.format.evidence)
        raise DiagError(
            "bad-option",
            obj,
            f"mixes quantization formats ({ev}); one recipe cannot have made it",
            "infer the recipe of a model made by one quantize_dynamic / quantize_static call",
        )
    if FORMATS[kind].weight_only:
        recipe, evidence = infer_weight_only(loaded.proto)
        return InferredRecipe(recipe, {}, evidence)
    # NOTE: external weights are read one tensor at a time where a value is needed (zero points,
    # the reduce_range check), never all at once: memory stays O(largest weight) on large models.
    base_dir = str(loaded.path.resolve().parent) if loaded.has_external_data else ""
    return _infer(loaded.proto, kind, base_dir)


def toml_comment(text: str) -> str:
    r"""One TOML comment line: line breaks and control characters (invalid in a TOML comment) become '?'.

    Example:
        >>> toml_comment('from evil\nmode = "static".onnx')
        '# from evil?mode = "static".onnx'
    """
    return "# " + "".join(ch if ch == "\t" or ch.isprintable() else "?" for ch in text)


def recipe_to_toml(path: str | os.PathLike[str]) -> str:
    """`diag inspect --recipe`: the inferred recipe as TOML text (see :func:`infer_recipe`).

    Example:
        >>> print(recipe_to_toml("int8.onnx"))  # doctest: +SKIP
        mode = "dynamic"
        ...
    """
    inferred = infer_recipe(path)
    # NOTE: file and node names come from the user's files: a newline in one must not become a live line.
    header = [toml_comment(f"recipe inferred by diag from {Path(path).name}")]
    header += [toml_comment(f"evidence: {e}") for e in inferred.evidence]
    return "\n".join(header) + "\n" + inferred.to_toml()


def recipe_to_file(model: str | os.PathLike[str], out: str | os.PathLike[str]) -> tuple[Path, list[str]]:
    """`diag inspect --recipe-out FILE`: write the inferred recipe (.toml with comments, else JSON).

    Returns the path and the notes for fields that could not be inferred (a JSON file cannot
    hold them as comments, so the caller prints them).

    Example:
        >>> recipe_to_file("int8.onnx", "recipe.toml")  # doctest: +SKIP
        (PosixPath('recipe.toml'), ['calibrate_method: cannot be inferred ...'])
    """
    inferred = infer_recipe(model)
    p = output_file(out, "--recipe-out")
    text = recipe_to_toml(model) + "\n" if p.suffix.lower() == ".toml" else inferred.to_json()
    notes = [f"{k}: cannot be inferred from the model ({why})" for k, why in inferred.unknown.items()]
    write_set({p: text}, "--recipe-out")
    return p, notes


# ---------------------------------------------------------------- inference


def _infer(model: onnx.ModelProto, kind: str, base_dir: str = "") -> InferredRecipe:
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    weights = _quantized_weights(graph, inits, producers, kind, base_dir)
    evidence: list[str] = []
    recipe: dict[str, Any] = {"mode": "dynamic" if kind == "dynamic" else "static"}
    if kind != "dynamic":
        recipe["quant_format"] = FORMATS[kind].quant_format
        act_zps = _activation_zero_points(graph, inits)
        act_types = Counter(zp.data_type for zp in act_zps)
        if act_types:
            dtype = act_types.most_common(1)[0][0]
            recipe["activation_type"] = QUANT_TYPE_NAMES.get(dtype, str(dtype))
            evidence.append(f"activation_type from {len(act_zps)} activation zero point(s)")
    extra: dict[str, Any] = {}
    if kind == "qdq" and act_zps and act_types:
        overrides = activation_overrides(graph, inits, act_types.most_common(1)[0][0], QUANT_TYPE_NAMES)
        if overrides:
            extra["TensorQuantOverrides"] = overrides
            evidence.append(
                f"TensorQuantOverrides: {len(overrides)} activation(s) on another grid than activation_type"
            )
    if weights:
        w_types = Counter(q.data_type for q, _, _ in _weight_type_evidence(graph, weights, kind))
        w_dtype = w_types.most_common(1)[0][0]
        recipe["weight_type"] = QUANT_TYPE_NAMES.get(w_dtype, str(w_dtype))
        recipe["per_channel"] = any(_size(s) > 1 for _, s, _ in weights if s is not None) or any(
            _size(z) > 1 for _, _, z in weights if z is not None
        )
        recipe["reduce_range"] = all(_fits_reduced(q, base_dir) for q, _, _ in weights)
        evidence.append(f"weight_type, per_channel, reduce_range from {len(weights)} quantized weight(s)")
        w_zps = [z for _, _, z in weights if z is not None]
        if kind == "qdq":
            # onnxruntime's QDQ quantizer makes every per-channel weight symmetric whatever
            # WeightSymmetric says ("always quantize per-channel initializers as symmetric",
            # qdq_quantizer.py): only the per-tensor ones it quantizes as weights (Conv / MatMul /
            # Gemm weights, a normalization's scale: operators/norm.py) tell the setting; its other
            # constants are quantized as activations.
            w_zps = [z for _, _, z in weights if z is not None and _size(z) == 1]
            w_zps += _norm_scale_zero_points(graph, inits, producers, w_dtype)
        symmetric = bool(w_zps) and all(_is_symmetric(z, base_dir) for z in w_zps)
        default_symmetric = w_dtype in (onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.FLOAT8E4M3FN)
        if w_zps and symmetric != default_symmetric:
            extra["WeightSymmetric"] = symmetric
    untold: dict[str, str] = {}
    if kind == "dynamic" and weights and w_dtype != onnx.TensorProto.UINT8:
        untold = _dynamic_activation_symmetry(inits, weights, recipe["weight_type"], extra, evidence, base_dir)
    if kind != "dynamic":
        act_zps = _activation_zero_points(graph, inits)
        float8 = all(z.data_type == onnx.TensorProto.FLOAT8E4M3FN for z in act_zps)
        if act_zps and not float8 and all(_is_symmetric(z, base_dir) for z in act_zps):
            extra["ActivationSymmetric"] = True
    recipe["nodes_to_exclude"] = _exclusions(model, inits, producers, kind, extra, evidence)
    if kind == "qdq":
        _qdq_op_types(graph, producers, recipe, evidence)
    if extra:
        recipe["extra_options"] = extra
    unknown = dict(UNKNOWN_FIELDS) | untold
    if kind == "dynamic":
        del unknown["calibrate_method"], unknown["calibration"]
    elif recipe.get("activation_type") == "QFLOAT8E4M3FN":
        recipe["calibrate_method"] = "Distribution"
        del unknown["calibrate_method"]
        evidence.append("calibrate_method: onnxruntime quantizes to float8 with Distribution only")
    return InferredRecipe(recipe, unknown, evidence)


#: Activations onnxruntime's QDQ quantizer folds into the node before them: the output Q/DQ pair
#: goes after the activation, which then reads no DequantizeLinear though it is quantized.
_FUSED_ACTIVATIONS = ("Relu", "Clip")


def _qdq_op_types(
    graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], recipe: dict[str, Any], evidence: list[str]
) -> None:
    """``op_types_to_quantize`` of a QDQ model that quantizes some op types and leaves others of
    onnxruntime's QDQ registry entirely in float (``op_types_to_quantize=["MatMul"]`` on a
    transformer: its Add, Mul, Softmax and Gather nodes read no DequantizeLinear). A node is
    quantized when it reads a DequantizeLinear output, or is a Relu / Clip whose output a
    QuantizeLinear reads (onnxruntime quantizes a Conv's output after its activation). Written only
    when a present type is never
    quantized; the nodes of those types leave ``nodes_to_exclude`` (the type says it)."""
    from onnxruntime.quantization import registry

    qdq_types = set(registry.QDQRegistry)
    quantizing = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear" and n.input}
    quantized = {
        n.op_type
        for n in graph.node
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
        and (
            any((p := producers.get(i)) is not None and p.op_type == "DequantizeLinear" for i in n.input)
            or (n.op_type in _FUSED_ACTIVATIONS and any(o in quantizing for o in n.output))
        )
    }
    present = {n.op_type for n in graph.node} & qdq_types
    never = sorted(present - quantized)
    if not never or not quantized & qdq_types:
        return
    recipe["op_types_to_quantize"] = sorted(quantized & qdq_types)
    left = {n.name for n in graph.node if n.op_type in never}
    recipe["nodes_to_exclude"] = [n for n in recipe["nodes_to_exclude"] if n not in left]
    evidence.append(
        f"op_types_to_quantize: {', '.join(never)} present and never quantized (no node of the type reads a "
        "DequantizeLinear output)"
    )


def _weight_type_evidence(
    graph: onnx.GraphProto,
    weights: list[tuple[onnx.TensorProto, onnx.TensorProto | None, onnx.TensorProto | None]],
    kind: str,
) -> list[tuple[onnx.TensorProto, onnx.TensorProto | None, onnx.TensorProto | None]]:
    """The weights whose dtype is ``weight_type``'s: all of them, but in QOperator a per-channel
    QLinearConv weight is int8 whatever ``weight_type`` says (onnxruntime's QLinearConv quantizer
    hard-codes INT8 for per-channel weights, operators/conv.py), so it tells the type only when it
    is all there is (a QUInt8 convnet read those as QInt8, and the rebuild's Gemm weight differed)."""
    if kind != "qoperator":
        return weights
    conv_weights = {n.input[3] for n in graph.node if n.op_type == "QLinearConv" and len(n.input) > 3}
    told = [w for w in weights if not (w[0].name in conv_weights and w[1] is not None and _size(w[1]) > 1)]
    return told or weights


#: Normalizations whose scale (input 1) onnxruntime's QDQ quantizer quantizes as a weight.
_QDQ_NORMS = ("LayerNormalization", "InstanceNormalization", "BatchNormalization")


def _norm_scale_zero_points(
    graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], producers: dict[str, onnx.NodeProto], w_dtype: int
) -> list[onnx.TensorProto]:
    """Per-tensor zero points of the normalization scales a QDQ model quantized as weights (``w_dtype``)."""
    out = []
    for n in graph.node:
        dq = producers.get(n.input[1]) if n.op_type in _QDQ_NORMS and len(n.input) > 1 else None
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            continue
        q, zp = inits.get(dq.input[0]), inits.get(dq.input[2])
        if q is not None and zp is not None and q.data_type == w_dtype and _size(zp) == 1:
            out.append(zp)
    return out


def _dynamic_activation_symmetry(
    inits: dict[str, onnx.TensorProto],
    weights: list[tuple[onnx.TensorProto, onnx.TensorProto | None, onnx.TensorProto | None]],
    weight_type: str,
    extra: dict[str, Any],
    evidence: list[str],
    base_dir: str = "",
) -> dict[str, str]:
    """``ActivationSymmetric`` of a dynamic model with signed weights, into ``extra`` when proven on.

    Returns the unknown fields: the option, when its constants cannot tell (see :func:`_activation_symmetric`).
    """
    tables = _activation_typed_constants(inits, {q.name for q, _, _ in weights})
    told = _activation_symmetric(tables, base_dir)
    if told:
        extra["ActivationSymmetric"] = True
        evidence.append(
            f"ActivationSymmetric: True — {len(tables)} constant(s) quantized to uint8 beside "
            f"{weight_type} weights are centred on 128 without spanning 0..255: e.g. '{tables[0][0].name}'"
        )
    if told is not None:
        return {}
    return {
        "extra_options.ActivationSymmetric": (
            f"the {len(tables)} constant(s) quantize_dynamic quantizes with it (e.g. '{tables[0][0].name}') "
            "are centred on 128 and span 0..255, as both settings would make them"
        )
    }


def _exclusions(
    model: onnx.ModelProto,
    inits: dict[str, onnx.TensorProto],
    producers: dict[str, onnx.NodeProto],
    kind: str,
    extra: dict[str, Any],
    evidence: list[str],
) -> list[str]:
    """``nodes_to_exclude``, after ``MatMulConstBOnly`` (into ``extra`` where the graph proves it off).

    The lever comes first: it decides whether a float MatMul on two activations is an exclusion.
    """
    graph = model.graph
    both_quantized = two_activation_matmuls(graph)
    lever_off = kind == "dynamic" and bool(both_quantized)
    if lever_off:
        extra["MatMulConstBOnly"] = False  # quantize_dynamic's default is True: only this trace proves it off
        evidence.append(
            f"MatMulConstBOnly: False — {len(both_quantized)} MatMulInteger read two activations "
            f"(B from DynamicQuantizeLinear): e.g. '{both_quantized[0]}'"
        )
    dtypes = value_dtypes(model) if kind == "qoperator" or lever_off else None
    excluded = _excluded_nodes(graph, inits, producers, kind, dtypes, lever_off)
    evidence.append(
        f"nodes_to_exclude: {len(excluded)} quantizable node(s) left in float"
        if excluded
        else "nodes_to_exclude: every quantizable node with a float weight is quantized"
    )
    if kind == "qoperator" and not both_quantized:
        listed = set(excluded)
        float_pairs = [n for n in _float_activation_matmuls(graph, inits, dtypes) if n in listed]
        if float_pairs:
            evidence.append(
                f"MatMulConstBOnly: not told — every MatMul reading two activations is float "
                f"({len(float_pairs)}, e.g. '{float_pairs[0]}'); listed in nodes_to_exclude, which rebuilds "
                "the graph MatMulConstBOnly: True makes"
            )
    return excluded


def _quantized_weights(
    graph: onnx.GraphProto,
    inits: dict[str, onnx.TensorProto],
    producers: dict[str, onnx.NodeProto],
    kind: str,
    base_dir: str = "",
) -> list[tuple[onnx.TensorProto, onnx.TensorProto | None, onnx.TensorProto | None]]:
    """(quantized weight, scale, zero point) of every quantized weighted op.

    A float weight quantized at run time (float initializer -> QuantizeLinear -> DequantizeLinear:
    ModelOpt, AIMET's ``to_onnx_qdq()``, NNCF on Constant weights) counts too: its integer value is
    what the QuantizeLinear computes (:func:`_run_time_quantized`)."""
    found: dict[str, tuple[onnx.TensorProto, onnx.TensorProto | None, onnx.TensorProto | None]] = {}

    def get(node: onnx.NodeProto, i: int | None) -> onnx.TensorProto | None:
        if i is None or i >= len(node.input) or not node.input[i]:
            return None
        return inits.get(node.input[i])

    for node in graph.node:
        if node.op_type in _WEIGHT_INPUTS:
            wi, si, zi = _WEIGHT_INPUTS[node.op_type]
            q = get(node, wi)
            if q is None or q.data_type not in QUANT_TYPE_NAMES:
                continue
            scale = get(node, si)
            if scale is None and q.name.endswith("_quantized"):
                scale = inits.get(q.name[: -len("_quantized")] + "_scale")
            found[q.name] = (q, scale, get(node, zi))
        elif kind == "qdq" and node.op_type in WEIGHTED_OPS and len(node.input) > 1:
            dq = producers.get(node.input[1])
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = get(dq, 0)
            quant = producers.get(dq.input[0])
            if q is None and quant is not None and quant.op_type == "QuantizeLinear":
                q = _run_time_quantized(quant, inits, base_dir)
            if q is None or q.data_type not in QUANT_TYPE_NAMES:
                continue
            found[q.name] = (q, get(dq, 1), get(dq, 2))
    return list(found.values())


def _run_time_quantized(
    quant: onnx.NodeProto, inits: dict[str, onnx.TensorProto], base_dir: str = ""
) -> onnx.TensorProto | None:
    """The integer weight a QuantizeLinear makes of a float initializer (round half to even, saturated
    to the zero point's type, uint8 when omitted), as a tensor named like the float one; None when
    its input is not a float initializer."""
    w = inits.get(quant.input[0])
    scale = inits.get(quant.input[1]) if len(quant.input) > 1 else None
    if w is None or scale is None or w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return None
    zp_t = inits.get(quant.input[2]) if len(quant.input) > 2 and quant.input[2] else None
    zp = numpy_helper.to_array(zp_t, base_dir) if zp_t is not None else np.zeros((), np.uint8)
    if zp.dtype.kind not in "iu":
        return None  # fp8 grids: not an integer weight
    value = numpy_helper.to_array(w, base_dir).astype(np.float64)
    s = numpy_helper.to_array(scale, base_dir).astype(np.float64)
    z = zp.astype(np.float64)
    if s.size > 1:
        axis = next((int(a.i) for a in quant.attribute if a.name == "axis"), 1)
        shape = [1] * value.ndim
        shape[axis] = -1
        s, z = s.reshape(shape), z.reshape(shape) if z.size > 1 else z
    info = np.iinfo(zp.dtype)
    integer = np.clip(np.rint(value / s) + z, info.min, info.max).astype(zp.dtype)
    return numpy_helper.from_array(integer, w.name)


def _activation_typed_constants(
    inits: dict[str, onnx.TensorProto], weight_names: set[str]
) -> list[tuple[onnx.TensorProto, onnx.TensorProto]]:
    """(quantized constant, zero point) of a dynamic model's uint8 constants that are no op's weight.

    ``quantize_dynamic`` quantizes the constant inputs it does not treat as weights (a Gather's
    embedding table) with its activation type, uint8, and the activation's symmetry; they are
    found by onnxruntime's names ``<t>_quantized`` / ``<t>_zero_point``.
    """
    out = []
    for name, q in inits.items():
        if name in weight_names or q.data_type != onnx.TensorProto.UINT8 or not name.endswith("_quantized"):
            continue
        zp = inits.get(name[: -len("_quantized")] + "_zero_point")
        if zp is not None and zp.data_type == onnx.TensorProto.UINT8 and _size(zp) == 1:
            out.append((q, zp))
    return out


def _activation_symmetric(tables: list[tuple[onnx.TensorProto, onnx.TensorProto]], base_dir: str = "") -> bool | None:
    """Whether uint8 constants were quantized symmetrically: True, False, or None (cannot tell).

    Symmetric quantization always writes zero point 128, and maps only the side of the larger
    magnitude to an end of 0..255. Asymmetric quantization of values of both signs maps the
    minimum to 0 and the maximum to 255 exactly, whatever its zero point. So a zero point other
    than 128 proves asymmetric, and 128 with a range short of 0..255 proves symmetric; 128 spanning
    0..255 is what both make.
    """
    if not tables:
        return False
    if any(int(numpy_helper.to_array(zp).ravel()[0]) != 128 for _, zp in tables):
        return False
    for q, _ in tables:
        values = numpy_helper.to_array(q, base_dir)
        if values.size and (int(values.min()) > 0 or int(values.max()) < 255):
            return True
    return None


def _activation_zero_points(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto]) -> list[onnx.TensorProto]:
    """Zero points of QuantizeLinear nodes that quantize activations (not constant weights)."""
    out = []
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits and len(node.input) > 2:
            zp = inits.get(node.input[2])
            if zp is not None and zp.data_type in QUANT_TYPE_NAMES:
                out.append(zp)
    return out


def _excluded_nodes(
    graph: onnx.GraphProto,
    inits: dict[str, onnx.TensorProto],
    producers: dict[str, onnx.NodeProto],
    kind: str,
    dtypes: dict[str, int] | None = None,
    matmul_const_b_off: bool = False,
) -> list[str]:
    """FP32 nodes onnxruntime would have quantized that are still float, in graph order.

    Weighted ops (all formats): a Conv / ConvTranspose / MatMul / Gemm still reading a float
    weight initializer, and a Gather still reading a float table. QOperator only: an Add / Mul /
    Softmax / MatMul on float activations; onnxruntime's QLinear quantizers for these types
    quantize their inputs themselves, so a float one was skipped. Dynamic, where the graph proves
    ``MatMulConstBOnly`` off (``matmul_const_b_off``): a MatMul on two float activations. Without
    that proof such a MatMul is never listed: the lever kept it in float, not the user. The
    quantizable op types come from the installed onnxruntime's registries: IntegerOpsRegistry for dynamic, QDQRegistry /
    QLinearOpsRegistry for static (its default op_types_to_quantize).
    """
    quantizable = set(quantizable_op_types(kind))
    weighted = quantizable & set(WEIGHTED_OPS)
    unconditional = _unconditional_qoperator_ops() & quantizable if kind == "qoperator" else set()
    lever_kept: set[str] = set()
    if kind == "dynamic" and matmul_const_b_off and "MatMul" in quantizable:
        lever_kept = set(_float_activation_matmuls(graph, inits, dtypes))
    out = []
    for node in graph.node:
        if node.op_type == "Gather" and "Gather" in quantizable and node.input and node.input[0] in inits:
            # An embedding table still in float: onnxruntime quantizes a Gather's constant table in
            # every format (dynamic and static alike), so this one was excluded (by node or by
            # leaving Gather out of op_types_to_quantize: the same graph).
            if inits[node.input[0]].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
                out.append(node.name)
            continue
        if node.op_type in weighted and len(node.input) > 1 and node.input[1] in inits:
            w = inits[node.input[1]]
            if w.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
                out.append(node.name)
            continue
        if node.name in lever_kept:
            out.append(node.name)
            continue
        if node.op_type in unconditional and dtypes is not None:
            acts = [i for i in node.input if i and i not in inits]
            if acts and all(dtypes.get(i) == onnx.TensorProto.FLOAT for i in acts):
                out.append(node.name)  # (integer shape arithmetic, or unknown types: no proof)
    return out


def two_activation_matmuls(graph: onnx.GraphProto) -> list[str]:
    """Quantized MatMuls reading two activations (B quantized at run time), in graph order.

    onnxruntime's dynamic and QOperator quantizers quantize a MatMul whose B is not a constant
    (attention's Q·Kᵀ and P·V) only with ``MatMulConstBOnly`` off; its quantized B is then the
    output of a quantizing node (``DynamicQuantizeLinear``, ``QuantizeLinear``, a ``QLinear*`` op)
    where a weight's is an initializer. Nodes are named as in the graph (an unnamed one by its output).

    Example:
        >>> g = onnx.parser.parse_graph('''
        ...   g (float[2,2] a, float[2,2] b) => (int32[2,2] y) {
        ...     qa, sa, za = DynamicQuantizeLinear(a)
        ...     qb, sb, zb = DynamicQuantizeLinear(b)
        ...     [scores] y = MatMulInteger(qa, qb, za, zb)
        ...   }''')
        >>> two_activation_matmuls(g)
        ['scores']
    """
    inits = {t.name for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    out = []
    for node in graph.node:
        b = _MATMUL_B.get(node.op_type)
        if b is None or b >= len(node.input) or not node.input[b] or node.input[b] in inits:
            continue
        producer = producers.get(node.input[b])
        if producer is not None and producer.op_type in QUANTIZED_OPS:
            out.append(node.name or node.output[0])
    return out


def _float_activation_matmuls(
    graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], dtypes: dict[str, int] | None
) -> list[str]:
    """Float MatMuls whose two inputs are float activations (neither an initializer), in graph order.

    Without element types (``dtypes`` None) nothing is proven float, and none is listed.
    """
    if dtypes is None:
        return []
    out = []
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or any(i in inits for i in node.input[:2]):
            continue
        if all(dtypes.get(i) == onnx.TensorProto.FLOAT for i in node.input[:2]):
            out.append(node.name)
    return out


def _unconditional_qoperator_ops() -> set[str]:
    """Op types whose QOperator quantizer quantizes float inputs itself (QLinearAdd, QLinearSoftmax...)."""
    from onnxruntime.quantization import registry

    classes = {"QLinearBinaryOp", "QLinearSoftmax", "QLinearMatMul"}
    return {op for op, cls in registry.QLinearOpsRegistry.items() if cls.__name__ in classes}


def _size(t: onnx.TensorProto) -> int:
    return int(np.prod(t.dims)) if t.dims else 1


def _is_symmetric(zp: onnx.TensorProto, base_dir: str = "") -> bool:
    if zp.data_type == onnx.TensorProto.FLOAT8E4M3FN:
        return True  # onnxruntime's float8 grids are always centred on 0 (their default: no option)
    values = numpy_helper.to_array(zp, base_dir).astype(np.int64).ravel()
    return bool(values.size) and any(bool(np.all(values == w)) for w in SYMMETRIC_ZERO_POINTS.get(zp.data_type, ()))


def _fits_reduced(q: onnx.TensorProto, base_dir: str = "") -> bool:
    """True when the weight's integer values span no more than a reduced (7-bit) range."""
    limit = REDUCED_SPAN.get(q.data_type)
    if limit is None:
        return False
    values = numpy_helper.to_array(q, base_dir).astype(np.int64)
    if not values.size:
        return False
    return bool(values.max() - values.min() <= limit)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


# ---------------------------------------------------------------- the recipe behind a fix


#: recipe keys a fix snippet passes to onnxruntime, in its argument order.
SNIPPET_KEYS = tuple(k for k in RECIPE_KEYS if k not in ("mode", *DIAG_ONLY_KEYS))


def fix_recipe(
    int8_path: str | os.PathLike[str], given: Recipe | str | os.PathLike[str] | None = None
) -> dict[str, Any] | None:
    """The recipe a suggested fix must re-quantize with, as recorded in ``diag.json``.

    ``given`` (a :class:`diag.core.recipe.Recipe`, a recipe file path or inline JSON: ``--recipe``) wins;
    otherwise the settings are inferred from the INT8 model (:func:`infer_recipe`), so the fix
    changes only the excluded nodes, not the types, granularity or symmetry the user chose.
    Returns ``{"source": "given" | "inferred", "settings": {...}, "unknown": {field: why}}``; when
    the settings cannot be read back (a mixed-format model, a model file gone) ``source`` is
    ``"unknown"``, ``settings`` None and ``why`` says why.

    Example:
        >>> fix_recipe("int8.onnx")["settings"]["per_channel"]  # doctest: +SKIP
        True
    """
    if given is not None:
        recipe = given if isinstance(given, Recipe) else recipe_from_option(given)
        settings = {k: v for k, v in recipe.to_dict().items() if k in ("mode", *SNIPPET_KEYS)}
        unknown = {} if settings.get("mode") == "dynamic" else {"calibration": UNKNOWN_FIELDS["calibration"]}
        if recipe.preprocess:
            settings["preprocess"] = True
        return {"source": "given", "settings": settings, "unknown": unknown}
    try:
        inferred = infer_recipe(int8_path)
    except Exception as e:  # the diagnosis must not fail because the recipe cannot be read back
        why = e.problem if isinstance(e, DiagError) else f"{type(e).__name__}: {e}"
        return {"source": "unknown", "settings": None, "unknown": {}, "why": why}
    return {"source": "inferred", "settings": dict(inferred.recipe), "unknown": dict(inferred.unknown)}


# ---------------------------------------------------------------- the recipe a search starts from


@dataclass(frozen=True)
class RecipeOrigin:
    """Where the recipe a search (`diag exclude`, `--tiers`) starts from came from, said to the user.

    Issue 25 item 6: a search that silently starts from onnxruntime's defaults measures a baseline
    the user never shipped (cosine 0.44 where their INT8 model gives 0.85). The origin is printed
    first and recorded in ``exclusion.json`` / ``tiers.json`` and summary.md.

    Attributes:
        source: ``"given"`` (--recipe), ``"inferred"`` (--int8: read back from the user's INT8 model)
            or ``"default"`` (neither: onnxruntime's quantize_dynamic defaults).
        path: the recipe file or INT8 model it came from (None for defaults and inline JSON).
        settings: the recipe as a recipe-file dict.
        unknown: recipe field -> why the INT8 model cannot tell it (inferred recipes only).
        spliced: the search spliced every trial into the user's INT8 model (``--int8`` without
            ``--requantize``): the recipe quantized nothing and calibrated nothing, it only words
            the fix in onnxruntime's terms.
    """

    source: str
    path: str | None
    settings: dict[str, Any]
    unknown: dict[str, str] = field(default_factory=dict)
    spliced: bool = False
    #: The INT8 model is AIMET's export: the encodings file the recipe was read back through
    #: (from the QDQ model they describe); None otherwise.
    encodings: str | None = None

    def line(self) -> str:
        """One line for the terminal and summary.md, starting ``recipe:``.

        Example:
            >>> RecipeOrigin("given", "r.json", {"mode": "dynamic", "per_channel": True}).line()
            'recipe: as given in r.json {"mode": "dynamic", "per_channel": true}'
        """
        settings = json.dumps(_beyond_defaults(self.settings), ensure_ascii=False)
        if self.spliced and self.encodings is not None:
            return (
                f"recipe: read back from the QDQ model AIMET encodings {self.encodings} describe {settings}, in "
                "onnxruntime's terms; nothing was re-quantized with it: every trial is built from your encodings "
                "with the float nodes' encodings taken out"
            )
        if self.spliced:
            where = f"read back from the INT8 model {self.path}" if self.source == "inferred" else "as given"
            return (
                f"recipe: {where} {settings}, in onnxruntime's terms; nothing was re-quantized with it: every "
                "trial is your INT8 model with float regions spliced in"
            )
        if self.source == "inferred":
            unknown = (
                f"; not in the model: {', '.join(self.unknown)}"
                + (" (static: calibrated on the ranking split)" if "calibration" in self.unknown else "")
                if self.unknown
                else ""
            )
            return f"recipe: inferred from the INT8 model {self.path} {settings}{unknown}"
        if self.source == "given":
            return f"recipe: as given in {self.path} {settings}" if self.path else f"recipe: as given {settings}"
        return (
            f"recipe: onnxruntime's quantize_dynamic defaults {settings} (no --recipe or --int8 given; "
            "--int8 YOUR_INT8.onnx starts from the recipe of the model you ship)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``recipe_origin`` record of exclusion.json / tiers.json."""
        return {"source": self.source, "path": self.path, "unknown": dict(self.unknown), "line": self.line()}


def _beyond_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the fields a bare ``Recipe(mode=...)`` already has: what the line must show."""
    mode = settings.get("mode", "dynamic")
    try:
        defaults = Recipe(mode=mode).to_dict()
    except Exception:  # an unusual mode: show everything rather than guess
        return dict(settings)
    return {k: v for k, v in settings.items() if k == "mode" or defaults.get(k) != v}


def search_recipe(
    recipe: Recipe | str | os.PathLike[str] | None,
    int8: str | os.PathLike[str] | None = None,
    encodings: str | os.PathLike[str] | None = None,
) -> tuple[Recipe, RecipeOrigin]:
    """The recipe a search starts from: ``--recipe`` as given, else the one that made ``--int8``, else defaults.

    With ``int8`` the search's baseline is the user's own quantization (same types, granularity,
    symmetry and exclusions), so its "before" figure is the one `diag compare` reported; fields the
    model cannot tell (calibration data for static recipes) are listed in ``unknown``.

    Example:
        >>> search_recipe(None)[1].source
        'default'
    """
    if recipe is not None and int8 is not None:
        raise DiagError(
            "bad-option",
            "--recipe with --int8",
            "name two starting recipes (a file, and the one read back from the INT8 model)",
            "pass --int8 to start from your INT8 model's recipe, or --recipe to start from a file",
        )
    if isinstance(recipe, Recipe):
        return recipe, RecipeOrigin("given", None, recipe.to_dict())
    if recipe is not None:
        loaded = recipe_from_option(recipe)
        inline = str(recipe).lstrip().startswith("{")
        return loaded, RecipeOrigin("given", None if inline else str(recipe), loaded.to_dict())
    if int8 is not None:
        # AIMET's export (an FP32 graph and its encodings): the recipe of the QDQ model they describe
        q = model_from_path(int8, "INT8 model")
        where = encodings_of(q, None if encodings is None else Path(encodings))
        inferred = infer_recipe(int8 if where is None else model_from_encodings(q, where).path)
        loaded = Recipe.from_dict(dict(inferred.recipe), f"recipe inferred from INT8 model '{int8}'")
        origin = RecipeOrigin("inferred", str(int8), loaded.to_dict(), dict(inferred.unknown))
        return loaded, dataclasses.replace(origin, encodings=None if where is None else str(where))
    default = Recipe(mode="dynamic")
    return default, RecipeOrigin("default", None, {"mode": "dynamic"})
