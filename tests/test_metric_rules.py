"""One SQNR and one cosine: every copy diag prints follows diag.core.metrics' edge rules.

``metrics.sqnr_db`` and ``metrics.cosines`` decide what a zero, infinite or NaN sum reads as. The
tensor accumulator, the per-sample output cosine, the weight table (per-tensor and block-wise),
nbits' accuracy_level check and saturation's AVX2 prediction all go through them; these tests
feed each copy the edge cases and fail when one answers differently, and fail when a new
``log10`` appears outside the two places that may compute one.
"""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from diag.analysis import weights
from diag.core.metrics import ErrorAccumulator, OutputAccumulator, cosine, cosines, sqnr_db
from diag.core.saturation import NodePrediction

INF, NAN = math.inf, math.nan
DIAG = Path(__file__).resolve().parent.parent / "diag"

#: (signal, noise) -> SQNR in dB: the rule, written out.
SQNR_RULE = [
    ((100.0, 1.0), 20.0),
    ((0.0, 0.0), INF),  # identical zeros
    ((NAN, 0.0), INF),  # no noise: identical, whatever the signal
    ((0.0, 1.0), -INF),
    ((1.0, INF), -INF),  # the noise sum overflowed
    ((INF, INF), -INF),
    ((INF, 1.0), INF),
    ((1.0, NAN), -INF),
    ((NAN, 1.0), -INF),
    ((-1.0, 1.0), -INF),
]

#: (sum xy, sum x^2, sum y^2) -> cosine: the rule, written out.
COSINE_RULE = [
    ((2.0, 4.0, 1.0), 1.0),
    ((-2.0, 4.0, 1.0), -1.0),
    ((1.0, 4.0, 1.0), 0.5),
    ((0.0, 0.0, 0.0), 1.0),  # two zero vectors are identical
    ((0.0, 0.0, 3.0), 0.0),  # a zero vector against a non-zero one
    ((0.0, 3.0, 0.0), 0.0),
    ((3.0, 9.0, -1e-17), 0.0),  # a derived sum y^2 rounded below 0 counts as 0
    ((2.0 + 1e-15, 4.0, 1.0), 1.0),  # rounding above 1 is clamped
    ((1.0, NAN, 1.0), 0.0),  # a NaN energy has no cosine
    ((NAN, NAN, NAN), 0.0),
    ((INF, INF, INF), 1.0),  # both energies overflowed (masks at float32's lowest value)
    ((1.0, INF, 1.0), 0.0),
]

EDGES = (0.0, 1.0, 4.0, 1e-300, INF, NAN)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize(("sums", "expected"), SQNR_RULE)
def test_sqnr_edges_follow_the_one_rule(sums, expected):
    got = sqnr_db(*sums)
    assert same(got, expected), f"sqnr_db{sums} = {got}, the rule says {expected}"


@pytest.mark.parametrize(("sums", "expected"), COSINE_RULE)
def test_cosine_edges_follow_the_one_rule(sums, expected):
    assert same(cosine(*sums), expected), f"cosine{sums} = {cosine(*sums)}, the rule says {expected}"
    assert same(float(cosines(*(np.array([v]) for v in sums))[0]), expected)


def test_sqnr_and_cosine_are_never_nan_and_never_raise():
    for signal, noise in itertools.product(EDGES, EDGES):
        assert not math.isnan(sqnr_db(signal, noise)), (signal, noise)
    grid = list(itertools.product(EDGES, EDGES, EDGES))
    got = cosines(*(np.array(col) for col in zip(*grid, strict=True)))
    assert not np.isnan(got).any() and (got <= 1.0).all()


def test_the_tensor_accumulator_reads_its_sums_through_the_rules():
    for signal, noise in itertools.product(EDGES, EDGES):
        stats = ErrorAccumulator(n=1, s_xx=signal, s_ee=noise).finalize()
        assert same(stats.sqnr_db, sqnr_db(signal, noise)), (signal, noise)
    for dot, xx, yy in itertools.product(EDGES, EDGES, EDGES):
        stats = ErrorAccumulator(n=1, s_xx=xx, s_yy=yy, s_xy=dot).finalize()
        assert same(stats.cosine, cosine(dot, xx, yy)), (dot, xx, yy)


#: A row whose cosine with three times itself rounds to 1.0000000000000002 in float64.
PARALLEL = [-0.5816408395767212, 0.10927969962358475, -0.0757015272974968, 0.20211438834667206, 0.6941719651222229]


def test_the_per_sample_output_cosine_follows_the_rules():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5)).astype(np.float32)
    y = (x + rng.normal(0.0, 0.1, x.shape)).astype(np.float32)
    x[1], y[1] = 0.0, 0.0  # two zero vectors
    x[2] = 0.0  # a zero vector against a non-zero one
    x[3] = PARALLEL
    y[3] = x[3] * np.float32(3.0)
    acc = OutputAccumulator()
    acc.update(x, y)
    a, b = x.astype(np.float64), y.astype(np.float64)
    dot, xx, yy = (np.einsum("ij,ij->i", p, q) for p, q in ((a, b), (a, a), (b, b)))
    assert dot[3] / np.sqrt(xx[3] * yy[3]) > 1.0, "the row no longer rounds above 1"
    expected = cosines(dot, xx, yy)
    assert expected[1:4].tolist() == [1.0, 0.0, 1.0]
    assert acc.cos_min == float(expected.min())
    assert acc.cos_sum == pytest.approx(float(expected.sum()), abs=1e-12)
    parallel = OutputAccumulator()
    parallel.update(x[3:4], y[3:4])
    assert parallel.finalize().cosine_min == 1.0


@pytest.mark.parametrize(
    ("x", "y"),
    [
        ([0.0, 0.0], [0.0, 0.0]),
        ([0.0, 0.0], [1.0, 0.0]),
        ([1.0, 2.0], [1.0, 2.0]),
        ([1.0, 2.0], [1.5, 2.0]),
        ([NAN, 1.0], [1.0, 1.0]),
        ([1.0, 1.0], [INF, 1.0]),
        ([0.1, 0.3, 0.7], [0.2, 0.6, 1.4]),  # parallel
    ],
)
def test_the_weight_table_uses_the_same_sqnr_and_cosine(x, y):
    a, b = np.array(x), np.array(y)
    e = b - a
    with np.errstate(invalid="ignore"):
        assert same(weights._sqnr(a, e), sqnr_db(float((a * a).sum()), float((e * e).sum())))
        assert same(weights._cosine(a, b), cosine(float((a * b).sum()), float((a * a).sum()), float((b * b).sum())))


def test_the_block_wise_weight_cosine_uses_the_same_rule():
    zeros = np.zeros(2)
    for dot, xx, yy in itertools.product(EDGES, EDGES, EDGES):
        stats = weights._BlockedStats(np.array([xx, 0.0]), zeros, zeros, zeros, dot, yy, zeros, zeros)
        assert same(stats.cosine(), cosine(dot, xx, yy)), (dot, xx, yy)


def test_the_avx2_saturation_sqnr_uses_the_same_rule():
    for signal, noise in itertools.product(EDGES, EDGES):
        p = NodePrediction("n", "MatMulInteger", signal=signal, error=noise)
        assert same(p.saturation_sqnr_db, sqnr_db(signal, noise)), (signal, noise)


#: Where diag may call log10: the one SQNR, and the AVX2 prediction adding two noise powers in dB.
LOG10_ALLOWED = {("metrics.py", "sqnr_db"), ("saturation.py", "predicted_sqnr_db")}


class _Log10Calls(ast.NodeVisitor):
    """The innermost function around every ``log10`` (math.log10, np.log10, a bare log10)."""

    def __init__(self, module: str) -> None:
        self.module, self.stack, self.found = module, ["<module>"], set()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "log10":
            self.found.add((self.module, self.stack[-1]))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "log10":
            self.found.add((self.module, self.stack[-1]))


def test_no_module_computes_its_own_sqnr():
    found: set[tuple[str, str]] = set()
    for path in sorted(DIAG.rglob("*.py")):
        visitor = _Log10Calls(path.name)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        found |= visitor.found
    assert ("metrics.py", "sqnr_db") in found, "the scan no longer sees the one SQNR"
    assert found <= LOG10_ALLOWED, f"log10 in {sorted(found - LOG10_ALLOWED)}: use diag.core.metrics.sqnr_db"
