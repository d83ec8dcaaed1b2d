"""The library call behind each CLI verb: options in, the verb's output set written all-or-nothing,
summary lines out.

``diag.cli`` parses flags into the options of one function here and prints the lines it returns;
nothing the user sees is decided in the CLI. This is the one layer that may call both sides of
the pipeline: ``diag compare`` is the diagnosis (:func:`diag.compare.compare_models`) plus the
fix-side steps it reports (the recipe a fix re-quantizes with, ``--sensitivity``,
``--scheduler``), then the report (:mod:`diag.report`).
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag import compare as pipeline
from diag import diff as document_diff
from diag import gate
from diag.analyze import nonfinite_origins
from diag.cluster import compare_on_cluster, require_scheduler
from diag.compare import CompareOptions, CompareResult
from diag.environment import printable
from diag.errors import DiagError
from diag.feeds import FeedSource, FeedSpec
from diag.files import check_outputs
from diag.fp16health import fp16_range_lines
from diag.gate import Gates
from diag.infer import fix_recipe, recipe_to_file, recipe_to_toml
from diag.lint import lint_recipe_file
from diag.lint import summary_line as lint_summary_line
from diag.load import model_summary
from diag.merge import add_shard_state, merge_shards
from diag.precision import describe
from diag.recipe import Recipe, recipe_from_option
from diag.report import OUTPUT_NAMES, document_from_result, report_to_dir, write_outputs
from diag.sensitivity import SensitivityResult, skip_one_sensitivity
from diag.taskmetrics import task_lines

# --- diagnosing verbs ---


@dataclass(frozen=True)
class Summary:
    """What a verb prints (one line each, untrusted names still in them: the CLI makes them
    printable) and whether it failed its gate (the CLI's exit code 3)."""

    lines: list[str] = field(default_factory=list)
    failed: bool = False


@dataclass(frozen=True)
class InspectOptions:
    """``diag inspect MODEL [--recipe] [--recipe-out FILE]``."""

    model: str
    #: Print the recipe that made the INT8 model (TOML) instead of the summary.
    recipe: bool = False
    #: Write that recipe to this file (.toml with comments, .json without).
    recipe_out: str | None = None


@dataclass(frozen=True)
class MergeOptions:
    """``diag merge PART... --out DIR [--fp32 PATH] [--int8 PATH]``."""

    parts: tuple[str, ...]
    out: str = "diag-out"
    #: The models, when they moved since the shards ran.
    fp32: str | None = None
    int8: str | None = None


@dataclass(frozen=True)
class ReportOptions:
    """``diag report DIAG.JSON --out DIR|FILE.html``."""

    json: str
    out: str = "diag-out"


@dataclass(frozen=True)
class DemoOptions:
    """``diag demo``: which bundled fixture, in which format, and whether to derive the fix."""

    out: str = "diag-demo"
    fixture: str = "transformer"
    format: str = "dynamic"
    samples: int = 32
    progress: bool = True
    fix: bool = True


@dataclass(frozen=True)
class CheckOptions:
    """``diag check DIAG.JSON`` with its gates."""

    json: str
    gates: Gates


@dataclass(frozen=True)
class DiffOptions:
    """``diag diff A B [--top N] [--json]``."""

    a: str
    b: str
    top: int = 10
    #: Machine-readable JSON instead of text lines.
    as_json: bool = False


@dataclass(frozen=True)
class LintOptions:
    """``diag lint RECIPE [--model FP32]``."""

    recipe: str
    model: str | None = None


def diagnose(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource | FeedSpec, options: CompareOptions | None = None
) -> CompareResult:
    """`diag compare` without the files: the diagnosis plus the fix-side steps it reports.

    :func:`diag.compare.compare_models`, run on a Dask cluster with ``options.scheduler``
    (:func:`diag.cluster.compare_on_cluster`), then the recipe a suggested fix re-quantizes with
    (:func:`diag.infer.fix_recipe`) and, with ``options.sensitivity``, skip-one sensitivity.

    Example:
        >>> r = diagnose("fp32.onnx", "int8.onnx", FeedSpec(random=True))  # doctest: +SKIP
        >>> r.fix_recipe["source"]  # doctest: +SKIP
        'inferred'
    """
    options = options or CompareOptions()
    if options.scheduler is not None:
        require_scheduler(options.scheduler)  # no Dask, no scheduler: say so before any work
    run = pipeline.prepare_comparison(fp32_path, int8_path, feeds, options)
    cluster: dict[str, Any] = {}
    if options.scheduler is not None:
        state, runtime_unmatched, cluster = compare_on_cluster(fp32_path, int8_path, run.spec, run.feeds, options)
    else:
        state, runtime_unmatched = pipeline.run_comparison(run.fp, run.q, run.matching, run.feeds, options)
    result = pipeline.analyze_comparison(run, state, runtime_unmatched, options)
    result.cluster = cluster
    result.fix_recipe = fix_recipe(run.q.path, options.recipe)
    if options.sensitivity > 0:
        result.sensitivity = _sensitivity(fp32_path, int8_path, run.feeds, result, options, run.spec)
        result.seconds = time.perf_counter() - run.start
    return result


def _sensitivity(
    fp32_path: str | Path,
    int8_path: str | Path,
    feeds: FeedSource,
    result: CompareResult,
    options: CompareOptions,
    spec: FeedSpec | None = None,
) -> SensitivityResult:
    if options.recipe is None:
        raise DiagError(
            "bad-option",
            "--sensitivity",
            "needs the recipe that made the INT8 model",
            "add --recipe recipe.json (diag inspect INT8 --recipe writes one)",
        )
    recipe = options.recipe if isinstance(options.recipe, Recipe) else recipe_from_option(options.recipe)
    return skip_one_sensitivity(
        fp32_path,
        int8_path,
        recipe,
        feeds,
        result.findings,
        options.sensitivity,
        options.threads,
        options.progress,
        (options.scheduler, spec) if options.scheduler is not None else None,
    )


def compare_to_dir(
    fp32_path: str | Path,
    int8_path: str | Path,
    feeds: FeedSource | FeedSpec,
    out_dir: str | Path,
    options: CompareOptions | None = None,
) -> tuple[CompareResult, dict[str, Path]]:
    """`diag compare` end to end: compare, then write diag.json, report.html and summary.md as one set.

    Example:
        >>> r, files = compare_to_dir("fp32.onnx", "int8.onnx", FeedSpec(random=True), "out")  # doctest: +SKIP
        >>> sorted(files)  # doctest: +SKIP
        ['diag.json', 'report.html', 'summary.md']
    """
    given = [fp32_path, int8_path, getattr(feeds, "inputs", None)]
    if options is not None:
        given += [options.labels, options.recipe]
    check_outputs(out_dir, OUTPUT_NAMES, given)  # before the run, not after it
    result = diagnose(fp32_path, int8_path, feeds, options)
    doc = document_from_result(result)
    if result.cluster:
        doc["run"]["cluster"] = result.cluster
    if result.options.shard is not None:
        add_shard_state(doc, result)
    return result, write_outputs(doc, out_dir)


def merge_to_dir(
    paths: list[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    fp32: str | os.PathLike[str] | None = None,
    int8: str | os.PathLike[str] | None = None,
) -> tuple[CompareResult, dict[str, Path]]:
    """`diag merge` end to end: merge the shards, then write diag.json, report.html and summary.md.

    Example:
        >>> r, files = merge_to_dir(["part0/diag.json", "part1/diag.json"], "all")  # doctest: +SKIP
        >>> sorted(files)  # doctest: +SKIP
        ['diag.json', 'report.html', 'summary.md']
    """
    check_outputs(out_dir, OUTPUT_NAMES, [*paths, fp32, int8])
    result = merge_shards(paths, fp32, int8)
    return result, write_outputs(document_from_result(result), out_dir)


def compare(fp32_path: str, int8_path: str, feeds: FeedSpec, out_dir: str, options: CompareOptions) -> Summary:
    """`diag compare`: :func:`compare_to_dir`, and the lines it prints (:func:`result_lines`)."""
    result, files = compare_to_dir(fp32_path, int8_path, feeds, out_dir, options)
    return Summary(result_lines(result, files))


def merge(options: MergeOptions) -> Summary:
    """`diag merge`: :func:`merge_to_dir`, and the lines it prints (:func:`result_lines`)."""
    result, files = merge_to_dir(list(options.parts), options.out, options.fp32, options.int8)
    return Summary(result_lines(result, files))


def inspect(options: InspectOptions) -> Summary:
    """`diag inspect`: a model's format, opsets, op counts and problems, or (``recipe``) the
    recipe that made an INT8 model, printed or written to ``recipe_out``."""
    if options.recipe_out:
        path, notes = recipe_to_file(options.model, options.recipe_out)
        return Summary([f"wrote recipe: {path}", *(f"note: {note}" for note in notes)])
    if options.recipe:
        return Summary(recipe_to_toml(options.model).splitlines())
    return Summary(model_summary_lines(options.model))


def model_summary_lines(model: str | os.PathLike[str]) -> list[str]:
    """What `diag inspect MODEL` prints: :func:`diag.load.model_summary`, one aligned line per fact."""
    s = model_summary(model)
    ev = ", ".join(f"{k} x{v}" for k, v in s.format.evidence.items())
    lines = [f"model:      {s.path}", f"format:     {s.format.kind}" + (f"  ({ev})" if ev else "")]
    if s.format.precisions:
        lines.append(f"precision:  {describe(s.format.precisions)}")
    lines += [
        f"opsets:     {', '.join(f'{k} {v}' for k, v in s.opsets.items())}; IR {s.ir_version}; "
        f"producer {s.producer or '?'}",
        f"inputs:     {', '.join(s.inputs)}",
        f"outputs:    {', '.join(s.outputs)}",
        f"nodes:      {s.node_count} ({s.quantized_nodes} quantization ops, {s.float_nodes} other)"
        + ("; external data" if s.external_data else ""),
    ]
    # Names made printable before wrapping: a newline in an op type must not move the wrap.
    ops = ", ".join(f"{printable(k)} {v}" for k, v in s.op_counts.items())
    lines += ("op counts:  " + textwrap.fill(ops, 96, subsequent_indent=" " * 12)).splitlines()
    if s.precision:
        lines.append(f"precision:  {', '.join(f'{k} x{v}' for k, v in s.precision.items())}")
    if s.subgraph_nodes:
        lines.append(f"subgraphs:  {', '.join(s.subgraph_nodes)}")
    lines += [f"warning:    {w}" for w in s.warnings]
    lines += [f"problem:    {p}" for p in s.problems]
    if not s.problems:
        lines.append("problems:   none found")
    return lines


def report(options: ReportOptions) -> Summary:
    """`diag report`: re-render a diag.json into a folder (report.html + summary.md) or one .html file."""
    return Summary([f"wrote {path}" for path in report_to_dir(options.json, options.out).values()])


def check(options: CheckOptions) -> Summary:
    """`diag check`: one line per gate and output, the summary line; failed when any gate failed."""
    results = gate.check_file(options.json, options.gates)
    return Summary([*(r.line() for r in results), gate.summary_line(results)], any(r.failed for r in results))


def diff(options: DiffOptions) -> Summary:
    """`diag diff`: what changed from ``a`` to ``b``, as text lines or (``as_json``) indented JSON."""
    result = document_diff.diff_files(options.a, options.b, top=options.top)
    if options.as_json:
        return Summary(json.dumps(result.to_dict(), indent=2).splitlines())
    return Summary(list(result.lines()))


def lint(options: LintOptions) -> Summary:
    """`diag lint`: one line per finding and a summary; failed when a finding is an error."""
    findings = lint_recipe_file(options.recipe, options.model)
    lines = [f.line() for f in findings] + [lint_summary_line(options.recipe, findings)]
    return Summary(lines, any(f.severity == "error" for f in findings))


def cluster_line(info: dict[str, Any], indent: str = "") -> str | None:
    """One line on what ``--scheduler`` did: workers, tasks, retries, where latency was measured."""
    if not info:
        return None
    shards = f"{info['shards']} shards, " if "shards" in info else ""
    unused = f", {info['unused_tasks']} computed ahead and not needed" if info.get("unused_tasks") else ""
    where = f"; latency measured on {info['latency_measured_on']}" if "latency_measured_on" in info else ""
    return (
        f"{indent}cluster: {info['workers']} worker(s) at {info['scheduler']}, {shards}{info['tasks']} tasks"
        f"{unused}, {info['retries']} retried after a worker died{where}"
    )


def result_lines(result: CompareResult, files: dict[str, Path]) -> list[str]:
    """What `diag compare` / `diag merge` / `diag demo` print about a result, in order: the
    verdict, then the few findings worth a line each (top-3 root causes, 2 outliers, 2 remedies,
    ...; the report has the rest), then coverage and the files written."""
    lines = [f"warning: {w}" for model in (result.fp32, result.int8) for w in model.warnings]
    lines.append(f"verdict: {result.grade.upper()} - {result.cause_sentence}")
    lines += [f"  output {v.name}: {v.grade} ({'; '.join(v.reasons)})" for v in result.verdicts]
    lines += [f"  {line}" for line in task_lines(result.task_metrics or {})]
    lines += _deployed_lines(result)
    lines += _cause_lines(result)
    lines += _health_lines(result)
    lines += _measured_lines(result)
    cluster = cluster_line(result.cluster, "  ")
    if cluster is not None:
        lines.append(cluster)
    m = result.matching
    lines.append(
        f"  matched {len(result.accumulated)}/{len(m.fp_float_tensors)} FP32 float tensors "
        f"({len(m.unmatched_tensors)} unmatched, listed in the report); {result.samples} samples "
        + (f"({result.passes} passes, memory budget) " if result.passes > 1 else "")
        + f"in {result.seconds:.1f} s"
    )
    lines += [f"wrote {name}: {path}" for name, path in files.items()]
    return lines


def _deployed_lines(result: CompareResult) -> list[str]:
    """``--ort-opt-level``: the outputs as deployed next to exact mode, and the fused kernels."""
    exact = {v.name: v.per_sample for v in result.verdicts}
    lines = []
    for name, d in result.deployed.items():
        e = exact.get(name)
        lines.append(
            f"  deployed ({result.options.opt_level}) output {name}: cosine min {d.cosine_min:.6f}, "
            f"max abs {d.max_abs:.3g}"
            + (f" (exact mode: cosine min {e.cosine_min:.6f}, max abs {e.max_abs:.3g})" if e is not None else "")
        )
    if result.fused:
        hidden = {n for k in result.fused for n in k.fp_nodes}
        lines.append(
            f"  {len(result.fused)} fused onnxruntime kernel(s) hide {len(hidden)} FP32 node(s) "
            "(diag.json deployed.fused_kernels)"
        )
    return lines


def _cause_lines(result: CompareResult) -> list[str]:
    """The top-3 root causes, where NaN/Inf first appear, FP16 range facts, the error paths."""
    lines = []
    roots = sorted((f for f in result.findings if f.role == "root-cause"), key=lambda f: f.rank_local)
    for f in roots[:3]:
        local, acc = f.local, f.accumulated
        assert local is not None and acc is not None  # a root cause is ranked by both errors
        lines.append(
            f"  root cause: {f.group.label} ({f.group.op_type}) local SQNR "
            f"{local.sqnr_db:.1f} dB, accumulated {acc.sqnr_db:.1f} dB"
            # SQNR is over finite values: say when the node writes NaN/Inf even fed FP32 inputs.
            + (
                f" (its own NaN/Inf: {local.nonfinite_int8 - local.nonfinite_fp} with FP32 inputs)"
                if local.nonfinite_int8 > local.nonfinite_fp
                else ""
            )
        )
    for model, f in nonfinite_origins(result.findings).items():
        acc = f.accumulated
        assert acc is not None  # an origin is found by its accumulated NaN/Inf counts
        count = acc.nonfinite_fp if model == "FP32" else acc.nonfinite_int8
        lines.append(
            f"  NaN/Inf: first produced in the {model} model by {f.group.label} ({f.group.op_type}): "
            f"{count} value(s) in '{f.tensor}'"
        )
    if result.state is not None and result.state.fp16_ranges:
        lines += [f"  {line}" for line in fp16_range_lines(result.findings, result.state.fp16_ranges)]
    for out, path in result.paths.items():
        labels = [f.group.label for f in path]
        if len(labels) > 5:
            labels = [*labels[:2], f"... {len(labels) - 4} more ...", *labels[-2:]]
        lines.append(f"  error path to {out}: {' -> '.join(labels)}")
    return lines


def _health_lines(result: CompareResult) -> list[str]:
    """The 2 worst outlier channels, the persistent one, 2 remedies, the worst weight block."""
    lines = []
    flagged = [(k, h) for k, h in result.health.items() if h.outliers and h.grid != "none"]
    for name, h in sorted(flagged, key=lambda kv: -kv[1].outliers[0].times_median)[:2]:
        o = h.outliers[0]
        lines.append(f"  outlier: channel {o.index} of {name} is {o.times_median:.0f}x the median channel")
    lines += [
        f"  persistent outlier: channel {p.index} in {len(p.tensors)} of {p.of_tensors} tensors of width {p.channels}"
        for p in result.persistent[:1]
    ]
    lines += [f"  remedy for {s.tensor}: {s.python}" for s in result.suggestions[:2]]
    blocks = result.weights.worst_blocks(1) if result.weights is not None else []
    lines += [  # block-wise weights (MatMulNBits, int4 QDQ): see diag.nbits
        f"  worst weight block: {b.weight} {b.where()}: "
        f"error {b.rel_rmse:.2f}x the weight's rms, {b.levels} levels used, max |w| {b.peak_ratio:.0f}x the median"
        for b in blocks
    ]
    return lines


def _measured_lines(result: CompareResult) -> list[str]:
    """What was measured beyond the error: accuracy_level, effects, output parts, sensitivity."""
    lines = []
    level = result.accuracy_level
    worst = level.worst_node() if level is not None else None
    if level is not None and worst is not None:
        node, db = worst
        outs = ", ".join(f"{k} {v:.1f} dB" for k, v in level.outputs.items())
        lines.append(
            f"  accuracy_level {level.level} vs 0 (MatMulNBits inputs quantized inside the kernel): SQNR {outs}; "
            f"worst node {node} {db:.1f} dB ({level.samples} samples)"
        )
    effects = result.effects
    if effects is not None and effects.best is not None and "rounding-level" not in result.cause_sentence:
        shown = [e for e in effects.effects[:3] if e.recovered > 0.01]
        if shown:
            lines.append(
                f"  effect on {effects.target} of keeping one node in float: "
                + ", ".join(f"{e.finding.group.label} {e.recovered:.0%}" for e in shown)
                + f" ({effects.samples} samples)"
            )
    for v in result.verdicts:
        for label, (part, acc, local) in v.per_sample.parts.items():
            lines.append(
                f"  output {v.name} part {label}: SQNR {acc.sqnr_db:.1f} dB, min cosine "
                f"{part.cosine_min:.4f}" + (f", local SQNR {local.sqnr_db:.1f} dB" if local is not None else "")
            )
    if result.sensitivity is not None and result.sensitivity.rows:
        best = result.sensitivity.rows[0]
        lines.append(
            f"  sensitivity: keeping {best.candidate.label} in float recovers "
            f"{best.cosine_recovered:+.4f} output cosine ({result.sensitivity.quantizations} quantizations)"
        )
    return lines
