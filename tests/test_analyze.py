"""Verdict bands and roles: the numbers in docs/verdict-bands.md's table are the numbers the code uses."""

from __future__ import annotations

import pytest

from diag.analysis.analyze import band_grade


@pytest.mark.parametrize(
    ("metric", "value", "grade"),
    [
        ("top1_agreement", 0.995, "excellent"),
        ("top1_agreement", 0.96, "acceptable"),
        ("top1_agreement", 0.92, "marginal"),
        ("top1_agreement", 0.89, "reject"),
        ("max_abs", 0.05, "excellent"),
        ("max_abs", 0.2, "acceptable"),
        ("max_abs", 0.4, "marginal"),
        ("max_abs", 0.6, "reject"),
        ("cosine_min", 0.9995, "excellent"),
        ("cosine_min", 0.995, "acceptable"),
        ("cosine_min", 0.985, "marginal"),
        ("cosine_min", 0.97, "reject"),
        ("accuracy_drop", 0.004, "excellent"),
        ("accuracy_drop", 0.01, "acceptable"),
        ("accuracy_drop", 0.018, "marginal"),
        ("accuracy_drop", 0.03, "reject"),
    ],
)
def test_band_grade_matches_the_readme_table(metric, value, grade):
    assert band_grade(value, metric) == grade
