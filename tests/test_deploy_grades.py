"""Grades as deployed (issue 42 item 3): the outputs are graded as onnxruntime runs the INT8 model by
default (optimization level "all", fused integer kernels), against the exact FP32 outputs, with the
exact-mode grades beside them; ``diag check`` gates what the user deploys.

The fixture: the transformer quantized static QDQ per channel with its culprit excluded, the way a
user applies a fix. Around the float node, onnxruntime's optimizer fuses the remaining Q/DQ pairs,
so what runs at level "all" differs from exact mode. Every figure is re-computed with plain
onnxruntime sessions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import QuantFormat, quantize_static
from plain_ort import Rows

from diag.cli import commands as cli
from diag.fixtures import models
from diag.foundations.errors import GATE_FAILED


def _max_abs(fp32: Path, model: Path, feeds: dict[str, np.ndarray], level: ort.GraphOptimizationLevel) -> float:
    """Largest |FP32 (exact) - INT8 (at ``level``)| over every sample, by plain onnxruntime."""
    exact = ort.SessionOptions()
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    deployed = ort.SessionOptions()
    deployed.graph_optimization_level = level
    a = ort.InferenceSession(str(fp32), exact, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(str(model), deployed, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.fixture(scope="module")
def excluded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("deploy")
    fx = models.build("transformer")
    fp, q, x = d / "t.fp32.onnx", d / "t.qdq.onnx", d / "x.npz"
    onnx.save(fx.model, fp)
    quantize_static(
        str(fp),
        str(q),
        Rows(fx.make_inputs(16, 5), 16),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        nodes_to_exclude=[fx.expected.culprit_node],
    )
    feeds = fx.make_inputs(32, 3)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_outputs_are_graded_as_deployed_with_exact_mode_beside(excluded, tmp_path, capsys) -> None:
    fp, q, x, feeds = excluded
    out = tmp_path / "out"
    cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    verdict = json.loads((out / "diag.json").read_text())["verdict"]
    assert verdict["graded_at"] == "all"
    graded, exact = verdict["outputs"][0], verdict["exact_outputs"][0]
    deployed_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    exact_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert graded["max_abs"] == pytest.approx(deployed_abs, rel=1e-5)
    assert exact["max_abs"] == pytest.approx(exact_abs, rel=1e-5)
    assert abs(deployed_abs - exact_abs) > 0.05 * exact_abs, "the fixture must run differently as deployed"
    assert "outputs graded as deployed (level all)" in printed
    assert "Graded as onnxruntime runs the INT8 model at optimization level all" in (out / "summary.md").read_text()
    # --deploy-level disabled grades exact mode, and says so.
    cli.main([*["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0"],
              "--deploy-level", "disabled", "--out", str(tmp_path / "exact")])  # fmt: skip
    printed = capsys.readouterr().out
    exact_doc = json.loads((tmp_path / "exact" / "diag.json").read_text())["verdict"]
    assert exact_doc["graded_at"] == "disabled" and exact_doc["exact_outputs"] == []
    assert exact_doc["outputs"][0]["max_abs"] == pytest.approx(exact_abs, rel=1e-5)
    assert "outputs graded in exact mode" in printed


def test_check_gates_the_model_as_deployed(excluded, tmp_path, capsys) -> None:
    """A max-abs gate between the exact and deployed figures: the deployed one decides."""
    fp, q, x, feeds = excluded
    out = tmp_path / "out"
    cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0", "--out", str(out)])
    capsys.readouterr()
    deployed_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    exact_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    between = (deployed_abs + exact_abs) / 2
    code = cli.main(["check", str(out / "diag.json"), "--max-abs", f"{between:.6f}"])
    printed = capsys.readouterr().out
    if deployed_abs > exact_abs:
        assert code == GATE_FAILED and "FAIL max-abs" in printed, printed  # passes exact, fails as deployed
    else:
        assert code == 0, printed  # fails exact, passes as deployed: deployment is what counts
