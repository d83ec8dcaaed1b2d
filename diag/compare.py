"""`diag compare` as one library call: load, match, instrument, stream, reduce, analyze.

Memory is O(one batch): each batch's FP32, INT8 and cut-model outputs are reduced into
accumulators and dropped before the next batch is read.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag import __version__
from diag.analyze import (
    NodeFinding,
    OutputVerdict,
    grade_output,
    node_findings,
    overall_grade,
    single_cause,
)
from diag.distributions import (
    OUTLIER_FACTOR,
    DistributionAccumulator,
    GridInfo,
    PersistentOutlier,
    TensorHealth,
    persistent_outliers,
)
from diag.errors import DiagError
from diag.feeds import FeedSource, FeedSpec, input_specs, load_labels
from diag.graph import fp_graph
from diag.instrument import cut_model, exposed_model
from diag.load import LoadedModel, model_from_path
from diag.match import Matching, TensorPair, match_models, node_id
from diag.metrics import ErrorAccumulator, ErrorStats, OutputAccumulator
from diag.patterns import PatternInstance, PatternTotal, find_patterns, pattern_totals
from diag.progress import Progress
from diag.remedies import Suggestion, all_suggestions
from diag.run import check_memory, run_batch, session_from_model
from diag.weights import WeightReport, weight_report

#: Below this fraction of matched float tensors the two files are not the same graph.
MIN_COVERAGE = 0.3


@dataclass
class CompareOptions:
    """Knobs of a comparison (the CLI maps its flags one to one onto these)."""

    opt_level: str = "disabled"
    threads: int | None = None
    local: bool = True
    progress: bool = True
    labels: str | None = None
    distributions: bool = True
    outlier_factor: float = OUTLIER_FACTOR
    #: Skip-one sensitivity for the top-K local-ranking nodes (0 = off); needs ``recipe``.
    sensitivity: int = 0
    #: The recipe that made the INT8 model (a path or a Recipe), for ``sensitivity``.
    recipe: Any = None


@dataclass
class CompareState:
    """The mergeable part of a comparison: accumulators only, no tensors."""

    accumulated: dict[str, ErrorAccumulator] = field(default_factory=dict)
    local: dict[str, ErrorAccumulator] = field(default_factory=dict)
    outputs: dict[str, OutputAccumulator] = field(default_factory=dict)
    distributions: dict[str, DistributionAccumulator] = field(default_factory=dict)
    labelled: dict[str, int] = field(default_factory=lambda: {"n": 0, "fp32": 0, "int8": 0})
    samples: int = 0
    batches: int = 0

    def merge(self, other: CompareState) -> CompareState:
        for mine, theirs in ((self.accumulated, other.accumulated), (self.local, other.local)):
            for k, acc in theirs.items():
                mine.setdefault(k, ErrorAccumulator()).merge(acc)
        for k, oacc in other.outputs.items():
            self.outputs.setdefault(k, OutputAccumulator()).merge(oacc)
        for k, dacc in other.distributions.items():
            if k in self.distributions:
                self.distributions[k].merge(dacc)
            else:
                self.distributions[k] = dacc
        for k in self.labelled:
            self.labelled[k] += other.labelled[k]
        self.samples += other.samples
        self.batches += other.batches
        return self


@dataclass
class CompareResult:
    """Everything `diag compare` found; rendered by :mod:`diag.report`."""

    fp32: LoadedModel
    int8: LoadedModel
    matching: Matching
    accumulated: dict[str, ErrorStats]
    local: dict[str, ErrorStats]
    findings: list[NodeFinding]
    verdicts: list[OutputVerdict]
    grade: str
    single_cause: bool
    cause_sentence: str
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
    sensitivity: Any = None


def load_pair(fp32_path: str | Path, int8_path: str | Path) -> tuple[LoadedModel, LoadedModel]:
    """Load both models and check they are an FP32 / INT8 pair of the same graph, in that order."""
    fp = model_from_path(fp32_path, "FP32 model")
    q = model_from_path(int8_path, "INT8 model")
    fk, qk = fp.format.kind, q.format.kind
    if fk != "fp32" and qk == "fp32":
        raise DiagError(
            "swapped-models",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"the first is quantized ({fk}) and the second is FP32: did you swap them?",
            "put the FP32 model first: diag compare FP32 INT8",
        )
    if qk == "fp32":
        raise DiagError(
            "not-quantized",
            f"INT8 model '{q.path}'",
            "contains no quantized operators",
            "pass the output of quantize_dynamic / quantize_static as the second model",
        )
    if fk != "fp32":
        raise DiagError(
            "fp32-is-quantized",
            f"FP32 model '{fp.path}'",
            f"already contains quantized operators ({fk})",
            "pass the original float model first",
        )
    f_in = {s.name: s for s in input_specs(fp.proto)}
    q_in = {s.name: s for s in input_specs(q.proto)}
    if set(f_in) != set(q_in):
        raise DiagError(
            "model-mismatch",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"have different inputs ({sorted(f_in)} vs {sorted(q_in)})",
            "compare an INT8 model with the FP32 model it was quantized from",
        )
    f_out = [o.name for o in fp.graph.output]
    q_out = [o.name for o in q.graph.output]
    if set(f_out) != set(q_out):
        raise DiagError(
            "model-mismatch",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"have different outputs ({sorted(f_out)} vs {sorted(q_out)})",
            "compare an INT8 model with the FP32 model it was quantized from",
        )
    return fp, q


def compare_models(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource | FeedSpec, options: CompareOptions | None = None
) -> CompareResult:
    """Compare an FP32 model and its INT8 version tensor by tensor on ``feeds``.

    Example:
        >>> from diag.feeds import FeedSpec
        >>> r = compare_models("fp32.onnx", "int8.onnx", FeedSpec(random=True))  # doctest: +SKIP
        >>> r.findings[0].group.label  # doctest: +SKIP
        'conv3'
    """
    options = options or CompareOptions()
    start = time.perf_counter()
    fp, q = load_pair(fp32_path, int8_path)
    # Pre-flight: refuse declared shapes that cannot fit before any session allocates them.
    check_memory(
        [(fp.proto, "FP32 model", 1), (q.proto, "INT8 model", 2 if options.local else 1)],
        feeds.batch if isinstance(feeds, FeedSpec) else 1,
    )
    if isinstance(feeds, FeedSpec):
        feeds = feeds.source(fp.proto)
    matching = match_models(fp.proto, q.proto)
    if matching.coverage < MIN_COVERAGE:
        raise DiagError(
            "model-mismatch",
            f"models '{fp.path.name}' / '{q.path.name}'",
            f"only {matching.coverage:.0%} of FP32 tensors exist in the INT8 model",
            "compare an INT8 model with the FP32 model it was quantized from",
        )
    state, runtime_unmatched = run_comparison(fp, q, matching, feeds, options)
    result = finish(fp, q, matching, state, runtime_unmatched, feeds.description, options, time.perf_counter() - start)
    if options.sensitivity > 0:
        result.sensitivity = _sensitivity(fp32_path, int8_path, feeds, result, options)
        result.seconds = time.perf_counter() - start
    return result


def _sensitivity(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource, result: CompareResult, options: CompareOptions
) -> Any:
    from diag.recipe import Recipe, recipe_from_option
    from diag.sensitivity import skip_one_sensitivity

    if options.recipe is None:
        raise DiagError(
            "bad-option",
            "--sensitivity",
            "needs the recipe that made the INT8 model",
            "add --recipe recipe.json (diag inspect INT8 --recipe writes one)",
        )
    recipe = options.recipe if isinstance(options.recipe, Recipe) else recipe_from_option(options.recipe)
    return skip_one_sensitivity(
        fp32_path, int8_path, recipe, feeds, result.findings, options.sensitivity, options.threads, options.progress
    )


def run_comparison(
    fp: LoadedModel, q: LoadedModel, matching: Matching, feeds: FeedSource, options: CompareOptions
) -> tuple[CompareState, dict[str, str]]:
    """Stream every batch through FP32, INT8 and cut models; reduce into a CompareState."""
    labels = load_labels(options.labels) if options.labels else None
    if labels is not None and feeds.total_samples is not None and len(labels) < feeds.total_samples:
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"has {len(labels)} labels but the inputs have {feeds.total_samples} samples",
            "give one label per sample",
        )
    pairs = dict(matching.pairs)
    output_names = [o.name for o in fp.graph.output]
    fp_names = list(dict.fromkeys(list(pairs) + output_names))
    int8_names = list(
        dict.fromkeys(
            [p.int8_name for p in pairs.values()]
            + [p.dynamic_scale for p in pairs.values() if p.dynamic_scale]
            + output_names
        )
    )
    ext_fp = fp.path.resolve().parent if fp.has_external_data else None
    ext_q = q.path.resolve().parent if q.has_external_data else None
    fp_sess = session_from_model(
        exposed_model(fp.proto, fp_names), f"FP32 model '{fp.path}'", options.opt_level, options.threads, ext_fp
    )
    q_sess = session_from_model(
        exposed_model(q.proto, int8_names), f"INT8 model '{q.path}'", options.opt_level, options.threads, ext_q
    )
    cut = None
    cut_sess = None
    if options.local:
        local_pairs = [p for p in pairs.values() if p.producer is not None]
        cut = cut_model(q.proto, local_pairs)
        cut_sess = session_from_model(
            cut.model, f"cut INT8 model of '{q.path}'", options.opt_level, options.threads, ext_q
        )
    state = CompareState()
    if options.distributions:
        ops = {node_id(n, i): n.op_type for i, n in enumerate(fp.graph.node)}
        for name, pair in pairs.items():
            grid = GridInfo.from_params(pair.grid) if pair.grid is not None else None
            state.distributions[name] = DistributionAccumulator(grid, ops.get(pair.producer or ""))
    runtime_unmatched: dict[str, str] = {}
    progress = Progress(feeds.total_samples, "compare", enabled=options.progress)
    try:
        for batch in feeds:
            fp_out = run_batch(fp_sess, batch.feeds, f"FP32 model '{fp.path.name}'")
            q_out = run_batch(q_sess, batch.feeds, f"INT8 model '{q.path.name}'")
            for name, pair in list(pairs.items()):
                value = q_out[pair.int8_name]
                if pair.dequant is not None:
                    value = pair.dequant.dequantize(value)
                ref = fp_out[name]
                if value.shape != ref.shape:
                    runtime_unmatched[name] = (
                        f"shape differs at run time: FP32 {ref.shape}, INT8 '{pair.int8_name}' {value.shape}"
                    )
                    del pairs[name]
                    state.accumulated.pop(name, None)
                    state.distributions.pop(name, None)
                    continue
                scale = _scale_for(pair, q_out)
                state.accumulated.setdefault(name, ErrorAccumulator()).update(ref, value, scale)
                if name in state.distributions:
                    dyn = scale if pair.dynamic_scale else None
                    state.distributions[name].update(ref, value, dyn)
            for name in output_names:
                state.outputs.setdefault(name, OutputAccumulator()).update(fp_out[name], q_out[name])
            if labels is not None:
                _count_correct(state, labels, fp_out[output_names[0]], q_out[output_names[0]], batch.size)
            del q_out
            if cut is not None and cut_sess is not None:
                cut_feeds = dict(batch.feeds)
                for ci in cut.inputs:
                    v = fp_out[ci.fp_name]
                    if ci.quant is not None:
                        v = ci.quant.quantize(v, onnx.helper.tensor_dtype_to_np_dtype(ci.dtype))
                    cut_feeds[ci.name] = v
                local_out = run_batch(cut_sess, cut_feeds, f"cut INT8 model of '{q.path.name}'")
                for lo in cut.outputs:
                    if lo.fp_name not in pairs:
                        continue
                    value = local_out[lo.name]
                    if lo.dequant is not None:
                        value = lo.dequant.dequantize(value)
                    ref = fp_out[lo.fp_name]
                    if value.shape == ref.shape:
                        state.local.setdefault(lo.fp_name, ErrorAccumulator()).update(
                            ref, value, _scale_for(pairs[lo.fp_name], None)
                        )
                del local_out
            del fp_out
            state.samples += batch.size
            state.batches += 1
            progress.advance(batch.size)
    finally:
        progress.close()
    if state.batches == 0:
        raise DiagError("bad-inputs", "inputs", "yielded zero samples", "provide at least one sample")
    return state, runtime_unmatched


def _count_correct(state: CompareState, labels: np.ndarray, fp: np.ndarray, q: np.ndarray, size: int) -> None:
    start = state.samples
    if fp.ndim != 2 or fp.shape[0] != size:
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"needs the first model output to be [batch, classes], it is {fp.shape}",
            "drop --labels for this model",
        )
    if start + size > len(labels):
        raise DiagError(
            "bad-inputs",
            "--labels",
            f"has {len(labels)} labels but the inputs have more samples",
            "give one label per sample",
        )
    truth = labels[start : start + size]
    state.labelled["n"] += size
    state.labelled["fp32"] += int((fp.argmax(axis=1) == truth).sum())
    state.labelled["int8"] += int((q.argmax(axis=1) == truth).sum())


def _scale_for(pair: TensorPair, q_out: dict[str, np.ndarray] | None) -> float | None:
    if pair.grid is not None:
        return pair.grid.per_tensor_scale
    if pair.dynamic_scale and q_out is not None and pair.dynamic_scale in q_out:
        return float(np.max(q_out[pair.dynamic_scale]))
    return None


def finish(
    fp: LoadedModel,
    q: LoadedModel,
    matching: Matching,
    state: CompareState,
    runtime_unmatched: dict[str, str],
    description: str,
    options: CompareOptions,
    seconds: float,
) -> CompareResult:
    """Finalize accumulators and run the analysis (also used after merging shards)."""
    accumulated = {k: a.finalize() for k, a in state.accumulated.items()}
    local = {k: a.finalize() for k, a in state.local.items()}
    graph = fp_graph(fp.proto)
    findings = node_findings(matching.groups, accumulated, local, graph)
    labelled = state.labelled if state.labelled["n"] else None
    verdicts = [
        grade_output(
            name,
            accumulated.get(name) or ErrorAccumulator().finalize(),
            state.outputs[name].finalize(),
            labelled if i == 0 else None,
        )
        for i, name in enumerate(state.outputs)
    ]
    one, sentence = single_cause(findings)
    health = {k: d.finalize(options.outlier_factor) for k, d in state.distributions.items()}
    weights = weight_report(fp.proto, q.proto)
    suggestions = all_suggestions(fp.proto, matching, health, q.format.kind, weights.findings)
    patterns = find_patterns(fp.proto)
    tensor_of_node = {n: f.tensor for f in findings for n in f.group.fp_nodes}
    per_instance, per_kind = pattern_totals(patterns, accumulated, local, tensor_of_node)
    return CompareResult(
        fp,
        q,
        matching,
        accumulated,
        local,
        findings,
        verdicts,
        overall_grade(verdicts),
        one,
        sentence,
        description,
        state.samples,
        state.batches,
        seconds,
        options,
        runtime_unmatched,
        environment(),
        health,
        persistent_outliers(health),
        suggestions,
        weights,
        patterns,
        per_instance,
        per_kind,
    )


def environment() -> dict[str, str]:
    """Versions and date recorded in every report (scrubbed in golden tests)."""
    import onnxruntime as ort

    return {
        "diag": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(terse=True),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def compare_to_dir(
    fp32_path: str | Path,
    int8_path: str | Path,
    feeds: FeedSource | FeedSpec,
    out_dir: str | Path,
    options: CompareOptions | None = None,
) -> tuple[CompareResult, dict[str, Path]]:
    """`diag compare` end to end: compare, then write diag.json, report.html and summary.md."""
    from diag.report import document_from_result, write_outputs

    result = compare_models(fp32_path, int8_path, feeds, options)
    return result, write_outputs(document_from_result(result), out_dir)
