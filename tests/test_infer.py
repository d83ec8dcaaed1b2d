"""Recipe inference: quantize with known recipes (real onnxruntime), infer, get the same recipe back."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest

from diag.cli import commands as cli
from diag.core.recipe import Recipe, read_recipe_file
from diag.fix.infer import infer_recipe, recipe_to_toml
from diag.fixtures import models
from diag.fixtures.quantize import FORMATS, _ArrayReader
from diag.foundations import ortfacts
from diag.foundations.errors import DiagError

#: (fixture, recipe as a user writes it). Defaults are onnxruntime's: only the asked-for keys are set.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic-u8-per-channel-excluded": (
        "transformer",
        {
            "mode": "dynamic",
            "weight_type": "QUInt8",
            "per_channel": True,
            "nodes_to_exclude": ["layer0/ffn/fc1/MatMul", "layer1/attn/q/MatMul"],
        },
    ),
    "dynamic-u8-symmetric-reduced": (
        "transformer",
        {"mode": "dynamic", "weight_type": "QUInt8", "reduce_range": True, "extra_options": {"WeightSymmetric": True}},
    ),
    "qdq-per-channel-excluded": (
        "convnet",
        {
            "mode": "static",
            "quant_format": "QDQ",
            "activation_type": "QUInt8",
            "weight_type": "QInt8",
            "per_channel": True,
            "nodes_to_exclude": ["conv2"],
        },
    ),
    "qdq-u8-weights-transformer": (
        "transformer",
        {
            "mode": "static",
            "quant_format": "QDQ",
            "activation_type": "QUInt8",
            "weight_type": "QUInt8",
            "nodes_to_exclude": ["layer1/ffn/fc2/MatMul"],
        },
    ),
    "qoperator-int8-act-symmetric-reduced": (
        "convnet",
        {
            "mode": "static",
            "quant_format": "QOperator",
            "activation_type": "QInt8",
            "weight_type": "QInt8",
            "reduce_range": True,
            "nodes_to_exclude": ["conv3", "fc"],
            "extra_options": {"ActivationSymmetric": True},
        },
    ),
    "qoperator-transformer-weightless-excluded": (
        "transformer",
        {
            "mode": "static",
            "quant_format": "QOperator",
            "activation_type": "QUInt8",
            "nodes_to_exclude": [
                "layer0/attn/residual",
                "layer0/attn/Mul",
                "layer0/attn/Softmax",
                "layer0/attn/MatMul",
                "layer1/ffn/fc1/Add",
            ],
        },
    ),
    "qdq-asymmetric-int8-weights": (
        "convnet",
        {
            "mode": "static",
            "quant_format": "QDQ",
            "activation_type": "QUInt8",
            "weight_type": "QInt8",
            "extra_options": {"WeightSymmetric": False},
        },
    ),
}

# Each 8-bit kind with onnxruntime's defaults, its recipe read from the format table: a new kind
# gets its row here without writing one.
CASES |= {
    f"{kind}-defaults": ("transformer", {"mode": f.mode} | ({"quant_format": f.quant_format} if f.quant_format else {}))
    for kind, f in ((k, ortfacts.FORMATS[k]) for k in FORMATS)
}

COMPARED = ("mode", "quant_format", "activation_type", "weight_type", "per_channel", "reduce_range")


def _quantize(fp32: Path, out: Path, recipe: Recipe, calib: dict[str, Any]) -> Path:
    from onnxruntime.quantization import quantize_dynamic, quantize_static

    logging.getLogger().setLevel(logging.ERROR)
    kwargs = recipe.ort_kwargs()
    if recipe.mode == "dynamic":
        quantize_dynamic(fp32, out, **kwargs)
    else:
        quantize_static(fp32, out, _ArrayReader(calib), **kwargs)
    return out


@pytest.fixture(scope="module")
def fp32_models(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    d = tmp_path_factory.mktemp("infer")
    out = {}
    for name in ("transformer", "convnet"):
        fx = models.build(name)
        path = d / f"{name}.fp32.onnx"
        onnx.save(fx.model, path)
        out[name] = (path, fx.make_inputs(16, 11))
    return out


def _normalised(recipe: Recipe) -> dict[str, Any]:
    """What a recipe means in onnxruntime terms, with onnxruntime's defaults spelled out."""
    d = {k: getattr(recipe, k) for k in COMPARED}
    if recipe.mode == "dynamic":
        d.pop("quant_format")
        d.pop("activation_type")
    d["nodes_to_exclude"] = sorted(recipe.nodes_to_exclude)
    extra = recipe.extra_options
    signed = recipe.weight_type in ("QInt8", "QInt16")
    d["weight_symmetric"] = extra.get("WeightSymmetric", signed)
    d["activation_symmetric"] = extra.get("ActivationSymmetric", False) if recipe.mode == "static" else None
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_inferred_recipe_is_the_recipe_that_made_the_model(case, fp32_models, tmp_path):
    fixture, used = CASES[case]
    fp32, calib = fp32_models[fixture]
    recipe = Recipe.from_dict(used)
    int8 = _quantize(fp32, tmp_path / "int8.onnx", recipe, calib)

    inferred = infer_recipe(int8)

    back = Recipe.from_dict(inferred.recipe)  # a valid recipe file, by the recipe module's own rules
    assert _normalised(back) == _normalised(recipe)
    assert inferred.recipe["nodes_to_exclude"] == [
        n.name for n in onnx.load(str(fp32)).graph.node if n.name in set(recipe.nodes_to_exclude)
    ]
    if recipe.mode == "static":
        assert "calibrate_method" in inferred.unknown and "calibrate_method" not in inferred.recipe


def test_requantizing_with_the_inferred_recipe_gives_the_same_graph(fp32_models, tmp_path):
    fp32, calib = fp32_models["convnet"]
    _, used = CASES["qoperator-int8-act-symmetric-reduced"]
    first = _quantize(fp32, tmp_path / "first.onnx", Recipe.from_dict(used), calib)
    again = _quantize(fp32, tmp_path / "again.onnx", Recipe.from_dict(infer_recipe(first).recipe), calib)

    def ops(p: Path) -> list[tuple[str, str]]:
        return [(n.op_type, n.name) for n in onnx.load(str(p)).graph.node]

    assert ops(again) == ops(first)
    assert Counter(t for t, _ in ops(first))["Conv"] == 1  # conv3 stayed float: the test can see exclusions


def test_toml_output_parses_and_marks_what_cannot_be_inferred(fp32_models, tmp_path):
    fp32, calib = fp32_models["convnet"]
    _, used = CASES["qdq-per-channel-excluded"]
    int8 = _quantize(fp32, tmp_path / "int8.onnx", Recipe.from_dict(used), calib)
    text = recipe_to_toml(int8)
    (tmp_path / "recipe.toml").write_text(text)
    data = read_recipe_file(tmp_path / "recipe.toml")
    assert data["nodes_to_exclude"] == ["conv2"] and data["per_channel"] is True
    assert "calibrate_method" not in data
    assert any(line.startswith("# calibrate_method: cannot be inferred") for line in text.splitlines())


def test_cli_recipe_out_writes_a_loadable_json_and_prints_the_notes(fp32_models, tmp_path, capsys):
    fp32, calib = fp32_models["convnet"]
    _, used = CASES["qdq-per-channel-excluded"]
    int8 = _quantize(fp32, tmp_path / "int8.onnx", Recipe.from_dict(used), calib)
    out = tmp_path / "recipe.json"
    code = cli.main(["inspect", str(int8), "--recipe-out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[0] == f"wrote recipe: {out}"
    assert lines[1].startswith("note: calibrate_method: cannot be inferred")
    assert Recipe.from_dict(json.loads(out.read_text())).nodes_to_exclude == ["conv2"]


def test_an_fp32_model_has_no_recipe(fp32_models):
    with pytest.raises(DiagError) as e:
        infer_recipe(fp32_models["convnet"][0])
    assert e.value.slug == "not-quantized"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["static-qdq-per-channel", "dynamic-u8-excluded"])
def test_inferred_recipe_of_a_real_paddle_model(case, tmp_path):
    """PaddleOCR's direction classifier (paddle2onnx export, Constant weights, opset 11)."""
    from onnx import version_converter

    from diag.fixtures import quantize, thirdparty

    src = quantize.lift_constants(onnx.load(str(thirdparty.rapidocr_model("cls"))))
    fp32 = tmp_path / "cls.fp32.onnx"
    onnx.save(version_converter.convert_version(src, 13), fp32)
    convs = [n.name for n in onnx.load(str(fp32)).graph.node if n.op_type == "Conv"]
    excluded = [convs[0], convs[len(convs) // 2]]
    if case == "static-qdq-per-channel":
        used = {"mode": "static", "activation_type": "QUInt8", "per_channel": True, "nodes_to_exclude": excluded}
    else:
        used = {"mode": "dynamic", "weight_type": "QUInt8", "nodes_to_exclude": excluded}
    name = src.graph.input[0].name
    calib = {name: thirdparty.text_images(4, 48, 192, seed=3)}
    recipe = Recipe.from_dict(used)
    int8 = _quantize(fp32, tmp_path / "cls.int8.onnx", recipe, calib)

    inferred = infer_recipe(int8)

    assert _normalised(Recipe.from_dict(inferred.recipe)) == _normalised(recipe)
    assert len(convs) > 10
