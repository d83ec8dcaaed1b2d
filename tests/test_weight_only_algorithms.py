"""`algorithm` in weight_only recipes: real MatMulNBitsQuantizer runs with k_quant vs RTN, the Python
diag writes reproduces the same bytes, and recipe mistakes are one-line errors.

HQQ and GPTQ run only where torch is installed (onnxruntime's code for them imports it); without it
they are refused up front with ``missing-extra``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from diag.errors import DiagError
from diag.fixtures.nbits_models import BLOCK, stray_block_mlp
from diag.quantize import quantize_model
from diag.recipe import Recipe
from diag.weightonly import quantizer_calls, weight_only_snippet

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def fp32(tmp_path: Path) -> Path:
    path = tmp_path / "fp32.onnx"
    onnx.save(stray_block_mlp().model, path)
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {sess.get_inputs()[0].name: x})[0])


def test_k_quant_differs_from_rtn_and_snippet_reproduces_bytes(fp32: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    out = {}
    for algo in ("RTN", "k_quant"):
        recipe = Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK, "algorithm": algo})
        dst = tmp_path / f"{algo}.onnx"
        report = quantize_model(fp32, recipe, dst)
        assert [n.op_type for n in onnx.load(dst).graph.node].count("MatMulNBits") == 3
        out[algo] = (dst.read_bytes(), _run(dst, x))
        if algo == "k_quant":
            assert any("algorithm k_quant" in a for a in report.actions)
        script = tmp_path / f"{algo}.py"
        script.write_text(weight_only_snippet(recipe.to_dict(), str(fp32), str(tmp_path / f"{algo}.re.onnx"), "# t"))
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120)
        assert (tmp_path / f"{algo}.re.onnx").read_bytes() == dst.read_bytes()
    assert out["RTN"][0] != out["k_quant"][0]
    assert not np.array_equal(out["RTN"][1], out["k_quant"][1])
    assert Recipe.from_dict({"mode": "weight_only", "algorithm": "k_quant"}).to_dict()["algorithm"] == "k_quant"
    assert "algorithm" not in Recipe.from_dict({"mode": "weight_only"}).to_dict()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"algorithm": "hqq"}, "did you mean 'HQQ'"),
        ({"algorithm": "GPTQ"}, "GPTQ needs calibration"),
        ({"algorithm": "k_quant", "quant_format": "QDQ"}, "QOperator"),
        ({"calibration": "c.npz"}, "read by GPTQ only"),
        ({"algorithm": "GPTQ", "calibration": "c.npz", "bits": 8}, "4-bit only"),
    ],
)
def test_bad_algorithm_recipes_are_one_line_errors(data: dict[str, object], words: str) -> None:
    with pytest.raises(DiagError) as e:
        Recipe.from_dict({"mode": "weight_only", **data})
    assert e.value.slug == "bad-recipe" and words in str(e.value) and "\n" not in str(e.value)


def test_dynamic_recipe_refuses_algorithm() -> None:
    with pytest.raises(DiagError, match="only applies to MatMulNBitsQuantizer"):
        Recipe.from_dict({"mode": "dynamic", "algorithm": "HQQ"})


def test_gptq_and_hqq_python_names_their_config_classes(tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.zeros((2, 64), np.float32))
    gptq = Recipe.from_dict({"mode": "weight_only", "algorithm": "GPTQ", "calibration": str(calib)})
    src = "\n".join(quantizer_calls(gptq))
    assert "GPTQWeightOnlyQuantConfig(calibration_data_reader=NpzReader(" in src and str(calib) in src
    compile(src, "gptq", "exec")
    hqq = "\n".join(quantizer_calls(Recipe.from_dict({"mode": "weight_only", "algorithm": "HQQ", "block_size": 32})))
    assert "HQQWeightOnlyQuantConfig(block_size=32, bits=4" in hqq


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: HQQ/GPTQ run")
@pytest.mark.parametrize("algo", ["HQQ", "GPTQ"])
def test_hqq_gptq_without_torch_are_refused(algo: str, fp32: Path, tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.zeros((2, 64), np.float32))
    data = {"mode": "weight_only", "algorithm": algo, **({"calibration": str(calib)} if algo == "GPTQ" else {})}
    with pytest.raises(DiagError) as e:
        quantize_model(fp32, Recipe.from_dict(data), tmp_path / "q.onnx")
    assert e.value.slug == "missing-extra" and "torch" in str(e.value)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.skipif(not HAS_TORCH, reason="HQQ/GPTQ need torch")
@pytest.mark.parametrize("algo", ["HQQ", "GPTQ"])
def test_hqq_gptq_differ_from_rtn(algo: str, fp32: Path, tmp_path: Path) -> None:
    calib = tmp_path / "c.npz"
    inp = onnx.load(fp32).graph.input[0].name
    np.savez(calib, **{inp: np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)})
    extra = {"calibration": str(calib)} if algo == "GPTQ" else {}
    rtn = quantize_model(fp32, Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK}), tmp_path / "r.onnx")
    del rtn
    quantize_model(fp32, Recipe.from_dict({"mode": "weight_only", "block_size": BLOCK, "algorithm": algo, **extra}),
                   tmp_path / "a.onnx")  # fmt: skip
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "r.onnx").read_bytes()
