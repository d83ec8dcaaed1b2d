"""Weight-only remedies are measured when the recipe is given (issue 25, item 2), and the spread
headline lists only remedies that change the model's recipe (item 1), checked end to end."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import QuantFormat
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from diag.cli.commands import main
from diag.fixtures import models
from diag.fixtures.quantize import quantize

RECIPE = {"mode": "weight_only", "bits": 4, "block_size": 32, "accuracy_level": 4}


def _plain_q4(fp32: Path, out: Path, block_size: int, accuracy_level: int) -> Path:
    """MatMulNBitsQuantizer with its default (RTN) config, as a user would call it."""
    logging.getLogger().setLevel(logging.ERROR)
    q = MatMulNBitsQuantizer(
        onnx.load(fp32), bits=4, block_size=block_size, is_symmetric=False, accuracy_level=accuracy_level,
        quant_format=QuantFormat.QOperator,
    )  # fmt: skip
    q.process()
    onnx.save(q.model.model, out)
    return out


def _plain_min_cosine(fp32: Path, model: Path, x: np.ndarray) -> float:
    """Min per-sample cosine of the logits, one sample at a time, onnxruntime's default level."""
    a = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = a.get_inputs()[0].name
    worst = 1.0
    for i in range(len(x)):
        p = a.run(None, {name: x[i : i + 1]})[0].astype(np.float64).ravel()
        q = b.run(None, {name: x[i : i + 1]})[0].astype(np.float64).ravel()
        worst = min(worst, float(p @ q / np.sqrt((p @ p) * (q @ q))))
    return worst


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("q4")
    fx = models.build("clean_transformer")  # spread error at 4 bits: no single node to blame
    fp32 = folder / "fp32.onnx"
    onnx.save(fx.model, fp32)
    inputs = folder / "x.npz"
    np.savez(inputs, **fx.make_inputs(16, 12))
    return {"fp32": fp32, "int8": _plain_q4(fp32, folder / "q4.onnx", 32, 4), "inputs": inputs, "folder": folder}


def _compare(q4: dict[str, Path], out: Path, *extra: str) -> tuple[dict, str]:
    args = ["compare", str(q4["fp32"]), str(q4["int8"]), "--inputs", str(q4["inputs"]), *extra]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "diag.json").read_text())
    return doc, doc["verdict"]["cause"]


def test_with_the_recipe_each_weight_only_remedy_is_measured_and_the_best_comes_first(q4, tmp_path):
    doc, cause = _compare(q4, tmp_path / "o", "--recipe", json.dumps(RECIPE))
    assert "What fits spread error: " in cause and "measured by re-quantizing on 16 samples" in cause, cause
    checks = doc["remedy_checks"]
    assert checks["proved"] and checks["proof"].startswith("the recipe rebuilds your INT8 model exactly")
    remedies = [c["remedy"] for c in checks["checks"]]
    last = next(iter(next(c for c in checks["checks"] if "node_bits" in c["change"])["change"]["node_bits"]))
    assert set(remedies) == {
        "a smaller block_size (16)",
        "accuracy_level=0 (no int8 quantization of the input inside the kernel)",
        f"the output head {last} at 8 bits (node_bits)",
    }
    assert last == "classifier/MatMul"  # an encoder's head by its own name: no "lm_head" it does not have
    cosines = [c["cosine"] for c in checks["checks"]]
    assert cosines == sorted(cosines, reverse=True)  # best first, as the headline lists them
    assert cause.index(remedies[0]) < cause.index(remedies[1]) < cause.index(remedies[2])
    x = np.load(q4["inputs"])["input_ids"]
    # The baseline is the INT8 model as given, the block-16 figure a plain re-quantization.
    assert checks["baseline"] == pytest.approx(_plain_min_cosine(q4["fp32"], q4["int8"], x), abs=1e-5)
    block16 = next(c for c in checks["checks"] if c["change"] == {"block_size": 16})
    plain16 = _plain_q4(q4["fp32"], tmp_path / "b16.onnx", 16, 4)
    assert block16["cosine"] == pytest.approx(_plain_min_cosine(q4["fp32"], plain16, x), abs=1e-5)
    assert block16["cosine"] > checks["baseline"]  # the top remedy improves the output
    assert not list(q4["folder"].glob(".diag-remedies-*"))  # its models were temporary


def test_a_recipe_that_does_not_rebuild_the_model_measures_no_remedy(q4, tmp_path, capsys):
    """The model was made with block_size 32; a recipe saying 64 would measure remedies of a model
    nobody shipped: nothing is re-quantized, the round trip's difference is recorded, and the headline
    lists the remedies unmeasured."""
    doc, cause = _compare(q4, tmp_path / "o", "--recipe", json.dumps({**RECIPE, "block_size": 64}))
    assert "  weight-only remedies not measured: the recipe does not rebuild your INT8 model" in capsys.readouterr().out
    checks = doc["remedy_checks"]
    assert checks["proved"] is False and checks["checks"] == []
    assert checks["proof"].startswith("the recipe does not rebuild your INT8 model")
    assert "measured by re-quantizing" not in cause and "What fits spread error: a smaller block_size" in cause


def test_without_the_recipe_the_remedies_are_listed_not_measured(q4, tmp_path):
    doc, cause = _compare(q4, tmp_path / "o")
    assert "remedy_checks" not in doc
    assert "What fits spread error: a smaller block_size (16), " in cause, cause
    assert "per_channel" not in cause and "16-bit activations" not in cause  # INT8-activation advice


def test_a_per_channel_model_is_not_told_per_channel_in_the_spread_headline(tmp_path):
    """The generic list was matched after its exclusion search had become a command, so it stayed
    in the headline: per_channel=True and QDQ advice for a per-channel dynamic model."""
    fx = models.build("spread_mlp")
    fp32 = tmp_path / "fp32.onnx"
    onnx.save(fx.model, fp32)
    np.savez(tmp_path / "x.npz", **fx.make_inputs(32, 12))
    int8 = quantize(fp32, tmp_path / "pc.onnx", "dynamic", per_channel=True)
    args = ["compare", str(fp32), str(int8), "--inputs", str(tmp_path / "x.npz"), "--effects", "0"]
    assert main([*args, "--out", str(tmp_path / "o"), "--quiet"]) == 0
    cause = json.loads((tmp_path / "o" / "diag.json").read_text())["verdict"]["cause"]
    assert "spread error: static calibration instead of dynamic, or an exclusion search: diag exclude" in cause
    assert "per_channel=True" not in cause and "16-bit activations" not in cause
