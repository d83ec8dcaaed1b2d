"""``CompareResult`` -> ``diag.json``: the versioned document every rendering, gate and diff reads.

One function per section of the document (models, outputs, nodes, recommendation, matching,
tensors, distributions, weights, patterns, FP16, deployed run); numbers go through
:func:`diag.foundations.jsonnum.json_number` (6 significant digits, inf/NaN as strings). The schema it follows
is ``reports_templates/diag.schema.json`` (:mod:`diag.report.documents` validates every document read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diag.analysis.analyze import (
    AMPLIFY_DB,
    BAD_SQNR_DB,
    BANDS,
    INHERIT_DB,
    OutputVerdict,
    reaching_nonfinite,
    recommended_nodes,
)
from diag.analysis.compare import CompareResult
from diag.analysis.decoder import decoder_layout, module_paths
from diag.analysis.fp16health import fp16_fix
from diag.analysis.patterns import PatternInstance, PatternTotal
from diag.analysis.weights import WeightReport
from diag.core.distributions import TensorHealth, compact_histograms, worst_tensors
from diag.core.match import Matching, UnmatchedCause
from diag.core.metrics import ErrorStats, OutputStats
from diag.core.taskmetrics import json_values
from diag.foundations.cpu import kernel_path
from diag.foundations.jsonnum import json_number as _num
from diag.foundations.producers import PRODUCERS
from diag.report.documents import SCHEMA, SCHEMA_VERSION


def _stats(s: ErrorStats | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {k: _num(v) for k, v in s.to_dict().items()}


def document_from_result(result: CompareResult) -> dict[str, Any]:
    """The ``diag.json`` document of a CompareResult (see ``reports_templates/diag.schema.json``).

    Example:
        >>> doc = document_from_result(compare_models("fp32.onnx", "int8.onnx", FeedSpec()))  # doctest: +SKIP
        >>> doc["verdict"]["grade"]  # doctest: +SKIP
        'acceptable'
    """
    nodes = _node_dicts(result)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "environment": result.environment,
        "models": _models(result),
        **_fp16(result),
        # --accuracy-level-check: MatMulNBits at that accuracy_level vs 0 (diag.core.nbits); absent otherwise.
        **({"accuracy_level": result.accuracy_level.to_dict()} if result.accuracy_level is not None else {}),
        # --deploy-isa avx2: the u8s8 nodes' predicted saturation on AVX2 without VNNI (diag.core.saturation).
        **({"deploy_isa": result.deploy_isa} if result.deploy_isa is not None else {}),
        "run": {
            "inputs": result.input_description,
            "samples": result.samples,
            "batches": result.batches,
            "seconds": round(result.seconds, 2),
            "opt_level": result.options.opt_level,
            "local_error": result.options.local,
            "local_samples": result.local_samples,
            "passes": result.passes,
            "kernel_path": kernel_path().to_dict(),
            # The padding per-tensor errors left out (diag.core.positions); null: every position counted.
            "positions": result.padding.to_dict() if result.padding is not None else None,
        },
        "deployed": _deployed(result),
        "thresholds": {"bad_sqnr_db": BAD_SQNR_DB, "amplify_db": AMPLIFY_DB, "inherit_db": INHERIT_DB, "bands": BANDS},
        "verdict": {
            "grade": result.grade,
            "single_cause": result.single_cause,
            "cause": result.cause_sentence,
            # The headline as typed data: its kind, the node it names, its remedies and next search
            # (diag.analysis.headline); "cause" is its sentence.
            "headline": result.headline.to_dict(),
            # The level the outputs are graded at: onnxruntime's default ("all": what the user
            # deploys) unless --deploy-level says otherwise; "disabled" grades exact mode.
            "graded_at": result.options.opt_level,
            "outputs": [_output_dict(result, v) for v in result.verdicts],
            # The same outputs graded in exact mode (optimizations off), beside the deployed grades.
            "exact_outputs": [_exact_dict(result, v) for v in result.exact_verdicts],
        },
        # F1 against --labels and --metric plugin values (see diag.core.taskmetrics).
        "task_metrics": json_values(result.task_metrics or {}),
        "recommendation": _recommendation(result),
        # Weight-only spread remedies re-quantized and measured (compare --recipe; diag.fix.remedycheck).
        **({"remedy_checks": result.remedy_checks} if result.remedy_checks else {}),
        "matching": _matching(result),
        "nodes": nodes,
        "distributions": _distributions(result),
        "suggestions": [x.to_dict() for x in result.suggestions],
        "weights": _weights(result.weights),
        "patterns": _patterns(result),
        "sensitivity": result.sensitivity.to_dict() if result.sensitivity is not None else None,
        "effects": result.effects.to_dict() if result.effects is not None else None,
        "tensors": _tensors(result),
        # --recipe FILE: each recipe line measured on the model it builds (diag.fix.linecheck); absent otherwise.
        **({"recipe_lines": [dataclasses.asdict(f) for f in result.recipe_lines]} if result.recipe_lines else {}),
        # The recipe's settings changed alone and re-quantized (diag.fix.levercheck); absent when not tried.
        **({"recipe_settings": result.recipe_settings.to_dict()} if result.recipe_settings is not None else {}),
        # Transformer stacks only (an optional key: documents without it stay valid).
        **_decoder(result),
    }


def _decoder(result: CompareResult) -> dict[str, Any]:
    """``{"decoder": ...}`` for a transformer stack (:mod:`diag.analysis.decoder`), else nothing."""
    layout = decoder_layout(result.findings, module_paths(result.fp32.proto))
    return {"decoder": layout.to_dict()} if layout is not None else {}


def _node_dicts(result: CompareResult) -> list[dict[str, Any]]:
    """Every node finding, in accumulated-rank order."""
    pattern_of = _innermost_patterns(result.patterns)
    reaching = {id(f) for f in reaching_nonfinite(result.findings)}
    paths = module_paths(result.fp32.proto)  # torch's module scopes, where node names carry none
    nodes = []
    for f in sorted(result.findings, key=lambda f: f.rank_accumulated):
        g = f.group
        nodes.append(
            {
                "name": g.label,
                "fp_nodes": g.fp_nodes,
                "op_type": g.op_type,
                "index": f.index,
                "tensor": f.tensor,
                "inputs": list(f.inputs),
                "pattern": next((pattern_of[n] for n in g.fp_nodes if n in pattern_of), None),
                "quantized": g.quantized,
                "unnamed": g.unnamed,
                "role": f.role,
                "rank_accumulated": f.rank_accumulated,
                "rank_local": f.rank_local,
                "amplification_db": _num(f.amplification_db),
                "accumulated": _stats(f.accumulated),
                "local": _stats(f.local),
                "int8_nodes": g.int8_nodes,
                "nonfinite_reaches": id(f) in reaching,
                # The module path torch's exporter recorded for the group's first node (layers of a
                # stack whose nodes are named node_linear_3); absent otherwise.
                **({"module": paths[g.fp_nodes[0]]} if g.fp_nodes and g.fp_nodes[0] in paths else {}),
            }
        )
    return nodes


def _models(result: CompareResult) -> dict[str, Any]:
    int8_format = result.int8.format
    return {
        "fp32": {
            "path": str(result.fp32.path),
            "format": result.fp32.format.kind,
            "warnings": list(result.fp32.warnings),
            "external_data": result.fp32.has_external_data,
        },
        "int8": {
            "path": str(result.int8.shown_path),
            "format": int8_format.kind,
            # Built by diag from the user's file (AIMET encodings: diag.core.encodings); absent otherwise.
            **({"built": result.int8.origin} if result.int8.origin else {}),
            "evidence": int8_format.evidence,
            "warnings": list(result.int8.warnings),
            "external_data": result.int8.has_external_data,
            # Which nodes run at which precision (FP16, 16-bit activations); absent otherwise.
            **({"precisions": int8_format.precisions} if int8_format.precisions else {}),
            # The tool that made it (diag.foundations.producers), when its marks say; absent otherwise.
            **_producer(result),
        },
    }


def _producer(result: CompareResult) -> dict[str, str]:
    """``{"producer": "AMD Quark"}`` when the INT8 model's marks name the tool that made it."""
    key = result.int8.producer_key()  # AIMET for a model diag built from AIMET's encodings
    return {} if key == "unknown" else {"producer": PRODUCERS[key].name}


def _first_divergence(per_sample: OutputStats) -> dict[str, Any] | None:
    """Sequence outputs: where each sample's argmax first differs, counted by position."""
    if per_sample.positions is None:
        return None
    return {
        "diverged_samples": per_sample.diverged_samples,
        "earliest": per_sample.earliest_divergence,
        "median": per_sample.median_divergence,
        "by_position": list(per_sample.first_divergence),
    }


def _output_dict(result: CompareResult, v: OutputVerdict) -> dict[str, Any]:
    """One model output's verdict, its figures, its error path and its Concat parts."""
    state = result.state
    return {
        "name": v.name,
        "grade": v.grade,
        "reasons": v.reasons,
        "sqnr_db": _num(v.stats.sqnr_db),
        "cosine_min": _num(v.per_sample.cosine_min),
        "cosine_mean": _num(v.per_sample.cosine_mean),
        "max_abs": _num(v.per_sample.max_abs),
        "top1_agreement": _num(v.per_sample.top1_agreement),
        "samples": v.per_sample.samples,
        "positions": v.per_sample.positions,
        "sequence_agreement": _num(v.per_sample.sequence_agreement),
        "kl_mean": _num(v.per_sample.kl_mean),
        "kl_max": _num(v.per_sample.kl_max),
        "first_divergence": _first_divergence(v.per_sample),
        "accuracy_fp32": _num(v.accuracy_fp32),
        "accuracy_int8": _num(v.accuracy_int8),
        "accuracy_drop": _num(v.accuracy_drop),
        **_f1_fields(result, v.name),
        "error_path": [f.group.label for f in result.paths.get(v.name, [])],
        "kind": v.per_sample.kind,
        "kind_evidence": state.outputs[v.name].spec.evidence if state is not None and v.name in state.outputs else "",
        "cache_of": v.per_sample.cache_of,
        "nonfinite_samples": v.per_sample.nonfinite_samples,
        "mask_iou": _num(v.per_sample.mask_iou),
        "rel_max_abs": _num(v.per_sample.rel_max_abs),
        "parts": [
            {
                "label": label,
                "sqnr_db": _num(acc.sqnr_db),
                "cosine_min": _num(part.cosine_min),
                "max_abs": _num(part.max_abs),
                "local_sqnr_db": _num(local.sqnr_db) if local is not None else None,
            }
            for label, (part, acc, local) in v.per_sample.parts.items()
        ],
    }


#: The figures ``verdict.exact_outputs`` keeps of an output graded in exact mode.
_EXACT_KEYS = (
    "name", "grade", "reasons", "sqnr_db", "cosine_min", "max_abs", "top1_agreement", "accuracy_int8", "accuracy_drop",
    "f1_macro_int8", "f1_macro_drop", "f1_micro_int8", "f1_micro_drop",
)  # fmt: skip


def _exact_dict(result: CompareResult, v: OutputVerdict) -> dict[str, Any]:
    """An output's exact-mode grade and figures (``verdict.exact_outputs``): those of :func:`_output_dict`."""
    full = {**_output_dict(result, v), **_f1_fields(result, v.name, exact=True)}
    return {k: full[k] for k in _EXACT_KEYS}


def _recommendation(result: CompareResult) -> dict[str, Any]:
    """The root causes' nodes to keep in float (a starting point: its measured estimate beside it,
    when the effect check ran), and the recipe the fix snippet re-quantizes with."""
    exclude, unnamed = recommended_nodes(result.findings)
    estimate = result.list_estimate
    return {
        "nodes_to_exclude": exclude,
        "unnamed_nodes": unnamed,
        "verified": False,
        "estimate": estimate.to_dict() if estimate is not None and estimate.nodes == exclude else None,
        "verify_command": result.verify_command,
        # The settings the fix snippet re-quantizes with (given or inferred), so that
        # `diag report` renders the same snippet without the models.
        "recipe": result.fix_recipe,
    }


def _matching(result: CompareResult) -> dict[str, Any]:
    m = result.matching
    return {
        "float_tensors": len(m.fp_float_tensors),
        "compared": len(result.accumulated),
        "accounted": len(m.pairs) + len(m.fused_away),
        "coverage": _num(m.coverage),
        "unmatched_tensors": dict(sorted({**m.unmatched_tensors, **result.runtime_unmatched}.items())),
        # One entry per cause (kind, the FP32 op writing the tensors): one sentence each (diag.report.brief).
        "unmatched_causes": _unmatched_causes(m, result.runtime_unmatched),
        "skipped_tensors": dict(sorted(m.skipped_tensors.items())),
        "unmatched_nodes": dict(sorted(m.unmatched_nodes.items())),
        "int8_only_nodes": m.int8_only_nodes,
    }


def _tensors(result: CompareResult) -> dict[str, Any]:
    """How each compared FP32 tensor was paired, and its accumulated and local error."""
    m = result.matching
    return {
        name: {
            "how": m.pairs[name].how,
            "int8_name": m.pairs[name].int8_name,
            "accumulated": _stats(result.accumulated.get(name)),
            "local": _stats(result.local.get(name)),
            # Padding masked out: the figures above count real positions, these every position.
            **(
                {
                    "all_positions": _stats(result.all_positions[name]),
                    "all_positions_local": _stats(result.all_positions_local.get(name)),
                }
                if name in result.all_positions
                else {}
            ),
        }
        for name in m.fp_float_tensors
        if name in result.accumulated
    }


def _f1_fields(result: CompareResult, output: str, exact: bool = False) -> dict[str, Any]:
    """``f1_macro_*`` / ``f1_micro_*`` of the labelled output (None elsewhere: ``diag check`` skips those);
    ``exact``: those of the exact-mode INT8 outputs (``verdict.exact_outputs``)."""
    f1 = (result.task_metrics or {}).get("f1")
    keys = ("f1_macro_fp32", "f1_macro_int8", "f1_macro_drop", "f1_micro_fp32", "f1_micro_int8", "f1_micro_drop")
    values = (f1 or {}).get("exact" if exact else "values")
    if not f1 or f1["output"] != output or not values:
        return dict.fromkeys(keys)
    return {k: _num(values[k]) for k in keys}


def _deployed(result: CompareResult) -> dict[str, Any] | None:
    """Outputs as onnxruntime really runs the models at --ort-opt-level, and what its fusions hide."""
    deployed = result.deployed
    if not deployed:
        return None
    return {
        "opt_level": result.options.opt_level,
        "outputs": {
            name: {
                "cosine_min": _num(s.cosine_min),
                "cosine_mean": _num(s.cosine_mean),
                "max_abs": _num(s.max_abs),
                "top1_agreement": _num(s.top1_agreement),
                "samples": s.samples,
            }
            for name, s in deployed.items()
        },
        "fused_kernels": [
            {"kernel": k.name, "op_type": k.op_type, "hides": k.hidden, "fp_nodes": k.fp_nodes} for k in result.fused
        ],
    }


def _fp16(result: CompareResult) -> dict[str, Any]:
    """``{"fp16": {...}}`` for an FP16 comparison: range counts per tensor and the derived fix."""
    state = result.state
    if state is None or not state.fp16_ranges:
        return {}
    fix = fp16_fix(result.findings, state.fp16_ranges)
    return {
        "fp16": {
            "ranges": {k: r.to_dict() for k, r in state.fp16_ranges.items()},
            "fix": None
            if fix is None
            else {
                "node_block_list": fix.node_block_list,
                "op_block_list": fix.op_block_list,
                "over_range": fix.over_range,
                "why": fix.why,
            },
        }
    }


#: Tensors whose histograms and channel charts go into diag.json and the report.
PLOTTED_TENSORS = 6
#: Per-channel entries kept per weight in diag.json (the worst ones).
WEIGHT_CHANNELS = 8


def _unmatched_causes(m: Matching, runtime: dict[str, str]) -> list[dict[str, Any]]:
    """The unmatched tensors grouped by cause: kind, the FP32 op that writes them, the op it was
    merged with (fused / folded), and the tensors, the largest group first."""
    causes = {**m.unmatched_causes, **{t: UnmatchedCause("shape", "") for t in runtime}}
    groups: dict[UnmatchedCause, list[str]] = {}
    for tensor, cause in causes.items():
        groups.setdefault(cause, []).append(tensor)
    return [
        {"kind": c.kind, "op_type": c.op_type, "merged_with": c.merged_with, "tensors": sorted(tensors)}
        for c, tensors in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0].kind, kv[0].op_type))
    ]


def _innermost_patterns(instances: list[PatternInstance]) -> dict[str, str]:
    """Node id -> label of the smallest pattern instance containing it ("GELU in layer1 (ffn/gelu)")."""
    best: dict[str, tuple[int, str]] = {}
    for p in instances:
        for n in p.nodes:
            if n not in best or len(p.nodes) < best[n][0]:
                best[n] = (len(p.nodes), p.label)
    return {n: label for n, (_, label) in best.items()}


def _weights(report: WeightReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    weights = []
    for w in report.findings:
        d = w.to_dict()
        chans = sorted(d.get("channels", []), key=lambda c: c["sqnr_db"] if isinstance(c["sqnr_db"], float) else 1e9)
        d["channels_total"] = len(d.get("channels", []))
        d["channels"] = chans[:WEIGHT_CHANNELS]
        weights.append(d)
    blocks = report.worst_blocks()
    return (
        {"findings": weights, "unmatched": dict(sorted(report.unmatched.items()))}
        | ({"blocks": [b.to_dict() for b in blocks]} if blocks else {})
        # What the producer changed on purpose (NNCF): its SmoothQuant Muls and corrected biases.
        | ({"smoothing": [s.to_dict() for s in report.smoothing]} if report.smoothing else {})
        | ({"bias_corrections": [b.to_dict() for b in report.bias_corrections]} if report.bias_corrections else {})
    )


def _pattern_total(t: PatternTotal) -> dict[str, Any]:
    return {
        "kind": t.kind,
        "label": t.label,
        "instances": t.instances,
        "nodes": t.nodes,
        "measured": t.measured,
        "worst_local_sqnr_db": _num(t.worst_local_sqnr_db),
        "worst_local_node": t.worst_local_node,
        "worst_accumulated_sqnr_db": _num(t.worst_accumulated_sqnr_db),
        "output_accumulated_sqnr_db": _num(t.output_accumulated_sqnr_db),
        "local_energy": _num(t.local_energy),
        "local_share": _num(t.local_share),
    }


def _patterns(result: CompareResult) -> dict[str, Any]:
    return {
        "kinds": [_pattern_total(t) for t in result.pattern_kinds],
        "instances": [_pattern_total(t) for t in result.pattern_instances],
    }


def _health_dict(h: TensorHealth) -> dict[str, Any]:
    small = compact_histograms(h.fp_hist, h.int8_hist) if h.fp_hist is not None and h.int8_hist is not None else None
    return {
        "grid": h.grid,
        "histogram": {**small, "lo": _num(small["lo"]), "hi": _num(small["hi"])} if small is not None else None,
        "scale": _num(h.scale),
        "zero_point": _num(h.zero_point),
        "zero_point_position": _num(h.zero_point_position),
        "clip_fraction": _num(h.clip_fraction),
        "clip_noise_ratio": _num(h.clip_noise_ratio),
        "effective_bits": _num(h.effective_bits),
        "grid_bits": _num(h.grid_bits),
        "min": _num(h.fp_min),
        "max": _num(h.fp_max),
        "mean": _num(h.mean),
        "std": _num(h.std),
        "kurtosis": _num(h.kurtosis),
        "bulk": [_num(h.bulk_low), _num(h.bulk_high)],
        "range_over_bulk": _num(h.range_over_bulk),
        "dynamic_scale": (
            {"min": _num(h.dynamic_scale_min), "max": _num(h.dynamic_scale_max), "batches": h.dynamic_batches}
            if h.dynamic_batches
            else None
        ),
        "axis": h.axis,
        "channels": h.channels,
        "median_channel_max": _num(h.median_channel_max),
        "median_channel_levels": _num(h.median_channel_levels),
        "grid_range": [_num(v) for v in h.grid_range] if h.grid_range else None,
        "outliers": [
            {
                "index": o.index,
                "max_abs": _num(o.max_abs),
                "mean": _num(o.mean),
                "times_median": _num(o.times_median),
                "scale_share": _num(o.scale_share),
            }
            for o in h.outliers
        ],
        "reasons": h.unhealthy_reasons,
    }


def _distributions(result: CompareResult) -> dict[str, Any] | None:
    """Per-tensor health for every compared tensor; histograms for the worst few only."""
    if not result.health:
        return None
    worst = worst_tensors(result.health, PLOTTED_TENSORS)
    return {
        "outlier_factor": result.options.outlier_factor,
        "persistent_outliers": [
            {"index": p.index, "channels": p.channels, "tensors": p.tensors, "of_tensors": p.of_tensors}
            for p in result.persistent
        ],
        "tensors": {name: _health_dict(h) for name, h in result.health.items()},
        "plotted": {name: _plotted(result.health[name]) for name in worst},
    }


def _plotted(h: TensorHealth) -> dict[str, Any]:
    """Both histograms and the channel maxima of one tensor, for the report's plots."""
    # A finalized TensorHealth always has both histograms; only a hand-built one has none.
    assert h.fp_hist is not None and h.int8_hist is not None, "plotted tensors have histograms"
    return {
        "fp32": h.fp_hist.to_state(),
        "int8": h.int8_hist.to_state(),
        "channel_max": [round(v, 6) for v in h.channel_max],
    }
