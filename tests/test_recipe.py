"""Recipe files: onnxruntime's argument names one to one, JSON and TOML, nothing silently ignored."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

from diag.cli.commands import main
from diag.core.recipe import (
    FP16_KEYS,
    WEIGHT_ONLY_KEYS,
    Recipe,
    load_recipe,
    read_recipe_file,
    recipe_from_option,
    save_recipe,
)
from diag.foundations.errors import DiagError

RECIPE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipe.md"


def _full_recipe() -> Recipe:
    """Every field away from its default, so a round trip that drops one fails."""
    return Recipe(
        mode="static",
        quant_format="QOperator",
        activation_type="QUInt8",
        weight_type="QUInt8",
        per_channel=True,
        reduce_range=True,
        op_types_to_quantize=["Conv", "MatMul"],
        nodes_to_quantize=["conv1", "conv2"],
        nodes_to_exclude=["conv2", 'odd name/with "quotes"', "tab\there, back\\slash, DEL\x7f, \U0001f600 ünï"],
        calibrate_method="Percentile",
        extra_options={
            "ActivationSymmetric": True,
            "CalibPercentile": 99.99,
            "TensorQuantOverrides": {"conv1_out": [{"quant_type": "QUInt8", "symmetric": False}]},
        },
        calibration="data/calib.npz",
        calibration_samples=16,
        preprocess=True,
    )


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_recipe_round_trips_through_json_and_toml(tmp_path: Path, suffix: str) -> None:
    recipe = _full_recipe()
    path = save_recipe(recipe, tmp_path / f"recipe{suffix}")
    back = load_recipe(path)
    assert back == recipe
    assert back.to_dict() == recipe.to_dict()
    assert back.calibration_path() == tmp_path / "data" / "calib.npz"
    assert not [p for p in tmp_path.iterdir() if p.name != f"recipe{suffix}"], "no temp files left"


def test_to_dict_has_stable_key_order_and_plain_types() -> None:
    d = _full_recipe().to_dict()
    # A static recipe: the weight_only and fp16 modes' keys are None and left out.
    # use_external_data_format is written only when true: recipe files written before it stay the same.
    skipped = ("base_dir", "use_external_data_format", *WEIGHT_ONLY_KEYS, *FP16_KEYS)
    assert list(d) == [f.name for f in dataclasses.fields(Recipe) if f.name not in skipped]
    assert json.loads(json.dumps(d)) == d
    assert "base_dir" not in Recipe(base_dir="x").to_dict()
    assert "calibration" not in Recipe().to_dict(), "None is left out (TOML has no null)"


def test_smallest_recipes_from_the_style_guide_load(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text('{"mode": "dynamic", "weight_type": "QUInt8", "per_channel": true}')
    r = load_recipe(tmp_path / "d.json")
    assert (r.mode, r.weight_type, r.per_channel) == ("dynamic", "QUInt8", True)
    (tmp_path / "s.toml").write_text(
        'mode = "static"\nquant_format = "QDQ"\nactivation_type = "QUInt8"\nweight_type = "QInt8"\n'
        'per_channel = true\ncalibrate_method = "MinMax"\n'
    )
    s = load_recipe(tmp_path / "s.toml")
    assert (s.quant_format, s.activation_type, s.calibrate_method) == ("QDQ", "QUInt8", "MinMax")


def test_misspelled_key_is_an_error_with_did_you_mean() -> None:
    with pytest.raises(DiagError) as e:
        Recipe.from_dict({"mode": "dynamic", "op_type_to_quantize": ["MatMul"]}, "recipe 'r.json'")
    assert e.value.slug == "bad-recipe"
    assert "recipe 'r.json' key 'op_type_to_quantize'" in str(e.value)
    assert "did you mean 'op_types_to_quantize'?" in str(e.value)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"weight_type": "QInt9"}, "did you mean 'QInt8'?"),
        ({"weight_type": "qint8"}, "did you mean 'QInt8'?"),
        ({"quant_format": "qdq"}, "did you mean 'QDQ'?"),
        ({"calibrate_method": "Entropie"}, "did you mean 'Entropy'?"),
        ({"mode": "Static"}, "did you mean 'static'?"),
        ({"per_channel": "yes"}, "is 'yes', not true/false"),
        ({"nodes_to_exclude": "conv3"}, "is not a list of names"),
        ({"calibration_samples": 0}, "not a positive integer"),
        ({"extra_options": {"x": float("nan")}}, "holds nan"),
        ({"mode": "dynamic", "quant_format": "QOperator"}, "only applies to quantize_static"),
        ({"mode": "dynamic", "calibration": "c.npz"}, "only applies to quantize_static"),
    ],
)
def test_bad_values_are_errors_that_name_the_key(data: dict, expected: str) -> None:
    with pytest.raises(DiagError) as e:
        Recipe.from_dict(data)
    assert e.value.slug == "bad-recipe"
    assert expected in str(e.value)
    assert f"key '{next(reversed(data))}'" in str(e.value)


def test_enum_names_may_carry_their_python_class_prefix() -> None:
    r = Recipe.from_dict({"weight_type": "QuantType.QUInt8", "quant_format": "QuantFormat.QOperator"})
    assert (r.weight_type, r.quant_format) == ("QUInt8", "QOperator")


def test_dynamic_recipe_round_trips_although_static_defaults_are_written() -> None:
    r = Recipe(mode="dynamic", per_channel=True)
    assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "r.json",
            '{"mode": "dynamic",}',
            "is not valid JSON (Expecting property name enclosed in double quotes at line 1",
        ),
        ("r.json", '["mode"]', "holds a list, not a table"),
        ("r.json", '{"nodes_to_exclude": ["a"], "nodes_to_exclude": ["b"]}', "has key 'nodes_to_exclude' twice"),
        ("r.toml", 'mode = "dynamic"\nmode = "static"\n', "is not valid TOML"),
        ("r.toml", 'mode = "dynamic"\nper_channel = \n', "is not valid TOML"),
        ("r.json", b"\xff\xfe{", "is not UTF-8"),
    ],
)
def test_syntax_errors_are_one_line_bad_recipe(tmp_path: Path, name: str, text: str | bytes, expected: str) -> None:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DiagError) as e:
        read_recipe_file(p)
    assert e.value.slug == "bad-recipe"
    assert expected in str(e.value)
    assert "\n" not in e.value.message()


def test_missing_recipe_file_is_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DiagError) as e:
        load_recipe(tmp_path / "nope.json")
    assert e.value.slug == "missing-file"


def test_with_excluded_adds_names_once_and_leaves_the_original_alone() -> None:
    base = Recipe(nodes_to_exclude=["a"], extra_options={"k": 1})
    more = base.with_excluded(["b", "a", "c"])
    assert more.nodes_to_exclude == ["a", "b", "c"]
    assert base.nodes_to_exclude == ["a"]
    more.extra_options["k"] = 2
    assert base.extra_options == {"k": 1}


def test_ort_kwargs_are_real_parameters_of_the_onnxruntime_functions() -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    static = _full_recipe().ort_kwargs()
    assert set(static) <= set(inspect.signature(quantize_static).parameters)
    assert static["quant_format"] is QuantFormat.QOperator
    assert static["activation_type"] is QuantType.QUInt8
    assert static["calibrate_method"] is CalibrationMethod.Percentile
    assert static["nodes_to_exclude"][:2] == ["conv2", 'odd name/with "quotes"']
    dynamic = Recipe(mode="dynamic", weight_type="QUInt8").ort_kwargs()
    assert set(dynamic) <= set(inspect.signature(quantize_dynamic).parameters)
    assert dynamic["weight_type"] is QuantType.QUInt8
    assert "activation_type" not in dynamic and "calibrate_method" not in dynamic


def test_save_recipe_rebases_calibration_to_the_new_folder(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "r.json").write_text('{"calibration": "calib.npz"}')
    r = load_recipe(tmp_path / "cfg" / "r.json")
    (tmp_path / "out").mkdir()
    moved = load_recipe(save_recipe(r, tmp_path / "out" / "r.json"))
    assert json.loads((tmp_path / "out" / "r.json").read_text())["calibration"] == "../cfg/calib.npz"
    assert moved.calibration_path().resolve() == (tmp_path / "cfg" / "calib.npz").resolve()


def test_inline_recipe_is_json_relative_to_the_current_folder() -> None:
    r = recipe_from_option('{"mode": "dynamic", "nodes_to_exclude": ["fc"]}')
    assert (r.mode, r.nodes_to_exclude, r.base_dir) == ("dynamic", ["fc"], ".")
    with pytest.raises(DiagError, match="inline --recipe"):
        recipe_from_option("{mode: dynamic}")


def test_readme_recipe_table_lists_every_key_and_its_examples_load(tmp_path: Path) -> None:
    section = RECIPE_PAGE.read_text()
    keys = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    assert keys == {f.name for f in dataclasses.fields(Recipe) if f.name != "base_dir"}
    blocks = re.findall(r"```(json|toml)\n(.*?)```", section, flags=re.S)
    assert [b[0] for b in blocks] == ["json", "toml"]
    for lang, body in blocks:
        (tmp_path / f"r.{lang}").write_text(body)
        load_recipe(tmp_path / f"r.{lang}")


def test_cli_reports_a_bad_recipe_in_one_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "r.json").write_text('{"mode": "dynamic", "per_chanel": true}')
    code = main(["quantize", str(tmp_path / "m.onnx"), "--recipe", str(tmp_path / "r.json"), "-o", "x.onnx"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("diag: error[bad-recipe]: ") and "did you mean 'per_channel'?" in err
    assert err.count("\n") == 1
