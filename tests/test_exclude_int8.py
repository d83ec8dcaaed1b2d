"""`diag exclude --int8 MODEL` starts from the user's own quantization (issue 25 item 6).

Without it, a search starts from onnxruntime's defaults and says so on its first line; with it,
the recipe is read back from the INT8 model and the search's baseline is that model's figure,
checked here against plain onnxruntime sessions of the user's file on the held-out samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnxruntime.quantization import QuantType, quantize_dynamic

from diag.fixtures import models
from diag.foundations.errors import USER_ERROR


def _min_cosine(fp32: Path, int8: Path, feeds: dict[str, np.ndarray], first: int, batch: int) -> float:
    """Min per-sample cosine over outputs, FP32 vs INT8, both run by plain onnxruntime in exact mode."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a = ort.InferenceSession(str(fp32), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(int8), so, providers=["CPUExecutionProvider"])
    total = len(next(iter(feeds.values())))
    worst = 1.0
    for start in range(first, total, batch):  # dynamic quantization scales per run: batch as diag does
        chunk = {k: v[start : start + batch] for k, v in feeds.items()}
        for x, y in zip(a.run(None, chunk), b.run(None, chunk), strict=True):
            x2, y2 = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
            cos = (x2 * y2).sum(1) / np.sqrt((x2 * x2).sum(1) * (y2 * y2).sum(1))
            worst = min(worst, float(cos.min()))
    return worst


@pytest.fixture(scope="module")
def user_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    """The transformer fixture and the user's INT8 model: dynamic, per-channel, QUInt8 weights (not the defaults)."""
    d = tmp_path_factory.mktemp("int8")
    fx = models.build("transformer")
    fp, q, x = d / "t.fp32.onnx", d / "t.int8.onnx", d / "t.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(str(fp), str(q), weight_type=QuantType.QUInt8, per_channel=True)
    feeds = fx.make_inputs(16, 12)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_exclude_with_int8_starts_from_that_models_figure(user_model, tmp_path, capsys) -> None:
    fp, q, x, feeds = user_model
    before = q.read_bytes()
    common = ["--inputs", x, "--batch", "8", "--target", "cosine>=0.99999", "--bench-runs", "0", "--quiet"]
    code, out, err = run_cli(["exclude", fp, "--int8", q, *common, "--out", tmp_path / "mine"], capsys)
    assert code in (0, 3), err
    first = out.splitlines()[0]
    assert first.startswith(f"recipe: read back from the INT8 model {q} "), first
    assert '"per_channel": true' in first and '"weight_type": "QUInt8"' in first, first
    # Surgical: the recipe re-quantized nothing (no "calibrated on the ranking split" claim).
    assert first.endswith(
        "nothing was re-quantized with it: every trial is your INT8 model with float regions spliced in"
    ), first
    doc = json.loads((tmp_path / "mine" / "exclusion.json").read_text())
    assert doc["recipe_origin"]["source"] == "inferred" and doc["recipe_origin"]["path"] == str(q)
    assert doc["recipe"]["per_channel"] is True and doc["recipe"]["weight_type"] == "QUInt8"
    held = doc["split"]["held_out_first"]
    expected = _min_cosine(fp, q, feeds, held, 8)
    assert doc["metrics"]["before"]["cosine"] == pytest.approx(expected, abs=1e-6)
    assert "recipe: read back from the INT8 model" in (tmp_path / "mine" / "summary.md").read_text()
    assert q.read_bytes() == before  # the user's model is read, never written

    # Without --int8 the search starts from onnxruntime's defaults, a different baseline, and says so.
    code, out, err = run_cli(["exclude", fp, *common, "--out", tmp_path / "defaults"], capsys)
    assert out.splitlines()[0].startswith("recipe: onnxruntime's quantize_dynamic defaults"), out
    default_doc = json.loads((tmp_path / "defaults" / "exclusion.json").read_text())
    assert default_doc["recipe_origin"]["source"] == "default"
    assert default_doc["metrics"]["before"]["cosine"] != pytest.approx(expected, abs=1e-6)


def test_int8_with_a_recipe_that_does_not_rebuild_it_says_so_and_fixes_the_int8_model(user_model, tmp_path, capsys):
    fp, q, x, _ = user_model
    args = ["exclude", fp, "--int8", q, "--recipe", '{"mode": "dynamic"}', "--inputs", x, "--target", "cosine>=0.9"]
    code, out, err = run_cli([*args, "--bench-runs", "0", "--quiet", "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    # QInt8 per-tensor defaults against the user's QUInt8 per-channel weights: the scales' shapes differ.
    line = next(x for x in out.splitlines() if x.strip().startswith("round trip: the recipe does not rebuild"))
    assert "differs (" in line and line.endswith("splicing float regions into it instead"), line
    assert json.loads((tmp_path / "o" / "exclusion.json").read_text())["method"] == "surgical"


def test_int8_that_is_not_quantized_is_refused(user_model, tmp_path, capsys) -> None:
    fp, _, x, _ = user_model
    code, _, err = run_cli(
        ["exclude", fp, "--int8", fp, "--inputs", x, "--target", "cosine>=0.9", "--out", tmp_path / "o"], capsys
    )
    assert code == USER_ERROR and "error[not-quantized]" in err, err
