"""Derive, re-quantize, verify and prune an exclusion list (`diag exclude`).

The question a user asks after `diag compare`: *which nodes do I keep in float so that the INT8
model is good enough, and how few can I get away with?* The answer is searched, not guessed:

1. The samples are split: the first part ranks the nodes (and calibrates a static recipe that
   has no calibration data of its own); the rest is **held out** and every verdict is measured
   on it only, so the list is not fitted to the samples it is judged on.
2. The baseline INT8 model is compared with FP32 on the ranking split; quantized node groups are
   ordered by local error (worst first; accumulated error where no local error exists).
3. The smallest prefix of that order that meets the target is found by exponential then binary
   search on the prefix length: O(log n) re-quantizations for n candidates.
4. The prefix is **pruned**: excluded groups are re-included (in blocks first, then one by
   one) and stay quantized when the target still holds. Each try costs one re-quantization, so
   the total is O(log n + prefix length), and about O(log n + m log(prefix/m)) when m groups are
   really needed.
5. Steps 3 and 4 run first on **estimates**: the baseline INT8 model with the groups' FP32 nodes
   computed in float where their INT8 versions were, reading and writing the same calibrated
   grids — what ``nodes_to_exclude`` produces, built in memory without re-quantizing
   (:func:`diag.core.surgery.float_region_model`, which follows onnxruntime's rule that a tensor
   keeps its Q/DQ while a still-quantized node touches it). A trial then costs one session, not
   a quantization (plus a calibration pass in onnxruntime before the cache). The estimated answer
   is re-quantized and verified; when it meets the target each of its groups is re-included once
   by real re-quantization (minimal in real terms too), and when it misses the real search of
   steps 3-4 runs with it ranked first. RapidOCR's cls MobileNet (static QDQ, cosine>=0.99):
   325 re-quantizations before, about 20 with estimates.
6. A list that keeps every candidate in float is not a fix: when only that meets the target the
   verdict is "not reachable", with the cheaper alternatives worth trying instead.

Every re-quantization and held-out evaluation is counted and timed; the trajectory (excluded
count vs metric) is kept for the report.

Which trial comes next (the ranking of step 2, the search and pruning of steps 3-4) is
:mod:`diag.fix.search`, pure logic that ``diag.fix.cluster`` replays to run trials ahead; this module
answers the trials (estimates, re-quantization, held-out evaluation) and builds the result.

NOTE: candidates are *groups* (:class:`diag.core.match.NodeGroup`): nodes the quantizer fused
(Conv+Relu in QDQ) are excluded together, because excluding only one of them changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import onnx

from diag.analysis.compare import CompareOptions, CompareResult, compare_models, load_pair
from diag.analysis.levers import nearly_all
from diag.analysis.remedies import per_channel_switch
from diag.core.encodings import AimetExport, aimet_export_at
from diag.core.feeds import FeedSource, FeedSpec, load_labels
from diag.core.load import LoadedModel, float_model_from_path
from diag.core.match import Matching, match_models
from diag.core.protos import default_opset
from diag.core.recipe import Recipe
from diag.core.surgery import float_region_model, region_dirs, save_spliced, spliced_model
from diag.core.taskmetrics import metric_factory
from diag.fix.bench import BenchOptions, bench_models
from diag.fix.evaluate import (
    HeldOutEvaluator,
    HeldOutMetrics,
    Split,
    Target,
    parse_target,
    split_feeds,
)
from diag.fix.evaluate import format_metric as _fmt
from diag.fix.linecheck import shown_lines
from diag.fix.lint import Finding
from diag.fix.modelprep import copy_model
from diag.fix.quantize import quantize_model
from diag.fix.search import BudgetExhausted, Candidate, SearchAlgorithm, ranked_candidates
from diag.foundations.cpu import kernel_path
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number
from diag.foundations.metricnames import labelled_names
from diag.foundations.ortfacts import DEPLOY_LEVEL
from diag.foundations.producers import (
    ORT_RECIPE_PRODUCERS,
    PRODUCERS,
    detect_producer,
    fix_call,
    op_types_change,
)
from diag.foundations.progress import Progress

#: An op type is suggested for exclusion when more than this share of its nodes end up excluded.
OP_TYPE_SHARE = 0.5


@dataclass(frozen=True)
class SearchOptions:
    """The options every held-out search shares (`diag exclude`, `diag exclude --tiers`).

    Attributes:
        target: ``metric>=value`` / ``metric<=value`` (see :data:`TARGET_METRICS`), or a parsed one.
        holdout: share of the samples held out (cut on batch boundaries).
        labels: ``.npy`` of class indices for ``accuracy_drop`` / ``f1_drop`` targets.
        threads: intra-op threads for evaluation sessions.
        bench_runs: timed runs per model for the latency table (0 skips it).
        progress: one line per step on stderr.
        max_trials: at most this many quantizations (the baseline included); None: no cap.
        time_budget: no new trial starts after this many seconds; None: no limit. When a cap
            stops the search, the answer is the smallest list that met the target so far
            (verified on the held-out samples, not proven minimal), or none: ``budget`` says so.
        metric: ``module:function`` of a task-metric plugin (:mod:`diag.core.taskmetrics`); the names
            it declares become target metrics (``--target map50>=0.6``).
        int8: the user's INT8 model (``--int8``). Every trial is then that model with the trial's
            groups spliced in float (:func:`diag.core.surgery.spliced_model`): its baseline *is* the
            user's model, the answer is their model with float regions, and no quantizer runs. The
            recipe (read back from it, :func:`diag.fix.infer.search_recipe`) only words the fix.
        requantize: with ``int8``, re-quantize every trial from the recipe instead of splicing:
            only after :mod:`diag.fix.roundtrip` proved that the recipe rebuilds ``int8`` exactly
            (the verb checks; calibration then sees the exclusions).
        deploy_level: the onnxruntime optimization level the user deploys with (``--deploy-level``;
            default ``"all"``, onnxruntime's own default). A list is *met* only when the target holds
            in exact mode (optimizations off, what the search compares) and at this level, where fused
            integer kernels can undo an exclusion (issue 25 item 9). ``"disabled"``: exact mode only.
    """

    target: str | Target
    holdout: float = 0.5
    labels: str | None = None
    threads: int | None = None
    bench_runs: int = 20
    progress: bool = True
    max_trials: int | None = None
    time_budget: float | None = None
    metric: str | None = None
    int8: str | None = None
    deploy_level: str = DEPLOY_LEVEL
    requantize: bool = False
    #: ``--max-memory``: the ranking pass's budget for one batch's exposed tensors (split into passes
    #: above it), as in `diag compare`; None: no budget (the pre-flight still refuses what cannot fit).
    max_memory: int | None = None
    #: ``--encodings``: AIMET's encodings file when ``int8`` is AIMET's FP32 export (default: the
    #: ``<stem>.encodings`` beside it). The fix is then made in the encodings (:class:`AimetExport`).
    encodings: str | None = None

    @property
    def surgical(self) -> bool:
        """Trials are the user's INT8 model with float regions spliced in (no quantizer runs)."""
        return self.int8 is not None and not self.requantize


@dataclass(frozen=True)
class ExcludeOptions(SearchOptions):
    """What `diag exclude` takes besides the model, the recipe and the inputs.

    Attributes:
        estimates: search on float-region estimates of the baseline first (one session per
            trial, no re-quantization), then verify and prune the answer by re-quantizing; False
            re-quantizes every trial.
        scheduler: ``ADDRESS`` or ``local[:N]``: run the search's trials as Dask tasks; the trial
            runner that does it (``diag.fix.cluster.ClusterTrialRunner``) is passed to
            :func:`derive_exclusions` by the verb (:func:`diag.cli.verbs.exclude_to_dir`).

    Example:
        >>> ExcludeOptions("cosine>=0.999", bench_runs=0).holdout
        0.5
    """

    estimates: bool = True
    scheduler: str | None = None


@dataclass(frozen=True)
class Step:
    """One re-quantization + held-out evaluation of the search."""

    phase: str
    excluded_groups: int
    excluded_nodes: list[str]
    metric: float | None
    met: bool
    seconds: float
    #: Held-out samples with NaN/Inf in an output (the metric is then the worst value).
    nonfinite_samples: int = 0
    #: The metric at the deploy level, for trials that met it in exact mode (None: not checked).
    deployed_metric: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metric"] = json_number(self.metric, digits=None, nan=None)
        d["deployed_metric"] = json_number(self.deployed_metric, digits=None, nan=None)
        return d


@dataclass
class EditedEncodings:
    """The fix of an AIMET export, in AIMET's file: the user's encodings without those the float
    nodes' quantizers own (:meth:`diag.core.encodings.AimetExport.without`), the model measured."""

    #: The user's encodings file, and the names taken out of it.
    source: str
    removed: list[str]
    #: The edited document (written whole by the verb, as ``file``; not in exclusion.json).
    document: dict[str, Any]
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "removed": list(self.removed), "file": self.file}


@dataclass
class ExclusionResult:
    """Everything `diag exclude` found; :meth:`to_dict` is ``exclusion.json`` (JSON-ready).

    ``reachable`` is False when no list short of keeping every candidate in float meets the
    target: ``nodes_to_exclude`` is then empty and ``alternatives`` says what to try instead.
    """

    fp32: str
    target: Target
    reachable: bool
    already_met: bool
    nodes_to_exclude: list[str]
    excluded: list[Candidate]
    candidates: list[Candidate]
    recipe: dict[str, Any]
    op_types_to_quantize: list[str] | None
    op_type_suggestions: list[dict[str, Any]]
    before: HeldOutMetrics
    after: HeldOutMetrics | None
    trajectory: list[Step]
    quantizations: int
    evaluations: int
    ranking_passes: int
    seconds: float
    split: dict[str, Any]
    calibration: str | None
    alternatives: list[dict[str, Any]]
    latency: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    snippet: str = ""
    #: Calibration passes (static recipes: 1, the ranges are reused by every later trial).
    calibrations: int = 0
    #: Trials estimated without re-quantizing (float regions of the baseline; see ``_Search.estimate``).
    estimates: int = 0
    #: What quantize_model did to the FP32 model before quantizing (replayed by reproduce.py).
    steps: list[str] = field(default_factory=list)
    #: ``{"max_trials": N, "time_budget": S, "exhausted": bool, "reason": str}``.
    budget: dict[str, Any] = field(default_factory=dict)
    #: Sentences the user must read (e.g. the mixed model is slower than FP32).
    warnings: list[str] = field(default_factory=list)
    #: ``--scheduler``: the cluster's workers, tasks, retries, and where latency was measured.
    cluster: dict[str, Any] = field(default_factory=dict)
    #: Where the starting recipe came from (:meth:`diag.fix.infer.RecipeOrigin.to_dict`; set by the verb).
    recipe_origin: dict[str, Any] = field(default_factory=dict)
    #: The onnxruntime optimization level "met" was also checked at ("disabled": exact mode only).
    deploy_level: str = DEPLOY_LEVEL
    #: ``after`` at the deploy level (None when not checked: no answer, or exact mode only).
    after_deployed: HeldOutMetrics | None = None
    #: Sessions run at the deploy level (met-in-exact-mode lists only).
    deployed_checks: int = 0
    #: ``"surgical"``: every trial was the user's INT8 model (``int8``) with float regions spliced in;
    #: ``"encodings"``: ``int8`` is AIMET's export, and every trial the QDQ model its encodings describe
    #: with the float nodes' encodings taken out (``encodings`` holds the answer's file);
    #: ``"requantized"``: every trial was quantized from ``recipe`` by onnxruntime.
    method: str = "requantized"
    #: The user's INT8 model the surgical trials were spliced into.
    int8: str | None = None
    #: Trials built by splicing float regions into the user's model (surgical searches).
    splices: int = 0
    #: Who made the user's INT8 model (:func:`diag.foundations.producers.detect_producer`): its
    #: key, name and the mark that decided it; the fix is also worded in that tool's terms.
    producer: dict[str, Any] = field(default_factory=dict)
    #: Quantized node groups of the baseline (the candidates) and how many stay quantized in the answer.
    quantized_groups: int = 0
    #: A met list that keeps (almost) every quantized group in float: not a fix (see ``verdict``).
    all_but_float: bool = False
    #: The CompareResult of the ranking pass (None when the baseline already met the target);
    #: not part of exclusion.json, it becomes the diagnosis half of the exclusion's report.
    diagnosis: CompareResult | None = None
    #: ``--recipe FILE``: each line of the recipe measured on the model it builds
    #: (:func:`diag.fix.linecheck.measure_lines`, set by the verb); empty otherwise.
    recipe_lines: list[Finding] = field(default_factory=list)
    #: The user's model is AIMET's export: the answer as its edited encodings (None otherwise).
    encodings: EditedEncodings | None = None

    @property
    def verdict(self) -> str:
        if self.already_met:
            return "already met"
        if self.all_but_float:
            return "not reachable"
        if self.reachable:
            return "met"
        return "budget exhausted" if self.budget.get("exhausted") else "not reachable"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``exclusion.json``; embeddable in a report).

        Example:
            >>> r = derive_exclusions("m.onnx", recipe, FeedSpec(inputs="d.npz"), "cosine>=0.999")  # doctest: +SKIP
            >>> json.dumps(r.to_dict())  # doctest: +SKIP
        """
        return {
            "schema": "diag.exclusion/1",
            "fp32": self.fp32,
            "target": str(self.target),
            "verdict": self.verdict,
            "reachable": self.reachable,
            "method": self.method,
            "int8": self.int8,
            "producer": self.producer,
            "nodes_to_exclude": list(self.nodes_to_exclude),
            **({"encodings": self.encodings.to_dict()} if self.encodings is not None else {}),
            "stays_int8": {
                "groups": self.quantized_groups - len(self.excluded),
                "of": self.quantized_groups,
            },
            "op_types_to_quantize": self.op_types_to_quantize,
            "excluded": [c.to_dict() for c in self.excluded],
            "recipe": self.recipe,
            "recipe_origin": self.recipe_origin,
            **({"recipe_lines": [dataclasses.asdict(f) for f in self.recipe_lines]} if self.recipe_lines else {}),
            "op_type_suggestions": self.op_type_suggestions,
            "fixes": ranked_fixes(self),
            # the before/after metrics come from onnxruntime's integer kernels on this CPU
            "kernel_path": kernel_path().to_dict(),
            "metrics": {
                "held_out": self.split["held_out"],
                "before": self.before.to_dict(),
                "after": self.after.to_dict() if self.after else None,
                "deploy_level": self.deploy_level,
                "after_deployed": self.after_deployed.to_dict() if self.after_deployed else None,
            },
            "split": self.split,
            "calibration": self.calibration,
            "search": {
                "quantizations": self.quantizations,
                "splices": self.splices,
                "calibrations": self.calibrations,
                "estimates": self.estimates,
                "evaluations": self.evaluations,
                "deployed_checks": self.deployed_checks,
                "ranking_passes": self.ranking_passes,
                "seconds": round(self.seconds, 3),
                "candidates": len(self.candidates),
                "trajectory": [s.to_dict() for s in self.trajectory],
                "budget": self.budget,
            }
            | ({"cluster": self.cluster} if self.cluster else {}),
            "preparation": list(self.steps),
            "warnings": list(self.warnings),
            "candidates": [c.to_dict() for c in self.candidates],
            "alternatives": self.alternatives,
            "latency": self.latency,
            "model": self.model,
            "snippet": self.snippet,
        }


def default_op_types(recipe: Recipe) -> list[str]:
    """The op types onnxruntime quantizes for this recipe when ``op_types_to_quantize`` is unset.

    Dynamic: ``IntegerOpsRegistry``; static: ``QLinearOpsRegistry`` plus ``QDQRegistry`` (what
    ``quantize_static`` does with ``op_types_to_quantize=None``); weight-only: ``MatMul``
    (``MatMulNBitsQuantizer``'s default; Gather only when asked for).

    Example:
        >>> "MatMul" in default_op_types(Recipe(mode="dynamic"))  # doctest: +SKIP
        True
    """
    if recipe.op_types_to_quantize:
        return list(recipe.op_types_to_quantize)
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    if _name(recipe.mode) == "dynamic":
        return sorted(IntegerOpsRegistry)
    if _name(recipe.mode) == "weight_only":
        return ["MatMul"]
    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


def _name(v: Any) -> Any:
    """Enum member -> its name; strings and other values unchanged."""
    return getattr(v, "name", v)


# ---------------------------------------------------------------- the trials


class TrialRunner(Protocol):
    """Where an exclusion search's real trials run, when not in this process.

    :func:`derive_exclusions` calls :meth:`check` before any work, :meth:`start` once the
    baseline and the ranking are done (they stay local: everything else depends on them), and
    :meth:`close` at the end; :meth:`info` is what the report says about where the trials ran.
    ``diag.fix.cluster.ClusterTrialRunner`` runs them as Dask tasks; :class:`LocalTrials` is the
    default (the search quantizes and evaluates itself).
    """

    def check(self) -> None: ...

    def start(self, search: _Search) -> None: ...

    def close(self) -> None: ...

    def info(self, latency: bool) -> dict[str, Any]: ...


class LocalTrials:
    """The default :class:`TrialRunner`: every trial is quantized and evaluated in this process."""

    def check(self) -> None:
        """Nothing to check: this process can always run a trial."""

    def start(self, search: _Search) -> None:
        """Nothing to attach: :meth:`_Search.try_groups` runs the trial itself."""

    def close(self) -> None:
        """Nothing to release."""

    def info(self, latency: bool) -> dict[str, Any]:
        return {}


class _Search(SearchAlgorithm):
    """Quantize-and-evaluate with a cache keyed by the set of excluded groups."""

    def __init__(self, setup: SearchSetup, recipe: Recipe, work: Path, options: SearchOptions) -> None:
        self.fp32 = setup.fp32
        self.recipe = recipe
        self.base = list(recipe.nodes_to_exclude or [])
        self.candidates: list[Candidate] = []
        self.evaluator = setup.evaluator
        self.deploy_evaluator = setup.deployed
        #: Deploy-level metrics of the trials that met the target in exact mode.
        self.deployed: dict[frozenset[int], HeldOutMetrics] = {}
        #: Sessions run at the deploy level (not in ``evaluations``: those are the exact-mode ones).
        self.deployed_checks = 0
        self.target = setup.target
        self.calibration = setup.calibration
        self.work = work
        self.progress = options.progress
        self.cache: dict[frozenset[int], tuple[HeldOutMetrics, Path]] = {}
        self.trajectory: list[Step] = []
        self.quantizations = 0
        self.evaluations = 0
        self.calibrations = 0
        # NOTE: the FP32 model's activation ranges do not depend on which nodes are excluded:
        # the first static quantization calibrates and writes them here, every later one reads them
        # (onnxruntime's calibration_cache_path). One calibration pass instead of one per trial.
        self.calibration_cache = work / "calibration.json"
        #: The preparation steps of the last quantization (lift, opset upgrade, pre-processing).
        self.steps: list[str] = []
        self.max_trials = options.max_trials
        self.deadline = setup.deadline
        #: The met list with the fewest groups seen so far: the answer when the budget runs out.
        self.best: frozenset[int] | None = None
        self.bar: Any = Progress(options.max_trials, "exclude", enabled=options.progress, unit="trials")
        #: What estimates are built from; None when estimates are off.
        self.region: EstimateSource | None = None
        self.estimates: dict[frozenset[int], HeldOutMetrics | None] = {}
        #: Estimated lists that met in exact mode and at the deploy level.
        self.estimates_met: dict[frozenset[int], bool] = {}
        #: While True, :meth:`check` answers with estimates (no re-quantization) where it can.
        self.estimating = False
        self.estimate_bar = Progress(None, "exclude: estimates", enabled=False, unit="estimates")
        #: ``--scheduler``: runs a trial elsewhere instead (set by a :class:`TrialRunner`'s ``start``).
        self.remote: Callable[[frozenset[int], Path], HeldOutMetrics] | None = None
        #: Surgical searches: the user's INT8 model, the baseline every trial is spliced into.
        self.user_int8: Path | None = Path(options.int8) if options.surgical and options.int8 else None
        #: What the splices are built from (set by the ranking pass, which pairs the two models).
        self.surgery: EstimateSource | None = None
        self.splices = 0
        #: The user's model is AIMET's export: a float region is its encodings taken out of the file,
        #: and ``user_int8`` the QDQ model the user's encodings describe (:meth:`use_export`).
        self.export: AimetExport | None = None

    def use_export(self, export: AimetExport | None) -> None:
        """Fix AIMET's export in its encodings: the baseline is the model the user's file describes."""
        if export is None:
            return
        self.export = export
        self.user_int8 = save_spliced(export.build().model, self.work / export.model.name, None)

    def export_nodes(self, fp_nodes: list[str]) -> list[str]:
        """The export's nodes that compute FP32 nodes ``fp_nodes`` (AIMET's graph is the FP32 graph)."""
        assert self.export is not None and self.surgery is not None
        wanted = set(fp_nodes)
        for g in self.surgery.matching.groups:
            if wanted & set(g.fp_nodes):
                wanted.update(g.int8_nodes)
        return [n.name for n in self.export.proto.graph.node if n.name in wanted]

    @property
    def trials_made(self) -> int:
        """The models built and measured, the baseline included (what ``--max-trials`` caps): quantizations,
        or, in a surgical search, splices plus the user's own model."""
        return self.quantizations + self.splices + (1 if self.user_int8 is not None else 0)

    def expect(self, remaining: int) -> None:
        """Set the progress bar's total to the trials done plus an estimate of those left (for its ETA)."""
        total = self.trials_made + max(remaining, 0)
        self.bar.total = min(total, self.max_trials) if self.max_trials else total

    def out_of_budget(self) -> str | None:
        """Why no further trial may run (``--max-trials`` / ``--time-budget``), or None."""
        if self.max_trials is not None and self.trials_made >= self.max_trials:
            return f"--max-trials {self.max_trials} reached"
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return "--time-budget reached"
        return None

    def nodes(self, groups: frozenset[int] | list[int]) -> list[str]:
        return list(dict.fromkeys([*self.base, *self.picked(groups)]))

    def picked(self, groups: frozenset[int] | list[int]) -> list[str]:
        """The FP32 nodes of ``groups`` (without the recipe's own exclusions)."""
        return list(dict.fromkeys(n for i in sorted(groups) for n in self.candidates[i].fp_nodes))

    def splice(self, fp_nodes: list[str]) -> onnx.ModelProto:
        """The user's INT8 model with ``fp_nodes`` in float (:func:`diag.core.surgery.spliced_model`).

        Not counted here: ``splices`` counts measured trials, and a splice is also built to prove
        candidates (:func:`_drop_unspliceable`) and to write the answer (:meth:`model_path`).
        """
        src = self.surgery
        assert src is not None, "the ranking pass pairs the models before any splice"
        if self.export is not None:  # AIMET: the model the edited encodings describe
            return self.export.build(self.export.without(self.export_nodes(fp_nodes))).model
        return spliced_model(src.fp, src.q, fp_nodes, src.matching, src.fp_dir)

    def model_path(self, groups: frozenset[int]) -> Path:
        """The trial's model on disk. A spliced trial is built again and written only when needed
        (the answer, its latency): holding every met splice in memory would cost a model each."""
        path = self.cache[groups][1]
        if self.user_int8 is not None and groups and not path.exists():
            assert self.surgery is not None
            save_spliced(self.splice(self.picked(groups)), path, self.surgery.q_dir)
        return path

    def quantize(self, nodes: list[str], out: Path, recipe: Recipe | None = None) -> Path:
        r = (recipe or self.recipe).with_excluded(nodes)
        report = quantize_model(
            self.fp32, r, out, calibration=self.calibration, progress=False, calibration_cache=self.calibration_cache
        )
        self.quantizations += 1
        self.calibrations += report.calibrations
        self.steps = report.steps
        return out

    def evaluate(self, path: Path) -> HeldOutMetrics:
        m = self.evaluator.evaluate(path)
        self.evaluations += 1
        return m

    def judge(
        self, m: HeldOutMetrics, path: Path, model: onnx.ModelProto | None = None
    ) -> tuple[bool, HeldOutMetrics | None]:
        """Met = met in exact mode *and* at the deploy level (issue 25 item 9); the deploy-level metrics.

        Only lists that meet in exact mode are run a second time, so the check costs one session
        per met trial (a handful per search), not one per trial. ``model``: a spliced trial, in memory.
        """
        if not m.meets(self.target):
            return False, None
        if self.deploy_evaluator is None:
            return True, None
        if model is not None:
            assert self.surgery is not None
            d = self.deploy_evaluator.evaluate_model(model, path.name, self.surgery.q_dir)
        elif path.exists():
            d = self.deploy_evaluator.evaluate(path)
        else:
            return True, None
        self.deployed_checks += 1
        return d.meets(self.target), d

    def met(self, groups: frozenset[int]) -> bool:
        """Did the real trial of ``groups`` meet the target (both levels)."""
        m = self.cache[groups][0]
        return m.meets(self.target) and (groups not in self.deployed or self.deployed[groups].meets(self.target))

    def try_groups(self, groups: frozenset[int], phase: str) -> tuple[HeldOutMetrics, bool]:
        """Quantize with ``groups`` kept in float (cached), evaluate, record one trajectory step."""
        if groups in self.cache:
            return self.cache[groups][0], self.met(groups)
        reason = self.out_of_budget() if groups else None  # the baseline always runs
        if reason:
            raise BudgetExhausted(reason)
        t0 = time.perf_counter()
        path = self.work / f"step{len(self.trajectory):03d}.onnx"
        model: onnx.ModelProto | None = None
        if self.user_int8 is not None and not groups:
            path = self.user_int8  # the baseline is the user's model itself, read as it is
            m = self.evaluate(path)
        elif self.user_int8 is not None:
            model = self.splice(self.picked(groups))
            self.splices += 1
            assert self.surgery is not None
            m = self.evaluator.evaluate_model(model, path.name, self.surgery.q_dir)
            self.evaluations += 1
        elif self.remote is not None:
            m = self.remote(groups, path)
        else:
            self.quantize(self.nodes(groups), path)
            m = self.evaluate(path)
        self.cache[groups] = (m, path)
        value = m.value(self.target.metric)
        met, deployed = self.judge(m, path, model)
        if deployed is not None:
            self.deployed[groups] = deployed

        if met and groups and (self.best is None or len(groups) < len(self.best)):
            self.best = groups
        self.bar.advance(1)
        if not met and groups and self.user_int8 is None:
            # NOTE: only the baseline (ranking, latency) and met lists (the answer is one of them)
            # are ever read again; dropping the rest keeps disk use at a few model copies.
            path.unlink(missing_ok=True)
        self.trajectory.append(
            Step(
                phase,
                len(groups),
                self.nodes(groups)[len(self.base) :],
                value,
                met,
                time.perf_counter() - t0,
                m.nonfinite_samples,
                None if deployed is None else deployed.value(self.target.metric),
            )
        )
        if self.progress:
            shown = "n/a" if value is None else f"{value:.6g}"
            at = (
                "" if deployed is None else f", {deployed.value(self.target.metric):.6g} at level {self.deploy_level()}"
            )
            self.bar.note(
                f"exclude: {phase:<8} {len(groups):>4} group(s) in float -> {self.target.metric} {shown}{at}"
                f"{_nonfinite_note(m)} ({'met' if met else 'missed'})"
            )
        return m, met

    def deploy_level(self) -> str:
        return self.deploy_evaluator.opt_level if self.deploy_evaluator is not None else "disabled"

    def estimate(self, groups: frozenset[int], phase: str) -> HeldOutMetrics | None:
        """Held-out metrics of ``groups`` in float *estimated* without re-quantizing (cached).

        The baseline INT8 model with those groups' FP32 nodes computed in float where their INT8
        versions were (:func:`diag.core.surgery.float_region_model`, which mirrors what
        ``nodes_to_exclude`` does: the same calibrated grids around the float region). One
        session instead of a quantization; None when the region cannot be rebuilt.
        """
        if groups in self.estimates:
            return self.estimates[groups]
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            raise BudgetExhausted("--time-budget reached")
        assert self.region is not None
        src = self.region
        t0 = time.perf_counter()
        picked = [n for i in sorted(groups) for n in self.candidates[i].fp_nodes]
        try:
            op_types = set(default_op_types(self.recipe))
            model = float_region_model(src.fp, src.q, picked, src.matching, op_types, src.fp_dir)
            name = f"estimate of {len(groups)} group(s) in float"
            m = self.evaluator.evaluate_model(model, name, src.q_dir)
            deployed = None
            if m.meets(self.target) and self.deploy_evaluator is not None:
                # The float-region model at the deploy level: onnxruntime fuses its Q/DQ pairs as it
                # would the re-quantized model's, so estimates also see a fusion that undoes a fix.
                deployed = self.deploy_evaluator.evaluate_model(model, name, src.q_dir)
        except (ValueError, DiagError):
            # NOTE: a region diag cannot rebuild, or one onnxruntime refuses to run, is not the
            # user's problem: that trial is re-quantized instead.
            self.estimates[groups] = None
            return None
        self.estimates[groups] = m
        self.estimates_met[groups] = m.meets(self.target) and (deployed is None or deployed.meets(self.target))
        self.estimate_bar.advance(1)
        self.trajectory.append(
            Step(
                f"estimate {phase}",
                len(groups),
                self.nodes(groups)[len(self.base) :],
                m.value(self.target.metric),
                self.estimates_met[groups],
                time.perf_counter() - t0,
                m.nonfinite_samples,
                None if deployed is None else deployed.value(self.target.metric),
            )
        )
        return m

    def check(self, groups: frozenset[int], phase: str) -> bool:
        """Does ``groups`` in float meet the target: estimated while :attr:`estimating`, else a real trial."""
        if self.estimating and groups not in self.cache:  # a real answer is better than an estimate
            m = self.estimate(groups, phase)
            if m is not None:
                return self.estimates_met[groups]
        return self.try_groups(groups, phase)[1]

    def find(self) -> frozenset[int] | None:
        """The smallest met list: estimated first, then verified and pruned by real re-quantization.

        Estimates run the whole search (prefix, then prune) at the cost of one session each; the
        real trials that follow are :meth:`SearchAlgorithm.search_real`'s.
        """
        if self.region is not None:
            self.estimating = True
            self.estimate_bar = Progress(None, "exclude: estimates", enabled=self.progress, unit="estimates")
            order = list(range(len(self.candidates)))
            try:
                k = self.smallest_prefix(order)
                guess = self.prune(frozenset(order[:k])) if k is not None else None
            finally:
                self.estimating = False
                self.estimate_bar.close()
            if self.progress:
                self.bar.note(
                    f"exclude: {len(self.estimates)} estimate(s) without re-quantizing -> "
                    + (f"{len(guess)} group(s) in float; verifying" if guess else "no list; searching")
                )
            self.guess = guess
        return self.search_real()


def splice_to_file(
    fp32_path: str | Path,
    int8_path: str | Path,
    fp_nodes: list[str],
    out_path: str | Path,
    bits: dict[str, int] | None = None,
) -> Path:
    """Write the user's INT8 model with ``fp_nodes`` kept in float: the fix ``diag exclude --int8`` verified.

    The same splice the search measured (:func:`diag.core.surgery.spliced_model`): every other
    node and initializer of ``int8_path`` is kept as it is, so the file is the user's model with
    float regions, deployable as is, whatever quantizer made it. reproduce.py calls this.
    ``bits``: weight-only nodes re-blocked at that width from their FP32 weight instead (a tier
    plan of ``diag exclude --tiers --int8``).

    Example:
        >>> splice_to_file("m.fp32.onnx", "m.int8.onnx", ["layer1/ffn/fc1/MatMul"], "m.mixed.onnx")  # doctest: +SKIP
        PosixPath('m.mixed.onnx')
    """
    fp, q = load_pair(fp32_path, int8_path)
    fp_dir, q_dir = region_dirs(fp, q)
    try:
        matching = match_models(fp.proto, q.proto)
        model = spliced_model(fp.proto, q.proto, list(fp_nodes), matching, fp_dir, bits, external_dir=q_dir)
    except ValueError as e:
        raise DiagError(
            "bad-option",
            f"nodes {[*fp_nodes, *(bits or {})]}",
            f"cannot be kept in float inside '{q.path.name}': {e}",
            "pass FP32 node names of quantized nodes (exclusion.json's nodes_to_exclude)",
        ) from e
    return save_spliced(model, Path(out_path), q_dir)


def search_target(
    target: str | Target, metric: str | None, labels: str | None, max_trials: int | None, time_budget: float | None
) -> Target:
    """The parsed ``--target`` of a search, after checking the options it depends on (exclude, tiers).

    A plugin's declared names are targets too (``--metric``); label-based targets need ``--labels``;
    the budget caps must be positive. Every problem is a ``bad-option`` before any work.
    """
    if max_trials is not None and max_trials < 1:
        raise DiagError("bad-option", f"--max-trials {max_trials}", "must be at least 1", "e.g. --max-trials 50")
    if time_budget is not None and not time_budget > 0:
        raise DiagError("bad-option", f"--time-budget {time_budget}", "must be positive", "e.g. --time-budget 600")
    plugin = None
    if metric:
        plugin = dict(metric_factory(metric)().better)
    tgt = parse_target(target, plugin) if isinstance(target, str) else target
    if tgt.metric in labelled_names() and not labels:
        raise DiagError("bad-option", f"--target {tgt}", "needs --labels", "pass --labels labels.npy")
    return tgt


@dataclass(frozen=True)
class SearchSetup:
    """What a held-out search starts from: the FP32 model, the split, the evaluator, the target.

    Built once by :func:`prepare_search` for `diag exclude` and `diag exclude --tiers` alike.
    """

    fp32: Path
    fp: LoadedModel
    target: Target
    split: Split
    labels: np.ndarray | None
    #: Static recipes without calibration data of their own calibrate on the ranking split.
    calibration: FeedSource | None
    calibration_note: str | None
    evaluator: HeldOutEvaluator
    #: The same held-out samples run at the deploy level (None: ``deploy_level="disabled"``).
    deployed: HeldOutEvaluator | None
    deploy_level: str
    #: ``time.perf_counter()`` when the search started, and the ``--time-budget`` deadline.
    start: float
    deadline: float | None


def prepare_search(
    fp32_path: str | Path, recipe: Recipe, feeds: FeedSource | FeedSpec, target: Target, options: SearchOptions
) -> SearchSetup:
    """Load the FP32 model, split the samples, and build the held-out evaluator (FP32 outputs cached).

    Example:
        >>> setup = prepare_search("fp32.onnx", recipe, FeedSpec(inputs="d.npz"), tgt, options)  # doctest: +SKIP
        >>> setup.split.to_dict()["held_out"]  # doctest: +SKIP
        'samples 16..31'
    """
    start = time.perf_counter()
    if recipe.algorithm == "GPTQ":
        raise DiagError(
            "bad-recipe",
            "--recipe with algorithm GPTQ",
            "onnxruntime's GPTQ quantizes every MatMul at 4 bits whatever nodes_to_exclude says, so no exclusion "
            "or tier plan can be built on it",
            'search with "algorithm": "RTN", "k_quant" or "HQQ", then compare GPTQ in diag sweep',
        )
    fp32 = Path(fp32_path)
    fp = float_model_from_path(fp32)
    label_array = load_labels(options.labels) if options.labels else None
    source = feeds.source(fp.proto) if isinstance(feeds, FeedSpec) else feeds
    split = split_feeds(source, options.holdout)
    calibration: FeedSource | None = None
    calib_note: str | None = None
    if _name(recipe.mode) == "static":
        if getattr(recipe, "calibration", None):
            calib_note = f"recipe calibration {recipe.calibration}"
        else:
            calibration = split.ranking
            calib_note = f"ranking split ({split.to_dict()['ranking']})"
    return SearchSetup(
        fp32=fp32,
        fp=fp,
        target=target,
        split=split,
        labels=label_array,
        calibration=calibration,
        calibration_note=calib_note,
        evaluator=HeldOutEvaluator(
            fp, split.held_out, split.held_out_first, label_array, options.threads, options.metric
        ),
        deployed=None
        if options.deploy_level == "disabled"
        else HeldOutEvaluator(
            fp,
            split.held_out,
            split.held_out_first,
            label_array,
            options.threads,
            options.metric,
            opt_level=options.deploy_level,
        ),
        deploy_level=options.deploy_level,
        start=start,
        deadline=start + options.time_budget if options.time_budget is not None else None,
    )


def _check_labels(setup: SearchSetup) -> None:
    """One label per sample of the inputs, before any trial runs."""
    split, labels = setup.split, setup.labels
    if labels is not None and len(labels) < split.held_out_first + split.held_out_samples:
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"has {len(labels)} labels but the inputs have {split.held_out_first + split.held_out_samples}",
            "give one label per sample",
        )


def _check_measurable(before: HeldOutMetrics, tgt: Target) -> None:
    if before.value(tgt.metric) is None:
        raise DiagError(
            "bad-option",
            f"--target {tgt}",
            "cannot be measured on this model: no output is class-like ([..., classes] scores)",
            "use a cosine or max_abs target",
        )


@dataclass
class _Outcome:
    """What the search found, before it becomes an :class:`ExclusionResult`."""

    before: HeldOutMetrics
    met0: bool
    baseline: Path
    chosen: frozenset[int] | None = None
    candidates: list[Candidate] = field(default_factory=list)
    compared: CompareResult | None = None
    exhausted: str | None = None
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    model: Path | None = None


def derive_exclusions(
    fp32_path: str | Path,
    recipe: Recipe,
    feeds: FeedSource | FeedSpec,
    options: ExcludeOptions,
    work_dir: str | Path | None = None,
    trials: TrialRunner | None = None,
) -> ExclusionResult:
    """Find a minimal ``nodes_to_exclude`` list that makes ``recipe`` meet ``options.target`` on held-out inputs.

    Args:
        fp32_path: the FP32 model.
        recipe: a :class:`diag.core.recipe.Recipe` (its own ``nodes_to_exclude`` stay excluded).
        feeds: all samples; the first ``1 - holdout`` rank the nodes (and calibrate a static recipe
            without calibration data), the rest are held out for every verdict.
        options: target, split, budget and the rest (:class:`ExcludeOptions`).
        work_dir: where the final mixed model is kept (a temp folder is used for the trials).
        trials: where the real trials run (default :class:`LocalTrials`, this process); with
            ``options.scheduler`` the verb passes ``diag.fix.cluster.ClusterTrialRunner``: same list,
            same metrics, same trajectory as without.

    Returns:
        The result; ``reachable`` False (and an empty list) when only keeping every candidate in
        float meets the target. Never a fake success.

    Example:
        >>> from diag.core.recipe import Recipe
        >>> r = derive_exclusions("fp32.onnx", Recipe(mode="dynamic"), FeedSpec(inputs="d.npz"),
        ...                       ExcludeOptions("cosine>=0.999"))  # doctest: +SKIP
        >>> r.nodes_to_exclude  # doctest: +SKIP
        ['layer1/ffn/fc1/MatMul']
    """
    o = options
    tgt = search_target(o.target, o.metric, o.labels, o.max_trials, o.time_budget)
    if o.scheduler is not None and trials is None:
        raise ValueError("options.scheduler needs trials=diag.fix.cluster.ClusterTrialRunner(...)")
    runner: TrialRunner = trials if trials is not None else LocalTrials()
    runner.check()  # no Dask, no scheduler: say so before any work
    setup = prepare_search(fp32_path, recipe, feeds, tgt, o)
    _check_labels(setup)
    tmp = Path(tempfile.mkdtemp(prefix="diag-exclude-"))
    started = False
    try:
        search = _Search(setup, recipe, tmp, o)
        if o.surgical:
            search.use_export(aimet_export_at(str(o.int8), o.encodings))
        before, met0 = search.try_groups(frozenset(), "baseline")
        _check_measurable(before, tgt)
        outcome = _Outcome(before, met0, search.cache[frozenset()][1], chosen=frozenset() if met0 else None)
        if not met0:
            _rank(setup, search, outcome, o)
            runner.start(search)
            started = True
            _find(search, outcome)
        search.bar.finish()
        _finish(setup, search, outcome, o, work_dir)
    finally:
        if started:
            runner.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result = _exclusion_result(setup, recipe, search, outcome, o)
    result.cluster = runner.info(o.bench_runs > 0) if started else {}
    return result


def _rank(setup: SearchSetup, search: _Search, outcome: _Outcome, options: ExcludeOptions) -> None:
    """The ranking pass: compare the baseline INT8 model with FP32 on the ranking split."""
    export = search.export  # AIMET: diagnosed as compare diagnoses it, from the user's files
    outcome.compared = compare_models(
        setup.fp32,
        outcome.baseline if export is None else export.model,
        setup.split.ranking,
        CompareOptions(
            progress=False,
            threads=options.threads,
            max_memory=options.max_memory,
            encodings=None if export is None else str(export.encodings),
        ),
    )
    outcome.candidates = ranked_candidates(outcome.compared.findings, set(search.base))
    search.candidates = outcome.candidates
    if search.user_int8 is not None:
        # Surgical: a trial is already one session on a spliced model, so estimates add nothing.
        search.surgery = _estimate_source(outcome.compared)
        outcome.warnings += _drop_unspliceable(search)
        outcome.candidates = search.candidates
    elif options.estimates:
        search.region = _estimate_source(outcome.compared)


def _drop_unspliceable(search: _Search) -> list[str]:
    """Candidates whose float region cannot be built inside the user's model leave the search, said once.

    One splice of every candidate at once proves them all in the usual case; only when it fails is
    each tried alone (a subgraph, a tensor with no INT8 pair).
    """
    everything = list(range(len(search.candidates)))
    try:
        search.splice(search.picked(everything))
        return []
    except ValueError:
        pass
    keep, dropped = [], []
    for i in everything:
        try:
            search.splice(search.picked([i]))
            keep.append(i)
        except ValueError as e:
            dropped.append(f"{search.candidates[i].label} ({e})")
    search.candidates = [search.candidates[i] for i in keep]
    if not dropped:
        return []
    return [
        f"{count_phrase(len(dropped), 'quantized group')} cannot be kept in float inside your INT8 model and "
        f"stay quantized in every trial: {'; '.join(dropped[:5])}" + (" ..." if len(dropped) > 5 else "")
    ]


def _find(search: _Search, outcome: _Outcome) -> None:
    try:
        outcome.chosen = search.find()
    except BudgetExhausted as e:
        outcome.exhausted = str(e)
        outcome.chosen = search.best  # verified on the held-out samples, not proven minimal


def _finish(
    setup: SearchSetup, search: _Search, outcome: _Outcome, options: ExcludeOptions, work_dir: str | Path | None
) -> None:
    """After the search: op-type suggestions, the deployed-mode check, the kept model, latency."""
    chosen = outcome.chosen
    unmeasured: list[str] = []
    if chosen and not outcome.exhausted:
        outcome.suggestions = _op_type_suggestions(search, setup.fp, outcome.candidates, chosen, unmeasured)
    if chosen is None:
        outcome.warnings += _deployed_misses(setup, search)
    outcome.warnings += unmeasured
    if chosen is not None and work_dir is not None:
        outcome.model = Path(work_dir) / "mixed.onnx"
        copy_model(search.model_path(chosen), outcome.model)
    if options.bench_runs > 0:
        paths: list[str | Path] = [setup.fp32, outcome.baseline]
        if chosen:
            paths.append(search.model_path(chosen))
        bench = BenchOptions(runs=options.bench_runs, warmup=3, threads=options.threads, progress=False)
        stats = bench_models(paths, setup.split.held_out, bench)
        names = ["fp32", "int8", "mixed"]
        outcome.latency = [{**s.to_dict(), "model": names[i]} for i, s in enumerate(stats)]


def _deployed_misses(setup: SearchSetup, search: _Search) -> list[str]:
    """When no list met: the lists that met in exact mode but missed at the deploy level, said plainly.

    NOTE: the search compares in exact mode (optimizations off); onnxruntime's optimizer then
    fuses the remaining Q/DQ pairs into integer kernels, which can undo a fix (the convnet
    fixture, QDQ: excluding conv2 takes the logits error from 0.12 to 0.002 in exact mode, to
    0.147 with optimizations). Such a list is a miss (issue 25 item 9), and the user must know
    the exact-mode figure was there, or they would take the search for broken.
    """
    tgt = setup.target
    misses = [(g, d) for g, d in search.deployed.items() if not d.meets(tgt)]
    if not misses:
        return []
    groups, d = min(misses, key=lambda x: len(x[0]))
    exact = search.cache[groups][0]
    return [
        f"{count_phrase(len(misses), 'list')} met the target in exact mode but missed it as onnxruntime runs "
        f"{'it' if len(misses) == 1 else 'them'} at level {setup.deploy_level} (the smallest, {len(groups)} "
        f"group(s) in float: {tgt.metric} {_fmt(exact.value(tgt.metric), tgt)} exact, "
        f"{_fmt(d.value(tgt.metric), tgt)} deployed): the fused integer kernels re-quantize what the "
        "exclusion kept in float; --deploy-level disabled if you deploy without optimizations"
    ]


def _exclusion_result(
    setup: SearchSetup, recipe: Recipe, search: _Search, outcome: _Outcome, options: ExcludeOptions
) -> ExclusionResult:
    chosen, candidates, exhausted = outcome.chosen, outcome.candidates, outcome.exhausted
    # NOTE: a list that keeps (almost) every quantized group in float is the FP32 model, not a fix:
    # NOT REACHABLE unless the target is met with the model still quantized (issue 41 item 5).
    all_but_float = bool(chosen) and _nearly_all(len(chosen or ()), len(candidates))
    if all_but_float:
        outcome.warnings.append(
            f"only a list keeping {len(chosen or ())} of {len(candidates)} quantized node groups in float met the "
            "target: that is the FP32 model, not a fix"
        )
        chosen = None
        outcome.model = None
    nodes = search.nodes(chosen) if chosen is not None else []
    final_recipe = recipe.with_excluded(nodes) if chosen is not None else recipe
    producer = _producer(search.user_int8, nodes, search.export) if search.user_int8 is not None else {}
    tool = (producer.get("key", "onnxruntime"), default_opset(setup.fp.proto, 13))
    result = ExclusionResult(
        fp32=str(setup.fp32),
        target=setup.target,
        reachable=chosen is not None,
        already_met=outcome.met0,
        nodes_to_exclude=nodes,
        excluded=[candidates[i] for i in sorted(chosen)] if chosen else [],
        candidates=candidates,
        recipe=_recipe_dict(final_recipe),
        op_types_to_quantize=list(recipe.op_types_to_quantize) if recipe.op_types_to_quantize else None,
        op_type_suggestions=outcome.suggestions,
        before=outcome.before,
        after=search.cache[chosen][0] if chosen is not None else None,
        deploy_level=setup.deploy_level,
        after_deployed=search.deployed.get(chosen) if chosen is not None else None,
        deployed_checks=search.deployed_checks,
        trajectory=search.trajectory,
        quantizations=search.quantizations,
        calibrations=search.calibrations,
        steps=search.steps,
        budget=_budget(options, exhausted),
        warnings=outcome.warnings + _slower_warning(outcome.latency),
        evaluations=search.evaluations,
        estimates=sum(1 for m in search.estimates.values() if m is not None),
        ranking_passes=1 if outcome.compared is not None else 0,
        seconds=time.perf_counter() - setup.start,
        split=setup.split.to_dict(),
        calibration=setup.calibration_note,
        alternatives=[] if chosen is not None else alternatives(recipe, candidates, *tool),
        latency=outcome.latency,
        model=str(outcome.model) if outcome.model else None,
        method="encodings"
        if search.export is not None
        else "surgical"
        if search.user_int8 is not None
        else "requantized",
        producer=producer,
        int8=str(options.int8) if search.user_int8 is not None else None,
        encodings=_edited_encodings(search, nodes) if search.export is not None and chosen is not None else None,
        splices=search.splices,
        quantized_groups=len(candidates),
        all_but_float=all_but_float,
    )
    result.diagnosis = outcome.compared
    return result


def _producer(int8: Path, nodes: list[str], export: AimetExport | None = None) -> dict[str, Any]:
    """Who made the user's model, by the marks it carries, and the fix in that tool's own call."""
    if export is not None:  # diag built the model it measured; the user's files are AIMET's
        aimet = PRODUCERS["aimet"]
        return {
            "key": "aimet",
            "name": aimet.name,
            "evidence": f"an FP32 export with AIMET encodings ({export.encodings.name})",
            "fix_call": fix_call(aimet, nodes) if nodes else "",
        }
    detection = detect_producer(onnx.load(str(int8), load_external_data=False), int8)
    mark = detection.decided_by
    return {
        "key": detection.key,
        "name": detection.producer.name,
        "evidence": f"{mark.mark.means} ({mark.found})" if mark is not None else (detection.note or ""),
        "fix_call": fix_call(detection.producer, nodes) if nodes else "",
    }


def _edited_encodings(search: _Search, nodes: list[str]) -> EditedEncodings:
    """The fix of an AIMET export: its encodings without those the float nodes' quantizers own."""
    export = search.export
    assert export is not None
    region = search.export_nodes(nodes)
    return EditedEncodings(str(export.encodings), export.owned(region), export.without(region))


def _nearly_all(in_float: int, quantized: int) -> bool:
    """Does keeping ``in_float`` of ``quantized`` groups in float leave (almost) nothing quantized?
    (:func:`diag.analysis.levers.nearly_all`: the same rule names recipe-lever causes.)

    Example:
        >>> _nearly_all(206, 207), _nearly_all(7, 207), _nearly_all(2, 2), _nearly_all(1, 2)
        (True, False, True, False)
    """
    return nearly_all(in_float, quantized)


def _budget(options: SearchOptions, exhausted: str | None) -> dict[str, Any]:
    """``{"max_trials": N, "time_budget": S, "exhausted": bool, "reason": str}`` of exclusion.json."""
    budget: dict[str, Any] = {
        "max_trials": options.max_trials,
        "time_budget": options.time_budget,
        "exhausted": exhausted is not None,
    }
    return budget | ({"reason": exhausted} if exhausted else {})


class EstimateSource(NamedTuple):
    """What :meth:`_Search.estimate` edits: the FP32 and baseline INT8 protos and their matching,
    as the ranking comparison of the baseline loaded and matched them, and where external data is
    read from (:func:`diag.core.surgery.region_dirs`). The protos hold no external weights: an estimate
    copies the graph and reads at most its float region's FP32 weights."""

    fp: onnx.ModelProto
    q: onnx.ModelProto
    matching: Matching
    fp_dir: Path | None
    q_dir: Path | None


def _estimate_source(compared: CompareResult) -> EstimateSource:
    """The :class:`EstimateSource` of the ranking comparison."""
    fp_dir, region_dir = region_dirs(compared.fp32, compared.int8)
    return EstimateSource(compared.fp32.proto, compared.int8.proto, compared.matching, fp_dir, region_dir)


def _slower_warning(latency: list[dict[str, Any]]) -> list[str]:
    """A warning when the verified mixed model runs slower than FP32 (measured, never assumed)."""
    by = {x["model"]: x for x in latency}
    fp, mixed = by.get("fp32"), by.get("mixed")
    if not fp or not mixed or mixed["p50_ms"] <= fp["p50_ms"]:
        return []
    return [
        f"warning: the mixed model is slower than FP32 (p50 {mixed['p50_ms']:.2f} ms vs {fp['p50_ms']:.2f} ms): "
        "the float islands add Quantize/Dequantize pairs at every boundary; keeping the model in FP32 may be "
        "the better deployment"
    ]


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _recipe_dict(recipe: Recipe) -> dict[str, Any]:
    d = recipe.to_dict()
    return json.loads(json.dumps(d, default=_name))


def _op_type_suggestions(
    search: _Search, fp: Any, candidates: list[Candidate], chosen: frozenset[int], unmeasured: list[str]
) -> list[dict[str, Any]]:
    """Op types most of whose candidate nodes ended up excluded, as an ``op_types_to_quantize`` complement.

    Each suggestion is verified: re-quantized with that ``op_types_to_quantize`` (plus the
    remaining node exclusions of other types) and evaluated on the held-out split. One that
    onnxruntime fails to quantize is left out, with why appended to ``unmeasured``.
    """
    present = {n.op_type for n in fp.graph.node}
    out = []
    for op in sorted({c.op_type for c in candidates}):
        total = [i for i, c in enumerate(candidates) if c.op_type == op]
        picked = [i for i in total if i in chosen]
        if len(picked) < 2 or len(picked) / len(total) <= OP_TYPE_SHARE:
            continue
        if search.out_of_budget():
            break
        keep = sorted((set(default_op_types(search.recipe)) & present) - {op})
        if not keep:
            continue  # op_types_to_quantize=[] means "the default types" to onnxruntime, not "none"
        rest = frozenset(i for i in chosen if candidates[i].op_type != op)
        recipe = dataclasses.replace(search.recipe, op_types_to_quantize=keep)
        t0 = time.perf_counter()
        path = search.work / f"optype-{op}.onnx"
        if search.user_int8 is not None:
            # Surgical: every candidate group of this op type in float, inside the user's model.
            model = search.splice(search.picked(rest | frozenset(total)))
            search.splices += 1
            assert search.surgery is not None
            m = search.evaluator.evaluate_model(model, path.name, search.surgery.q_dir)
            search.evaluations += 1
            met, deployed = search.judge(m, path, model)
        else:
            try:
                search.quantize(search.nodes(rest), path, recipe)
            except DiagError as e:
                # NOTE: an op-type suggestion is an extra; onnxruntime failing on it (its quantizer
                # raising the opset under a graph that does not convert) drops the suggestion only.
                unmeasured.append(f"note: op_types_to_quantize without {op} was not measured: {e.problem}")
                continue
            m = search.evaluate(path)
            met, deployed = search.judge(m, path)
            path.unlink(missing_ok=True)
        value = m.value(search.target.metric)
        search.trajectory.append(
            Step(
                f"op-type {op}",
                len(rest),
                search.nodes(rest)[len(search.base) :],
                value,
                met,
                _since(t0),
                m.nonfinite_samples,
                None if deployed is None else deployed.value(search.target.metric),
            )
        )
        out.append(
            {
                "op_type": op,
                "excluded": len(picked),
                "of": len(total),
                "op_types_to_quantize": keep,
                "nodes_to_exclude": search.nodes(rest),
                "metric": json_number(value, digits=None, nan=None),
                "met": met,
                "deployed_metric": None
                if deployed is None
                else json_number(deployed.value(search.target.metric), digits=None, nan=None),
            }
        )
    return out


def alternatives(
    recipe: Recipe, candidates: list[Candidate], producer: str = "onnxruntime", opset: int = 13
) -> list[dict[str, Any]]:
    """Cheaper changes worth trying when node exclusion cannot meet the target, for a model
    ``producer`` made (per-channel weights in its own terms; the other changes are onnxruntime's
    recipe arguments, and say so when another tool made the model).

    Example:
        >>> [a["change"] for a in alternatives(Recipe(mode="dynamic"), [])]
        ['per_channel=True', 'static QDQ instead of dynamic']
        >>> alternatives(Recipe(mode="static"), [], "nncf", 11)[0]["change"]
        'model = onnx.version_converter.convert_version(model, 13)  # then nncf.quantize(model, ...)'
    """
    out: list[dict[str, Any]] = []
    mode = _name(recipe.mode)
    if not recipe.per_channel:
        change, _, why = per_channel_switch(mode or "static", producer, opset)
        ort_why = "one scale per output channel of each weight: outlier channels stop crushing the others"
        out.append({"change": change, "why": ort_why if change == "per_channel=True" else why})
    if mode == "dynamic":
        out.append(
            {
                "change": "static QDQ instead of dynamic",
                "why": "calibrated activation ranges (mode static, quant_format QDQ) and a per-tensor choice of types",
            }
        )
    else:
        method = _name(recipe.calibrate_method) or "MinMax"
        others = [m for m in ("MinMax", "Percentile", "Entropy") if m != method]
        out.append(
            {
                "change": f"calibrate_method {' or '.join(others)}",
                "why": f"{method} ranges are set by the extremes; another method trades clipping for resolution",
            }
        )
    tensors = [c.fp_nodes[0] for c in candidates[:3]]
    if tensors:
        out.append(
            {
                "change": "QInt16 for the worst nodes' tensors",
                "why": "static QDQ with extra_options TensorQuantOverrides {tensor: [{'quant_type': QInt16}]} and "
                "UseQDQContribOps for the inputs/outputs of " + ", ".join(tensors),
            }
        )
    if producer not in ORT_RECIPE_PRODUCERS and producer in PRODUCERS:
        name = PRODUCERS[producer].name
        own = PRODUCERS[producer].per_channel_fix
        for alt in out:
            if alt["change"] != own:
                alt["why"] += f" (onnxruntime's recipe; {name} has its own setting for it)"
    return out


# ---------------------------------------------------------------- outputs


def ranked_fixes(result: ExclusionResult) -> list[dict[str, Any]]:
    """Every verified fix of this run, best first (issue 25 item 3: the best fix must not hide).

    Ranked by (meets the target, size of the change): an ``op_types_to_quantize`` change counts
    as one edit plus the node exclusions it still needs, a node list as its length. Only fixes
    that met the target are listed; ties keep the node list (the searched answer) first.
    """
    fixes: list[dict[str, Any]] = []
    if result.reachable and not result.already_met and result.after is not None:
        fixes.append(
            {
                "kind": "nodes_to_exclude",
                "nodes_to_exclude": list(result.nodes_to_exclude),
                "op_types_to_quantize": result.op_types_to_quantize,
                "metric": json_number(result.after.value(result.target.metric), digits=None, nan=None),
                "deployed_metric": None
                if result.after_deployed is None
                else json_number(result.after_deployed.value(result.target.metric), digits=None, nan=None),
                "met": True,
                "size": len(result.nodes_to_exclude),
            }
        )
    for s in result.op_type_suggestions:
        if s["met"]:
            fixes.append(
                {
                    "kind": "op_types_to_quantize",
                    "op_type": s["op_type"],
                    "nodes_to_exclude": list(s["nodes_to_exclude"]),
                    "op_types_to_quantize": list(s["op_types_to_quantize"]),
                    "metric": s["metric"],
                    "deployed_metric": s.get("deployed_metric"),
                    "met": True,
                    "size": 1 + len(s["nodes_to_exclude"]),
                }
            )
    fixes.sort(key=lambda f: (not f["met"], f["size"]))
    for rank, f in enumerate(fixes, 1):
        f["rank"] = rank
    return fixes


def summary_lines(result: ExclusionResult) -> list[str]:
    """What `diag exclude` prints: the verdict first, counts and time last (ends "in N s").

    Example:
        >>> summary_lines(result)[0]  # doctest: +SKIP
        'target cosine>=0.999 met on 16 held-out samples: cosine 0.9672 -> 0.9994 by keeping 1 node in float ...'
    """
    t = result.target
    held = result.split["held_out_samples"]
    b = result.before.value(t.metric)
    b_note = _nonfinite_note(result.before)
    lines: list[str] = []
    if result.already_met:
        lines.append(f"target {t} already met on {held} held-out samples: {t.metric} {_fmt(b, t)}; nothing to exclude")
    elif result.reachable and result.after is not None:
        lines += _met_lines(result, b, b_note)
    else:

        def as_deployed(s: Step) -> float:
            # "met" means met as deployed: a list checked there is worth its deployed figure
            v = s.deployed_metric if s.deployed_metric is not None else s.metric
            return (v or 0.0) if t.op == ">=" else -(v or 0.0)

        tried = [s for s in result.trajectory if s.metric is not None and not s.phase.startswith("estimate")]
        best = max(tried, key=as_deployed, default=None)
        tail = ""
        if best is not None and best.deployed_metric is not None:
            tail = (
                f"; best tried: {_fmt(best.deployed_metric, t)} as deployed ({_fmt(best.metric, t)} exact) "
                f"with {best.excluded_groups} group(s) in float"
            )
        elif best is not None:
            tail = f"; best tried: {_fmt(best.metric, t)} with {best.excluded_groups} group(s) in float"
        nan = sum(1 for s in result.trajectory if s.nonfinite_samples and not s.phase.startswith("estimate"))
        if nan:
            tail += f"; {count_phrase(nan, 'list')} tried gave NaN/Inf outputs (failed)"
        if result.budget.get("exhausted"):
            lines.append(
                f"target {t} NOT MET: budget exhausted ({result.budget['reason']}) before any list met it on "
                f"{held} held-out samples: {t.metric} {_fmt(b, t)}{b_note} quantized{tail}; raise the budget"
            )
        else:
            lines.append(
                f"target {t} NOT REACHABLE on {held} held-out samples: {t.metric} {_fmt(b, t)}{b_note} quantized; "
                f"no list short of keeping all {len(result.candidates)} quantized node groups in float meets it{tail}"
            )
        for alt in result.alternatives:
            lines.append(f"  try: {alt['change']} - {alt['why']}")
    if result.latency:
        p = " / ".join(
            f"{x['p50_ms']:.2f} ms {x['model'].upper() if x['model'] != 'mixed' else 'mixed'}" for x in result.latency
        )
        lines.append(f"  latency p50 {p}")
    lines.extend(f"  {w}" for w in result.warnings)
    lines.extend(f"  {line}" for line in shown_lines(result.recipe_lines))
    lines.append(
        f"  ranked on {result.split['ranking']}, verified on {result.split['held_out']}; "
        f"{trials_phrase(result.method, result.quantizations, result.splices, result.calibrations)}, "
        f"{count_phrase(result.evaluations, 'evaluation')}{estimates_phrase(result.estimates)}, "
        f"{count_phrase(result.ranking_passes, 'ranking pass', 'ranking passes')} in {result.seconds:.1f} s"
    )
    return lines


def trials_phrase(method: str, quantizations: int, splices: int, calibrations: int) -> str:
    """How the trials were made: spliced into the user's model, or re-quantized by onnxruntime.

    Example:
        >>> trials_phrase("surgical", 0, 12, 0)
        '12 models spliced from your INT8 model (no re-quantization)'
        >>> trials_phrase("requantized", 5, 0, 1)
        '5 quantizations (1 calibration pass)'
    """
    if method == "encodings":
        return f"{count_phrase(splices, 'model')} built from your AIMET encodings, edited (no re-quantization)"
    if method == "surgical":
        return f"{count_phrase(splices, 'model')} spliced from your INT8 model (no re-quantization)"
    return f"{count_phrase(quantizations, 'quantization')}{calibrations_phrase(calibrations)}"


def stays_int8_phrase(in_float: int, quantized: int) -> str:
    """``12 of 14 quantized node groups stay INT8``: how much of the model a fix leaves quantized.

    Example:
        >>> stays_int8_phrase(1, 14)
        '13 of 14 quantized node groups stay INT8'
    """
    return f"{quantized - in_float} of {quantized} quantized node groups stay INT8"


def _met_lines(result: ExclusionResult, b: float | None, b_note: str) -> list[str]:
    """The verdict of a met search: the best fix first (issue 25 item 3), then the searched list."""
    t, held = result.target, result.split["held_out_samples"]
    assert result.after is not None
    lines: list[str] = []
    a = result.after.value(t.metric)
    n = len(result.nodes_to_exclude)
    keeping = f"keeping {n} node{'s' if n != 1 else ''} in float ({', '.join(result.nodes_to_exclude)})"
    fixes = ranked_fixes(result)
    if fixes and fixes[0]["kind"] == "op_types_to_quantize":
        # The best fix leads (issue 25 item 3): a one-argument change beats a long node list.
        f = fixes[0]
        key = result.producer.get("key", "onnxruntime")
        rest = f["nodes_to_exclude"]
        also = (
            ""
            if not rest
            else f" with nodes_to_exclude={rest}"
            if key in ORT_RECIPE_PRODUCERS
            else f" with {', '.join(rest)} also in float"  # another tool: its own list, not onnxruntime's argument
        )
        change = op_types_change(key, [f["op_type"]], f["op_types_to_quantize"])
        lines.append(
            f"target {t} met on {held} held-out samples: {t.metric} {_fmt(b, t)}{b_note} -> "
            f"{_fmt(f['metric'], t)}{_level_note(result.deploy_level, f.get('deployed_metric'), t)} "
            f"by {change}{also} (best fix: a smaller change than the {n}-node list)"
        )
        lines.append(f"  also met: {t.metric} {_fmt(a, t)}{_deployed_note(result)} by {keeping}")
    else:
        lines.append(
            f"target {t} met on {held} held-out samples: {t.metric} {_fmt(b, t)}{b_note} -> {_fmt(a, t)}"
            f"{_deployed_note(result)} by {keeping}"
        )
    where = {"surgical": "inside your INT8 model", "encodings": "in your AIMET encodings"}.get(
        result.method, "re-quantized from the recipe"
    )
    lines.append(f"  {where}: {stays_int8_phrase(len(result.excluded), result.quantized_groups)}")
    if result.producer.get("fix_call"):
        lines.append(f"  made by {result.producer['name']}: reproduce.py also words the list in its terms")
    if result.budget.get("exhausted"):
        lines.append(
            f"  budget exhausted ({result.budget['reason']}): this is the smallest list that met the target "
            "before the search stopped, verified on the held-out samples but not proven minimal"
        )
    for s in result.op_type_suggestions:
        change = op_types_change(result.producer.get("key", "onnxruntime"), [s["op_type"]], s["op_types_to_quantize"])
        lines.append(
            f"  op types: {s['excluded']}/{s['of']} {s['op_type']} nodes excluded; {change} gives "
            f"{t.metric} {_fmt(s['metric'], t)} ({'met' if s['met'] else 'missed'})"
        )
    return lines


def _deployed_note(result: ExclusionResult) -> str:
    """`` (level all: 0.9991)``: the answer's figure as onnxruntime runs it at the deploy level."""
    d = result.after_deployed
    return _level_note(result.deploy_level, None if d is None else d.value(result.target.metric), result.target)


def _level_note(level: str, value: float | None, t: Target) -> str:
    return "" if value is None else f" (level {level}: {_fmt(value, t)})"


def estimates_phrase(n: int) -> str:
    """`` (+ 40 estimates)``: trials answered without re-quantizing; nothing when there were none."""
    return f" (+ {count_phrase(n, 'estimate')})" if n else ""


def calibrations_phrase(n: int) -> str:
    """`` (1 calibration pass)`` for static recipes; nothing for dynamic ones."""
    return f" ({count_phrase(n, 'calibration pass', 'calibration passes')})" if n else ""


def _nonfinite_note(m: HeldOutMetrics | None) -> str:
    """`` (15 of 16 held-out samples NaN/Inf)`` when an evaluated output held NaN/Inf, else ``""``."""
    if m is None or not m.nonfinite_samples:
        return ""
    return f" ({m.nonfinite_samples} of {m.samples} held-out samples NaN/Inf)"


def count_phrase(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"
