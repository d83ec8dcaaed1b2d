"""Skip-one sensitivity: how much of the end-to-end error each top candidate really causes.

Local error says which nodes quantize badly; it does not say how much the *outputs* would gain by
keeping one of them in float (a bad node on a branch that barely reaches the output matters
little). Sensitivity answers that directly, for the top-K nodes of the local ranking only: re-
quantize with the user's recipe plus ``nodes_to_exclude=[node]``, run it on the same inputs, and
measure the outputs again. K re-quantizations, never one per node.

The recipe is re-applied as given first ("baseline"): if that model's metrics differ from the
INT8 model under diagnosis, the recipe does not describe it and the figures are flagged.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from diag.analysis.analyze import NodeFinding
from diag.core.feeds import FeedSource
from diag.core.load import model_from_path
from diag.core.recipe import Recipe
from diag.fix.evaluate import HeldOutEvaluator, HeldOutMetrics
from diag.fix.quantize import quantize_model
from diag.fix.search import Candidate, ranked_candidates
from diag.foundations.jsonnum import json_number as _j
from diag.foundations.progress import Progress

#: Baseline and the diagnosed INT8 model agree when their min cosines differ by less than this.
REPRODUCE_TOLERANCE = 1e-3


@dataclass
class SensitivityRow:
    """One candidate kept in float, everything else quantized as the recipe says."""

    candidate: Candidate
    metrics: HeldOutMetrics
    cosine_recovered: float
    max_abs_recovered: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label,
            "fp_nodes": list(self.candidate.fp_nodes),
            "local_sqnr_db": _j(self.candidate.local_sqnr_db),
            "cosine": _j(self.metrics.cosine),
            "max_abs": _j(self.metrics.max_abs),
            "agreement": _j(self.metrics.agreement),
            "cosine_recovered": _j(self.cosine_recovered),
            "max_abs_recovered": _j(self.max_abs_recovered),
        }


@dataclass
class SensitivityResult:
    """Skip-one results, most recovering first, with the baseline they are measured against."""

    recipe: dict[str, Any]
    given: HeldOutMetrics
    baseline: HeldOutMetrics
    reproduces: bool
    rows: list[SensitivityRow]
    quantizations: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "given": self.given.to_dict(),
            "baseline": self.baseline.to_dict(),
            "reproduces": self.reproduces,
            "rows": [r.to_dict() for r in self.rows],
            "quantizations": self.quantizations,
            "seconds": round(self.seconds, 2),
        }


@dataclass(frozen=True)
class SensitivityOptions:
    """How many candidates to try (``--sensitivity K``), with how many threads, with a bar or not."""

    k: int = 5
    threads: int | None = None
    progress: bool = True


class SkipOneTrials(Protocol):
    """Runs the skip-one trials elsewhere: ``recipe`` + each node list kept in float, evaluated on
    every sample; their metrics in the order given. ``diag.fix.cluster.ClusterSkipOne`` runs them as
    Dask tasks; without one (:func:`skip_one_sensitivity`'s default) they run here, one by one."""

    def __call__(
        self,
        fp32: Path,
        recipe: Recipe,
        node_lists: list[list[str]],
        calibration_cache: Path,
        threads: int | None,
        progress: bool,
    ) -> list[HeldOutMetrics]: ...


def skip_one_sensitivity(
    fp32_path: str | Path,
    int8_path: str | Path,
    recipe: Recipe,
    feeds: FeedSource,
    findings: list[NodeFinding],
    options: SensitivityOptions | None = None,
    trials: SkipOneTrials | None = None,
) -> SensitivityResult:
    """Re-quantize with each of the top-``k`` local-ranking nodes kept in float; measure the outputs.

    Static recipes calibrate on the recipe's own calibration data when it names some, otherwise
    on ``feeds`` (say so in the report: calibrating on the evaluation inputs flatters every row
    alike, so rows stay comparable). ``trials`` (``diag.fix.cluster.ClusterSkipOne``) runs the ``k``
    re-quantizations as Dask tasks; same rows.

    Example:
        >>> res = skip_one_sensitivity("fp32.onnx", "int8.onnx", Recipe(mode="dynamic"), feeds,
        ...                            result.findings, SensitivityOptions(k=3))  # doctest: +SKIP
        >>> res.rows[0].candidate.label  # doctest: +SKIP
        'layer1/ffn/fc1/MatMul'
    """
    o = options if options is not None else SensitivityOptions()
    start = time.perf_counter()
    fp32_path, int8_path = Path(fp32_path), Path(int8_path)
    evaluator = HeldOutEvaluator(model_from_path(fp32_path, "FP32 model"), feeds, 0, None, o.threads)
    given = evaluator.evaluate(int8_path)
    candidates = ranked_candidates(findings, set(recipe.nodes_to_exclude))[: max(o.k, 0)]
    calibration = None if recipe.mode == "dynamic" or recipe.calibration else feeds
    work = Path(tempfile.mkdtemp(prefix="diag-sensitivity-"))
    bar = Progress(len(candidates) + 1, "sensitivity", enabled=o.progress)
    try:
        base_path = work / "baseline.onnx"
        # The ranges of the FP32 model do not depend on the excluded node: calibrate once.
        cache = work / "calibration.json"
        quantize_model(fp32_path, recipe, base_path, calibration=calibration, calibration_cache=cache)
        baseline = evaluator.evaluate(base_path)
        bar.advance(1)
        rows = []
        remote = None
        if trials is not None and candidates:
            nodes = [list(c.fp_nodes) for c in candidates]
            remote = trials(fp32_path, recipe, nodes, cache, o.threads, o.progress)
        for i, cand in enumerate(candidates):
            if remote is not None:
                m = remote[i]
            else:
                path = work / f"skip{i}.onnx"
                m = _local_trial(fp32_path, recipe.with_excluded(cand.fp_nodes), path, calibration, cache, evaluator)
            rows.append(SensitivityRow(cand, m, m.cosine - baseline.cosine, baseline.max_abs - m.max_abs))
            bar.advance(1)
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)
    rows.sort(key=lambda r: (-r.cosine_recovered, -r.max_abs_recovered, r.candidate.rank))
    return SensitivityResult(
        recipe=recipe.to_dict(),
        given=given,
        baseline=baseline,
        reproduces=abs(given.cosine - baseline.cosine) < REPRODUCE_TOLERANCE,
        rows=rows,
        quantizations=len(candidates) + 1,
        seconds=time.perf_counter() - start,
    )


def _local_trial(
    fp32: Path, recipe: Recipe, path: Path, calibration: FeedSource | None, cache: Path, evaluator: HeldOutEvaluator
) -> HeldOutMetrics:
    """One skip-one trial in this process: quantize (calibration ranges from ``cache``), evaluate, delete."""
    quantize_model(fp32, recipe, path, calibration=calibration, calibration_cache=cache)
    m = evaluator.evaluate(path)
    path.unlink(missing_ok=True)
    return m
