"""One table of quantized-op signatures: right against onnxruntime's schemas, and every module's view is it."""

from __future__ import annotations

from typing import get_args

import onnx
import pytest

from diag.analysis import remedies, weights
from diag.core import load, match, saturation
from diag.fix import fixcode, infer
from diag.foundations import cpu
from diag.foundations.ortfacts import (
    FORMATS,
    QUANTIZED_OPS,
    Family,
    families_where,
    kind_made_by,
    kinds_where,
    ops_where,
)


def _schemas() -> dict[tuple[str, str], tuple[str, ...]]:
    """(domain, op type) -> input names of the newest schema, ONNX's and onnxruntime's contrib ops alike."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    newest: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {}
    for s in ort_c.get_all_operator_schema():
        key = (s.domain, s.name)
        if key not in newest or s.since_version > newest[key][0]:
            newest[key] = (s.since_version, tuple(i.name for i in s.inputs))
    return {k: names for k, (_, names) in newest.items()}


@pytest.mark.parametrize("op_type", sorted(QUANTIZED_OPS))
def test_each_signature_is_the_one_onnxruntime_registers(op_type: str) -> None:
    op = QUANTIZED_OPS[op_type]
    schemas = _schemas()
    assert schemas.get((op.domain, op_type)) == op.inputs
    if op.domain == "":
        assert tuple(i.name for i in onnx.defs.get_schema(op_type).inputs) == op.inputs


@pytest.mark.parametrize("op_type", sorted(QUANTIZED_OPS))
def test_each_operand_and_grid_names_an_input_of_the_schema(op_type: str) -> None:
    op = QUANTIZED_OPS[op_type]
    indices = [op.operand(i) for i in range(len(op.operands))]
    for g in indices:
        for i in (g.index, g.scale, g.zero_point):
            assert i is None or 0 <= i < len(op.inputs)
    assert op.output_grid is None or all(0 <= i < len(op.inputs) for i in op.output_grid)
    assert (op.bias is None) == (op.bias_index is None)
    assert not op.weighted or len(op.operands) == 2


def test_every_module_view_agrees_with_the_table() -> None:
    """The views are derived: this fails when a module goes back to writing its own indices."""
    sig = QUANTIZED_OPS
    assert frozenset(sig) == load.DYNAMIC_OPS | load.QOPERATOR_OPS | load.QDQ_OPS | load.NBITS_OPS
    assert frozenset(sig) == match.QUANT_OPS
    for op, grid in match._OUTPUT_QPARAMS.items():
        assert sig[op].output_grid == grid
    for op, grids in match._INPUT_QPARAM_INDICES.items():
        for i, s, z in grids:
            assert any(
                (g.index, g.scale, g.zero_point) == (i, s, z)
                for g in map(sig[op].operand, range(2)[: len(sig[op].operands)])
            )
    for op, k in cpu._WEIGHT_INPUT.items():
        assert sig[op].u8s8 and sig[op].operand(1).index == k
    for op, (w, s, z) in infer._WEIGHT_INPUTS.items():
        assert sig[op].weighted and sig[op].operand(1) == type(sig[op].operand(1))(w, s, z)
    for op, (a, az, w, wz) in saturation._OPS.items():
        x, y = sig[op].operand(0), sig[op].operand(1)
        assert (a, az, w, wz) == (x.index, x.zero_point if x.zero_point is not None else -1, y.index, y.zero_point)
    for op, inputs in weights._QOP_INPUTS.items():
        for idx, (s, z, fp_idx) in inputs.items():
            assert sig[op].operand(fp_idx) == type(sig[op].operand(fp_idx))(idx, s, z)
    for op, inputs in weights._INTEGER_INPUTS.items():
        for idx, (z, fp_idx) in inputs.items():
            assert (sig[op].operand(fp_idx).index, sig[op].operand(fp_idx).zero_point) == (idx, z)
    for op, (b, xs, ws, _) in weights._QOP_BIAS.items():
        assert (b, xs, ws) == (sig[op].bias_index, sig[op].operand(0).scale, sig[op].operand(1).scale)
    assert all(weights._FLOAT_OP_OF[op] == sig[op].float_op for op in weights._FLOAT_OP_OF)


def test_qattention_is_dynamic_as_the_quantizer_makes_it() -> None:
    """onnxruntime's quantizer writes QAttention in IntegerOps (dynamic) mode only, next to DynamicQuantizeLinear."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QLinearOpsRegistry

    assert "Attention" in IntegerOpsRegistry and "Attention" not in QLinearOpsRegistry
    assert "QAttention" in ops_where(lambda op: op.family == "dynamic")
    node = onnx.helper.make_node
    graph = onnx.helper.make_graph(
        [
            node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
            node("QAttention", ["q", "w"], ["y"], domain="com.microsoft"),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    assert load.detect_format(onnx.helper.make_model(graph)).kind == "dynamic"


def test_model_format_kinds_are_the_schemas_format_enum() -> None:
    """``ModelFormat.kind`` is a Literal; an INT8 model's kinds are exactly what diag.json's schema accepts."""
    import json
    from typing import get_args

    from diag.core import precision
    from diag.foundations.environment import templates_dir

    schema = json.loads((templates_dir() / "diag.schema.json").read_text(encoding="utf-8"))
    enum = schema["properties"]["models"]["properties"]["int8"]["properties"]["format"]["enum"]
    kinds = get_args(load.FormatKind)
    assert len(kinds) == len(set(kinds))
    assert set(kinds) == set(enum) | {"fp32"}  # fp32: the FP32 model's format, which has no enum
    assert list(FORMATS) == list(kinds)  # one row of the format table per kind, in the Literal's order
    assert set(get_args(precision.PrecisionKind)) <= set(kinds)


def test_the_optimization_levels_are_onnxruntimes_and_written_once() -> None:
    """run maps every level name to onnxruntime's enum; the deploy level is onnxruntime's default, ORT_ENABLE_ALL."""
    import onnxruntime as ort

    from diag.analysis import effects
    from diag.core.run import session_from_model
    from diag.fix import bench, exclude
    from diag.foundations.ortfacts import DEPLOY_LEVEL, EXACT_LEVEL, OPT_LEVELS

    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
    )
    got = [session_from_model(model, "m", level).get_session_options().graph_optimization_level for level in OPT_LEVELS]
    assert [int(g) for g in got] == sorted(int(g) for g in got) and len({int(g) for g in got}) == len(OPT_LEVELS)
    assert (
        got[OPT_LEVELS.index(DEPLOY_LEVEL)]
        == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        == ort.SessionOptions().graph_optimization_level
    )
    assert got[OPT_LEVELS.index(EXACT_LEVEL)] == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert bench.DEPLOY_OPT_LEVEL == effects.EFFECT_OPT_LEVEL == exclude.SearchOptions.deploy_level == DEPLOY_LEVEL


def test_the_format_table_is_onnxruntimes_and_family_facts_agree_within_a_family() -> None:
    """Each row's mode and QuantFormat exist in onnxruntime and the recipe; a family's rows agree on its facts."""
    from onnxruntime.quantization import QuantFormat

    from diag.core.recipe import Recipe

    for kind, f in FORMATS.items():
        assert f.quant_format is None or f.quant_format in QuantFormat.__members__, kind
        if f.mode is not None:
            recipe = Recipe.from_dict({"mode": f.mode} | ({"quant_format": f.quant_format} if f.quant_format else {}))
            assert recipe.mode == f.mode, kind
        assert f.quant_format is None or f.mode in ("static", "weight_only"), kind
    assert {f.family for f in FORMATS.values()} - {None} == set(get_args(Family))
    for family in get_args(Family):
        rows = [f for f in FORMATS.values() if f.family == family]
        assert len({(f.input_grids, f.integer_weights) for f in rows}) == 1, family


def test_every_module_view_of_the_format_kinds_is_the_table() -> None:
    """The kind lists are derived: this fails when a module goes back to spelling its own tuple."""
    grids = families_where(lambda f: f.input_grids)
    assert {QUANTIZED_OPS[op].family for op in match._INPUT_QPARAM_INDICES} == grids
    integer = families_where(lambda f: f.integer_weights)
    assert {QUANTIZED_OPS[op].family for op in weights._OPERANDS} == integer
    assert {QUANTIZED_OPS[op].family for op in infer._WEIGHT_INPUTS} == integer
    assert remedies.WEIGHT_ONLY_FORMATS == kinds_where(lambda f: f.weight_only) == {"matmulnbits", "qdq-int4-blocked"}
    assert kinds_where(lambda f: f.calibrated) == remedies.CALIBRATED_FORMATS
    from onnxruntime.quantization import registry

    dynamic, static = set(registry.IntegerOpsRegistry), set(registry.QDQRegistry) | set(registry.QLinearOpsRegistry)
    for kind, f in FORMATS.items():
        if f.family == kind or f.weight_only:  # the kinds a recipe with 8-bit types asks for (quantize's check)
            assert kind_made_by(str(f.mode), f.quant_format or "QDQ") == kind
        want = {"dynamic": dynamic, "static": static}.get(str(f.mode), dynamic | static)
        assert load._quantizable_op_types(kind) == want, kind
        snippet = fixcode._plain_fix_snippet(kind, ["n"])
        if f.mode == "dynamic":
            assert "quantize_dynamic(" in snippet, kind
        elif f.quant_format is not None:
            assert f"QuantFormat.{f.quant_format}" in snippet, (kind, snippet)


def test_docs_formats_has_a_row_for_every_kind_of_the_table() -> None:
    """docs/formats.md is the manual's list of formats: a kind added to the table without its row fails here."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text(encoding="utf-8")
    listed = {k for cell in re.findall(r"^\| (`[^|]+`) \|", page, flags=re.M) for k in re.findall(r"`([^`]+)`", cell)}
    assert listed == set(FORMATS) - {"fp32"}  # fp32: the FP32 model, not a format diag diagnoses
