"""`diag exclude` on a real Paddle export (RapidOCR's cls MobileNet): calibrate once, search on
estimates so that a minimal list costs a few re-quantizations, and a reproduce.py that rebuilds the
verified model byte for byte through the same guards
(Constant nodes lifted, opset 11 -> 13 for per-channel QDQ)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from diag.cli.commands import main
from diag.fixtures import thirdparty

pytestmark = pytest.mark.slow

#: Measured before calibration was reused (onnxruntime 1.32, 2 cores): static per-tensor QDQ exclusion
#: on this model, 16 text images, cosine>=0.99, ran 325 quantizations, each with its own calibration
#: pass (31 min next to another run). An uncapped search must now stay under 10 % of that count.
BEFORE_QUANTIZATIONS = 325


def test_static_exclusion_on_cls_calibrates_once_searches_on_estimates_and_reproduce_rebuilds_it(tmp_path, capsys):
    fp32 = thirdparty.rapidocr_model("cls")
    assert any(n.op_type == "Constant" for n in onnx.load(str(fp32)).graph.node), "the guards are needed"
    np.savez(tmp_path / "cls.npz", x=thirdparty.text_images(8, 48, 192, seed=3))
    recipe = {"mode": "static", "quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": True}
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    out = tmp_path / "ex"
    argv = ["exclude", str(fp32), "--recipe", str(tmp_path / "recipe.json"), "--inputs", str(tmp_path / "cls.npz")]
    argv += ["--batch", "2", "--target", "cosine>=0.99", "--bench-runs", "0", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "exclusion.json").read_text())
    search = doc["search"]
    assert search["calibrations"] == 1 and not search["budget"]["exhausted"]
    assert search["quantizations"] < BEFORE_QUANTIZATIONS / 10, search["quantizations"]
    assert search["estimates"] > 5 * search["quantizations"], "the search ran on estimates"
    assert "(1 calibration pass)" in text and "estimates)" in text
    assert doc["verdict"] == "met" and doc["metrics"]["after"]["cosine"] >= 0.99 and doc["nodes_to_exclude"]
    # minimal in real terms: every group of the answer was re-included once by re-quantizing, and missed
    real = [s for s in search["trajectory"] if not s["phase"].startswith("estimate")]
    pruned = [s for s in real if s["phase"] == "prune"]
    assert len(pruned) == len(doc["excluded"]) and not any(s["met"] for s in pruned)
    assert doc["preparation"] == ["lift_constants", "upgrade_opset"]

    mixed = out / f"{fp32.stem}.mixed.onnx"
    verified = mixed.read_bytes()
    code = (out / "reproduce.py").read_text()
    assert "import diag" not in code and "from diag" not in code
    assert str(mixed) not in code, "reproduce.py must never overwrite the verified model"
    # paths in reproduce.py are as given to diag exclude (absolute here): any folder will do
    subprocess.run([sys.executable, str(out / "reproduce.py")], check=True, capture_output=True, cwd=tmp_path)
    assert (out / f"{fp32.stem}.reproduced.onnx").read_bytes() == verified
    assert mixed.read_bytes() == verified
