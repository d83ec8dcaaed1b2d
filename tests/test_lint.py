"""The recipe linter: invented extra_options, misspelled and PyTorch-style node names, contradictions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import onnxruntime
import pytest
from cli_run import run_cli
from onnx import TensorProto, helper, numpy_helper

from diag.cli import commands as cli
from diag.fix.lint import (
    FALLBACK_EXTRA_OPTIONS,
    lint_recipe,
    lint_recipe_file,
    module_to_onnx_prefix,
    onnxruntime_extra_options,
)
from diag.fixtures import models
from diag.foundations.errors import GATE_FAILED, DiagError

LINT_PAGE = Path(__file__).resolve().parents[1] / "docs" / "verbs" / "lint.md"


def _bert_like(path: Path) -> Path:
    """Two MatMul+Add nodes named the way torch.onnx.export names BERT's query/key projections."""
    import numpy as np

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    cur = "x"
    for proj in ("query", "key"):
        p = f"/encoder/layer.0/attention/self/{proj}"
        inits += [
            numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"{proj}.weight"),
            numpy_helper.from_array(np.zeros(8, np.float32), f"{proj}.bias"),
        ]
        nodes += [
            helper.make_node("MatMul", [cur, f"{proj}.weight"], [f"{p}/MatMul_output_0"], name=f"{p}/MatMul"),
            helper.make_node("Add", [f"{p}/MatMul_output_0", f"{proj}.bias"], [f"{p}/Add_output_0"], name=f"{p}/Add"),
        ]
        cur = f"{p}/Add_output_0"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["n", 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return _bert_like(tmp_path_factory.mktemp("lint") / "bert.onnx")


def _codes(findings) -> list[tuple[str, str, str]]:
    return [(f.severity, f.code, f.where) for f in findings]


def test_done_means_invented_key_misspelled_node_and_module_name_are_flagged(bert, tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(
        json.dumps(
            {
                "mode": "dynamic",
                "nodes_to_exclude": [
                    "/encoder/layer.0/attention/self/query/Matmul",
                    "encoder.layer.0.attention.self.key",
                ],
                "extra_options": {"OpTypesToExclude": ["Add"]},
            }
        )
    )
    findings = lint_recipe_file(recipe, bert)
    assert _codes(findings) == [
        ("error", "unknown-extra-option", "extra_options.OpTypesToExclude"),
        ("error", "unknown-node", "nodes_to_exclude '/encoder/layer.0/attention/self/query/Matmul'"),
        ("error", "module-name", "nodes_to_exclude 'encoder.layer.0.attention.self.key'"),
    ]
    by_code = {f.code: f for f in findings}
    assert f"onnxruntime {onnxruntime.__version__} ignores this key" in by_code["unknown-extra-option"].message
    assert '"op_types_to_quantize": ["MatMul"]' in by_code["unknown-extra-option"].hint
    assert by_code["unknown-node"].hint == "did you mean '/encoder/layer.0/attention/self/query/MatMul'?"
    assert by_code["module-name"].hint == (
        "the module's nodes: /encoder/layer.0/attention/self/key/MatMul, /encoder/layer.0/attention/self/key/Add"
    )


def test_quantization_precision_and_misspelled_keys_are_errors_with_the_real_key():
    findings = lint_recipe(
        {"mode": "static", "extra_options": {"QuantizationPrecision": "int8", "ActivationSymetric": True}}
    )
    assert _codes(findings) == [
        ("error", "unknown-extra-option", "extra_options.QuantizationPrecision"),
        ("error", "unknown-extra-option", "extra_options.ActivationSymetric"),
    ]
    assert findings[1].hint == "did you mean 'ActivationSymmetric'?"


def test_calibrator_keys_point_to_the_name_quantize_static_maps():
    (f,) = lint_recipe({"mode": "static", "calibrate_method": "Percentile", "extra_options": {"percentile": 99.9}})
    assert (f.code, f.hint) == ("calibrator-option", "write 'CalibPercentile'")


def test_a_clean_recipe_has_no_findings(bert):
    data = {
        "mode": "static",
        "quant_format": "QDQ",
        "per_channel": True,
        "op_types_to_quantize": ["MatMul", "Add"],
        "nodes_to_exclude": ["/encoder/layer.0/attention/self/key/MatMul"],
        "extra_options": {"WeightSymmetric": True, "CalibMovingAverage": True},
    }
    assert lint_recipe(data, onnx.load(str(bert))) == []


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"mode": "dynamic", "quant_format": "QDQ"}, ("error", "contradiction", "quant_format")),
        ({"mode": "dynamic", "calibrate_method": "Entropy"}, ("error", "contradiction", "calibrate_method")),
        (
            {"mode": "static", "quant_format": "QOperator", "activation_type": "QInt16"},
            ("error", "contradiction", "activation_type"),
        ),
        (
            {"nodes_to_quantize": ["a", "b"], "nodes_to_exclude": ["b"]},
            ("error", "contradiction", "nodes_to_exclude 'b'"),
        ),
        (
            {"mode": "dynamic", "weight_type": "QUInt8", "extra_options": {"ActivationSymmetric": True}},
            ("warning", "static-only-option", "extra_options.ActivationSymmetric"),
        ),
        (
            {"mode": "dynamic", "extra_options": {"MatMulConstBOnly": False}},
            ("warning", "act-act-matmuls", "extra_options.MatMulConstBOnly"),
        ),
        ({"op_type_to_quantize": ["Conv"]}, ("error", "unknown-key", "op_type_to_quantize")),
        ({"weight_type": "INT8"}, ("error", "bad-value", "weight_type")),
        ({"calibration_samples": 8}, ("warning", "unused-option", "calibration_samples")),
        ({"mode": "dynamic", "op_types_to_quantize": []}, ("warning", "empty-list", "op_types_to_quantize")),
    ],
)
def test_contradictions_and_bad_values(data, expected):
    assert _codes(lint_recipe(data)) == [expected]


def test_per_channel_qdq_on_opset_12_is_an_error_and_op_types_are_checked(tmp_path):
    fx = models.build("convnet")
    m = onnx.ModelProto()
    m.CopyFrom(fx.model)
    m.opset_import[0].version = 12
    data = {"mode": "static", "per_channel": True, "op_types_to_quantize": ["Conv", "MatMul", "Softplus"]}
    assert _codes(lint_recipe(data, m)) == [
        ("warning", "old-opset", "per_channel"),
        ("warning", "unknown-op-type", "op_types_to_quantize 'MatMul'"),
        ("warning", "unquantizable-op-type", "op_types_to_quantize 'Softplus'"),
    ]


def test_extra_option_keys_are_read_from_the_installed_onnxruntime_and_match_the_fallback():
    keys = onnxruntime_extra_options()
    assert keys.scanned and keys.version == onnxruntime.__version__
    assert "OpTypesToExclude" not in keys.quantizer and "QuantizationPrecision" not in keys.quantizer
    assert {"WeightSymmetric", "ActivationSymmetric", "CalibPercentile", "extra.Sigmoid.nnapi"} <= keys.quantizer
    if onnxruntime.__version__.startswith("1.32."):
        assert keys.quantizer == FALLBACK_EXTRA_OPTIONS  # update the fallback when onnxruntime moves


def test_without_onnxruntime_sources_the_fallback_list_is_used(tmp_path):
    keys = onnxruntime_extra_options(tmp_path)
    assert not keys.scanned and keys.quantizer == FALLBACK_EXTRA_OPTIONS
    assert keys.calibrator["percentile"] == "CalibPercentile"


def test_module_path_becomes_the_exporter_prefix():
    assert module_to_onnx_prefix("encoder.layer.0.attention.self.query") == "/encoder/layer.0/attention/self/query/"
    assert module_to_onnx_prefix("blocks.11.mlp.fc1") == "/blocks.11/mlp/fc1/"


def test_cli_exit_code_is_3_on_errors_and_0_on_warnings(bert, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "dynamic"\n[extra_options]\nOpTypesToExclude = ["Add"]\n')
    assert cli.main(["lint", str(bad), "--model", str(bert)]) == GATE_FAILED
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("error[unknown-extra-option] extra_options.OpTypesToExclude: onnxruntime ")
    # Measured on the model: the hint's op_types_to_quantize writes the same model (Add is not quantized here).
    assert out[1].startswith("warning[no-effect] extra_options.OpTypesToExclude: its fix, op_types_to_quantize=")
    assert out[-1] == "bad.toml: 1 error, 1 warning; 1 line measured on the model"
    warn = tmp_path / "warn.json"
    warn.write_text('{"mode": "static", "calibration_samples": 8}')
    assert cli.main(["lint", str(warn)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "warn.json: 0 errors, 1 warning"


def test_readme_lint_example_prints_what_the_readme_shows(tmp_path, monkeypatch, capsys):
    """diag lint's page's failing-recipe example (exit 3, so test_readme cannot run it) runs here,
    from the folder the page's paths are relative to."""
    section = LINT_PAGE.read_text()
    recipe = section[section.index("```json\n") + 8 : section.index("```", section.index("```json\n") + 8)]
    block = section[section.index("```\ndiag lint recipe.json") + 4 :]
    block = block[: block.index("```")].splitlines()
    from diag.cli.demo import build_fixture_files

    build_fixture_files(tmp_path / "demo" / "models", "transformer", "dynamic")
    (tmp_path / "recipe.json").write_text(recipe)
    monkeypatch.chdir(tmp_path)
    argv = block[0].split()[1:]  # no '$ ': test_readme runs only examples that exit 0
    code, out, err = run_cli(argv, capsys)
    assert code == GATE_FAILED, err
    assert out.splitlines() == block[1:]
    # The measured example: the golden config's lines, each quantized with and without (exit 0).
    start = section.index("```json\n", section.index("(`golden.json`)")) + 8
    (tmp_path / "golden.json").write_text(section[start : section.index("```", start)])
    block = section[section.index("```\ndiag lint golden.json") + 4 :]
    block = block[: block.index("```")].splitlines()
    code, out, err = run_cli(block[0].split()[1:], capsys)
    assert code == 0, err
    assert out.splitlines() == block[1:]


def test_names_are_checked_against_a_float_model_only(built, tmp_path):
    q = built("convnet").int8["qdq"]
    with pytest.raises(DiagError) as e:
        lint_recipe_file(_recipe(tmp_path / "r.json"), q)
    assert e.value.slug == "fp32-is-quantized"


def _recipe(path: Path) -> Path:
    path.write_text('{"mode": "dynamic", "nodes_to_exclude": ["conv3"]}')
    return path


def test_use_external_data_format_is_a_recipe_key_onnxruntime_honours(tmp_path):
    """Issue 45: a real quantize_dynamic / quantize_static argument; the guide's literal recipe has it."""
    from diag.core.recipe import Recipe
    from diag.fix.quantize import quantize_model

    assert lint_recipe({"mode": "dynamic", "use_external_data_format": True}) == []
    fp = tmp_path / "t.fp32.onnx"
    onnx.save(models.build("transformer").model, fp)
    out = tmp_path / "t.int8.onnx"
    recipe = Recipe.from_dict({"mode": "dynamic", "use_external_data_format": True}, "recipe")
    quantize_model(fp, recipe, out, progress=False)
    m = onnx.load(str(out), load_external_data=False)
    external = [t.name for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external, "the weights were written inline"
    assert onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_inputs()[0].name
    assert Recipe(mode="dynamic").to_dict().get("use_external_data_format") is None  # old recipes unchanged


def test_activation_symmetric_in_dynamic_mode_is_judged_by_weight_type_and_measured(tmp_path, capsys):
    """quantize_dynamic reads ActivationSymmetric for a Gather's table when weights are QInt8 (its
    default), and ignores it with QUInt8 weights: the rule says so by weight type, and --model measures it."""
    assert not [f for f in lint_recipe({"mode": "dynamic", "extra_options": {"ActivationSymmetric": True}})]
    fp = tmp_path / "t.onnx"
    onnx.save(models.build("transformer").model, fp)  # embeddings/Gather: a table quantized by quantize_dynamic
    for weight_type, expected in (("QInt8", "note[measured]"), ("QUInt8", "warning[no-effect]")):
        recipe = tmp_path / f"{weight_type}.json"
        recipe.write_text(
            json.dumps({"mode": "dynamic", "weight_type": weight_type, "extra_options": {"ActivationSymmetric": True}})
        )
        code, out = _lint([str(recipe), "--model", str(fp)], capsys)
        lines = [x for x in out.splitlines() if "ActivationSymmetric" in x]
        assert code == 0
        assert len(lines) == 1 and lines[0].startswith(f"{expected} extra_options.ActivationSymmetric: "), lines
    # The claim behind the QUInt8 line, by hand: the two quantize_dynamic calls write the same bytes.
    from onnxruntime.quantization import QuantType, quantize_dynamic

    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    quantize_dynamic(str(fp), str(a), weight_type=QuantType.QUInt8)
    quantize_dynamic(str(fp), str(b), weight_type=QuantType.QUInt8, extra_options={"ActivationSymmetric": True})
    assert a.read_bytes() == b.read_bytes()


def _lint(argv: list[str], capsys) -> tuple[int, str]:
    """``diag lint ARGV``: its exit code and what it printed."""
    code = cli.main(["lint", *argv])
    return code, capsys.readouterr().out


def test_matmul_const_b_only_false_is_called_out_with_its_measured_cost(tmp_path, capsys):
    """The guide's line on the attention_lever fixture: a warning, and the measured cost in output SQNR."""
    import numpy as np

    fx = models.build("attention_lever")
    fp, x = tmp_path / "enc.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    np.savez(x, **fx.make_inputs(16, 3))
    recipe = tmp_path / "golden.json"
    recipe.write_text(
        json.dumps(
            {
                "mode": "dynamic",
                "weight_type": "QUInt8",
                "per_channel": True,
                "extra_options": {"MatMulConstBOnly": False, "EnableSubgraph": True},
            }
        )
    )
    code, out = _lint([str(recipe), "--model", str(fp), "--inputs", str(x)], capsys)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("warning[act-act-matmuls] extra_options.MatMulConstBOnly: False quantizes every ")
    measured = next(x for x in lines if x.startswith("note[measured] extra_options.MatMulConstBOnly: "))
    # 8 activation x activation MatMuls more with it (the fixture's 4 layers x scores and context)
    assert "MatMulInteger 33 with it, 25 without" in measured
    with_it, without = (float(v) for v in re.findall(r"([-\d.]+) dB", measured))
    assert without > with_it + 10, measured
    assert any(x.startswith("warning[no-effect] extra_options.EnableSubgraph: changes nothing") for x in lines)
    assert lines[-1] == "golden.json: 0 errors, 2 warnings; 3 lines measured on the model"


def test_an_invented_keys_fix_that_changes_nothing_says_so(tmp_path, capsys):
    fp = tmp_path / "t.onnx"
    onnx.save(models.build("transformer").model, fp)
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"mode": "dynamic", "extra_options": {"OpTypesToExclude": ["Softmax"]}}))
    code, out = _lint([str(recipe), "--model", str(fp)], capsys)
    lines = out.splitlines()
    assert code == GATE_FAILED
    assert lines[0].startswith("error[unknown-extra-option] extra_options.OpTypesToExclude")
    assert lines[1].startswith("warning[no-effect] extra_options.OpTypesToExclude: its fix, op_types_to_quantize=")
    assert "changes nothing in this model (byte-identical)" in lines[1]
    code, out = _lint([str(recipe), "--model", str(fp), "--no-measure"], capsys)
    assert code == GATE_FAILED and "no-effect" not in out
