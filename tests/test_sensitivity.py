"""Skip-one sensitivity: the top local-ranking nodes re-quantized one at a time in float, outputs re-measured."""

from __future__ import annotations

import json

import pytest

from diag.analysis.compare import CompareOptions
from diag.cli.commands import main
from diag.cli.verbs import diagnose
from diag.core.feeds import FeedSpec
from diag.foundations.errors import DiagError


def test_keeping_the_injected_culprit_in_float_recovers_the_most(built):
    b = built("transformer")
    r = diagnose(
        b.fp32,
        b.int8["dynamic"],
        FeedSpec(inputs=str(b.inputs_path), batch=8),
        CompareOptions(progress=False, sensitivity=3, recipe='{"mode": "dynamic"}'),
    )
    s = r.sensitivity
    assert s.quantizations == 4  # the recipe as given, then one per candidate: K, never one per node
    assert s.reproduces, (s.baseline.cosine, s.given.cosine)
    assert s.rows[0].candidate.label == b.fixture.expected.culprit_node
    first, second = s.rows[0].cosine_recovered, s.rows[1].cosine_recovered
    assert first > 0 and first > 3 * max(second, 1e-9), (first, second)
    # Every row is the model re-quantized with that node alone in float, measured against FP32.
    assert all(0.9 < row.metrics.cosine <= 1.0 for row in s.rows)


def test_sensitivity_lands_in_json_report_and_summary(built, tmp_path, capsys):
    b = built("convnet")
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"mode": "static", "quant_format": "QDQ", "calibration": str(b.inputs_path)}))
    out = tmp_path / "out"
    argv = ["compare", str(b.fp32), str(b.int8["qdq"]), "--inputs", str(b.inputs_path), "--batch", "8"]
    assert main([*argv, "--sensitivity", "2", "--recipe", str(recipe), "--quiet", "--out", str(out)]) == 0
    assert "sensitivity: keeping" in capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    rows = doc["sensitivity"]["rows"]
    assert len(rows) == 2 and doc["sensitivity"]["quantizations"] == 3
    assert {r["label"] for r in rows} >= {"conv3 (+relu3)"}
    assert 'id="sensitivity"' in (out / "report.html").read_text()
    assert "**Sensitivity**" in (out / "summary.md").read_text()


def test_sensitivity_without_a_recipe_is_a_user_error(built, tmp_path, capsys):
    b = built("transformer")
    argv = ["compare", str(b.fp32), str(b.int8["dynamic"]), "--inputs", str(b.inputs_path), "--quiet"]
    assert main([*argv, "--sensitivity", "--out", str(tmp_path / "o")]) == 2
    assert "error[bad-option]: --sensitivity | needs the recipe" in capsys.readouterr().err
    assert not (tmp_path / "o" / "diag.json").exists()
    with pytest.raises(DiagError):
        diagnose(
            b.fp32,
            b.int8["dynamic"],
            FeedSpec(inputs=str(b.inputs_path), samples=4),
            CompareOptions(progress=False, sensitivity=1),
        )
