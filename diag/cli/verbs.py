"""The library call behind each CLI verb: options in, the verb's output set written all-or-nothing,
summary lines out.

``diag.cli.commands`` parses flags into the options of one function here and prints the lines it returns;
nothing the user sees is decided in the CLI. This is the one layer that may call both sides of
the pipeline: ``diag compare`` is the diagnosis (:func:`diag.analysis.compare.compare_models`) plus the
fix-side steps it reports (the recipe a fix re-quantizes with, ``--sensitivity``,
``--scheduler``), then the report (:mod:`diag.report.view`).

Two sections: the diagnosing verbs (compare, merge, inspect, report, lint) and the fixing verbs
(exclude and ``--tiers``, sweep, bench, quantize). The searches and measurements below this layer
(:mod:`diag.fix.exclude`, :mod:`diag.fix.tiers`, :mod:`diag.fix.sweep`, :mod:`diag.fix.bench`, :mod:`diag.fix.quantize`)
return results and write nothing: each function here checks the outputs before any work, runs one
of them (on a Dask cluster when the options name a scheduler: :mod:`diag.fix.cluster`), renders the
documents and writes the set with :func:`diag.foundations.files.write_set`. ``diag check`` and ``diag diff``
are not here: :func:`diag.report.gate.run_check` and :func:`diag.report.diff.run_diff` read JSON only and must
not import the pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from diag.analysis import compare as pipeline
from diag.analysis.compare import CompareOptions, CompareResult
from diag.analysis.effects import setting_headline
from diag.analysis.levers import recipe_changes
from diag.analysis.merge import add_shard_state, merge_shards
from diag.analysis.remedies import applicable_suggestions
from diag.core.encodings import encodings_beside, encodings_of, read_encodings
from diag.core.feeds import FeedSource, FeedSpec
from diag.core.load import checked_path, model_from_path, model_summary
from diag.core.precision import describe
from diag.core.recipe import Recipe, recipe_file_text, recipe_from_option
from diag.core.streaming import LARGE_MODEL_BYTES
from diag.fix.bench import DEPLOY_OPT_LEVEL, BenchOptions, LatencyStats, bench_models, format_table
from diag.fix.cluster import ClusterRecipes, ClusterSkipOne, ClusterTrialRunner, compare_on_cluster, require_scheduler
from diag.fix.exclude import ExcludeOptions, ExclusionResult, SearchOptions, count_phrase, derive_exclusions
from diag.fix.exclude import summary_lines as exclude_lines
from diag.fix.fixcode import encodings_snippet, reproduce_snippet, splice_snippet
from diag.fix.infer import fix_recipe, recipe_to_file, recipe_to_toml, search_recipe
from diag.fix.levercheck import measure_recipe_levers, settings_skipped
from diag.fix.linecheck import measure_lines
from diag.fix.lint import lint_recipe_file
from diag.fix.lint import summary_line as lint_summary_line
from diag.fix.modelprep import copy_model
from diag.fix.quantize import QuantizeOptions, QuantizeReport, quantize_model
from diag.fix.remedycheck import check_weight_only_remedies
from diag.fix.roundtrip import prove_roundtrip, roundtrip_line
from diag.fix.sensitivity import SensitivityOptions, SensitivityResult, skip_one_sensitivity
from diag.fix.sweep import (
    JSONL,
    SweepEntry,
    SweepOptions,
    SweepResult,
    load_grid,
    recipe_file_dict,
    sweep_model,
)
from diag.fix.sweep import OUTPUT_NAMES as SWEEP_OUTPUT_NAMES
from diag.fix.sweep import summary_lines as sweep_lines
from diag.fix.tiers import TierOptions, TierPlan, derive_tier_plan, plan_snippet
from diag.fix.tiers import summary_lines as tier_lines
from diag.fix.weightonly import quantizer_calls
from diag.foundations.environment import environment, printable
from diag.foundations.errors import DiagError
from diag.foundations.files import check_outputs, internal_writes, output_file, resume_file, work_dir, write_set
from diag.foundations.files import out_dir as checked_out_dir
from diag.foundations.producers import ORT_RECIPE_PRODUCERS, detect_producer
from diag.foundations.summary import Summary
from diag.report.brief import brief, cluster_line
from diag.report.document import document_from_result
from diag.report.documents import read_document
from diag.report.plots_sweep import pareto_plot
from diag.report.sweep_report import render_html, render_markdown, sweep_view
from diag.report.view import OUTPUT_NAMES, load_document, output_texts, report_to_dir, write_outputs

# --- diagnosing verbs ---


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
    #: None: the fixture's own (int4 for the LLM fixture, dynamic for the others).
    format: str | None = None
    samples: int = 32
    progress: bool = True
    fix: bool = True


@dataclass(frozen=True)
class LintOptions:
    """``diag lint RECIPE [--model FP32]``."""

    recipe: str
    model: str | None = None
    #: ``--inputs``: with ``model``, each measured line also gets the outputs' SQNR with and without it.
    inputs: FeedSpec | None = None
    #: With ``model``: quantize with and without each line to measure what it changes (``--no-measure``: off).
    measure: bool = True
    threads: int | None = None


def diagnose(
    fp32_path: str | Path, int8_path: str | Path, feeds: FeedSource | FeedSpec, options: CompareOptions | None = None
) -> CompareResult:
    """`diag compare` without the files: the diagnosis plus the fix-side steps it reports.

    :func:`diag.analysis.compare.compare_models`, run on a Dask cluster with ``options.scheduler``
    (:func:`diag.fix.cluster.compare_on_cluster`), then the recipe a suggested fix re-quantizes with
    (:func:`diag.fix.infer.fix_recipe`) and, with ``options.sensitivity``, skip-one sensitivity.

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
    _drop_remedies_in_effect(result)
    _measure_settings(fp32_path, result, run, options)
    if options.recipe is not None:
        _measure_weight_only_remedies(result, run, options)
    if isinstance(options.recipe, str) and Path(options.recipe).is_file():
        # lint inside compare (issue 42 item 4): what each line of the given recipe does to this model
        result.recipe_lines = measure_lines(options.recipe, fp32_path, run.spec, options.threads)
        result.seconds = time.perf_counter() - run.start
    if options.sensitivity > 0:
        result.sensitivity = _sensitivity(fp32_path, int8_path, run.feeds, result, options, run.spec)
        result.seconds = time.perf_counter() - run.start
    return result


def _drop_remedies_in_effect(result: CompareResult) -> None:
    """Remedies the model's recipe already has (``per_channel=True`` on a per-channel model) are dropped,
    and the spread-error headline lists only remedies that change something for its recipe and format
    (issue 25 item 1: per_channel=True was told to a per-channel model)."""
    settings = (result.fix_recipe or {}).get("settings")
    result.suggestions = applicable_suggestions(result.suggestions, settings)
    spread = result.headline.spread
    if spread is not None:
        spread.settings, spread.recipe_known = settings, True


def _measure_settings(
    fp32_path: str | Path, result: CompareResult, run: pipeline.Prepared, options: CompareOptions
) -> None:
    """The recipe's settings as causes (issue 42 item 1), when the effect check found no node that
    explains the error: each changed alone, re-quantized and measured on the check's samples, once
    the recipe is proved to rebuild the INT8 model (:mod:`diag.fix.levercheck`). The headline then
    names a setting that explains the error, or lists the measured ones. Tried for recipes given
    (``--recipe``) or read back from a dynamic model: a static recipe read back has no calibration
    data, so it cannot rebuild the model's activation scales."""
    check = result.effects
    try:
        if not _settings_worth_measuring(result, options) or check is None or check.reference is None:
            return
        settings = (result.fix_recipe or {}).get("settings") or {}
        given = options.recipe
        if given is not None:
            recipe, source = (given if isinstance(given, Recipe) else recipe_from_option(given)), "given"
        elif settings.get("mode") == "dynamic":
            recipe, source = Recipe.from_dict(settings, "the recipe read back from the INT8 model"), "inferred"
        else:
            return
        if not recipe_changes(recipe.to_dict()):
            return  # a weight-only or fp16 recipe: its own remedies are measured elsewhere
        if options.settings == "auto" and run.fp.weight_bytes >= LARGE_MODEL_BYTES:
            result.recipe_settings = settings_skipped(source, check, run.fp.weight_bytes)
            return
        result.recipe_settings = measure_recipe_levers(
            fp32_path, run.q.path, recipe, source, check, run.spec, options.threads, options.progress
        )
        result.headline = setting_headline(result.findings, check, result.recipe_settings, result.headline)
        result.seconds = time.perf_counter() - run.start
    finally:
        if check is not None:
            check.reference = None  # the FP32 outputs the check kept: not needed any more


def _settings_worth_measuring(result: CompareResult, options: CompareOptions) -> bool:
    """No node alone is the cause, the outputs are not excellent, and onnxruntime's quantizer could
    have made the model (another tool's model has no onnxruntime recipe to rebuild it)."""
    q = result.int8
    return (
        options.settings != "off"
        and not result.headline.single_cause
        and result.grade != "excellent"
        and q.source is None
        and detect_producer(q.proto, q.path).key in ORT_RECIPE_PRODUCERS
    )


def _measure_weight_only_remedies(result: CompareResult, run: pipeline.Prepared, options: CompareOptions) -> None:
    """A weight-only model's spread remedies, re-quantized from the given recipe and measured: the
    headline lists them best first with their figures (issue 25, item 2)."""
    given = options.recipe
    assert given is not None  # checked by the caller
    recipe = given if isinstance(given, Recipe) else recipe_from_option(given)
    spread = result.headline.spread
    if recipe.mode != "weight_only" or spread is None:
        return
    checks = check_weight_only_remedies(run.fp, run.q.path, recipe, run.feeds, options.threads)
    result.remedy_checks = checks.to_dict()
    spread.measured, spread.measured_samples = checks.text(), checks.samples


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
    trials = ClusterSkipOne(options.scheduler, spec) if options.scheduler is not None else None
    return skip_one_sensitivity(
        fp32_path,
        int8_path,
        recipe,
        feeds,
        result.findings,
        SensitivityOptions(options.sensitivity, options.threads, options.progress),
        trials,
    )


def compare_to_dir(
    fp32_path: str | Path,
    int8_path: str | Path,
    feeds: FeedSource | FeedSpec,
    out_dir: str | Path,
    options: CompareOptions | None = None,
) -> Summary[CompareResult]:
    """`diag compare` end to end: compare, then write diag.json, report.html and summary.md as one set.

    Returns the lines the verb prints (:func:`result_lines`), the :class:`~diag.analysis.compare.CompareResult`
    as ``result`` and the files written as ``files``.

    Example:
        >>> s = compare_to_dir("fp32.onnx", "int8.onnx", FeedSpec(random=True), "out")  # doctest: +SKIP
        >>> sorted(s.files), s.result.grade  # doctest: +SKIP
        (['diag.json', 'report.html', 'summary.md'], 'excellent')
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
    files = write_outputs(doc, out_dir)
    return Summary(result_lines(doc, files), result=result, files=files)


def merge_to_dir(
    paths: list[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    fp32: str | os.PathLike[str] | None = None,
    int8: str | os.PathLike[str] | None = None,
) -> Summary[CompareResult]:
    """`diag merge` end to end: merge the shards, then write diag.json, report.html and summary.md.

    Returns what :func:`compare_to_dir` returns for one run over every shard's batches.

    Example:
        >>> s = merge_to_dir(["part0/diag.json", "part1/diag.json"], "all")  # doctest: +SKIP
        >>> sorted(s.files)  # doctest: +SKIP
        ['diag.json', 'report.html', 'summary.md']
    """
    check_outputs(out_dir, OUTPUT_NAMES, [*paths, fp32, int8])
    result = merge_shards([(str(p), read_document(p)) for p in paths], fp32, int8)
    doc = document_from_result(result)
    files = write_outputs(doc, out_dir)
    return Summary(result_lines(doc, files), result=result, files=files)


def merge(options: MergeOptions) -> Summary[CompareResult]:
    """`diag merge`: :func:`merge_to_dir` with the verb's options."""
    return merge_to_dir(list(options.parts), options.out, options.fp32, options.int8)


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
    """What `diag inspect MODEL` prints: :func:`diag.core.load.model_summary`, one aligned line per fact."""
    s = model_summary(model)
    ev = ", ".join(f"{k} x{v}" for k, v in s.format.evidence.items())
    lines = [f"model:      {s.path}", f"format:     {s.format.kind}" + (f"  ({ev})" if ev else "")]
    if s.format.precisions:
        lines.append(f"precision:  {describe(s.format.precisions)}")
    lines += [
        f"opsets:     {', '.join(f'{k} {v}' for k, v in s.opsets.items())}; IR {s.ir_version}; "
        f"producer {s.producer or '?'}",
        *([f"made by:    {printable(s.made_by)}"] if s.made_by else []),
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
    if s.format.kind == "fp32":
        lines += _encodings_lines(Path(model))
    lines += [f"warning:    {w}" for w in s.warnings]
    lines += [f"problem:    {p}" for p in s.problems]
    if not s.problems:
        lines.append("problems:   none found")
    return lines


def _encodings_lines(model: Path) -> list[str]:
    """An FP32 model with AIMET encodings beside it: what they hold and which verb reads them."""
    path = encodings_beside(model)
    if path is None:
        return []
    enc = read_encodings(path)
    counts = f"{len(enc.activations)} activation and {len(enc.params)} parameter encodings"
    if not enc.params:  # 2.x: one list
        counts = f"{len(enc.activations)} encodings"
    return [
        f"encodings:  AIMET '{printable(path.name)}' beside it (version {printable(enc.version)}, {counts}): "
        f"diag compare FP32 {printable(model.name)} diagnoses the QDQ model they describe"
    ]


def report(options: ReportOptions) -> Summary:
    """`diag report`: re-render a diag.json into a folder (report.html + summary.md) or one .html file,
    and print its verdict and the lines under it, as `diag compare` printed them (from the file alone)."""
    files = report_to_dir(options.json, options.out)
    said = result_lines(load_document(options.json), {})
    return Summary([*said, *(f"wrote {path}" for path in files.values())])


def lint(options: LintOptions) -> Summary:
    """`diag lint`: one line per finding and a summary; failed when a finding is an error."""
    findings = lint_recipe_file(options.recipe, options.model)
    if options.model is not None and options.measure:  # a recipe that loads is measured, errors or not
        measured = measure_lines(options.recipe, options.model, options.inputs, options.threads)
        # A rule of thumb ("only affects quantize_static") gives way to the measurement of the same line.
        where = {f.where for f in measured}
        findings = [f for f in findings if not (f.code == "static-only-option" and f.where in where)] + measured
    lines = [f.line() for f in findings] + [lint_summary_line(options.recipe, findings)]
    return Summary(lines, any(f.severity == "error" for f in findings))


def result_lines(doc: dict[str, Any], files: dict[str, Path]) -> list[str]:
    """What `diag compare` / `diag merge` / `diag demo` print about a diagnosis: the verdict, its fix
    when too long for the sentence, then the lines under it as summary.md and report.html word them
    (:func:`diag.report.brief.brief`, from the same document), then the files written."""
    headline = doc["verdict"].get("headline") or {}
    lines = [f"verdict: {doc['verdict']['grade'].upper()} - {doc['verdict']['cause']}"]
    if headline.get("fix_code"):
        lines.append(f"  fix: {headline['fix_code']}")
    lines += [f"  {'  ' * line.depth}{line.text}" for line in brief(doc)]
    lines += [f"wrote {name}: {path}" for name, path in files.items()]
    return lines


# --- fixing verbs ---

#: A search's answer files: (contents to write, their names as the verb reports them, stale files to remove).
AnswerFiles = tuple[dict[Path, str | bytes | Path], dict[str, Path], list[Path]]
#: The options of either search (``diag exclude``, ``diag exclude --tiers``).
_Opts = TypeVar("_Opts", bound=SearchOptions)


def exclude_to_dir(
    fp32_path: str | Path,
    recipe: Recipe | str | Path | None,
    feeds: FeedSpec,
    options: ExcludeOptions,
    out_dir: str | Path,
) -> Summary[ExclusionResult]:
    """`diag exclude` end to end: derive, then write exclusion.json, the mixed model and reproduce.py.

    ``recipe`` is a Recipe, a ``--recipe`` value, or None: then the recipe of ``options.int8`` (the
    user's INT8 model) or onnxruntime's defaults (:func:`diag.fix.infer.search_recipe`; the result's
    ``recipe_origin`` says which). The mixed model and the snippet are written only when the target
    is reachable. With ``options.scheduler`` the trials run on Dask (:class:`diag.fix.cluster.ClusterTrialRunner`).
    Returns the lines the verb prints, the :class:`~diag.fix.exclude.ExclusionResult` as ``result`` and
    the files written; ``failed`` when no list short of keeping every quantized node in float meets
    the target (or the budget ran out first).

    Example:
        >>> s = exclude_to_dir("fp32.onnx", recipe, FeedSpec(inputs="d.npz"),
        ...                    ExcludeOptions("cosine>=0.999"), "out")  # doctest: +SKIP
        >>> sorted(s.files), s.failed  # doctest: +SKIP
        (['diag.json', 'exclusion.json', 'mixed model', 'report.html', 'reproduce.py', 'summary.md'], False)
    """
    given = recipe
    # A recipe given with --int8 is the one to prove against the model, not to infer again.
    recipe, origin = search_recipe(given) if given is not None else search_recipe(None, options.int8, options.encodings)
    stem = Path(fp32_path).name.removesuffix(".onnx").removesuffix(".fp32")
    names_out = ["exclusion.json", f"{stem}.mixed.onnx", "reproduce.py", f"{stem}.reproduced.onnx", *OUTPUT_NAMES]
    if origin.encodings is not None:  # AIMET's export: the fix is its encodings, edited
        names_out += [Path(origin.encodings).name, _reproduced_encodings(origin.encodings)]
    inputs = [fp32_path, feeds.inputs, options.labels, recipe.calibration_path(), options.int8, origin.encodings]
    check_outputs(out_dir, names_out, inputs)
    out = checked_out_dir(out_dir)
    with work_dir(out, "exclude") as work:
        proof: list[str] = []
        if options.int8 is not None and (given is not None or options.requantize):
            options, proof = _prove_recipe(fp32_path, recipe, feeds, options, work)
        trials = ClusterTrialRunner(options.scheduler, fp32_path, recipe, feeds, options) if options.scheduler else None
        with internal_writes():  # candidate models are not this verb's outputs
            result = derive_exclusions(fp32_path, recipe, feeds, options, str(work), trials)
        if isinstance(given, (str, Path)) and Path(given).is_file():
            # lint inside exclude (issue 42 item 4): what each line of the given recipe does to this model
            result.recipe_lines = measure_lines(given, fp32_path, feeds, options.threads)
            if result.diagnosis is not None:
                result.diagnosis.recipe_lines = result.recipe_lines
        result.recipe_origin = dataclasses.replace(origin, spliced=result.method != "requantized").to_dict()
        result.warnings[:0] = proof
        answer = _exclusion_files(result, recipe, feeds, out, stem)
        # One report: the diagnosis of the baseline INT8 model, then the verified fix. The diagnosed
        # model is the recipe's baseline, quantized in a temp folder now gone.
        note = (
            f"your INT8 model {result.int8}"
            if result.method != "requantized"
            else "baseline INT8 (the recipe as given, quantized by diag exclude)"
        )
        record = ("exclusion.json", result.to_dict())
        files = _write_search_set(out, record, answer, result.diagnosis, note, "exclusion")
    lines = [result.recipe_origin["line"], *exclude_lines(result)]
    cluster = cluster_line(result.cluster)
    lines += [cluster] if cluster is not None else []
    lines += [f"wrote {name}: {path}" for name, path in files.items()]
    return Summary(lines, not result.reachable, result, files)


def _prove_recipe(
    fp32_path: str | Path, recipe: Recipe, feeds: FeedSpec, options: _Opts, work: Path
) -> tuple[_Opts, list[str]]:
    """Before re-quantizing for a user who gave their INT8 model: does the recipe rebuild it exactly?

    Identical: the search re-quantizes (calibration then sees the exclusions), and says the proof.
    Different: ``--requantize`` refuses (exit 2, ``recipe-mismatch``); a ``--recipe`` alone falls
    back to splicing float regions into the user's model, with the difference in one line. A
    rebuilt model's figure is never printed as the user's (issue 41 item 2).
    """
    where = encodings_of(model_from_path(str(options.int8), "INT8 model"), options.encodings)
    if where is not None:
        raise DiagError(
            "bad-option",
            f"--int8 '{options.int8}' with {'--recipe' if options.requantize is False else '--requantize'}",
            f"is AIMET's export (encodings {where.name}): an onnxruntime recipe cannot rebuild it, and diag fixes it "
            "in its encodings",
            "drop --recipe and --requantize",
        )
    static = str(getattr(recipe.mode, "name", recipe.mode)) == "static"
    calibration = feeds if static and not recipe.calibration else None
    with internal_writes():
        rt = prove_roundtrip(fp32_path, str(options.int8), recipe, work / "roundtrip", calibration)
    line = roundtrip_line(rt)
    if rt.identical:
        return dataclasses.replace(options, requantize=True), [f"round trip: {line}; re-quantizing from the recipe"]
    if options.requantize:
        raise DiagError(
            "recipe-mismatch",
            f"--requantize with --int8 '{options.int8}'",
            line,
            "drop --requantize: diag then fixes your INT8 model itself by splicing float regions into it",
        )
    return dataclasses.replace(options, requantize=False), [
        f"round trip: {line}; fixing your INT8 model by splicing float regions into it instead"
    ]


def _exclusion_files(result: ExclusionResult, recipe: Recipe, feeds: FeedSpec, out: Path, stem: str) -> AnswerFiles:
    """The mixed model (and its external data) and reproduce.py, or the stale ones to remove.

    NOTE: one set, written all or nothing: exclusion.json, the mixed model (and its external
    data), reproduce.py and the report. When there is no answer, a mixed model left by an
    earlier run in the same folder would read as this run's answer: it is removed in the same step.
    """
    mixed, reproduce, again = out / f"{stem}.mixed.onnx", out / "reproduce.py", out / f"{stem}.reproduced.onnx"
    contents: dict[Path, str | bytes | Path] = {}
    names: dict[str, Path] = {}
    edited = result.encodings
    if not (result.reachable and result.model):
        stale = [out / Path(edited.source).name] if edited is not None else []
        return contents, names, [mixed, reproduce, again, *stale]
    staged = Path(result.model)
    for written in copy_model(staged, staged.with_name(mixed.name)):  # its external data renamed with it
        contents[out / written.name] = written
    result.model = str(mixed)
    names["mixed model"] = mixed
    if edited is not None:  # AIMET: the fix is the user's encodings file, edited; reproduce.py edits it
        fixed = out / Path(edited.source).name
        edited.file = str(fixed)
        contents[fixed] = json.dumps(edited.document, indent=2, ensure_ascii=False) + "\n"
        names["encodings"] = fixed
        header = (
            f"# Rebuilds the encodings `diag exclude --int8` verified (target {result.target}: {result.verdict}):\n"
            f"# your AIMET encodings with the quantizers of {len(result.nodes_to_exclude)} node(s) taken out."
        )
        again_enc = str(out / _reproduced_encodings(edited.source))
        call = result.producer["fix_call"]
        result.snippet = encodings_snippet(edited.source, edited.removed, again_enc, header, call)
    elif result.method == "surgical" and result.int8 is not None:
        header = (
            f"# Rebuilds the model `diag exclude --int8` verified (target {result.target}: {result.verdict}):\n"
            f"# your INT8 model with {len(result.nodes_to_exclude)} node(s) kept in float."
        )
        call = result.producer.get("fix_call") or f"nodes_to_exclude={json.dumps(result.nodes_to_exclude)}"
        result.snippet = splice_snippet(result.fp32, result.int8, result.nodes_to_exclude, str(again), header, call)
    else:
        calib, count, batch = _calibration_of(recipe, feeds, result.split)
        # NOTE: never the verified model's path: running reproduce.py must not overwrite the answer.
        result.snippet = reproduce_snippet(result, str(again), str(calib) if calib else None, count, batch)
    contents[reproduce] = result.snippet
    names["reproduce.py"] = reproduce
    return contents, names, []


def _reproduced_encodings(source: str) -> str:
    """The file reproduce.py writes for an AIMET fix (never the verified one's name).

    Example:
        >>> _reproduced_encodings("dir/model.encodings")
        'model.reproduced.encodings'
    """
    name = Path(source).name
    stem, dot, suffix = name.partition(".")
    return f"{stem}.reproduced.{suffix}" if dot else f"{name}.reproduced"


def _write_search_set(
    out: Path,
    record: tuple[str, dict[str, Any]],
    answer: AnswerFiles,
    diagnosis: CompareResult | None,
    model_note: str,
    embed_as: str,
    embedded: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write a search's output set all or nothing; the files written, by the names the verb reports.

    The set: the search's record (``record``: file name, JSON; ``exclusion.json`` / ``tiers.json``),
    its answer's files (or the stale ones removed), and the report of ``diagnosis``, whose model
    ``model_note`` names; the report's diag.json holds the record (or ``embedded``) under
    ``embed_as`` (``exclusion`` / ``tiers``), and its HTML and summary.md show it as the verified fix.
    """
    name, data = record
    contents, names, remove = answer
    contents = {out / name: json.dumps(data, indent=1, ensure_ascii=False) + "\n", **contents}
    report, stale = diagnosis_outputs(out, diagnosis, model_note, embedded or data, embed_as)
    written = write_set({**contents, **report}, remove=remove + stale)
    files = {name: out / name, **names}
    files.update({k: v for k, v in written.items() if k in OUTPUT_NAMES})
    return files


def _calibration_of(recipe: Recipe, feeds: FeedSpec, split: dict[str, Any]) -> tuple[Any, int | None, int]:
    """What reproduce.py calibrates on: the recipe's own data, else the ranking split of the inputs."""
    if recipe.calibration:
        return recipe.calibration_path(), recipe.calibration_samples, 1
    return feeds.inputs, split["ranking_samples"], split["batch"]


def diagnosis_outputs(
    out: Path,
    diagnosis: CompareResult | None,
    model_note: str,
    exclusion: dict[str, Any] | None = None,
    key: str = "exclusion",
) -> tuple[dict[Path, str], list[Path]]:
    """The report of a search's diagnosis (diag.json, report.html, summary.md) for ``write_set``.

    Returns (files to write, files to remove): without a diagnosis (the target was already met) an
    earlier run's report would read as this run's, so it is removed in the same step.
    """
    if diagnosis is None:
        return {}, [out / name for name in OUTPUT_NAMES]
    # The diagnosed model sat in the search's work folder, now gone: a command naming it would
    # not run, and this search is the exclusion search the headline suggests.
    diagnosis.headline.search.held_here = True
    doc = document_from_result(diagnosis)
    doc["models"]["int8"]["path"] = model_note
    if exclusion is not None:
        doc[key] = exclusion  # "exclusion" (diag exclude) or "tiers" (diag exclude --tiers)
    return {out / name: text for name, text in output_texts(doc).items()}, []


def tier_plan_to_dir(
    fp32_path: str | Path,
    recipe: Recipe | str | Path | None,
    feeds: FeedSpec,
    options: TierOptions,
    out_dir: str | Path,
) -> Summary[TierPlan]:
    """`diag exclude --tiers` end to end: derive the plan, write tiers.json, recipe.json, the model and reproduce.py.

    ``recipe`` as for :func:`exclude_to_dir` (None: ``options.int8``'s recipe, else the defaults).
    Returns the lines, the :class:`~diag.fix.tiers.TierPlan` as ``result`` and the files written;
    ``failed`` when no plan meets the target.

    Example:
        >>> s = tier_plan_to_dir("fp32.onnx", recipe, FeedSpec(inputs="x.npz"),
        ...                      TierOptions("cosine>=0.94", tiers="int4,int8,fp32"), "out")  # doctest: +SKIP
        >>> sorted(s.files)  # doctest: +SKIP
        ['diag.json', 'plan model', 'recipe.json', 'report.html', 'reproduce.py', 'summary.md', 'tiers.json']
    """
    stem = Path(fp32_path).name.removesuffix(".onnx").removesuffix(".fp32")
    plan_name = f"{stem}.plan.onnx"
    names_out = ["tiers.json", plan_name, "reproduce.py", "recipe.json", f"{stem}.reproduced.onnx", *OUTPUT_NAMES]
    given = recipe
    recipe, origin = search_recipe(given) if given is not None else search_recipe(None, options.int8, options.encodings)
    if origin.encodings is not None:
        raise DiagError(
            "bad-option",
            f"--tiers with --int8 '{options.int8}'",
            f"is AIMET's export (encodings {Path(origin.encodings).name}): a tier plan re-blocks or re-quantizes "
            "weights, and an AIMET model is fixed in its encodings",
            "drop --tiers: diag exclude --int8 writes the fix as your encodings file, edited",
        )
    inputs = [fp32_path, feeds.inputs, options.labels, recipe.calibration_path(), options.int8]
    check_outputs(out_dir, names_out, inputs)
    out = checked_out_dir(out_dir)
    # NOTE: one set, written all or nothing (diag.foundations.files.write_set), as diag exclude writes its own:
    # tiers.json, the plan model, recipe.json, reproduce.py and the diagnosis report. Without a plan,
    # an earlier run's model, recipe and script would read as this run's answer: they are removed.
    with work_dir(out, "tiers") as work:
        proof: list[str] = []
        if options.int8 is not None and (given is not None or options.requantize):
            options, proof = _prove_recipe(fp32_path, recipe, feeds, options, work)
        with internal_writes():  # trial models are not this verb's outputs
            plan = derive_tier_plan(fp32_path, recipe, feeds, options, work_dir=work)
        plan.recipe_origin = dataclasses.replace(origin, spliced=plan.method == "surgical").to_dict()
        plan.warnings[:0] = proof
        answer = _plan_files(plan, recipe, feeds, out, stem)
        # The diagnosis of the starting model: what ranked the nodes (weight blocks included).
        note = (
            f"your INT8 model {plan.int8}"
            if plan.method == "surgical"
            else f"all {plan.tiers[0]} (the recipe as given, quantized by diag exclude --tiers)"
        )
        # The report shows the plan (it is this run's answer), with the reproduce.py it refers to.
        record = plan.to_dict()
        embedded = {**record, "snippet": plan.snippet or ""}
        files = _write_search_set(out, ("tiers.json", record), answer, plan.diagnosis, note, "tiers", embedded)
    lines = [plan.recipe_origin["line"], *tier_lines(plan), *(f"wrote {name}: {path}" for name, path in files.items())]
    return Summary(lines, not plan.reachable, plan, files)


def _plan_files(plan: TierPlan, recipe: Recipe, feeds: FeedSpec, out: Path, stem: str) -> AnswerFiles:
    """The plan model, recipe.json and reproduce.py, or the stale ones to remove."""
    model, reproduce, recipe_out = out / f"{stem}.plan.onnx", out / "reproduce.py", out / "recipe.json"
    contents: dict[Path, str | bytes | Path] = {}
    names: dict[str, Path] = {}
    if not (plan.reachable and plan.model):
        return contents, names, [model, reproduce, recipe_out]
    staged = Path(plan.model)
    for written in copy_model(staged, staged.with_name(model.name)):  # its external data renamed with it
        contents[out / written.name] = written
    plan.model = str(model)
    names["plan model"] = model
    final = Recipe.from_dict(plan.recipe, "plan recipe")
    again = str(out / f"{stem}.reproduced.onnx")
    if plan.method == "surgical" and plan.int8 is not None:
        # The verified plan is the user's model with regions spliced in: reproduce.py splices; the
        # recipe that would re-quantize it builds another model, so it is a comment, not recipe.json.
        in_float = [n for n, t in plan.plan.items() if t == "fp32"]
        bits = {n: int(t[3:]) for n, t in plan.plan.items() if t != "fp32"}
        changes = [f"{count_phrase(len(in_float), 'node')} kept in float"] if in_float else []
        changes += [f"{count_phrase(len(bits), 'weight')} re-blocked at a wider width"] if bits else []
        header = (
            f"# Rebuilds the plan `diag exclude --tiers --int8` verified (target {plan.target}):\n"
            f"# your INT8 model with {' and '.join(changes)}."
        )
        call = (
            "\n".join(quantizer_calls(final))
            if final.mode == "weight_only"
            else f"nodes_to_exclude={json.dumps(in_float, ensure_ascii=False)}"
        )
        plan.snippet = splice_snippet(plan.fp32, plan.int8, in_float, again, header, call, bits or None)
        contents[reproduce] = plan.snippet
        names["reproduce.py"] = reproduce
        return contents, names, [recipe_out]
    contents[recipe_out] = recipe_file_text(final, recipe_out)
    names["recipe.json"] = recipe_out
    calib, count, batch = _calibration_of(recipe, feeds, plan.split)
    plan.snippet = plan_snippet(plan, final, again, str(calib) if calib else None, count, batch)
    contents[reproduce] = plan.snippet
    names["reproduce.py"] = reproduce
    return contents, names, []


def sweep_to_dir(
    fp32_path: str | Path,
    feeds: FeedSpec,
    out_dir: str | Path,
    options: SweepOptions | None = None,
    on_entry: Callable[[SweepEntry], None] | None = None,
) -> Summary[SweepResult]:
    """`diag sweep` end to end: sweep, then write sweep.json, sweep.md, sweep.html, pareto.svg, best.recipe.json.

    ``options.grid`` is what ``--grid`` takes (a file, inline JSON, or None for
    :data:`diag.fix.sweep.DEFAULT_GRID`). ``best.recipe.json`` is written only when a recipe
    qualifies (a stale one is removed). ``on_entry``: see :func:`diag.fix.sweep.sweep_model`. Returns
    the lines, the :class:`~diag.fix.sweep.SweepResult` as ``result`` and the files written.

    Example:
        >>> s = sweep_to_dir("fp32.onnx", FeedSpec(inputs="d.npz", batch=8), "sweep")  # doctest: +SKIP
        >>> sorted(s.files)  # doctest: +SKIP
        ['best.recipe.json', 'pareto.svg', 'sweep.html', 'sweep.json', 'sweep.jsonl', 'sweep.md']
    """
    o = options if options is not None else SweepOptions()
    # Ctrl-C: the recipes finished so far are in sweep.jsonl, and the same command resumes from them.
    resume_file(Path(out_dir) / JSONL, "finished recipes")
    grid_dict, grid_dir = load_grid(o.grid)
    given = [fp32_path, feeds.inputs, o.calib.inputs if o.calib else None, o.labels]
    check_outputs(out_dir, [*SWEEP_OUTPUT_NAMES, JSONL], given)  # before any recipe is measured
    out = checked_out_dir(out_dir)
    runner = ClusterRecipes(o.scheduler, feeds, o) if o.scheduler is not None else None
    result = sweep_model(fp32_path, feeds, out, o, grid=(grid_dict, grid_dir), on_entry=on_entry, runner=runner)
    doc = result.to_dict()
    view = sweep_view(doc)
    best_path = out / "best.recipe.json"
    contents: dict[Path, str | bytes | Path] = {
        out / "sweep.json": json.dumps(doc, indent=1, ensure_ascii=False) + "\n",
        out / "sweep.md": render_markdown(view),
        out / "sweep.html": render_html(view),
        out / "pareto.svg": pareto_plot(doc),
    }
    if result.best_recipe is not None:
        if result.best_recipe.mode == "dynamic":  # the static-only keys would be inert
            contents[best_path] = json.dumps(recipe_file_dict(result.best_recipe), indent=2) + "\n"
        else:  # rebases the calibration path onto the recipe's folder
            contents[best_path] = recipe_file_text(result.best_recipe, best_path)
    # NOTE: one set, all or nothing; a best recipe of an earlier run goes in the same step.
    written = write_set(contents, remove=[] if best_path in contents else [best_path])
    files = {name: written[name] for name in ("sweep.json", "sweep.md", "sweep.html", "pareto.svg")}
    files["sweep.jsonl"] = out / JSONL
    if best_path.name in written:
        files["best.recipe.json"] = best_path
    lines = sweep_lines(result)
    cluster = cluster_line(result.cluster)
    lines += [cluster] if cluster is not None else []
    lines += [f"wrote {name}: {path}" for name, path in files.items()]
    return Summary(lines, result=result, files=files)


def bench_to_json(
    paths: list[str | Path], feeds: FeedSource | FeedSpec, options: BenchOptions
) -> Summary[list[LatencyStats]]:
    """`diag bench` end to end: bench, format the table, write the JSON file when asked.

    The JSON file is ``{"schema": "diag/bench", "schema_version": 1, "environment": ...,
    "models": [LatencyStats.to_dict(), ...]}``, written atomically. Returns the table's lines, the
    :class:`~diag.fix.bench.LatencyStats` of each model as ``result`` and the JSON file, if any.

    Example:
        >>> s = bench_to_json(["fp32.onnx", "int8.onnx"], FeedSpec(random=True),
        ...                   BenchOptions(json_path="bench.json"))  # doctest: +SKIP
        >>> s.result[1].p50_ms < s.result[0].p50_ms, s.files  # doctest: +SKIP
        (True, {'bench.json': PosixPath('bench.json')})
    """
    if options.json_path is not None:
        for path in paths:  # remembered as inputs first: --json may not name one of them
            checked_path(path, "model")
        output_file(options.json_path, "--json")
    stats = bench_models(paths, feeds, options)
    lines = format_table(stats).splitlines()
    files: dict[str, Path] = {}
    if options.json_path is not None:
        doc = {
            "schema": "diag/bench",
            "schema_version": 1,
            "environment": environment(),
            "opt_level": DEPLOY_OPT_LEVEL,
            "models": [s.to_dict() for s in stats],
        }
        written = Path(options.json_path)
        write_set({written: json.dumps(doc, indent=2) + "\n"}, "--json")
        files[written.name] = written
        lines.append(f"wrote {written}")
    return Summary(lines, result=stats, files=files)


def quantize_to_file(fp32_path: str | Path, options: QuantizeOptions) -> Summary[QuantizeReport]:
    """`diag quantize`: quantize as the recipe says (written atomically, verified) and the lines to print.

    The :class:`~diag.fix.modelprep.QuantizeReport` is the summary's ``result``.

    Example:
        >>> s = quantize_to_file("fp32.onnx", QuantizeOptions("recipe.json", "int8.onnx"))  # doctest: +SKIP
        >>> s.lines[-1], s.result.format  # doctest: +SKIP
        ('wrote int8.onnx (QDQ) in 1.2 s', 'QDQ')
    """
    o = options
    report = quantize_model(fp32_path, o.recipe, o.out, o.calibration, progress=o.progress, samples=o.samples)
    lines = list(report.actions)
    if o.verbose:
        lines += [f"onnxruntime: {line}" for line in report.log]
    elif report.log:
        lines.append(f"onnxruntime logged {len(report.log)} message(s) (--verbose shows them)")
    lines.append(f"wrote {report.output} ({report.format}) in {report.seconds:.1f} s")
    return Summary(lines, result=report, files={"model": Path(report.output)})
