"""Mixed-precision plans across precision tiers (`diag exclude --tiers int4,int8,fp32`).

`diag exclude` answers "which nodes do I keep in FP32?". With several precisions on offer the
cheaper answer is often a middle tier: a 4-bit weight block ruined by one stray value is fine at
8 bits; a tensor whose outlier channel wastes the 8-bit activation grid is fine at 16 bits. A plan
assigns each quantized node group one tier of an ordered list, lowest (the recipe as given) to
highest, and is searched, not guessed:

1. Samples are split as in :mod:`diag.fix.exclude`: the first part ranks the node groups by local
   error on the all-lowest model (and calibrates a static recipe), the rest is held out and judges
   every plan.
2. Tier by tier: the smallest prefix of the ranking promoted to the *next* tier that meets the
   target is found (exponential then binary search). Only when promoting every group to that tier
   misses does the search move up one more tier (on top of all groups at the tier below). So a
   node reaches FP32 only when its 8-bit (or 16-bit) version was not enough.
3. The plan is pruned: each promoted group, least suspicious first, is lowered one tier at a
   time while the target still holds, in passes until nothing changes.

Every plan is written in each tool's own terms and re-quantized by onnxruntime to be measured:

* weight-only (``MatMulNBitsQuantizer``): ``int4`` / ``int8`` / ``int2`` are ``bits``; a node at
  another width than the recipe's goes to ``node_bits`` (a second quantizer call with ``bits=8``),
  ``fp32`` to ``nodes_to_exclude``.
* static QDQ: the lowest tier is the recipe (``int8``, or ``int4`` for ``weight_type`` QInt4 /
  QUInt4); ``int8`` over an int4 recipe puts the group's weights at 8 bits and ``a16`` its
  activation tensors (float inputs and outputs) at 16 bits (and its weights at 8), both with
  ``extra_options["TensorQuantOverrides"]`` in the signedness of the recipe's types; ``fp32`` is
  ``nodes_to_exclude``.
* dynamic: ``int8``, ``fp32``.

NOTE: the cost of a plan is the number of groups promoted, tier by tier (fewest at the highest
tier first); the model size and (with ``bench_runs``) latency of the plan are measured and
reported next to the all-lowest and FP32 models, never assumed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnx

from diag.analysis.compare import CompareOptions, CompareResult, compare_models
from diag.analysis.decoder import module_paths, projection_phrase
from diag.core.feeds import FeedSource, FeedSpec
from diag.core.recipe import Recipe
from diag.core.surgery import region_dirs, save_spliced, spliced_model
from diag.fix.bench import BenchOptions, bench_models
from diag.fix.evaluate import HeldOutMetrics, Target
from diag.fix.evaluate import format_metric as _fmt
from diag.fix.exclude import SearchOptions, SearchSetup, count_phrase, prepare_search, search_target, trials_phrase
from diag.fix.fixcode import reproduce_snippet
from diag.fix.modelprep import copy_model
from diag.fix.quantize import quantize_model
from diag.fix.search import BudgetExhausted, Candidate, ranked_candidates, shortest_met_prefix
from diag.fix.weightonly import weight_only_snippet
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number
from diag.foundations.numfmt import byte_size
from diag.foundations.progress import Progress


@dataclass(frozen=True)
class TierOptions(SearchOptions):
    """What `diag exclude --tiers` takes: the search options of `diag exclude` and the tiers.

    Attributes:
        tiers: ordered lowest to highest (``"int4,int8,fp32"`` or a list; see :func:`parse_tiers`).
        bench_runs: timed runs per model for the latency rows (0: size only, the default here).

    Example:
        >>> TierOptions("cosine>=0.94", tiers="int4,int8,fp32").bench_runs
        0
    """

    bench_runs: int = 0
    tiers: str | list[str] = field(default="", kw_only=True)


#: The tiers each recipe mode can express, lowest first.
TIERS_BY_MODE: dict[str, tuple[str, ...]] = {
    "weight_only": ("int2", "int4", "int8", "fp32"),
    "static": ("int4", "int8", "a16", "fp32"),
    "dynamic": ("int8", "fp32"),
}
#: Other spellings accepted on the command line.
ALIASES = {"a16w8": "a16", "int16": "a16", "float": "fp32", "float32": "fp32"}


def lowest_tier(recipe: Recipe) -> str:
    """The tier the recipe itself quantizes to (every plan starts there).

    Example:
        >>> lowest_tier(Recipe(mode="weight_only", bits=4))
        'int4'
    """
    if recipe.mode == "weight_only":
        return f"int{recipe.bits or 4}"
    if recipe.mode == "static" and recipe.weight_type in ("QInt4", "QUInt4"):
        return "int4"
    if recipe.mode == "static" and recipe.activation_type in ("QInt16", "QUInt16"):
        return "a16"
    return "int8"


def parse_tiers(text: str, recipe: Recipe) -> list[str]:
    """``"int4,int8,fp32"`` -> ``["int4", "int8", "fp32"]``, checked against what the recipe can express.

    The first tier must be the recipe's own precision, the order must be lowest to highest.

    Example:
        >>> parse_tiers("int4,int8,fp32", Recipe(mode="weight_only", bits=4))
        ['int4', 'int8', 'fp32']
        >>> parse_tiers("int8,a16w8,fp32", Recipe(mode="static"))
        ['int8', 'a16', 'fp32']
    """
    names = [ALIASES.get(t.strip().lower(), t.strip().lower()) for t in str(text).split(",") if t.strip()]
    allowed = TIERS_BY_MODE[recipe.mode]
    obj = f"--tiers {text!r}"
    for t in names:
        if t not in allowed:
            raise DiagError(
                "bad-option",
                obj,
                f"has tier '{t}', which a {recipe.mode} recipe cannot express",
                f"{recipe.mode} tiers: {', '.join(allowed)}",
            )
    if len(names) < 2 or len(set(names)) != len(names):
        raise DiagError("bad-option", obj, "needs at least two different tiers", "e.g. --tiers int4,int8,fp32")
    if [allowed.index(t) for t in names] != sorted(allowed.index(t) for t in names):
        raise DiagError(
            "bad-option", obj, "is not ordered lowest to highest precision", f"e.g. {','.join(allowed[-3:])}"
        )
    base = lowest_tier(recipe)
    if names[0] != base:
        raise DiagError(
            "bad-option",
            obj,
            f"starts at '{names[0]}' but the recipe quantizes to '{base}'",
            f"start the list with {base} (or change the recipe)",
        )
    return names


def recipe_for_plan(recipe: Recipe, fp32: onnx.ModelProto, plan: dict[str, str]) -> Recipe:
    """The recipe that quantizes FP32 node ``n`` at tier ``plan[n]`` (others at the recipe's own tier).

    ``fp32`` is the FP32 ``onnx.ModelProto`` (its graph tells a node's activation tensors).

    Example:
        >>> r = recipe_for_plan(Recipe(mode="weight_only"), fp, {"head": "int8", "fc1": "fp32"})  # doctest: +SKIP
        >>> r.node_bits, r.nodes_to_exclude  # doctest: +SKIP
        ({'head': 8}, ['fc1'])
    """
    base = lowest_tier(recipe)
    fp32_nodes = [n for n, t in plan.items() if t == "fp32"]
    out = recipe.with_excluded(fp32_nodes)
    if recipe.mode == "weight_only":
        node_bits = dict(recipe.node_bits or {})
        node_bits.update({n: int(t[3:]) for n, t in plan.items() if t not in ("fp32", base)})
        return dataclasses.replace(out, node_bits=node_bits or None)
    a16 = [n for n, t in plan.items() if t == "a16"]
    # int4 weights (static QInt4 / QUInt4): int8 and a16 nodes get 8-bit weights (A16W8)
    w8 = [n for n, t in plan.items() if t in ("int8", "a16")] if base == "int4" else []
    if a16 or w8:
        extra = json.loads(json.dumps(out.extra_options))
        overrides = extra.setdefault("TensorQuantOverrides", {})
        wide = "QUInt16" if recipe.activation_type.startswith("QU") else "QInt16"
        for name in activation_tensors(fp32, a16):
            overrides.setdefault(name, [{"quant_type": wide}])
        eight = "QUInt8" if recipe.weight_type.startswith("QU") else "QInt8"
        for name in weight_tensors(fp32, w8):
            overrides.setdefault(name, [{"quant_type": eight}])
        out = dataclasses.replace(out, extra_options=extra)
    return out


def weight_tensors(fp32: onnx.ModelProto, nodes: list[str]) -> list[str]:
    """The weight initializers (2-D or more: not biases, which onnxruntime quantizes to int32) of ``nodes``.

    Example:
        >>> weight_tensors(fp.proto, ["fc2"])  # doctest: +SKIP
        ['fc2.weight']
    """
    weights = {t.name for t in fp32.graph.initializer if len(t.dims) >= 2}
    wanted = set(nodes)
    return list(dict.fromkeys(i for n in fp32.graph.node if n.name in wanted for i in n.input if i in weights))


def activation_tensors(fp32: onnx.ModelProto, nodes: list[str]) -> list[str]:
    """The float activation tensors (inputs that are not initializers, and outputs) of ``nodes``.

    Example:
        >>> activation_tensors(fp.proto, ["fc0"])  # doctest: +SKIP
        ['x', 'h']
    """
    inits = {t.name for t in fp32.graph.initializer}
    wanted = set(nodes)
    names: list[str] = []
    for node in fp32.graph.node:
        if node.name in wanted:
            names += [i for i in node.input if i and i not in inits]
            names += [o for o in node.output if o]
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class TierTrial:
    """One re-quantization + held-out evaluation: which tier each ranked group was at, and the result."""

    phase: str
    levels: tuple[int, ...]
    value: float | None
    met: bool
    seconds: float

    def to_dict(self, tiers: list[str]) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "promoted": {tiers[lv]: sum(1 for x in self.levels if x == lv) for lv in sorted(set(self.levels)) if lv},
            "value": json_number(self.value, digits=None),
            "met": self.met,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class TierPlan:
    """The answer of :func:`derive_tier_plan`.

    Attributes:
        fp32: the FP32 model.
        target: the goal, measured on the held-out samples.
        tiers: the tiers, lowest first.
        reachable: a plan short of every group at the highest tier meets the target.
        already_met: the all-lowest model meets it (empty plan).
        plan: FP32 node name -> tier, promoted nodes only.
        candidates: ranked node groups (worst local error first).
        recipe: the recipe that reproduces the plan (recipe-file form).
        before / after: held-out metrics of the all-lowest model and of the plan.
        sizes: model file size in bytes: ``lowest``, ``plan``, ``fp32``.
        latency: bench rows (``model``: fp32 / lowest / plan) when measured.
        trials: every re-quantization, in order.
        budget: why the search stopped early, if it did.
    """

    fp32: str
    target: Target
    tiers: list[str]
    reachable: bool
    already_met: bool
    plan: dict[str, str]
    candidates: list[Candidate]
    recipe: dict[str, Any]
    before: HeldOutMetrics
    after: HeldOutMetrics | None
    sizes: dict[str, int]
    split: dict[str, Any]
    trials: list[TierTrial] = field(default_factory=list)
    quantizations: int = 0
    seconds: float = 0.0
    latency: list[dict[str, Any]] = field(default_factory=list)
    budget: str | None = None
    model: str | None = None
    snippet: str | None = None
    #: Where the starting recipe came from (:meth:`diag.fix.infer.RecipeOrigin.to_dict`; set by the verb).
    recipe_origin: dict[str, Any] = field(default_factory=dict)
    #: ``"surgical"``: every plan was the user's INT8 model (``int8``) with groups spliced in float or
    #: re-blocked at a wider width, no quantizer run; ``"requantized"``: every plan quantized from FP32.
    method: str = "requantized"
    int8: str | None = None
    #: Plans built by splicing into the user's model (surgical searches).
    splices: int = 0
    #: What the search wants the user to know (groups that could not be spliced).
    warnings: list[str] = field(default_factory=list)
    #: The ``diag compare`` result of the all-lowest model that ranked the nodes (not serialized).
    diagnosis: CompareResult | None = field(default=None, repr=False)

    @property
    def by_tier(self) -> dict[str, list[str]]:
        """Promoted FP32 nodes grouped by tier, in tier order."""
        return {t: [n for n, x in self.plan.items() if x == t] for t in self.tiers[1:] if t in self.plan.values()}

    #: tier -> the tier's nodes named by projection (``mlp/down_proj in every layer (24)``), for
    #: decoder stacks where that is shorter than the node list (:func:`diag.analysis.decoder.projection_phrase`).
    by_projection: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``tiers.json``)."""
        return {
            "fp32": self.fp32,
            "target": str(self.target),
            "tiers": list(self.tiers),
            "reachable": self.reachable,
            "already_met": self.already_met,
            "plan": dict(self.plan),
            "by_tier": self.by_tier,
            "by_projection": dict(self.by_projection),
            "recipe": self.recipe,
            "recipe_origin": self.recipe_origin,
            "before": self.before.to_dict(),
            "after": self.after.to_dict() if self.after else None,
            "sizes": dict(self.sizes),
            "latency": self.latency,
            "split": self.split,
            "candidates": [c.to_dict() for c in self.candidates],
            "trials": [t.to_dict(self.tiers) for t in self.trials],
            "quantizations": self.quantizations,
            "method": self.method,
            "int8": self.int8,
            "splices": self.splices,
            "warnings": list(self.warnings),
            "seconds": round(self.seconds, 3),
            "budget": self.budget,
            "model": self.model,
        }


class _TierSearch:
    """Quantize-and-evaluate plans (levels per ranked group), cached by the levels tuple."""

    def __init__(
        self, setup: SearchSetup, recipe: Recipe, tiers: list[str], work: Path, options: SearchOptions
    ) -> None:
        self.fp32, self.fp_proto, self.recipe, self.tiers = setup.fp32, setup.fp.proto, recipe, tiers
        self.evaluator, self.target, self.calibration = setup.evaluator, setup.target, setup.calibration
        self.work, self.progress, self.max_trials, self.deadline = (
            work,
            options.progress,
            options.max_trials,
            setup.deadline,
        )
        self.candidates: list[Candidate] = []
        self.cache: dict[tuple[int, ...], tuple[HeldOutMetrics, Path]] = {}
        #: Met = met in exact mode and at the deploy level (as diag exclude: issue 25 item 9).
        self.deploy_evaluator = setup.deployed
        self.met_levels: dict[tuple[int, ...], bool] = {}
        self.trials: list[TierTrial] = []
        self.quantizations = 0
        self.calibration_cache = work / "calibration.json"
        #: why the pruning stopped before every group was tried one tier lower (None: it finished)
        self.pruning_stopped: str | None = None
        #: Per-trial lines go above any bar (no bar of its own: a plan's trial count is not known).
        self.lines = Progress(None, "tiers", enabled=False, unit="trials")
        #: Surgical plans (issue 41 item 6): the user's model, the baseline every plan is spliced into.
        self.user_int8: Path | None = Path(options.int8) if options.surgical and options.int8 else None
        #: (FP32 proto, INT8 proto, matching, FP32 folder, INT8 folder): set by the ranking comparison.
        self.surgery: tuple[Any, ...] | None = None
        self.splices = 0
        #: Plans kept in memory as spliced protos (written only for the answer, :meth:`model_path`).
        self.spliced: dict[tuple[int, ...], Any] = {}

    @property
    def trials_run(self) -> int:
        """The plans built and measured, the baseline included (what ``--max-trials`` caps): quantizations,
        or, in a surgical search, splices plus the user's own model."""
        return self.quantizations + self.splices + (1 if self.user_int8 is not None else 0)

    def splice(self, levels: tuple[int, ...]) -> onnx.ModelProto:
        """The user's model with the plan's fp32 groups in float and its wider weight-only groups
        re-blocked from their FP32 weights (:func:`diag.core.surgery.spliced_model`)."""
        assert self.surgery is not None, "the ranking comparison pairs the models before any splice"
        fp, q, matching, fp_dir, q_dir = self.surgery
        plan = self.plan_of(levels)
        in_float = [n for n, t in plan.items() if t == "fp32"]
        bits = {n: int(t[3:]) for n, t in plan.items() if t != "fp32"}
        return spliced_model(fp, q, in_float, matching, fp_dir, bits=bits or None, external_dir=q_dir)

    def model_path(self, levels: tuple[int, ...]) -> Path:
        """The plan's model on disk (a spliced plan is written when first asked for)."""
        path = self.cache[levels][1]
        if self.user_int8 is not None and levels and not path.exists():
            assert self.surgery is not None
            save_spliced(self.splice(levels), path, self.surgery[4])
        return path

    def smallest_met(self) -> tuple[int, ...] | None:
        """The met trial that promotes the fewest groups (then the lowest tiers), None if none met."""
        top = len(self.tiers) - 1  # every group at the top tier is the FP32 model, not a plan
        met = [lv for lv, ok in self.met_levels.items() if ok and any(lv) and not all(x == top for x in lv)]
        return min(met, key=lambda lv: (sum(1 for x in lv if x), sum(lv), lv), default=None)

    def plan_of(self, levels: tuple[int, ...]) -> dict[str, str]:
        plan: dict[str, str] = {}
        for c, lv in zip(self.candidates, levels, strict=False):
            if lv:
                plan.update({n: self.tiers[lv] for n in c.fp_nodes})
        return plan

    def trial(self, levels: tuple[int, ...], phase: str) -> tuple[HeldOutMetrics, bool]:
        if not any(levels):
            levels = ()  # nothing promoted is the baseline (pruning lowers the last group to it)
        if levels in self.cache:
            return self.cache[levels][0], self.met_levels[levels]
        if self.max_trials is not None and self.trials_run >= self.max_trials and any(levels):
            raise BudgetExhausted(f"--max-trials {self.max_trials} reached")
        if self.deadline is not None and time.perf_counter() >= self.deadline and any(levels):
            raise BudgetExhausted("--time-budget reached")
        t0 = time.perf_counter()
        path = self.work / f"plan{len(self.trials):03d}.onnx"
        if self.user_int8 is not None and not levels:
            path = self.user_int8  # the baseline is the user's model itself, read as it is
            m, met = self._judge(path, None)
        elif self.user_int8 is not None:
            model = self.splice(levels)
            self.splices += 1
            m, met = self._judge(path, model)
        else:
            recipe = recipe_for_plan(self.recipe, self.fp_proto, self.plan_of(levels))
            quantize_model(
                self.fp32, recipe, path, calibration=self.calibration, calibration_cache=self.calibration_cache
            )
            self.quantizations += 1
            m, met = self._judge(path, None)
        self.cache[levels] = (m, path)
        self.met_levels[levels] = met
        value = m.value(self.target.metric)
        self.trials.append(TierTrial(phase, levels, value, met, time.perf_counter() - t0))
        if self.progress:
            counts = ", ".join(
                f"{sum(1 for x in levels if x == lv)} at {self.tiers[lv]}" for lv in sorted(set(levels)) if lv
            )
            shown = "n/a" if value is None else f"{value:.6g}"
            self.lines.note(
                f"tiers: {phase:<8} {counts or 'all at ' + self.tiers[0]} -> {self.target.metric} {shown} "
                f"({'met' if met else 'missed'})"
            )
        return m, met

    def _judge(self, path: Path, model: onnx.ModelProto | None) -> tuple[HeldOutMetrics, bool]:
        """Held-out metrics in exact mode; met = met there and at the deploy level (as diag exclude).
        ``model``: a spliced plan, evaluated in memory (``path`` only names it)."""
        q_dir = self.surgery[4] if self.surgery is not None else None

        def run(evaluator: Any) -> HeldOutMetrics:
            if model is not None:
                return evaluator.evaluate_model(model, path.name, q_dir)  # type: ignore[no-any-return]
            return evaluator.evaluate(path)  # type: ignore[no-any-return]

        m = run(self.evaluator)
        met = m.meets(self.target)
        if met and self.deploy_evaluator is not None:
            met = run(self.deploy_evaluator).meets(self.target)
        return m, met

    def search(self) -> tuple[int, ...] | None:
        """Tier by tier, the shortest ranked prefix promoted one tier up that meets the target; then prune."""
        n, top = len(self.candidates), len(self.tiers) - 1
        floor = [0] * n
        found: list[int] | None = None
        for level in range(1, top + 1):
            # NOTE: every group at the highest tier is the FP32 model, not a plan: the last tier's
            # prefix stops one short of all groups (as `diag exclude` does).
            longest = n - 1 if level == top else n

            def at(k: int, lv: int = level, fl: tuple[int, ...] = tuple(floor)) -> tuple[int, ...]:
                return tuple(lv if i < k else fl[i] for i in range(n))

            hi = shortest_met_prefix(lambda k: self.trial(at(k), "search")[1], longest)
            if hi is None:
                floor = [level] * n
                continue
            found = list(at(hi))
            break
        if found is None:
            return None
        return self.prune(found)

    def prune(self, found: list[int]) -> tuple[int, ...]:
        """Lower each promoted group one tier at a time (least suspicious first) while the target holds."""
        changed = True
        while changed:
            changed = False
            for i in reversed(range(len(found))):
                while found[i] > 0:
                    trial = list(found)
                    trial[i] -= 1
                    try:
                        met = self.trial(tuple(trial), "prune")[1]
                    except BudgetExhausted as e:
                        self.pruning_stopped = str(e)  # verified met; not proven minimal: said so
                        return tuple(found)
                    if not met:
                        break
                    found = trial
                    changed = True
        return tuple(found)


def derive_tier_plan(
    fp32_path: str | Path,
    recipe: Recipe,
    feeds: FeedSource | FeedSpec,
    options: TierOptions,
    work_dir: str | Path | None = None,
) -> TierPlan:
    """Find the cheapest assignment of node groups to ``options.tiers`` that meets the target on held-out inputs.

    Args:
        fp32_path: the FP32 model.
        recipe: the lowest tier's recipe (weight_only, static or dynamic).
        feeds: all samples; split into ranking and held-out parts as :func:`diag.fix.exclude.derive_exclusions`.
        options: the tiers, the target and the search options (:class:`TierOptions`); ``max_trials``
            caps re-quantizations (the pruning stops at the cap with a verified plan), ``bench_runs``
            0 measures sizes only.
        work_dir: where the plan's model is kept (``plan.onnx``).

    Returns:
        The plan; ``reachable`` False when only every group at the highest tier meets the target.

    Example:
        >>> p = derive_tier_plan("fp32.onnx", Recipe(mode="weight_only", block_size=32), FeedSpec(inputs="x.npz"),
        ...                      TierOptions("cosine>=0.94", tiers="int4,int8,fp32"))  # doctest: +SKIP
        >>> p.plan  # doctest: +SKIP
        {'fc2': 'int8'}
    """
    o = options
    tier_list = parse_tiers(",".join(o.tiers) if isinstance(o.tiers, list) else o.tiers, recipe)
    tgt = search_target(o.target, o.metric, o.labels, o.max_trials, o.time_budget)
    if o.surgical:
        _check_spliceable(tier_list, recipe, o)
    setup = prepare_search(fp32_path, recipe, feeds, tgt, o)
    tmp = Path(tempfile.mkdtemp(prefix="diag-tiers-"))
    try:
        s = _TierSearch(setup, recipe, tier_list, tmp, o)
        before, met0 = s.trial((), "baseline")
        baseline = s.cache[()][1]
        chosen: tuple[int, ...] | None = ()
        compared: CompareResult | None = None
        budget: str | None = None
        warnings: list[str] = []
        if not met0:
            compared = compare_models(
                setup.fp32,
                baseline,
                setup.split.ranking,
                CompareOptions(progress=False, threads=o.threads, max_memory=o.max_memory),
            )
            s.candidates = ranked_candidates(compared.findings, set(recipe.nodes_to_exclude or []))
            if s.user_int8 is not None:
                fp_dir, q_dir = region_dirs(compared.fp32, compared.int8)
                s.surgery = (compared.fp32.proto, compared.int8.proto, compared.matching, fp_dir, q_dir)
                warnings += _drop_unspliceable(s)
            try:
                chosen = s.search()
            except BudgetExhausted as e:
                # A trial that met the target is a plan, just not the smallest: the search ran out
                # before narrowing it (500M decoder: every MatMul at int8 met cosine>=0.99, then
                # the budget was spent). Saying "not reachable" there would be wrong advice.
                budget, chosen = str(e), s.smallest_met()
            budget = budget or s.pruning_stopped
        plan = _plan(setup, recipe, s, chosen, o, work_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    plan.before, plan.already_met, plan.budget, plan.diagnosis = before, met0, budget, compared
    plan.warnings = warnings
    promotable = {n for c in plan.candidates for n in c.fp_nodes}
    universe = [n.name for n in setup.fp.proto.graph.node if n.name in promotable]  # in graph order
    paths = module_paths(setup.fp.proto)
    for tier, nodes in plan.by_tier.items():
        if (named := projection_phrase(nodes, universe, paths)) is not None:
            plan.by_projection[tier] = named
    plan.seconds = time.perf_counter() - setup.start
    return plan


def _plan(
    setup: SearchSetup,
    recipe: Recipe,
    s: _TierSearch,
    chosen: tuple[int, ...] | None,
    options: TierOptions,
    work_dir: str | Path | None,
) -> TierPlan:
    """The plan found (or none): its recipe, sizes, latency and kept model; ``before`` and the
    rest are filled in by :func:`derive_tier_plan`."""
    fp32, baseline = setup.fp32, s.cache[()][1]
    levels = chosen if chosen is not None else ()
    plan = s.plan_of(levels) if chosen is not None else {}
    after = s.cache[chosen][0] if chosen is not None and chosen in s.cache else None
    final = recipe_for_plan(recipe, setup.fp.proto, plan)
    plan_path = s.model_path(chosen) if chosen is not None and chosen in s.cache else None
    sizes = {"lowest": _size(baseline), "fp32": _size(fp32)}
    if plan_path is not None:
        sizes["plan"] = _size(plan_path)
    latency: list[dict[str, Any]] = []
    if options.bench_runs > 0:
        paths: list[str | Path] = [fp32, baseline]
        if plan_path is not None and plan:
            paths.append(plan_path)
        bench = BenchOptions(runs=options.bench_runs, warmup=3, threads=options.threads, progress=False)
        stats = bench_models(paths, setup.split.held_out, bench)
        latency = [{**st.to_dict(), "model": ["fp32", "lowest", "plan"][i]} for i, st in enumerate(stats)]
    model_out: str | None = None
    if plan_path is not None and work_dir is not None:
        model_out = str(Path(work_dir) / "plan.onnx")
        copy_model(Path(plan_path), Path(model_out))
    return TierPlan(
        fp32=str(fp32),
        target=setup.target,
        tiers=s.tiers,
        reachable=chosen is not None,
        already_met=False,
        plan=plan,
        candidates=s.candidates,
        recipe=final.to_dict(),
        before=s.cache[()][0],
        after=after,
        sizes=sizes,
        split=setup.split.to_dict(),
        trials=s.trials,
        quantizations=s.quantizations,
        splices=s.splices,
        method="surgical" if s.user_int8 is not None else "requantized",
        int8=str(s.user_int8) if s.user_int8 is not None else None,
        latency=latency,
        model=model_out,
    )


def _check_spliceable(tiers: list[str], recipe: Recipe, options: TierOptions) -> None:
    """Surgical plans promote a group to float, or re-block a weight-only node's weight; a tier
    that changes how tensors other nodes share are quantized (``a16``, 8-bit weights over a static
    int4 model) cannot be spliced into the user's model: said before any work."""
    if recipe.mode == "weight_only":
        return
    other = [t for t in tiers[1:] if t != "fp32"]
    if other:
        raise DiagError(
            "bad-option",
            f"--tiers {','.join(tiers)} with --int8 '{options.int8}'",
            f"tier '{other[0]}' changes the quantization of tensors other nodes share, so it cannot be spliced "
            "into your INT8 model",
            f"use --tiers {tiers[0]},fp32, or add --requantize with a --recipe that rebuilds your model exactly "
            "(diag proves that first)",
        )


def _drop_unspliceable(s: _TierSearch) -> list[str]:
    """Candidates whose region cannot be built in the user's model leave the plan search, said once
    (as in :func:`diag.fix.exclude._drop_unspliceable`: each is tried at the top tier, float)."""
    assert s.surgery is not None
    fp, q, matching, fp_dir, _ = s.surgery
    keep, dropped = [], []
    for c in s.candidates:
        try:
            spliced_model(fp, q, list(c.fp_nodes), matching, fp_dir)
            keep.append(c)
        except ValueError as e:
            dropped.append(f"{c.label} ({e})")
    s.candidates = keep
    if not dropped:
        return []
    return [
        f"{count_phrase(len(dropped), 'quantized group')} cannot be kept in float inside your INT8 model and stay at "
        f"{s.tiers[0]} in every plan: {'; '.join(dropped[:5])}" + (" ..." if len(dropped) > 5 else "")
    ]


def _size(path: Path) -> int:
    """Model file size plus its external data files next to it (``<name>.data``)."""
    p = Path(path)
    extra = p.with_name(p.name + ".data")
    return p.stat().st_size + (extra.stat().st_size if extra.is_file() else 0)


def plan_snippet(
    plan: TierPlan,
    recipe: Recipe,
    model_out: str,
    calibration: str | None,
    calibration_samples: int | None = None,
    batch: int = 1,
) -> str:
    """Python that rebuilds the plan's model with plain onnxruntime calls (no diag).

    ``calibration`` / ``calibration_samples`` / ``batch``: what a static recipe calibrates on.

    Example:
        >>> print(plan_snippet(plan, recipe, "m.reproduced.onnx", None))  # doctest: +SKIP
    """
    header = f"# target {plan.target}: plan {plan.by_tier or 'empty'}"
    if recipe.mode == "weight_only":
        return weight_only_snippet(recipe.to_dict(), plan.fp32, model_out, header)

    result = SimpleNamespace(
        recipe=recipe.to_dict(),
        steps=[],
        target=plan.target,
        verdict="met" if plan.reachable else ("budget exhausted" if plan.budget else "not reachable"),
        nodes_to_exclude=list(recipe.nodes_to_exclude),
        fp32=plan.fp32,
    )
    return reproduce_snippet(result, model_out, calibration, calibration_samples, batch)  # type: ignore[arg-type]


def summary_lines(plan: TierPlan) -> list[str]:
    """What `diag exclude --tiers` prints: the verdict and the plan first, sizes and counts last.

    Example:
        >>> summary_lines(plan)[0]  # doctest: +SKIP
        'target cosine>=0.94 met on 32 held-out samples: cosine 0.9254 (all int4) -> 0.9542 (plan)'
    """
    t = plan.target
    held = plan.split["held_out_samples"]
    b = plan.before.value(t.metric)
    low = plan.tiers[0]
    #: The starting point: the user's own model (surgical), or the recipe quantized at the lowest tier.
    start = "your model" if plan.method == "surgical" else f"all {low}"
    lines: list[str] = []
    if plan.already_met:
        lines.append(f"target {t} already met on {held} held-out samples by {start}: {t.metric} {_fmt(b, t)}")
    elif plan.reachable and plan.after is not None:
        lines.append(
            f"target {t} met on {held} held-out samples: {t.metric} {_fmt(b, t)} ({start}) -> "
            f"{_fmt(plan.after.value(t.metric), t)} (plan)"
        )
        if plan.budget:
            lines.append(
                f"  not the smallest plan: {plan.budget} before the search narrowed it "
                "(a larger --time-budget or --max-trials may find a shorter one)"
            )
        for tier, nodes in plan.by_tier.items():
            named = plan.by_projection.get(tier)
            if named:  # the node list is in tiers.json and recipe.json
                lines.append(f"  {tier} ({len(nodes)} nodes): {named}")
            else:
                lines.append(f"  {tier}: {', '.join(nodes)}")
    elif plan.budget:
        # NOTE: the search stopped before any plan met the target: that proves nothing either way.
        lines.append(
            f"target {t} not reached ({plan.budget}): {start} gives {t.metric} {_fmt(b, t)}; the search "
            "stopped before any plan met it (a larger budget may find one)"
        )
    else:
        lines.append(
            f"target {t} not reachable: {start} gives {t.metric} {_fmt(b, t)}, and no plan short of every "
            f"node at {plan.tiers[-1]} meets it"
        )
    sizes = plan.sizes
    parts = [f"{start} {byte_size(sizes['lowest'])}"]
    if "plan" in sizes and plan.plan:
        parts.append(f"plan {byte_size(sizes['plan'])}")
    parts.append(f"fp32 {byte_size(sizes['fp32'])}")
    lines.append("  size: " + ", ".join(parts))
    if plan.latency:
        names = {"lowest": start}
        lines.append(
            "  latency p50: "
            + ", ".join(f"{names.get(r['model'], r['model'])} {r['p50_ms']:.2f} ms" for r in plan.latency)
        )
    lines += [f"  {w}" for w in plan.warnings]
    lines.append(f"  {trials_phrase(plan.method, plan.quantizations, plan.splices, 0)} in {plan.seconds:.1f} s")
    return lines
