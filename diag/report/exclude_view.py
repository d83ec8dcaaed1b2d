"""The report's verified-fix section, from ``exclusion.json`` alone (`diag exclude`, `diag compare --fix`).

The search (:mod:`diag.fix.exclude`) returns results and writes no view; this module turns the
document it wrote into the rows the report templates print (every number formatted here) and
draws its trajectory (:func:`diag.report.plots_exclude.trajectory_plot`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from diag.fix.exclude import count_phrase, estimates_phrase, stays_int8_phrase, trials_phrase
from diag.foundations.metricnames import held_out_names
from diag.foundations.producers import op_types_change
from diag.report.plots_exclude import trajectory_plot


def report_section(doc: dict[str, Any], with_plots: bool = True) -> dict[str, Any]:
    """View-model for the report's exclusion section, from ``exclusion.json`` alone (numbers formatted here).

    Keys: ``verdict``, ``target``, ``nodes`` (the final list), ``metrics`` (rows of name / before /
    after), ``latency`` (rows of model / p50 / p90 / speedup), ``counts`` (one sentence),
    ``trajectory_svg`` (see :func:`diag.report.plots_exclude.trajectory_plot`; drawn only ``with_plots``),
    ``snippet`` and ``alternatives``. Templates only loop and print.

    Example:
        >>> view = report_section(json.load(open("exclusion.json")))  # doctest: +SKIP
        >>> view["nodes"]  # doctest: +SKIP
        ['layer1/ffn/fc1/MatMul']
    """
    rows = metric_rows(doc)
    latency = [
        {
            "model": x["model"],
            "p50": f"{x['p50_ms']:.2f} ms",
            "p90": f"{x['p90_ms']:.2f} ms",
            "speedup": "ref" if x["speedup"] is None else f"{x['speedup']:.2f}x",
        }
        for x in doc["latency"]
    ]
    s = doc["search"]
    verdict = doc["verdict"]
    budget = s.get("budget") or {}
    if budget.get("exhausted") and verdict == "met":
        verdict = f"met (budget exhausted: {budget['reason']}; verified, not proven minimal)"
    calib = s.get("calibrations") or 0
    method = doc.get("method", "requantized")
    stays = doc.get("stays_int8") or {}
    kept = f"; {stays_int8_phrase(stays['of'] - stays['groups'], stays['of'])}" if stays.get("of") else ""
    return {
        "verdict": verdict,
        "target": doc["target"],
        "held_out": doc["split"]["held_out"],
        "nodes": list(doc["nodes_to_exclude"]),
        "metrics": rows,
        "latency": latency,
        "counts": f"{trials_phrase(method, s['quantizations'], s.get('splices', 0), calib)}, "
        f"{count_phrase(s['evaluations'], 'evaluation')}{estimates_phrase(s.get('estimates', 0))}, "
        f"{count_phrase(s['ranking_passes'], 'ranking pass', 'ranking passes')} over {s['candidates']} candidate "
        f"groups in {s['seconds']:.1f} s{kept if doc['reachable'] else ''}" + _cluster_note(s.get("cluster") or {}),
        "trajectory_svg": trajectory_plot(doc) if with_plots and s["trajectory"] else "",
        "snippet": doc["snippet"],
        "fix_call": best_fix_call(doc),
        "fix_lines": fix_lines(doc),
        "recipe_line": (doc.get("recipe_origin") or {}).get("line", ""),
        "alternatives": [f"{a['change']}: {a['why']}" for a in doc["alternatives"]],
        "before_label": "the recipe, quantized by diag" if method == "requantized" else "your INT8 model",
        "after_label": {
            "surgical": "with float regions spliced in",
            "encodings": "with the float nodes' encodings taken out",
        }.get(method, "with the exclusions"),
    }


def metric_rows(doc: dict[str, Any]) -> list[dict[str, str]]:
    """Before/after rows of the exclusion's metrics: a NaN row first, then the target's own metric."""
    before = doc["metrics"]["before"]
    after = doc["metrics"]["after"] or {}

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, str):
            return v
        return f"{v:.6f}" if isinstance(v, float) else str(v)

    rows = [
        {"name": n, "before": cell(before.get(n)), "after": cell(after.get(n))}
        for n in held_out_names()
        if before.get(n) is not None
    ]
    if before.get("nonfinite_samples") or after.get("nonfinite_samples"):
        # First, so that the summary's three lines show it: NaN samples decide the verdict.
        rows.insert(
            0,
            {
                "name": "NaN/Inf samples",
                "before": f"{before['nonfinite_samples']} of {before['samples']}",
                "after": f"{after['nonfinite_samples']} of {after['samples']}" if after else "-",
            },
        )
    # --metric plugin values, by the names the plugin declares.
    rows += [
        {"name": n, "before": cell(v), "after": cell((after.get("task") or {}).get(n))}
        for n, v in (before.get("task") or {}).items()
    ]
    # The target's own metric first after any NaN row: the summary shows three rows, and a plugin
    # value (text_agreement of a CTC decoder) came after cosine, mean cosine and max abs.
    metric = re.split(r"[<>=]", str(doc["target"]), maxsplit=1)[0].strip()
    first = 1 if rows and rows[0]["name"] == "NaN/Inf samples" else 0
    rows[first:] = sorted(rows[first:], key=lambda r: r["name"] != metric)
    return rows


def fix_lines(doc: dict[str, Any]) -> list[str]:
    """Every verified fix of the run, best first, one line each: the report and summary.md list them all.

    Example:
        >>> fix_lines({"target": "cosine>=0.99", "fixes": [{"kind": "nodes_to_exclude", "nodes_to_exclude": ["a"],
        ...            "op_types_to_quantize": None, "metric": 0.995, "met": True, "size": 1}]})
        ['nodes_to_exclude=["a"]: cosine 0.995 (met; 1 node in float)']
    """
    metric = str(doc["target"]).replace("<", ">").split(">", 1)[0]
    lines = []
    for f in doc.get("fixes") or []:
        call = best_fix_call({"fixes": [f], "nodes_to_exclude": f["nodes_to_exclude"], "producer": doc.get("producer")})
        n = len(f["nodes_to_exclude"])
        size = f"{n} node{'s' if n != 1 else ''} in float"
        if f["kind"] == "op_types_to_quantize":
            size = "one op-type change" + (f" and {size}" if n else "")
        value = "-" if f["metric"] is None else f"{f['metric']:.6g}"
        if f.get("deployed_metric") is not None:
            value += f" (level {(doc.get('metrics') or {}).get('deploy_level', 'all')}: {f['deployed_metric']:.6g})"
        lines.append(f"{call}: {metric} {value} ({'met' if f['met'] else 'missed'}; {size})")
    return lines


def best_fix_call(doc: dict[str, Any]) -> str:
    """The best fix as the quantizer arguments to paste: what the report's first screen shows.

    The best-ranked entry of ``fixes`` when the search ranked several (an op-type list can beat a
    node list), else the verified node list. JSON string lists are valid Python literals.

    Example:
        >>> best_fix_call({"nodes_to_exclude": ["conv2"], "fixes": []})
        'nodes_to_exclude=["conv2"]'
    """
    fixes = doc.get("fixes") or []
    best = fixes[0] if fixes else {"nodes_to_exclude": doc["nodes_to_exclude"]}
    parts = []
    if best.get("op_types_to_quantize"):
        # In the terms of the tool that made the user's model (NNCF: IgnoredScope(types=[...])).
        producer = (doc.get("producer") or {}).get("key", "onnxruntime")
        excluded = [best["op_type"]] if best.get("op_type") else []
        # A document without the excluded type (older diag) keeps onnxruntime's own words.
        parts.append(op_types_change(producer if excluded else "onnxruntime", excluded, best["op_types_to_quantize"]))
    if best.get("nodes_to_exclude"):
        parts.append(f"nodes_to_exclude={json.dumps(list(best['nodes_to_exclude']), ensure_ascii=False)}")
    return ", ".join(parts) or "nodes_to_exclude=[]"


def _cluster_note(info: dict[str, Any]) -> str:
    """``--scheduler``: where the trials ran, their retries, and where latency was measured."""
    if not info:
        return ""
    where = f"; latency measured on {info['latency_measured_on']}" if info.get("latency_measured_on") else ""
    return (
        f"; trials on a Dask cluster of {info['workers']} worker(s): {info['tasks']} tasks, "
        f"{info['retries']} retried after a worker died{where}"
    )
