"""``diag.json`` -> view models -> HTML and Markdown, and the output set of a diagnosis.

The JSON document (:mod:`diag.report.document` builds it from a CompareResult) is the single source for
every rendering: ``diag report diag.json`` re-renders without re-running models, and HTML/Markdown
never see a CompareResult. Numbers are formatted here; templates only loop and print
(autoescaped, StrictUndefined).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from diag.analysis.effects import LEVELS_DISAGREE
from diag.analysis.headline import Name, Said, plain
from diag.analysis.levers import RecipeLevers
from diag.core.positions import Padding
from diag.core.precision import describe
from diag.core.saturation import prediction_sentence
from diag.fix.fixcode import fix_snippet
from diag.fix.lint import Finding
from diag.foundations.environment import templates_dir
from diag.foundations.errors import DiagError
from diag.foundations.files import check_outputs, input_file, out_dir, output_file, write_set
from diag.foundations.files import out_dir as checked_out_dir
from diag.foundations.jsonnum import number_from_json
from diag.foundations.numfmt import NO_VALUE, fmt_db, fmt_num, fmt_pct
from diag.report.brief import (
    brief,
    error_paths,
    nonfinite_lines,
    persistent_said,
    root_cause_said,
    root_causes,
    task_metric_lines,
)
from diag.report.documents import read_document
from diag.report.exclude_view import best_fix_call, report_section
from diag.report.graphview import GRAPH_LIBRARY, graph_json
from diag.report.nodedata import KEPT_IN_FLOAT, OVERLAYS, node_data_texts, open_command
from diag.report.plots import (
    NEIGHBOURHOOD_HOPS,
    channel_ranges,
    distribution,
    error_along_graph,
    error_path_picture,
    neighbourhood,
    per_layer,
)
from diag.report.tiers_view import report_section as tier_section

#: summary.md's length as a PR comment: the lines under the verdict (about ten, :mod:`diag.report.brief`),
#: then the tables and lists; longer, the lists keep one item each, then the middle is cut.
SUMMARY_MAX_LINES = 70


def view_from_file(path: str | os.PathLike[str]) -> ReportView:
    """Load a ``diag.json`` and format it; a hand-edited or truncated document is a user error.

    Example:
        >>> view_from_file("out/diag.json").grade  # doctest: +SKIP
        'acceptable'
    """
    doc = load_document(path)
    try:
        return view_from_document(doc)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise DiagError(
            "bad-report",
            f"report '{path}'",
            f"has missing or malformed fields ({type(e).__name__}: {str(e)[:80]})",
            "re-run diag compare to write it again",
        ) from e


def load_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``diag.json``, validated against the shipped schema and for meaning (:mod:`diag.report.documents`)."""
    return read_document(path)


# ---------------------------------------------------------------- formatting


def _sortable(v: Any) -> str:
    """A numeric sort key for the HTML table (``data-sort``)."""
    if v is None:
        return ""
    if v == "inf":
        return "1e9"
    if v == "-inf":
        return "-1e9"
    return str(v)


# ---------------------------------------------------------------- view models
# Every number is formatted and every cut is made here: the templates loop and print.

#: Root causes and victims listed in the report's sentences (the node table has them all).
CAUSE_LINES = 5
#: Items of each list the Markdown summary repeats (victims, effects, sensitivity, remedies, metrics).
SUMMARY_ITEMS = 3
#: Steps of an error path printed in full; a longer one keeps its first and last three.
PATH_STEPS = 7
#: Pattern instances listed (worst first); diag.json has them all.
PATTERN_INSTANCES = 25
#: Weights listed (worst first); diag.json has them all.
WEIGHT_ROWS = 40
#: Tensors named in a persistent-outlier sentence.
PERSISTENT_TENSORS = 8
#: Outlier channels named per tensor.
OUTLIER_CHANNELS = 6
#: Rows of the outlier and health tables.
OUTLIER_ROWS = 200
HEALTH_ROWS = 300
#: Tensors whose remedies the report lists (worst first); diag.json has them all.
REMEDY_GROUPS = 12
#: Root causes drawn with their graph neighbourhood.
NEIGHBOURHOODS = 3
_NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


@dataclass
class NodeRow:
    rank: int
    rank_local: int
    name: str
    op_type: str
    role: str
    quantized: str
    acc_sqnr: str
    acc_sqnr_key: str
    loc_sqnr: str
    loc_sqnr_key: str
    amplification: str
    amplification_key: str
    cosine: str
    max_abs: str
    rmse_scale: str
    tensor: str
    pattern: str


@dataclass
class OutputRow:
    name: str
    grade: str
    reasons: str
    sqnr: str
    cosine_min: str
    max_abs: str
    agreement: str
    #: What the output is (logits, probability-map, detector, ...) and the graph evidence for it.
    kind: str = ""
    evidence: str = ""


@dataclass
class EffectRow:
    """One candidate kept in float in the INT8 model, with the share of output error it removes."""

    label: str
    why: str
    local_sqnr: str
    recovered: str
    recovered_key: str


@dataclass
class OutlierRow:
    tensor: str
    grid: str
    axis: str
    channels: int
    outliers: str
    typical_levels: str


@dataclass
class HealthRow:
    tensor: str
    grid: str
    effective_bits: str
    effective_bits_key: str
    clip: str
    clip_key: str
    range_over_bulk: str
    kurtosis: str
    zero_point: str
    dynamic_scale: str
    reasons: str


@dataclass
class SuggestionItem:
    tensor: str
    problem: str
    remedy: str
    python: str
    applies_to: str
    note: str
    #: the nodes the remedy keeps in float (its recipe's ``nodes_to_exclude``)
    excludes: list[str] = field(default_factory=list)


@dataclass
class RemedyGroup:
    """All remedies for one tensor: its problem once, then each onnxruntime argument."""

    tensor: str
    problem: str
    remedies: list[SuggestionItem]


@dataclass
class DistributionPlot:
    tensor: str
    histogram: str
    channels: str


@dataclass
class Neighbourhood:
    """One root cause's graph neighbourhood, drawn (inline SVG)."""

    name: str
    svg: str


@dataclass
class LayerRowView:
    """One decoder layer in the report: its error and its projections' local SQNR, formatted."""

    index: int
    worst_local: str
    worst_node: str
    accumulated: str
    roles: str
    #: local SQNR dB per projection, in :attr:`DecoderView.projections` order ("–" where absent).
    cells: list[str]
    #: per cell: whether it is under the bad threshold (the template marks it).
    bad: list[bool]


@dataclass
class DecoderView:
    """The per-layer section (``diag.json["decoder"]``)."""

    projections: list[str]
    layers: list[LayerRowView]
    outside: list[tuple[str, str, str]]
    plot: str
    #: "Per encoder layer", "Per decoder layer" or "Per transformer layer" (what the stack is).
    title: str = "Per transformer layer"


@dataclass
class PatternRow:
    label: str
    instances: int
    nodes: int
    worst_local: str
    worst_local_key: str
    worst_node: str
    output_acc: str
    share: str
    share_key: str


@dataclass
class WeightRow:
    name: str
    op_type: str
    shape: str
    granularity: str
    sqnr: str
    sqnr_key: str
    worst_channel: str
    worst_key: str
    rmse_scale: str
    nodes: str


@dataclass
class BlockRow:
    """One of the worst quantization blocks of a block-wise weight (see :mod:`diag.core.nbits`)."""

    weight: str
    where: str
    rel_rmse: str
    max_abs: str
    levels: str
    peak: str


@dataclass
class SensitivityRowView:
    label: str
    local_sqnr: str
    cosine: str
    recovered: str
    recovered_key: str
    max_abs: str


@dataclass
class MetricRow:
    """A held-out metric before and after the verified exclusions."""

    name: str
    before: str
    after: str


@dataclass
class LatencyRow:
    model: str
    p50: str
    p90: str
    speedup: str


@dataclass
class ExclusionView:
    """The verified-fix section, from an ``exclusion.json`` (:func:`diag.report.exclude_view.report_section`)."""

    verdict: str
    target: str
    held_out: str
    nodes: list[str]
    node_count: int
    metrics: list[MetricRow]
    #: The first :data:`SUMMARY_ITEMS` metrics, for summary.md.
    summary_metrics: list[MetricRow]
    latency: list[LatencyRow]
    counts: str
    trajectory_svg: str
    snippet: str
    #: The best fix as the quantizer arguments to paste (first screen, copy button).
    fix_call: str
    #: Every verified fix, best first (:func:`diag.report.exclude_view.fix_lines`).
    fix_lines: list[str]
    #: Which recipe the search started from (``recipe: ...``; empty in older documents).
    recipe_line: str
    alternatives: list[str]
    #: A tier plan's nodes by tier (``diag exclude --tiers``; empty for an exclusion list).
    plan_lines: list[str] = field(default_factory=list)
    #: The metrics table's column heads: the model the search started from, and its answer.
    before_label: str = "INT8 as given"
    after_label: str = "with the exclusions"


@dataclass(frozen=True)
class BriefItem:
    """One line under the verdict (:class:`diag.report.brief.BriefLine`) for the templates: its
    (text, is a name) parts, names rendered as code, and its depth (1: a detail of the line before)."""

    parts: list[tuple[str, bool]]
    depth: int = 0


def _brief_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The lines under the verdict (:mod:`diag.report.brief`), and the two the report also shows apart:
    where NaN/Inf first appear (in the verdict's banner) and the error paths (over the picture)."""
    nodes = doc["nodes"]
    return {
        "brief": [BriefItem(_parts(line.parts), line.depth) for line in brief(doc)],
        "nonfinite": [plain(line) for line in nonfinite_lines(nodes)],
        "error_paths": [plain(p) for p in error_paths(doc["verdict"]["outputs"], nodes)],
    }


def _parts(said: Said) -> list[tuple[str, bool]]:
    """Said parts as (text, is a name) pairs, empty prose dropped.

    Example:
        >>> _parts(("root cause: ", Name("fc1"), ""))
        [('root cause: ', False), ('fc1', True)]
    """
    return [(p.text, True) if isinstance(p, Name) else (p, False) for p in said if isinstance(p, Name) or p]


@dataclass
class SummaryView:
    """What summary.md repeats of the report: the first :data:`SUMMARY_ITEMS` of each list."""

    victims: list[str]
    effects: list[EffectRow]
    sensitivity: list[SensitivityRowView]
    #: The first persistent-outlier sentence, or "".
    persistent: str
    remedy_groups: list[RemedyGroup]


@dataclass
class ReportView:
    """Everything the templates print, already formatted and already cut."""

    title: str
    #: "INT8 model", or "INT4 model" for a 4-bit weight-only one (the headline's subject).
    model_noun: str
    grade: str
    cause: str
    #: The headline as (text, is a name) parts: names are code in summary.md and report.html.
    cause_parts: list[tuple[str, bool]]
    #: The command that opens the FP32 model in Model Explorer with diag's overlays (run in the
    #: report's folder), or "" for a document without nodes.
    model_explorer: str
    single_cause: bool
    fp32_path: str
    int8_path: str
    int8_format: str
    #: How diag built the INT8 model from the user's file (AIMET encodings), "" for the file itself.
    int8_built: str
    inputs: str
    samples: int
    seconds: str
    environment: list[tuple[str, str]]
    outputs: list[OutputRow]
    #: Which run the grades are of (deployed at a level, or exact mode).
    outputs_note: str
    root_causes: list[str]
    #: The heading over ``root_causes``: under a "no single root cause" headline they are only the
    #: locally worst nodes, and a list titled "Root causes" would contradict the sentence above it.
    root_causes_heading: str
    victims: list[str]
    nodes_to_exclude: list[str]
    #: len(nodes_to_exclude), printed by the summary.
    fix_node_count: int
    unnamed_nodes: list[str]
    #: unnamed_nodes joined for a sentence.
    unnamed_list: str
    fix_command: str
    #: The starting point's measured estimate (or why there is none), one sentence.
    fix_estimate: str
    #: The command that verifies and prunes the starting point (diag exclude), or "".
    verify_command: str
    nodes: list[NodeRow]
    unmatched: list[tuple[str, str]]
    skipped_count: int
    compared: int
    float_tensors: int
    accounted: int
    plot_error_along_graph: str
    bad_db: str
    #: The loss (dB) under which a node only passes its input's error on (the document's threshold).
    inherit_db: str
    outliers: list[OutlierRow]
    persistent: list[str]
    health: list[HealthRow]
    remedy_groups: list[RemedyGroup]
    #: " The 12 worst of 30 tensors; diag.json lists them all." when the list is cut; else "".
    remedy_note: str
    distribution_plots: list[DistributionPlot]
    pattern_kinds: list[PatternRow]
    pattern_instances: list[PatternRow]
    weights: list[WeightRow]
    weights_shown: int
    weights_total: int
    exclusion: ExclusionView | None
    sensitivity: list[SensitivityRowView]
    neighbourhoods: list[Neighbourhood]
    #: How far around a root cause its neighbourhood plot reaches, in words ("two").
    neighbourhood_hops: str
    versions: str
    nonfinite: list[str]
    error_paths: list[str]
    #: Transformer stacks: the per-layer section (None for other models).
    decoder: DecoderView | None
    sensitivity_note: str
    summary: SummaryView
    #: Root-cause candidates with their measured effect on the outputs, and what it was measured on.
    effects: list[EffectRow] = field(default_factory=list)
    effects_note: str = ""
    #: " · 3 passes (memory budget)" when a --max-memory budget split the run, " · local error on the
    #: first 16 samples" when --local-samples limited it; empty otherwise.
    run_note: str = ""
    #: The CPU's integer-kernel path the figures were measured on (diag.foundations.cpu.KernelPath), or "".
    kernel_path: str = ""
    #: --deploy-isa avx2: one sentence for the prediction, then one per u8s8 node (worst first).
    deploy_isa_head: str = ""
    deploy_isa: list[str] = field(default_factory=list)
    #: Findings about the model files that did not stop diag (e.g. onnx.checker vs onnxruntime).
    model_warnings: list[str] = field(default_factory=list)
    #: One line per --metric plugin value.
    task_lines: list[str] = field(default_factory=list)
    #: Worst quantization blocks of block-wise weights (MatMulNBits, int4 QDQ).
    weight_blocks: list[BlockRow] = field(default_factory=list)
    #: The error-path picture's file name beside summary.md, "" when none is written (set by
    #: :func:`output_texts`, which writes it).
    error_path_picture: str = ""
    #: The interactive graph's data (:func:`diag.report.graphview.graph_json`) and the layout
    #: library the page inlines; "" without node findings.
    graph_json: str = ""
    #: ``compare --recipe FILE``: each recipe line measured on the model it builds, as lint words it.
    recipe_lines: list[str] = field(default_factory=list)
    #: The recipe's settings changed alone and re-quantized (:mod:`diag.fix.levercheck`): their one line
    #: and one row per setting; empty when not tried.
    recipe_settings_line: str = ""
    #: The headline's fix when too long for its sentence (:attr:`diag.analysis.headline.Headline.fix_code`).
    fix_code: str = ""
    recipe_settings: list[SettingRow] = field(default_factory=list)
    #: The lines under the verdict, as the terminal prints them (:func:`diag.report.brief.brief`).
    brief: list[BriefItem] = field(default_factory=list)
    graph_lib: str = ""
    graph_units: int = 0


@dataclass
class SettingRow:
    """One recipe setting changed alone, re-quantized and measured, for the report's table."""

    setting: str
    recipe_has: str
    recovered: str
    recovered_key: str
    sqnr_after: str


def _recipe_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The recipe's lines measured (``--recipe FILE``, as lint words them), and its settings' line and
    rows (:class:`diag.analysis.levers.RecipeLevers`), from diag.json."""
    lines = [Finding(**f).line() for f in doc.get("recipe_lines") or []]
    section = doc.get("recipe_settings")
    if not section:
        return {"recipe_lines": lines}
    levers = RecipeLevers.from_dict(section)
    rows = []
    for e in levers.effects:
        after = e.sqnr_after.get(levers.target)
        if e.identical or e.recovered is None:
            shown, key = ("byte-identical" if e.identical else "not measured"), "-1e9"
        else:
            shown, key = _share(e.recovered), _sortable(e.recovered if math.isfinite(e.recovered) else "-inf")
        rows.append(
            SettingRow(e.change.setting, e.change.lever, shown, key, f"{after:.1f}" if after is not None else "")
        )
    return {"recipe_lines": lines, "recipe_settings_line": levers.line(), "recipe_settings": rows}


def _share(recovered: float) -> str:
    """A measured share of the error removed, as the report's tables show it."""
    if math.isinf(recovered):
        return "NaN/Inf"
    return f"{recovered:.0%}" if recovered >= 0 else f"adds {-recovered:.0%}"


def view_from_document(doc: dict[str, Any], with_plots: bool = True) -> ReportView:
    """Format a ``diag.json`` document for the templates (``with_plots=False``: no SVG drawn).

    Example:
        >>> view_from_document(json.load(open("out/diag.json"))).grade  # doctest: +SKIP
        'acceptable'
    """
    nodes, models, verdict, rec, m = doc["nodes"], doc["models"], doc["verdict"], doc["recommendation"], doc["matching"]
    bad_db = doc["thresholds"]["bad_sqnr_db"]
    dist, patterns = doc.get("distributions") or {}, doc.get("patterns") or {}
    remedy_groups = _remedy_groups(doc.get("suggestions", []))
    _mark_remedies_off_the_list(remedy_groups, doc)
    weights, weights_total = _weight_rows(doc.get("weights")), len((doc.get("weights") or {}).get("findings", []))
    effects, sensitivity = _effect_rows(doc.get("effects")), _sensitivity_rows(doc.get("sensitivity"))
    victims, persistent = _victim_lines(nodes), [plain(p) for p in persistent_said(dist)]
    shown_groups = remedy_groups[:REMEDY_GROUPS]
    return ReportView(
        title=f"diag: {Path(models['int8']['path']).name} vs {Path(models['fp32']['path']).name}",
        model_noun=model_noun(doc),
        **_headline_fields(doc),
        fp32_path=models["fp32"]["path"],
        int8_path=models["int8"]["path"],
        int8_format=models["int8"]["format"] + _precision_note(models["int8"].get("precisions")),
        int8_built=str(models["int8"].get("built", "")),
        inputs=doc["run"]["inputs"],
        samples=doc["run"]["samples"],
        seconds=f"{doc['run']['seconds']:.1f}",
        run_note=_run_note(doc["run"]),
        kernel_path=_kernel_path_line(doc["run"].get("kernel_path")),
        **_deploy_isa_fields(doc.get("deploy_isa")),
        environment=sorted((k, str(v)) for k, v in doc["environment"].items()),
        outputs=_output_rows(verdict["outputs"], verdict.get("exact_outputs") or []),
        outputs_note=_graded_at_note(verdict),
        root_causes=[plain(root_cause_said(n, dist.get("tensors", {}))) for n in root_causes(nodes)][:CAUSE_LINES],
        victims=victims,
        **_starting_point_fields(models, rec),
        nodes=[_node_row(n) for n in nodes],
        unmatched=sorted(m["unmatched_tensors"].items()),
        skipped_count=len(m["skipped_tensors"]),
        compared=m["compared"],
        float_tensors=m["float_tensors"],
        accounted=m["accounted"],
        plot_error_along_graph=error_along_graph(nodes, bad_db) if with_plots and nodes else "",
        bad_db=f"{bad_db:g}",
        inherit_db=f"{doc['thresholds']['inherit_db']:g}",
        outliers=_outlier_rows(dist.get("tensors", {})),
        persistent=persistent,
        health=_health_rows(dist.get("tensors", {})),
        remedy_groups=shown_groups,
        remedy_note=_remedy_note(len(shown_groups), len(remedy_groups)),
        distribution_plots=_distribution_plots(dist) if with_plots else [],
        pattern_kinds=[_pattern_row(t) for t in patterns.get("kinds", [])],
        pattern_instances=[_pattern_row(t) for t in patterns.get("instances", [])[:PATTERN_INSTANCES]],
        weights=weights,
        weights_shown=len(weights),
        weights_total=weights_total,
        weight_blocks=_block_rows(doc.get("weights")),
        exclusion=_exclusion_view(doc.get("exclusion"), with_plots) or _tier_view(doc.get("tiers")),
        sensitivity=sensitivity,
        sensitivity_note=_sensitivity_note(doc.get("sensitivity")),
        effects=effects,
        effects_note=_effects_note(doc.get("effects")),
        versions=_versions(doc["environment"]),
        **_brief_fields(doc),
        decoder=_decoder_view(doc.get("decoder"), bad_db, with_plots),
        neighbourhoods=_neighbourhoods(nodes, bad_db) if with_plots else [],
        **_graph_fields(doc),
        **_recipe_fields(doc),
        neighbourhood_hops=_NUMBER_WORDS.get(NEIGHBOURHOOD_HOPS, str(NEIGHBOURHOOD_HOPS)),
        model_warnings=[w for k in ("fp32", "int8") for w in models[k].get("warnings", [])],
        task_lines=[plain(line) for line in task_metric_lines(doc.get("task_metrics") or {})],
        summary=SummaryView(
            victims[:SUMMARY_ITEMS],
            effects[:SUMMARY_ITEMS],
            sensitivity[:SUMMARY_ITEMS],
            persistent[0] if persistent else "",
            shown_groups[:SUMMARY_ITEMS],
        ),
    )


def _decoder_view(decoder: dict[str, Any] | None, bad_db: float, with_plots: bool) -> DecoderView | None:
    """The per-layer table (a row per layer, a column per projection) and its plot."""
    if not decoder:
        return None
    names = [p["name"] for p in decoder["projections"]]
    rows = []
    for layer in decoder["layers"]:
        key = str(layer["index"])
        cells, bad = [], []
        for p in decoder["projections"]:
            local = (p["by_layer"].get(key) or {}).get("local_sqnr_db")
            cells.append(fmt_db(local))
            bad.append(isinstance(local, (int, float)) and local < bad_db)
        rows.append(
            LayerRowView(
                layer["index"],
                fmt_db(layer["worst_local_sqnr_db"]),
                layer["worst_local_node"] or NO_VALUE,
                fmt_db(layer["accumulated_sqnr_db"]),
                ", ".join(layer["roles"]),
                cells,
                bad,
            )
        )
    outside = [(o["node"], fmt_db(o["local_sqnr_db"]), fmt_db(o["accumulated_sqnr_db"])) for o in decoder["outside"]]
    title = f"Per {decoder.get('stack', 'transformer')} layer"
    return DecoderView(names, rows, outside, per_layer(decoder, bad_db) if with_plots else "", title)


def _starting_point_fields(models: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ReportView` fields of the starting point (the unverified list) and its estimate."""
    return {
        "nodes_to_exclude": rec["nodes_to_exclude"],
        "fix_node_count": len(rec["nodes_to_exclude"]),
        "unnamed_nodes": rec["unnamed_nodes"],
        "unnamed_list": ", ".join(rec["unnamed_nodes"]),
        "fix_command": _fix_command(models, rec),
        "fix_estimate": starting_point_estimate(rec),
        "verify_command": rec.get("verify_command") or "",
    }


def starting_point_estimate(rec: dict[str, Any]) -> str:
    """What keeping the suggested list in float was measured to do, labelled as an estimate.

    Example:
        >>> rec = {"estimate": {"target": "probs", "samples": 8, "sqnr_before_db": 19.3,
        ...        "sqnr_after_db": 41.0, "recovered": 0.993, "opt_level": "all"}}
        >>> starting_point_estimate(rec).split(": ")[1]
        'probs SQNR 19.3 \u2192 41.0 dB, 99% of its error removed'
    """
    est = rec.get("estimate")
    if not est:
        return "not measured (the effect check did not run or could not rebuild the list in float)"
    recovered = number_from_json(est["recovered"])
    if math.isinf(recovered) and recovered < 0:
        share = "creates NaN/Inf"
    elif recovered < 0:
        share = f"its error grows by {-recovered:.0%}: this list alone does not fix it"
    else:
        share = f"{recovered:.0%} of its error removed"
    return (
        f"estimated on {est['samples']} samples with the list in float inside the INT8 model: "
        f"{est['target']} SQNR {fmt_db(est['sqnr_before_db'])} \u2192 {fmt_db(est['sqnr_after_db'])} dB, {share}"
    )


def _fix_command(models: dict[str, Any], rec: dict[str, Any]) -> str:
    """The unverified fix as Python to paste: re-quantize with the root causes kept in float."""
    int8 = models["int8"]
    external = bool(models["fp32"].get("external_data"))
    return fix_snippet(
        int8["format"], rec["nodes_to_exclude"], rec.get("recipe"), models["fp32"]["path"], int8["path"], external
    )


def _versions(environment: dict[str, Any]) -> str:
    """``onnxruntime 1.20.1 · onnx 1.17.0 · diag 0.9.0 · date ...`` for the report's header."""
    return " · ".join(f"{k} {environment[k]}" for k in ("onnxruntime", "onnx", "diag", "date") if k in environment)


def _deploy_isa_fields(isa: dict[str, Any] | None) -> dict[str, Any]:
    """The ``--deploy-isa avx2`` prediction: its summary sentence and the nodes, worst first."""
    if not isa:
        return {}
    head = prediction_sentence(isa)  # the terminal's sentence too
    if not isa["u8s8_nodes"]:
        return {"deploy_isa_head": head, "deploy_isa": []}
    head += (
        ": there onnxruntime adds each pair of u8 x s8 products into a saturating int16; predicted by replaying "
        "that arithmetic on this run's inputs (this CPU's own figures are above)"
    )
    return {"deploy_isa_head": head, "deploy_isa": [str(e["sentence"]) for e in isa["nodes"]]}


def _kernel_path_line(kp: dict[str, Any] | None) -> str:
    """``int8 kernels: x86_64 AVX2 AVX512-VNNI · onnxruntime 1.20.1 CPU · u8s8 exact (VNNI)``; "" for old documents."""
    if not kp:
        return ""
    providers = ", ".join(str(p).removesuffix("ExecutionProvider") for p in kp.get("providers", []))
    isa = " ".join(kp.get("isa", [])) or "no SIMD int8 flags seen"
    return f"{kp['machine']} {isa} · onnxruntime {kp['onnxruntime']} {providers} · u8s8 {kp['u8s8']}"


def _run_note(run: dict[str, Any]) -> str:
    passes = int(run.get("passes", 1))
    note = f" \u00b7 {passes} passes (memory budget)" if passes > 1 else ""
    padding = Padding.from_dict(run.get("positions"))
    note += f" \u00b7 {padding.sentence()}" if padding is not None else ""
    return note + local_samples_note(run, " \u00b7 ")


def local_samples_note(run: dict[str, Any], sep: str) -> str:
    """``sep`` + "local error on the first 16 samples" when fewer samples than the run's had
    their local error measured (``--local-samples``); empty otherwise."""
    local, samples = run.get("local_samples"), int(run.get("samples", 0))
    if not run.get("local_error") or local is None or int(local) >= samples:
        return ""
    return f"{sep}local error on the first {int(local)} samples"


def _remedy_note(shown: int, total: int) -> str:
    """The sentence that says the remedy list was cut to the worst tensors, or ""."""
    return f" The {shown} worst of {total} tensors; diag.json lists them all." if total > shown else ""


def _node_row(n: dict[str, Any]) -> NodeRow:
    a = n["accumulated"]
    loc = n["local"] or {}
    return NodeRow(
        rank=n["rank_accumulated"],
        rank_local=n["rank_local"],
        name=n["name"],
        op_type=n["op_type"],
        role=n["role"],
        quantized="yes" if n["quantized"] else "no",
        acc_sqnr=fmt_db(a["sqnr_db"]),
        acc_sqnr_key=_sortable(a["sqnr_db"]),
        loc_sqnr=fmt_db(loc.get("sqnr_db")),
        loc_sqnr_key=_sortable(loc.get("sqnr_db")),
        amplification=fmt_db(n["amplification_db"]),
        amplification_key=_sortable(n["amplification_db"]),
        cosine=fmt_num(a["cosine"], 6),
        max_abs=fmt_num(a["max_abs"]),
        rmse_scale=fmt_num(a["rmse_over_scale"]),
        tensor=n["tensor"],
        pattern=n.get("pattern") or "",
    )


def _victim_lines(nodes: list[dict[str, Any]]) -> list[str]:
    return [
        f"{n['name']} ({n['op_type']}): accumulated {fmt_db(n['accumulated']['sqnr_db'])} dB, "
        f"local {fmt_db((n['local'] or {}).get('sqnr_db'))} dB"
        for n in nodes
        if n["role"] in ("victim", "amplifier")
    ][:CAUSE_LINES]


def _agreement_cell(o: dict[str, Any]) -> str:
    """Top-1 agreement; for a sequence output, per position and how many samples agree at every one."""
    cell = fmt_pct(o["top1_agreement"])
    share = o.get("sequence_agreement")
    if o.get("positions") and share is not None and o["top1_agreement"] is not None:
        whole = round(share * o["samples"])
        cell += f" per position ({o['positions']}); {whole}/{o['samples']} samples at every position"
        first = o.get("first_divergence") or {}
        if first.get("earliest") is not None:
            cell += f"; first differ at position {first['earliest']} (median {first['median']})"
        if isinstance(o.get("kl_mean"), (int, float)):
            cell += f"; KL {o['kl_mean']:.4f}"
    return cell


def _graded_at_note(verdict: dict[str, Any]) -> str:
    """Which run the grades are of: as deployed (onnxruntime's optimization level) or exact mode."""
    level = verdict.get("graded_at", "disabled")
    if level == "disabled":
        return "Graded in exact mode (onnxruntime's optimizations off; --deploy-level disabled)."
    return (
        f"Graded as onnxruntime runs the INT8 model at optimization level {level} (what you deploy; "
        "--deploy-level), against the exact FP32 outputs; an output whose exact-mode grade differs has a "
        "row of its own."
    )


def _headline_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The verdict's fields of the view: the grade, the headline as text and as parts, the title over
    the root-cause list, and the command that opens the model in Model Explorer with the overlays."""
    verdict = doc["verdict"]
    return {
        "grade": verdict["grade"],
        "cause": verdict["cause"],
        "cause_parts": _cause_parts(verdict),
        "fix_code": str((verdict.get("headline") or {}).get("fix_code") or ""),
        "single_cause": verdict["single_cause"],
        "root_causes_heading": "Locally worst nodes" if _headline_kind(verdict) == "spread" else "Root causes",
        "model_explorer": open_command(doc) if doc.get("nodes") else "",
    }


def _cause_parts(verdict: dict[str, Any]) -> list[tuple[str, bool]]:
    """The headline's parts (:meth:`diag.analysis.headline.Headline.to_dict`); a document written
    before the headline had parts is one piece of prose.

    Example:
        >>> _cause_parts({"cause": "x", "headline": {"parts": [{"text": "root: ", "name": False},
        ...                                                      {"text": "a_b", "name": True}]}})
        [('root: ', False), ('a_b', True)]
        >>> _cause_parts({"cause": "a sentence"})
        [('a sentence', False)]
    """
    parts = (verdict.get("headline") or {}).get("parts")
    if not parts:
        return [(str(verdict["cause"]), False)]
    return [(str(p["text"]), bool(p["name"])) for p in parts]


def _headline_kind(verdict: dict[str, Any]) -> str:
    """The headline's kind (:data:`diag.analysis.headline.HeadlineKind`); "" in a document written
    before the headline was typed data (its sentence is shown as it is, never parsed).

    Example:
        >>> _headline_kind({"headline": {"kind": "spread"}}), _headline_kind({"cause": "no single root cause"})
        ('spread', '')
    """
    return str((verdict.get("headline") or {}).get("kind") or "")


def _output_rows(outputs: list[dict[str, Any]], exact: list[dict[str, Any]] | None = None) -> list[OutputRow]:
    """One row per model output, one per output whose exact-mode grade differs, then one per Concat part."""
    graded = {o["name"]: o["grade"] for o in outputs}
    differ = [e for e in exact or [] if graded.get(e["name"]) not in (None, e["grade"])]
    rows = [
        OutputRow(
            o["name"],
            o["grade"],
            "; ".join(o["reasons"]),
            fmt_db(o["sqnr_db"]),
            fmt_num(o["cosine_min"], 6),
            fmt_num(o["max_abs"]),
            _agreement_cell(o),
            o.get("kind") or "",
            o.get("kind_evidence") or "",
        )
        for o in outputs
    ]
    rows += [
        OutputRow(
            f"{e['name']} \u00b7 exact mode",
            e["grade"],
            "; ".join(e["reasons"]),
            fmt_db(e["sqnr_db"]),
            fmt_num(e["cosine_min"], 6),
            fmt_num(e["max_abs"]),
            _agreement_cell(e),
            "exact mode",
            "",
        )
        for e in differ
    ]
    return rows + [
        OutputRow(
            f"{o['name']} \u00b7 {p['label']}",
            "",
            f"Concat part; local SQNR {fmt_db(p['local_sqnr_db'])} dB",
            fmt_db(p["sqnr_db"]),
            fmt_num(p["cosine_min"], 6),
            fmt_num(p["max_abs"]),
            "",
            "part",
            "",
        )
        for o in outputs
        for p in o.get("parts") or []
    ]


def _sensitivity_rows(sens: dict[str, Any] | None) -> list[SensitivityRowView]:
    return [
        SensitivityRowView(
            r["label"],
            fmt_db(r["local_sqnr_db"]),
            fmt_num(r["cosine"], 6),
            ("+" if isinstance(r["cosine_recovered"], float) and r["cosine_recovered"] >= 0 else "")
            + fmt_num(r["cosine_recovered"], 4),
            _sortable(r["cosine_recovered"]),
            fmt_num(r["max_abs"]),
        )
        for r in (sens or {}).get("rows", [])
    ]


def _exact_note(e: dict[str, Any]) -> str:
    """`` (exact mode 98.40%)`` beside a deployed share the fused kernels change (issue 46), else ``""``."""
    exact = e.get("exact_recovered")
    if not isinstance(exact, (int, float)) or not isinstance(e.get("recovered"), (int, float)):
        return ""
    return f" (exact mode {fmt_pct(exact)})" if abs(exact - e["recovered"]) >= LEVELS_DISAGREE else ""


def _effect_rows(effects: dict[str, Any] | None) -> list[EffectRow]:
    """The nodes measured, then the recipe-lever groups (diag.analysis.levers) when some were measured."""
    rows = [
        EffectRow(
            e["node"],
            "; ".join(e["why"]),
            fmt_db(e["local_sqnr_db"]),
            fmt_pct(e["recovered"]) + _exact_note(e),
            _sortable(e["recovered"]),
        )
        for e in (effects or {}).get("effects", [])
    ]
    rows += [
        EffectRow(
            g["label"],
            f"recipe lever {g['lever']}; fix: {g['fix']}",
            "-",
            fmt_pct(g["recovered"]),
            _sortable(g["recovered"]),
        )
        for g in (effects or {}).get("groups", [])
    ]
    return rows


def _neighbourhoods(nodes: list[dict[str, Any]], bad_db: float) -> list[Neighbourhood]:
    roots = [n for n in sorted(nodes, key=lambda n: n["rank_local"]) if n["role"] == "root-cause"]
    drawn = [Neighbourhood(n["name"], neighbourhood(nodes, n["name"], bad_db)) for n in roots[:NEIGHBOURHOODS]]
    return [d for d in drawn if d.svg]


def _graph_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The interactive graph's fields of :class:`ReportView` (none without node findings)."""
    payload = graph_json(doc)
    if not payload:
        return {}
    lib = (templates_dir() / GRAPH_LIBRARY).read_text("utf-8")
    return {"graph_json": payload, "graph_lib": lib, "graph_units": len(doc.get("nodes") or [])}


def _effects_note(effects: dict[str, Any] | None) -> str:
    if not effects:
        return ""
    skipped = effects.get("skipped") or {}
    note = (
        f"Measured on '{effects['target']}' (the worst output or part) over {effects['samples']} samples, the "
        f"models run at onnxruntime's optimization level {effects.get('level', 'all')} (its default: what you deploy)."
    )
    if skipped:
        note += f" Not rebuilt: {', '.join(sorted(skipped))}."
    return note


def _sensitivity_note(sens: dict[str, Any] | None) -> str:
    if not sens:
        return ""
    b, g = sens["baseline"], sens["given"]
    note = (
        f"Recipe re-applied as given: min cosine {fmt_num(b['cosine'], 6)} "
        f"(the diagnosed INT8 model: {fmt_num(g['cosine'], 6)}); {sens['quantizations']} quantizations, "
        f"{sens['seconds']:.1f} s."
    )
    if not sens["reproduces"]:
        note += " The recipe does not reproduce the diagnosed model: read the rows with care."
    return note


def _exclusion_view(exclusion: dict[str, Any] | None, with_plots: bool) -> ExclusionView | None:
    """The verified-fix section, from an ``exclusion.json`` document (see diag.report.exclude_view.report_section)."""
    return _fix_view(report_section(exclusion, with_plots)) if exclusion else None


def _tier_view(plan: dict[str, Any] | None) -> ExclusionView | None:
    """A tier plan as the verified-fix section (see diag.report.tiers_view.report_section)."""
    return _fix_view(tier_section(plan)) if plan else None


def _fix_view(section: dict[str, Any]) -> ExclusionView:
    """The verified-fix section from either search's rows (the keys both report_section functions give)."""
    metrics = [MetricRow(r["name"], r["before"], r["after"]) for r in section["metrics"]]
    return ExclusionView(
        verdict=section["verdict"],
        target=section["target"],
        held_out=section["held_out"],
        nodes=section["nodes"],
        node_count=len(section["nodes"]),
        metrics=metrics,
        summary_metrics=metrics[:SUMMARY_ITEMS],
        latency=[LatencyRow(r["model"], r["p50"], r["p90"], r["speedup"]) for r in section["latency"]],
        counts=section["counts"],
        trajectory_svg=section["trajectory_svg"],
        snippet=section["snippet"],
        fix_call=section["fix_call"],
        fix_lines=section["fix_lines"],
        recipe_line=section["recipe_line"],
        alternatives=section["alternatives"],
        plan_lines=section.get("plan_lines", []),
        before_label=section.get("before_label", "INT8 as given"),
        after_label=section.get("after_label", "with the exclusions"),
    )


def _remedy_groups(suggestions: list[dict[str, Any]]) -> list[RemedyGroup]:
    """The remedies by tensor and problem, each with its measured effect when the check measured it;
    a remedy measured not to help says so first ("measured, does not help: ...": never advice)."""
    groups: dict[tuple[str, str], RemedyGroup] = {}
    for x in suggestions:
        key = (x["tensor"], x["problem"])
        g = groups.setdefault(key, RemedyGroup(x["tensor"], x["problem"], []))
        measured = str(x.get("measured_note") or "")
        note = (
            "; ".join(p for p in (measured, x["note"]) if p)
            if x.get("advised", True) is False
            else "; ".join(p for p in (x["note"], measured) if p)
        )
        g.remedies.append(
            SuggestionItem(
                x["tensor"],
                x["problem"],
                x["remedy"],
                x["python"],
                x["applies_to"],
                note,
                [str(n) for n in (x.get("recipe") or {}).get("nodes_to_exclude") or []],
            )
        )
    return list(groups.values())


def _mark_remedies_off_the_list(groups: list[RemedyGroup], doc: dict[str, Any]) -> None:
    """A ``nodes_to_exclude`` remedy naming nodes outside the run's one list says so (issue 25, item 4).

    The list is the verified fix when the run has one (``diag exclude``, ``diag demo``; a tier
    plan's fp32 tier for ``diag exclude --tiers``), else the starting point (the root causes). A
    per-tensor remedy is what fits that tensor alone; next to a list that does without its nodes,
    it must not read as a second, competing fix.
    """
    exclusion = doc.get("exclusion") or {}
    plan = doc.get("tiers") or {}
    if plan.get("reachable") and plan.get("plan"):
        # A tier plan keeps in float only its fp32 tier; the rest of it is at a higher bit width.
        floated = set((plan.get("recipe") or {}).get("nodes_to_exclude") or [])
        why = "not kept in float by the verified tier plan"
    elif str(exclusion.get("verdict", "")).startswith("met"):
        best = (exclusion.get("fixes") or [exclusion])[0]
        floated = set(best.get("nodes_to_exclude") or [])
        # An op-type fix leaves every node of the other op types in float as well.
        op_types = best.get("op_types_to_quantize")
        if op_types:
            for node in doc["nodes"]:
                if not set(str(node["op_type"]).split("+")) & set(op_types):
                    floated.update(node["fp_nodes"])
        why = f"not needed by the verified fix ({best_fix_call(exclusion)})"
    else:
        fix = list(doc["recommendation"]["nodes_to_exclude"])
        if not fix:
            return
        floated = set(fix)
        why = f"not in the starting point (nodes_to_exclude={json.dumps(fix, ensure_ascii=False)})"
    for g in groups:
        for r in g.remedies:
            extra = ", ".join(n for n in r.excludes if n not in floated)
            if extra:
                off = f"{extra}: {why}"
                r.note = f"{r.note}; {off}" if r.note else off


def _pattern_row(t: dict[str, Any]) -> PatternRow:
    return PatternRow(
        t["label"],
        t["instances"],
        t["nodes"],
        fmt_db(t["worst_local_sqnr_db"]),
        _sortable(t["worst_local_sqnr_db"]),
        t["worst_local_node"] or "",
        fmt_db(t["output_accumulated_sqnr_db"]),
        fmt_pct(t["local_share"]),
        _sortable(t["local_share"]),
    )


def _weight_rows(weights: dict[str, Any] | None, limit: int = WEIGHT_ROWS) -> list[WeightRow]:
    rows = []
    for w in (weights or {}).get("findings", [])[:limit]:
        worst = w["channels"][0] if w["channels"] else None
        gran = "per-tensor" if w["axis"] is None else f"per-channel (axis {w['axis']})"
        if w.get("block_size"):
            gran = f"block-wise ({w['block_size']} rows)"
        if w["folded"]:
            gran += f"; folded {w['folded']}"
        rows.append(
            WeightRow(
                w["fp_name"],
                w["op_type"] + (" bias" if w["is_bias"] else ""),
                "\u00d7".join(str(d) for d in w["shape"]) or "scalar",
                f"{w['dtype']} {gran}",
                fmt_db(w["sqnr_db"]),
                _sortable(w["sqnr_db"]),
                f"#{worst['channel']}: {fmt_db(worst['sqnr_db'])} dB" if worst else "",
                _sortable(w["worst_sqnr_db"]),
                fmt_num(w["rmse_over_scale"]),
                ", ".join(w["fp_nodes"][:3]),
            )
        )
    return rows


def _block_rows(weights: dict[str, Any] | None) -> list[BlockRow]:
    """The worst blocks of block-wise weights as table cells (see :mod:`diag.core.nbits`)."""
    return [
        BlockRow(
            weight=b["weight"],
            where=b["where"],
            rel_rmse=fmt_num(b["rel_rmse"]),
            max_abs=fmt_num(b["max_abs"]),
            levels=str(b["levels"]),
            peak=fmt_num(b["peak_ratio"]),
        )
        for b in (weights or {}).get("blocks", [])
    ]


def _outlier_rows(dist_tensors: dict[str, Any]) -> list[OutlierRow]:
    rows = []
    for name, h in dist_tensors.items():
        if not h["outliers"]:
            continue
        shown = ", ".join(
            f"{o['index']} ({fmt_num(o['times_median'], 3)}x, {fmt_pct(o['scale_share'])} of range)"
            for o in h["outliers"][:OUTLIER_CHANNELS]
        )
        extra = len(h["outliers"]) - OUTLIER_CHANNELS
        more = f" +{extra} more" if extra > 0 else ""
        rows.append(
            OutlierRow(
                name, h["grid"], str(h["axis"]), h["channels"], shown + more, fmt_num(h["median_channel_levels"], 3)
            )
        )
    quantized_first = sorted(rows, key=lambda r: (r.grid == "none",))
    return quantized_first[:OUTLIER_ROWS]


def _health_rows(dist_tensors: dict[str, Any]) -> list[HealthRow]:
    rows = []
    for name, h in dist_tensors.items():
        if h["grid"] == "none":
            continue
        dyn = h["dynamic_scale"]
        rows.append(
            HealthRow(
                name,
                h["grid"],
                fmt_num(h["effective_bits"], 3),
                _sortable(h["effective_bits"]),
                fmt_pct(h["clip_fraction"]),
                _sortable(h["clip_fraction"]),
                fmt_num(h["range_over_bulk"], 3),
                fmt_num(h["kurtosis"], 3),
                fmt_pct(h["zero_point_position"]),
                f"{fmt_num(dyn['min'])}\u2013{fmt_num(dyn['max'])} over {dyn['batches']} batches" if dyn else "",
                "; ".join(h["reasons"]),
            )
        )
    rows.sort(key=lambda r: (not r.reasons, float(r.effective_bits_key or 99)))
    return rows[:HEALTH_ROWS]


def _distribution_plots(dist: dict[str, Any]) -> list[DistributionPlot]:
    plots = []
    factor = dist.get("outlier_factor", 6.0)
    for name, p in dist.get("plotted", {}).items():
        h = dist["tensors"][name]
        chans = ""
        if p["channel_max"]:
            chans = channel_ranges(name, p["channel_max"], [o["index"] for o in h["outliers"]], factor)
        plots.append(DistributionPlot(name, distribution(name, p, h), chans))
    return plots


def model_noun(doc: dict[str, Any]) -> str:
    """ "INT4 model" for a weight-only model of 4 bits (as its recipe says), else "INT8 model".

    Example:
        >>> model_noun({"recommendation": {"recipe": {"settings": {"mode": "weight_only", "bits": 4}}}})
        'INT4 model'
        >>> model_noun({"recommendation": {"recipe": None}})
        'INT8 model'
    """
    settings = ((doc.get("recommendation") or {}).get("recipe") or {}).get("settings") or {}
    if settings.get("mode") == "weight_only":
        return f"INT{int(settings.get('bits', 4))} model"
    return "INT8 model"


def _precision_note(precisions: dict[str, list[str]] | None) -> str:
    """`` (fp16 6 nodes; fp32 1 (attn/Attention))`` for the report header; empty for 8-bit models."""
    if not precisions:
        return ""
    return f" ({describe(precisions)})"


# ---------------------------------------------------------------- rendering


def _printable(value: Any) -> Any:
    """Drop terminal control characters from untrusted names (newlines and tabs stay; Markup passes)."""
    if isinstance(value, str) and not hasattr(value, "__html__"):
        return "".join(ch for ch in value if ch.isprintable() or ch in "\n\t")
    return value


def jinja_environment(folder: Path | None = None) -> jinja2.Environment:
    """The templates' jinja2 environment: autoescaped, StrictUndefined, control characters dropped.

    ``folder``: where the templates are (default: :func:`templates_dir`).
    """

    return jinja2.Environment(
        finalize=_printable,
        loader=jinja2.FileSystemLoader(str(folder or templates_dir())),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def page_environment(markdown: bool = False) -> jinja2.Environment:
    """:func:`jinja_environment` for the HTML pages, or set up for Markdown (no autoescape, the
    ``md``/``mdcode``/``mdfence`` filters): one per templates folder and kind of page, so each
    template is compiled once per process instead of on every render. A template file changed
    on disk is still read again (jinja2's ``auto_reload``)."""
    return _environment_for(templates_dir(), markdown)


@functools.cache
def _environment_for(folder: Path, markdown: bool) -> jinja2.Environment:
    env = jinja_environment(folder)
    if markdown:
        env.autoescape = False
        env.filters["md"] = md_escape
        env.filters["mdcode"] = md_code
        env.filters["mdfence"] = md_fence
    return env


def render_html(view: ReportView) -> str:
    return str(page_environment().get_template("report.html.j2").render(v=view))


#: Where summary.md's closing fix block starts: the lines from it on are never cut.
_FIX_BLOCK = "**Starting point**"
_TRUNCATED = "_(truncated; see report.html)_"


def _cut_middle(lines: list[str], limit: int) -> list[str]:
    """At most ``limit`` lines: the verdict and the fix always stay (issue 45), the middle goes first.

    The head (title, verdict, the verified fix) and the closing fix block (the starting point to
    paste and the command that verifies it) are kept whole; sections between them are cut.

    Example:
        >>> _cut_middle(["# t", "verdict", "a", "b", "c", "**Starting point** x", "fix"], 5)
        ['# t', 'verdict', '_(truncated; see report.html)_', '**Starting point** x', 'fix']
    """
    if len(lines) <= limit:
        return lines
    tail_at = next((i for i, line in enumerate(lines) if line.startswith(_FIX_BLOCK)), len(lines))
    tail = lines[tail_at:]
    room = limit - 1 - len(tail)
    if room < 2:  # a fix block longer than the summary: keep the head, cut the rest
        return [*lines[: limit - 1], _TRUNCATED]
    return [*lines[:room], _TRUNCATED, *tail]


def render_markdown(view: ReportView) -> str:
    """The PR-comment summary; Markdown control characters in names are escaped."""
    env = page_environment(markdown=True)
    text = str(env.get_template("summary.md.j2").render(v=view))
    if len(text.splitlines()) > SUMMARY_MAX_LINES:
        # Fewer items per list before any cut: one victim, effect, remedy group, ...
        s = view.summary
        fewer = SummaryView(s.victims[:1], s.effects[:1], s.sensitivity[:1], s.persistent, s.remedy_groups[:1])
        text = str(env.get_template("summary.md.j2").render(v=dataclasses.replace(view, summary=fewer)))
    lines = _cut_middle(text.splitlines(), SUMMARY_MAX_LINES)
    return "\n".join(lines) + "\n"


def md_code(text: str) -> str:
    """An inline code span that no content can break out of (HTML inside it stays text).

    Example:
        >>> md_code("a`b")
        '`` a`b ``'
    """
    clean = "".join(ch for ch in str(text) if ch.isprintable())
    longest = max((len(run) for run in re.findall(r"`+", clean)), default=0)
    fence = "`" * (longest + 1)
    return f"{fence} {clean} {fence}" if longest else f"`{clean}`"


def md_fence(text: str, lang: str = "python") -> str:
    """A fenced code block that no content can close early (the fence outgrows every backtick run).

    Example:
        >>> print(md_fence('nodes_to_exclude=["a```b"]'))
        ````python
        nodes_to_exclude=["a```b"]
        ````
    """
    clean = "\n".join("".join(ch for ch in line if ch.isprintable()) for line in str(text).splitlines())
    longest = max((len(run) for run in re.findall(r"`+", clean)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{clean}\n{fence}"


def md_escape(text: str) -> str:
    """Escape Markdown/HTML control characters and drop terminal escapes from untrusted names.

    An underscore between two letters or digits is left as it is: CommonMark never opens or closes
    emphasis there, and a name copied from the raw summary.md (``down_proj``, ``ffn_norm``) must be
    the model's name, not ``down\\_proj`` (issue 46). Every other ``_`` is escaped.

    Example:
        >>> md_escape("layers.1/mlp/down_proj/MatMul _x_ *y*")
        'layers.1/mlp/down_proj/MatMul \\\\_x\\\\_ \\\\*y\\\\*'
    """
    text = "".join(ch for ch in str(text) if ch.isprintable())
    out = []
    for i, ch in enumerate(text):
        intraword = ch == "_" and 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()
        if ch in "\\`*_[]<>|~#&" and not intraword:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


#: The files of a diag compare / merge run, in the order they are printed.
#: The picture of the worst output's error path summary.md links (:func:`diag.report.plots.error_path_picture`).
ERROR_PATH_PICTURE = "error_path.svg"
OUTPUT_NAMES = ("diag.json", "report.html", "summary.md", ERROR_PATH_PICTURE, *OVERLAYS, KEPT_IN_FLOAT)


def report_to_dir(json_path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Path]:
    """`diag report`: re-render a diag.json into ``out`` (a folder, or a single ``.html`` path), as one set.

    Example:
        >>> report_to_dir("run/diag.json", "run")  # doctest: +SKIP
        {'report.html': PosixPath('run/report.html'), 'summary.md': PosixPath('run/summary.md')}
    """

    input_file(json_path, "report", "pass the diag.json written by diag compare")
    target = Path(out)
    if target.suffix.lower() in (".html", ".htm"):
        output_file(target, "--out")
        return write_set({target: render_html(view_from_file(json_path))})
    check_outputs(target, ("report.html", "summary.md"))
    view = view_from_file(json_path)
    folder = out_dir(target)
    return write_set({folder / "report.html": render_html(view), folder / "summary.md": render_markdown(view)})


def output_texts(doc: dict[str, Any]) -> dict[str, str]:
    """diag.json, report.html and summary.md of a document, rendered in memory (nothing written)."""
    picture = error_path_picture(doc) if doc.get("nodes") else ""
    view = dataclasses.replace(view_from_document(doc), error_path_picture=ERROR_PATH_PICTURE if picture else "")
    return {
        "diag.json": json.dumps(doc, indent=1, sort_keys=False, ensure_ascii=False) + "\n",
        "report.html": render_html(view),
        "summary.md": render_markdown(view),
        # The error path as a picture summary.md links: GitHub and GitLab render it, not inline SVG.
        **({ERROR_PATH_PICTURE: picture + "\n"} if picture else {}),
        # Model Explorer overlays (diag.report.nodedata): the figures on the model's graph.
        **node_data_texts(doc),
    }


def write_outputs(doc: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write diag.json, report.html and summary.md into ``out_dir`` as one set
    (:func:`diag.foundations.files.write_set`).

    Everything is rendered in memory first, so an existing report stays intact (all three files of
    it) until the new one is complete, and a failure leaves no half-written file.
    """

    out = checked_out_dir(out_dir)
    return write_set({out / name: text for name, text in output_texts(doc).items()})
