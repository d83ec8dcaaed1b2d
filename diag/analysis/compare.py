"""The diagnosis as one library call: load, match, instrument, stream, reduce, analyze.

:func:`compare_models` is three steps, each usable alone: :func:`prepare_comparison` (the pair
loaded, checked and matched, the inputs opened), :func:`run_comparison` (batches streamed into a
:class:`CompareState`; a cluster or ``diag merge`` produces the same state another way) and
:func:`analyze_comparison` (the state finished into a :class:`CompareResult`, causes confirmed by
effect). Analysis layer: nothing here re-quantizes, writes a file or renders a report; the
fix-side additions of ``diag compare`` and its files are :mod:`diag.cli.verbs`'.

``run_comparison`` and ``CompareState`` are the streaming engine's (:mod:`diag.core.streaming`, core
layer: sessions run batch by batch, memory O(one batch)), re-exported here (``import X as X``) so
that ``from diag.analysis.compare import run_comparison, CompareState`` keeps working.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shlex
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from diag.analysis.analyze import (
    NodeFinding,
    OutputVerdict,
    aimed_outputs,
    error_paths,
    grade_output,
    node_findings,
    overall_grade,
    recommended_nodes,
    upstream_of,
)
from diag.analysis.effects import (
    DEFAULT_CANDIDATES,
    EXACT_CANDIDATES,
    EffectBudget,
    EffectCheck,
    ListEstimate,
    check_effects,
    confirmed_cause,
    estimate_list,
    judge_remedies,
)
from diag.analysis.fp16health import nonfinite_cause
from diag.analysis.headline import ExcludeCommand, Headline, NextSearch
from diag.analysis.levers import RecipeLevers
from diag.analysis.patterns import PatternInstance, PatternTotal, find_patterns, pattern_totals
from diag.analysis.remedies import Suggestion, all_suggestions
from diag.analysis.taskgrade import attach_task_metrics
from diag.analysis.weights import WeightReport, weight_report
from diag.core.distributions import OUTLIER_FACTOR, PersistentOutlier, TensorHealth, persistent_outliers
from diag.core.encodings import encodings_of, model_from_encodings, not_quantized
from diag.core.feeds import FeedSource, FeedSpec, input_specs
from diag.core.graph import fp_graph
from diag.core.instrument import FusedKernel
from diag.core.load import LoadedModel, model_from_path
from diag.core.match import Matching, match_models
from diag.core.metrics import ErrorAccumulator, ErrorStats, OutputStats
from diag.core.nbits import AccuracyLevelCheck, accuracy_level_nodes, check_accuracy_level
from diag.core.positions import Padding
from diag.core.protos import default_opset
from diag.core.recipe import Recipe
from diag.core.run import check_memory
from diag.core.saturation import predict_avx2
from diag.core.streaming import LARGE_MODEL_BYTES, effect_sample_count
from diag.core.streaming import CompareState as CompareState
from diag.core.streaming import run_comparison as run_comparison
from diag.foundations.cpu import saturation_warning
from diag.foundations.environment import environment
from diag.foundations.errors import DiagError
from diag.foundations.ortfacts import DEPLOY_LEVEL


class SensitivitySection(Protocol):
    """What a :class:`CompareResult` keeps of ``--sensitivity``: a result that writes its diag.json section.

    :func:`diag.cli.verbs.diagnose` stores a :class:`diag.fix.sensitivity.SensitivityResult` here; the
    diagnosis never reads it, and the report reads only its section, so this layer need not know
    the fix layer's type.
    """

    def to_dict(self) -> dict[str, Any]: ...


#: Below this fraction of matched float tensors the two files are not the same graph.
MIN_COVERAGE = 0.3


@dataclass(frozen=True)
class CompareOptions:
    """Knobs of a comparison (the CLI maps its flags one to one onto these).

    The streaming engine reads its share through :class:`diag.core.streaming.StreamOptions`: a field it
    reads is a property there too.
    """

    #: The onnxruntime optimization level the user deploys with (``--deploy-level``): the outputs are
    #: graded as the INT8 model runs there (one extra INT8 run per batch, against the exact FP32
    #: outputs); exact-mode grades are kept beside them. ``"disabled"``: grade exact mode only.
    opt_level: str = DEPLOY_LEVEL
    threads: int | None = None
    local: bool = True
    progress: bool = True
    labels: str | None = None
    distributions: bool = True
    outlier_factor: float = OUTLIER_FACTOR
    #: Bytes one batch's exposed tensors may take; above it the tensors are split into passes.
    max_memory: int | None = None
    #: ``(k, n)``: run only batches k, k + n, k + 2n, ... and keep the mergeable state.
    shard: tuple[int, int] | None = None
    #: Skip-one sensitivity for the top-K local-ranking nodes (0 = off); needs ``recipe``.
    sensitivity: int = 0
    #: The recipe that made the INT8 model (a path, inline JSON or a Recipe), for ``sensitivity``
    #: and the recipe a fix re-quantizes with (read by :func:`diag.cli.verbs.diagnose`, not here).
    recipe: str | Recipe | None = None
    #: ``--output-kind NAME=KIND`` overrides of the kinds inferred from the graph (diag.core.outputs).
    output_kinds: dict[str, str] = field(default_factory=dict)
    #: Candidates whose effect on the outputs is measured by keeping each in float (0 = off).
    effects: int = DEFAULT_CANDIDATES
    #: Samples each effect check runs on (the first ones).
    #: Samples each effect check runs on, the first ones: a count or ``"auto"`` (8, but 4 for FP32
    #: weights of 1 GiB and more: :func:`diag.core.streaming.effect_sample_count`).
    effect_samples: int | str = "auto"
    #: ``module:function`` of a task-metric plugin (:mod:`diag.core.taskmetrics`), reported with the outputs.
    metric: str | None = None
    #: Where per-tensor statistics are computed: ``"numpy"`` (every tensor exposed and reduced in
    #: numpy; the reference implementation) or ``"graph"`` inside onnxruntime (one diagnostic
    #: graph per pass, :mod:`diag.core.diagraph`; equal statistics, leaner, but slower on 2 cores).
    reductions: str = "numpy"
    #: ``ADDRESS`` or ``local[:N]``: run the batches as shards on a Dask cluster (:mod:`diag.fix.cluster`).
    scheduler: str | None = None
    #: Also run the MatMulNBits nodes at this ``accuracy_level`` and measure it against level 0
    #: (:func:`diag.core.nbits.check_accuracy_level`); 0: off.
    accuracy_level_check: int = 0
    #: ``"avx2"``: predict what the INT8 model's u8s8 nodes do on an AVX2 CPU without VNNI
    #: (:func:`diag.core.saturation.predict_avx2` on the captured inputs); None: off.
    deploy_isa: str | None = None

    #: Samples the local error is measured on, the first ones: a count, ``"all"``, or ``"auto"``
    #: (all, but the first 16 for FP32 weights of 1 GiB and more: :func:`diag.core.streaming.local_sample_limit`).
    local_samples: int | str = "auto"
    #: The input whose zeros mark padding that per-tensor errors leave out (``--mask-input``);
    #: None: an input named ``attention_mask`` when the model has one (:mod:`diag.core.positions`).
    mask_input: str | None = None
    #: Count every position, padding included (``--no-mask``).
    no_mask: bool = False
    #: AIMET's encodings file for an FP32 second model (``--encodings``); None: ``<stem>.encodings``
    #: beside it when there is one (:mod:`diag.core.encodings`).
    encodings: str | None = None
    #: Measure the recipe's settings (per_channel, reduce_range, weight_type, symmetry) as causes by
    #: re-quantizing each changed alone, when the effect check finds no single node and the recipe
    #: rebuilds the INT8 model exactly (:mod:`diag.fix.levercheck`), ``--settings``: ``"auto"`` (for
    #: FP32 weights under LARGE_MODEL_BYTES: each setting re-quantizes the whole model), ``"always"``, ``"off"``.
    settings: str = "auto"

    @property
    def reference_samples(self) -> int | str:
        """Samples of FP32 outputs the main pass keeps for the effect check: ``effect_samples``, or 0
        when no check will run."""
        return self.effect_samples if self.effects > 0 and self.local and self.shard is None else 0


@dataclass
class CompareResult:
    """Everything `diag compare` found; rendered by :mod:`diag.report.view`."""

    fp32: LoadedModel
    int8: LoadedModel
    matching: Matching
    accumulated: dict[str, ErrorStats]
    local: dict[str, ErrorStats]
    findings: list[NodeFinding]
    verdicts: list[OutputVerdict]
    grade: str
    #: The verdict's headline, decided once every grade is final (:mod:`diag.analysis.headline`).
    headline: Headline
    input_description: str
    samples: int
    batches: int
    seconds: float
    options: CompareOptions
    runtime_unmatched: dict[str, str]
    environment: dict[str, str]
    health: dict[str, TensorHealth] = field(default_factory=dict)
    persistent: list[PersistentOutlier] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    weights: WeightReport | None = None
    patterns: list[PatternInstance] = field(default_factory=list)
    pattern_instances: list[PatternTotal] = field(default_factory=list)
    pattern_kinds: list[PatternTotal] = field(default_factory=list)
    passes: int = 1
    #: Samples whose local error was measured (the first ones; ``samples`` unless --local-samples limited it).
    local_samples: int = 0
    #: Output figures of what onnxruntime really runs at ``options.opt_level`` (empty when disabled).
    deployed: dict[str, OutputStats] = field(default_factory=dict)
    #: The outputs graded in exact mode (optimizations off), beside ``verdicts`` (graded as deployed);
    #: empty when the deploy level is ``disabled`` (then ``verdicts`` are the exact ones).
    exact_verdicts: list[OutputVerdict] = field(default_factory=list)
    fused: list[FusedKernel] = field(default_factory=list)
    #: The mergeable accumulators behind this result (written into shard files).
    state: CompareState | None = None
    #: ``--sensitivity``: skip-one re-quantizations (set by :func:`diag.cli.verbs.diagnose`).
    sensitivity: SensitivitySection | None = None
    paths: dict[str, list[NodeFinding]] = field(default_factory=dict)
    #: Measured effect on the outputs of keeping each candidate in float (diag.analysis.effects).
    effects: EffectCheck | None = None
    #: Measured effect of keeping the whole suggested list (the root causes) in float.
    list_estimate: ListEstimate | None = None
    #: Weight-only spread remedies re-quantized and measured (diag.fix.remedycheck, with --recipe).
    remedy_checks: dict[str, Any] | None = None
    #: ``--deploy-isa avx2``: per u8s8 node, its predicted saturation on AVX2 without VNNI.
    deploy_isa: dict[str, Any] | None = None
    #: The recipe a suggested fix re-quantizes with (see :func:`diag.fix.infer.fix_recipe`).
    fix_recipe: dict[str, Any] | None = None
    #: Finalized task metrics (see :func:`diag.analysis.taskgrade.attach_task_metrics`).
    task_metrics: dict[str, Any] = field(default_factory=dict)
    #: ``--scheduler``: the cluster's workers, shards, tasks and retries (empty for a local run).
    cluster: dict[str, Any] = field(default_factory=dict)
    #: ``--accuracy-level-check``: the MatMulNBits nodes at that accuracy_level vs 0 (diag.core.nbits).
    accuracy_level: AccuracyLevelCheck | None = None
    #: ``--recipe FILE``: each line of the recipe measured on the model it builds (quantized with
    #: and without the line: :func:`diag.fix.linecheck.measure_lines`); empty otherwise.
    recipe_lines: list[Any] = field(default_factory=list)
    #: The padding the per-tensor errors left out (``accumulated`` / ``local`` count real positions);
    #: None when every position counted (no mask input, or ``--no-mask``).
    padding: Padding | None = None
    #: Errors over every position, padding included, of the tensors that have a sequence axis.
    all_positions: dict[str, ErrorStats] = field(default_factory=dict)
    all_positions_local: dict[str, ErrorStats] = field(default_factory=dict)
    #: The recipe's settings, each changed alone, re-quantized and measured (:mod:`diag.fix.levercheck`);
    #: None when not tried (a node is the cause, no effect check, ``--settings off``).
    recipe_settings: RecipeLevers | None = None

    @property
    def single_cause(self) -> bool:
        """The headline names one node as the cause."""
        return self.headline.single_cause

    @property
    def cause_sentence(self) -> str:
        """The headline's sentence (:meth:`diag.analysis.headline.Headline.text`)."""
        return self.headline.text()

    @property
    def verify_command(self) -> str:
        """The diag exclude command that verifies and prunes the suggested list (from this run's
        inputs); "" before the paths are known, or when this report is the search's own."""
        command = self.headline.search.command
        return "" if command is None or self.headline.search.held_here else str(command)


def load_pair(
    fp32_path: str | Path, int8_path: str | Path, encodings: str | Path | None = None, read_encodings: bool = False
) -> tuple[LoadedModel, LoadedModel]:
    """Load both models and check they are an FP32 / INT8 pair of the same graph, in that order.

    ``read_encodings``: an FP32 second model with AIMET's encodings beside it (``<stem>.encodings``),
    or at ``encodings``, is the QDQ model they describe (:mod:`diag.core.encodings`).
    """
    fp = model_from_path(fp32_path, "FP32 model")
    q = model_from_path(int8_path, "INT8 model")
    where = encodings_of(q, encodings)
    if where is not None and (encodings is not None or read_encodings):
        q = model_from_encodings(q, where)
    fk, qk = fp.format.kind, q.format.kind
    if fk != "fp32" and qk == "fp32":
        raise DiagError(
            "swapped-models",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"the first is quantized ({fk}) and the second is FP32: did you swap them?",
            "put the FP32 model first: diag compare FP32 INT8",
        )
    if qk == "fp32":
        raise not_quantized(q)
    if fk != "fp32":
        raise DiagError(
            "fp32-is-quantized",
            f"FP32 model '{fp.path}'",
            f"already contains quantized operators ({fk})",
            "pass the original float model first",
        )
    pair = f"models '{fp.path.name}' / '{q.path.name}'"
    f_in = {s.name: s for s in input_specs(fp.proto)}
    q_in = {s.name: s for s in input_specs(q.proto)}
    _same_names(pair, "inputs", f_in, q_in)
    _same_names(pair, "outputs", [o.name for o in fp.graph.output], [o.name for o in q.graph.output])
    return fp, q


def _same_names(pair: str, what: str, fp_names: Collection[str], q_names: Collection[str]) -> None:
    """Both models have the same input (output) names, else ``model-mismatch`` listing both."""
    if set(fp_names) != set(q_names):
        raise DiagError(
            "model-mismatch",
            pair,
            f"have different {what} ({sorted(fp_names)} vs {sorted(q_names)})",
            "compare an INT8 model with the FP32 model it was quantized from",
        )


@dataclass
class Prepared:
    """Two models checked as a pair, their matching, and the inputs opened against the FP32 model.

    What :func:`prepare_comparison` hands to a run (:func:`run_comparison` here, or the verb's
    cluster run) and then to :func:`analyze_comparison`.
    """

    fp: LoadedModel
    q: LoadedModel
    matching: Matching
    feeds: FeedSource
    #: The inputs as given, when they were a FeedSpec (a cluster's workers open them themselves).
    spec: FeedSpec | None
    #: ``time.perf_counter()`` when the comparison started (``CompareResult.seconds`` counts from it).
    start: float


def compare_models(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource | FeedSpec, options: CompareOptions | None = None
) -> CompareResult:
    """Compare an FP32 model and its INT8 version tensor by tensor on ``feeds``.

    The diagnosis only: the fix-side additions of ``diag compare`` (the recipe a fix re-quantizes
    with, ``--sensitivity``, ``--scheduler``) are :func:`diag.cli.verbs.diagnose`'s, which calls the
    three steps below; ``options.scheduler``, ``options.sensitivity`` and ``options.recipe`` are
    not read here.

    Example:
        >>> from diag.core.feeds import FeedSpec
        >>> r = compare_models("fp32.onnx", "int8.onnx", FeedSpec(random=True))  # doctest: +SKIP
        >>> r.findings[0].group.label  # doctest: +SKIP
        'conv3'
    """
    options = options or CompareOptions()
    run = prepare_comparison(fp32_path, int8_path, feeds, options)
    state, runtime_unmatched = run_comparison(run.fp, run.q, run.matching, run.feeds, options)
    result = analyze_comparison(run, state, runtime_unmatched, options)
    if result.effects is not None:
        result.effects.reference = None  # kept for the settings' check, which is diagnose's
    return result


def prepare_comparison(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource | FeedSpec, options: CompareOptions
) -> Prepared:
    """Load and check the pair, refuse what cannot fit or be matched, open the inputs: no model runs yet."""
    start = time.perf_counter()
    fp, q = load_pair(fp32_path, int8_path, options.encodings, read_encodings=True)
    if options.accuracy_level_check:
        accuracy_level_nodes(q.proto, options.accuracy_level_check)  # a wrong flag fails before any work
    cpu_warning = saturation_warning(q.proto)
    if cpu_warning is not None and cpu_warning not in q.warnings:
        q.warnings.append(cpu_warning)
    # Pre-flight: refuse declared shapes that cannot fit before any session allocates them
    # (with --max-memory the user chose the budget and the tensors are split to fit it).
    if options.max_memory is None:
        check_memory(
            [(fp.proto, "FP32 model", 1), (q.proto, "INT8 model", 2 if options.local else 1)],
            feeds.batch if isinstance(feeds, FeedSpec) else 1,
        )
    spec = feeds if isinstance(feeds, FeedSpec) else None
    source = feeds.source(fp.proto) if isinstance(feeds, FeedSpec) else feeds
    matching = match_models(fp.proto, q.proto)
    if matching.coverage < MIN_COVERAGE:
        raise DiagError(
            "model-mismatch",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"only {matching.coverage:.0%} of FP32 tensors exist in the INT8 model",
            "compare an INT8 model with the FP32 model it was quantized from",
        )
    return Prepared(fp, q, matching, source, spec, start)


def analyze_comparison(
    run: Prepared, state: CompareState, runtime_unmatched: dict[str, str], options: CompareOptions
) -> CompareResult:
    """Finish the state into a result, then confirm causes by effect and attach the task metrics."""
    fp, q, matching, feeds = run.fp, run.q, run.matching, run.feeds
    seconds = time.perf_counter() - run.start
    # NOTE: the weight report reads only the two models: it runs on a thread beside the effect
    # check, whose session building is mostly single-threaded (500M int4 decoder, 2 cores: the
    # report took ~20 s and the check ~40 s one after the other).
    pool = ThreadPoolExecutor(1, thread_name_prefix="diag-weight-report")
    try:
        pending = pool.submit(_weight_report, fp, q)
        result = finish(fp, q, matching, state, runtime_unmatched, feeds.description, options, seconds, pending)
        _confirm_causes(run, state, result, options)
        attach_weights(result, pending.result())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # on an error, do not wait for the report
    result.seconds = time.perf_counter() - run.start
    if options.accuracy_level_check and options.shard is None:
        result.accuracy_level = check_accuracy_level(
            q.proto,
            feeds,
            options.accuracy_level_check,
            effect_sample_count(options.effect_samples, fp),
            options.threads,
            fp.proto,
            q.external_dir,
        )
        result.seconds = time.perf_counter() - run.start
    if options.deploy_isa == "avx2" and options.shard is None:
        result.deploy_isa = deploy_isa_prediction(result, feeds)
        result.seconds = time.perf_counter() - run.start
    command = exclude_search(fp.path, q.shown_path, run.spec, exclusion_target(result.verdicts))
    result.headline.search = NextSearch(dataclasses.replace(command, encodings=options.encodings))
    return result


def _confirm_causes(run: Prepared, state: CompareState, result: CompareResult, options: CompareOptions) -> None:
    """The effect check: which candidate's float region removes the failing output's error."""
    fp, q, matching, feeds = run.fp, run.q, run.matching, run.feeds
    # NOTE: no effect check on FP16 models: onnxruntime's CPU provider runs a float16 graph partly
    # in float32, and which parts depends on the graph, so a one-node change moves where FP16
    # overflows. The NaN/Inf origin and the converter's re-run (fp16health.fp16_fix) are the measure.
    if options.effects > 0 and options.local and options.shard is None and q.format.family != "fp16":
        specs = {k: a.spec for k, a in state.outputs.items()}
        samples = effect_sample_count(options.effect_samples, fp)
        # The exact-mode figures beside the deployed ones cost a run per candidate: not on models as
        # large as those whose effect check is cut to fewer samples (LARGE_MODEL_BYTES).
        exact = 0 if fp.weight_bytes >= LARGE_MODEL_BYTES else EXACT_CANDIDATES
        budget = EffectBudget(options.effects, samples, options.threads, options.progress, exact=exact)
        findings, paths = result.findings, result.paths
        # Aim at the outputs that fail (issue 25, item 5), the answers before the KV caches.
        aim = aimed_outputs(result.verdicts)
        if len(aim) < len(specs):
            findings = upstream_of(findings, aim)
            paths = {k: v for k, v in paths.items() if k in aim}
        aimed = {k: v for k, v in specs.items() if k in aim}
        kept = state.kept_outputs.batches() if state.kept_outputs is not None else None
        result.effects = check_effects(fp, q, matching, feeds, findings, paths, aimed, budget, kept)
        result.headline = confirmed_cause(
            result.findings, result.effects, result.grade, result.verdicts, specs, matching, q.format.family
        )
        suggested, _unnamed = recommended_nodes(result.findings)
        result.list_estimate = estimate_list(fp, q, matching, feeds, suggested, result.effects, specs, options.threads)
        if result.effects is not None and options.settings == "off":
            result.effects.reference = None  # the FP32 outputs it kept (diagnose measures the settings on them)
    if state.kept_outputs is not None:
        state.kept_outputs.close()  # the maps the check read are dropped with it


def deploy_isa_prediction(result: CompareResult, feeds: FeedSource) -> dict[str, Any]:
    """Every u8s8 node's predicted AVX2-without-VNNI saturation, next to its measured local SQNR.

    The saturation error and the node's own quantization error are independent, so the node's
    SQNR on AVX2 is their noise powers added (:meth:`diag.core.saturation.NodePrediction.predicted_sqnr_db`);
    measured here means exact integer arithmetic, which is what this run's per-node figures are.
    Nodes are ranked by the predicted drop, largest first.
    """
    preds = predict_avx2(str(result.int8.path), (b.feeds for b in feeds))
    finding_of = {n: f for f in result.findings for n in f.group.int8_nodes}
    nodes = []
    for p in preds:
        f = finding_of.get(p.node)
        stats = (f.local or f.accumulated) if f is not None else None
        p.measured_sqnr_db = stats.sqnr_db if stats is not None and math.isfinite(stats.sqnr_db) else None
        entry = p.to_dict()
        entry["fp32_node"] = f.group.label if f is not None else None
        entry["sentence"] = p.sentence(f.group.label if f is not None else None)
        predicted, measured = p.predicted_sqnr_db(), p.measured_sqnr_db
        entry["drop_db"] = round(measured - predicted, 2) if predicted is not None and measured is not None else None
        nodes.append(entry)
    nodes.sort(key=lambda e: (-(e["drop_db"] or 0.0), -e["saturated_pairs"]))
    return {
        "isa": "avx2",
        "u8s8_nodes": len(nodes),
        "saturating_nodes": sum(1 for e in nodes if e["saturated_pairs"]),
        "nodes": nodes,
    }


def exclude_search(fp32: Path, int8: Path, spec: FeedSpec | None, target: str = "cosine>=0.99") -> ExcludeCommand:
    """The exact command that runs an exclusion search from this INT8 model's own recipe.

    ``--int8`` makes the search start from the recipe read back from the INT8 model, so its
    baseline is the user's quantization, not onnxruntime's defaults. Paths are printed as the
    user gave them, shell-quoted (the target's ``>=`` would otherwise be a redirection); the target
    is the "acceptable" cosine band.

    Example:
        >>> print(exclude_search(Path("m.onnx"), Path("q.onnx"), FeedSpec(inputs="x.npz")))
        diag exclude m.onnx --int8 q.onnx --inputs x.npz --target 'cosine>=0.99'
    """
    if spec is not None and spec.inputs:
        feeds = f"--inputs {shlex.quote(spec.inputs)}"
    elif spec is not None and spec.random:
        feeds = "--random"
    else:
        feeds = "--inputs INPUTS"
    if spec is not None and spec.batch != 1:
        # Dynamic quantization scales each batch as a whole: the search must batch as this run did.
        feeds += f" --batch {spec.batch}"
    return ExcludeCommand(str(fp32), str(int8), feeds, target)


#: The cosine targets an exclusion search is suggested with, loosest first: the bands' "acceptable"
#: and "excellent" thresholds, then one more decade for a model already in the excellent band.
SUGGESTED_COSINES = (0.99, 0.999, 0.9999)


def exclusion_target(verdicts: list[OutputVerdict]) -> str:
    """The target a suggested exclusion search aims at: the loosest cosine band the worst output
    does not reach yet, so the command always has work to do (issue 45: the demo suggested
    ``cosine>=0.99`` to a model at 0.9965, and the search answered "nothing to exclude").

    Example:
        >>> exclusion_target([])
        'cosine>=0.99'
    """
    worst = min((v.per_sample.cosine_min for v in verdicts), default=0.0)
    target = next((t for t in SUGGESTED_COSINES if worst < t), SUGGESTED_COSINES[-1])
    return f"cosine>={target}"


def finish(  # NOTE: a shard merge's eight parameters, and the report computed beside the effect check
    fp: LoadedModel,
    q: LoadedModel,
    matching: Matching,
    state: CompareState,
    runtime_unmatched: dict[str, str],
    description: str,
    options: CompareOptions,
    seconds: float,
    weights: Future[WeightReport] | None = None,
) -> CompareResult:
    """Finalize accumulators and run the analysis (also used after merging shards).

    ``weights``: the weight report being computed elsewhere (:func:`analyze_comparison` runs it
    beside the effect check); the result then holds an empty report and no suggestions until
    :func:`attach_weights` gives it the report. Without it the report is computed here.
    """
    figures = state.finalize(options.outlier_factor)
    accumulated, local, health = figures.accumulated, figures.local, figures.health
    graph = fp_graph(fp.proto)
    findings = node_findings(matching.groups, accumulated, local, graph, [o.name for o in fp.proto.graph.output])
    verdicts, exact_verdicts = _graded_outputs(state, figures, accumulated)
    # Every grade is final before any headline is decided from it: the F1 drop joins them here.
    grades = _Grades(verdicts, overall_grade(verdicts))
    attach_task_metrics(grades, state.task, options.metric, exact_verdicts)
    specs = {k: a.spec for k, a in state.outputs.items()}
    headline = confirmed_cause(findings, None, grades.grade, verdicts, specs, matching, q.format.family)
    headline = _fp16_headline(findings, state, headline)
    patterns = find_patterns(fp.proto)
    tensor_of_node = {n: f.tensor for f in findings for n in f.group.fp_nodes}
    per_instance, per_kind = pattern_totals(patterns, accumulated, local, tensor_of_node)
    result = CompareResult(
        fp,
        q,
        matching,
        accumulated,
        local,
        findings,
        verdicts,
        grades.grade,
        headline,
        description,
        state.samples,
        state.batches,
        seconds,
        options,
        runtime_unmatched,
        environment(),
        health,
        persistent_outliers(health),
        [],  # suggestions: with the weight report (attach_weights)
        WeightReport([], {}),
        patterns,
        per_instance,
        per_kind,
        paths=error_paths(findings, [o.name for o in fp.graph.output]),
        passes=state.passes,
        local_samples=state.local_samples,
        deployed=figures.deployed,
        fused=list(state.fused),
        state=state,
        exact_verdicts=exact_verdicts,
        task_metrics=grades.task_metrics,
        padding=Padding(state.mask_input, state.positions, state.padding) if state.mask_input else None,
        all_positions=figures.all_positions,
        all_positions_local=figures.all_positions_local,
    )
    if weights is None:
        attach_weights(result, _weight_report(fp, q))
    return result


def _graded_outputs(
    state: CompareState, figures: CompareState.Figures, accumulated: dict[str, ErrorStats]
) -> tuple[list[OutputVerdict], list[OutputVerdict]]:
    """(the outputs graded as deployed, the same in exact mode); one list, exact, without a deploy level.

    NOTE: the grades, the bands and ``diag check`` follow what the user runs: onnxruntime's fused
    integer kernels at the deploy level compute other outputs than exact mode (a MiniLM classifier's
    F1 drop: 1.07 % exact, 1.82 % deployed; issue 42 item 3). Exact-mode grades stay beside them.
    A KV cache present is graded on the positions it adds, which only the exact run separates.
    """
    labelled = state.labelled if state.labelled["n"] else None
    exact_labels = {**labelled, "int8": labelled.get("int8_exact", labelled["int8"])} if labelled else None
    deployed = figures.deployed
    exact: list[OutputVerdict] = []
    graded: list[OutputVerdict] = []
    for i, name in enumerate(state.outputs):
        new_positions = state.outputs[name].new_position_errors()
        stats = new_positions or accumulated.get(name) or ErrorAccumulator().finalize()
        exact.append(
            grade_output(
                name, stats, figures.outputs[name], (exact_labels if deployed else labelled) if i == 0 else None
            )
        )
        dep = state.deployed.get(name)
        if name in deployed and dep is not None and dep.errors is not None and new_positions is None:
            # A Concat part's local error is measured in exact mode only (where the cut model runs):
            # the deployed figures of the part keep it, so a destroyed part still names its Concat.
            with_local = copy.copy(dep)
            with_local.part_local = state.outputs[name].part_local
            per_sample = with_local.finalize()
            graded.append(grade_output(name, dep.errors.finalize(), per_sample, labelled if i == 0 else None))
        else:
            graded.append(exact[-1])
    return graded, (exact if deployed else [])


def _weight_report(fp: LoadedModel, q: LoadedModel) -> WeightReport:
    return weight_report(fp.proto, q.proto, fp.external_dir, q.external_dir)


def attach_weights(result: CompareResult, report: WeightReport) -> None:
    """Give ``result`` (from :func:`finish` with a pending report) its weight report and the
    suggestions that depend on it."""
    result.weights = report
    fp, q = result.fp32, result.int8
    producer = q.producer_key()
    result.suggestions = all_suggestions(
        fp.proto, result.matching, result.health, q.format.family, report.findings, producer, default_opset(q.proto, 13)
    )
    judge_remedies(result.suggestions, result.effects)  # no advice against its own measurement


def _fp16_headline(findings: list[NodeFinding], state: CompareState, headline: Headline) -> Headline:
    """An FP16 model that creates NaN/Inf: its origin is the cause (see
    :func:`diag.analysis.fp16health.nonfinite_cause`)."""
    if not state.fp16_ranges:
        return headline
    cause = nonfinite_cause(findings, state.fp16_ranges)
    return cause if cause is not None else headline


@dataclass
class _Grades:
    """The outputs' grades while they are being made final (:class:`diag.analysis.taskgrade.Graded`)."""

    verdicts: list[OutputVerdict]
    grade: str
    task_metrics: dict[str, Any] = field(default_factory=dict)
