"""Weight-only remedies measured, not listed (issue 25, item 2).

A MatMulNBits model with spread error is told to try a smaller ``block_size``, the other symmetry,
``accuracy_level=0`` or the last MatMul at 8 bits. With the recipe that made the model
(``diag compare --recipe``), each is a re-quantization away from being a fact: this module
re-quantizes the FP32 model with every such change (``MatMulNBitsQuantizer``, seconds for the
models diag sees) and measures its outputs against FP32 on the compare's samples, as onnxruntime
runs them by default, next to the INT8 model as given. The headline then lists them best first
with their figures, and says which change nothing.

NOTE: only with a recipe given, and only once it is proved to rebuild the user's model exactly
(:func:`diag.fix.roundtrip.prove_roundtrip`): a remedy's "before" must be the model the user ships.
A recipe read back from the model cannot tell RTN from k_quant, HQQ or GPTQ (the graphs are the
same), so re-quantizing from it would measure another baseline.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.analysis.remedies import weight_only_changes
from diag.core.feeds import FeedSource
from diag.core.load import LoadedModel
from diag.core.recipe import Recipe
from diag.fix.evaluate import HeldOutEvaluator
from diag.fix.quantize import quantize_model
from diag.fix.roundtrip import prove_roundtrip, roundtrip_line
from diag.foundations.errors import DiagError
from diag.foundations.ortfacts import DEPLOY_LEVEL


@dataclass(frozen=True)
class RemedyCheck:
    """One weight-only remedy re-quantized and measured: min per-sample cosine over every output."""

    remedy: str
    change: dict[str, Any]
    cosine: float | None
    #: why it could not be measured ("" when it was)
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        cosine = None if self.cosine is None or math.isnan(self.cosine) else round(self.cosine, 6)
        return {"remedy": self.remedy, "change": self.change, "cosine": cosine, "error": self.error}


@dataclass(frozen=True)
class RemedyChecks:
    """The INT8 model's own figure and every remedy's, on the same samples."""

    baseline: float
    checks: list[RemedyCheck]
    samples: int
    #: The round trip's verdict (:func:`diag.fix.roundtrip.roundtrip_line`): the remedies are measured
    #: only when the recipe, unchanged, rebuilds the user's model exactly.
    proof: str = ""
    proved: bool = True

    def ranked(self) -> list[RemedyCheck]:
        """Measured remedies best first, then the ones that could not be measured."""
        measured = sorted((c for c in self.checks if c.cosine is not None), key=lambda c: -(c.cosine or 0.0))
        return measured + [c for c in self.checks if c.cosine is None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": "cosine",
            "samples": self.samples,
            "baseline": round(self.baseline, 6),
            "proof": self.proof,
            "proved": self.proved,
            "checks": [c.to_dict() for c in self.ranked()],
        }

    def text(self) -> str:
        """The headline's list: ``a smaller block_size (16) (cosine 0.8447 -> 0.9535), ...``."""
        parts = []
        for c in self.ranked():
            if c.cosine is None:
                parts.append(f"{c.remedy} (not measured: {c.error})")
            elif abs(c.cosine - self.baseline) < 5e-5:
                parts.append(f"{c.remedy} (changes nothing: cosine {c.cosine:.4f})")
            else:
                parts.append(f"{c.remedy} (cosine {self.baseline:.4f} -> {c.cosine:.4f})")
        return ", ".join(parts)


def check_weight_only_remedies(
    fp: LoadedModel, int8_path: Path, recipe: Recipe, feeds: FeedSource, threads: int | None = None
) -> RemedyChecks:
    """Re-quantize the FP32 model with each weight-only remedy of ``recipe`` and measure them all.

    Example:
        >>> checks = check_weight_only_remedies(fp, Path("q4.onnx"), recipe, feeds)  # doctest: +SKIP
        >>> checks.ranked()[0].remedy  # doctest: +SKIP
        'a smaller block_size (16)'
    """
    evaluator = HeldOutEvaluator(fp, feeds, 0, None, threads, opt_level=DEPLOY_LEVEL)
    baseline = evaluator.evaluate(int8_path)
    last = _last_matmul(fp)
    checks = []
    with tempfile.TemporaryDirectory(prefix=".diag-remedies-", dir=str(int8_path.resolve().parent)) as tmp:
        # A remedy's "before" must be the user's model: the recipe, unchanged, must rebuild it first.
        try:
            rt = prove_roundtrip(fp.path, int8_path, recipe, Path(tmp) / "roundtrip")
        except DiagError as e:
            why = f"the recipe could not be re-quantized: {e.obj}: {e.problem}"
            return RemedyChecks(baseline.cosine, [], baseline.samples, why, proved=False)
        proof = roundtrip_line(rt)
        if not rt.identical:
            return RemedyChecks(baseline.cosine, [], baseline.samples, proof, proved=False)
        for i, (remedy, change) in enumerate(weight_only_changes(recipe.to_dict(), last)):
            if not change:
                continue
            out = Path(tmp) / f"remedy{i}.onnx"
            try:
                quantize_model(fp.path, Recipe.from_dict({**recipe.to_dict(), **change}, "remedy"), out)
                got = evaluator.evaluate(out).cosine
            except DiagError as e:  # a remedy onnxruntime cannot build is reported, not fatal
                checks.append(RemedyCheck(remedy, change, None, e.problem))
                continue
            checks.append(RemedyCheck(remedy, change, got))
    return RemedyChecks(baseline.cosine, checks, baseline.samples, proof)


def _last_matmul(fp: LoadedModel) -> str | None:
    """The graph's last MatMul with a constant weight (the lm_head / classifier), by name."""
    consts = {i.name for i in fp.graph.initializer}
    names = [n.name for n in fp.graph.node if n.op_type == "MatMul" and n.name and n.input[1] in consts]
    return names[-1] if names else None
