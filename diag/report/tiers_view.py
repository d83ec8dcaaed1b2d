"""The report's verified-fix section for a tier plan, from ``tiers.json`` alone (`diag exclude --tiers`).

A tier plan is the answer of its run: the report and summary.md beside it must show it, not only
the diagnosis of the all-lowest model (whose "starting point" is the unverified guess the plan
replaces). This module turns the plan's document into the same rows as
:func:`diag.report.exclude_view.report_section` (so the templates print one "Verified fix"
section for both searches), with ``plan_lines`` instead of a float list: which nodes sit at which
tier, by projection when a decoder's names make that shorter.
"""

from __future__ import annotations

import json
from typing import Any

from diag.core.recipe import Recipe
from diag.fix.exclude import count_phrase, trials_phrase
from diag.fix.weightonly import quantizer_calls
from diag.foundations.numfmt import byte_size
from diag.report.exclude_view import metric_rows


def report_section(doc: dict[str, Any]) -> dict[str, Any]:
    """View-model of a tier plan: :func:`diag.report.exclude_view.report_section`'s keys, ``plan_lines``
    and the metrics table's column heads (``before_label``, ``after_label``).

    Example:
        >>> view = report_section(json.load(open("tiers.json")))  # doctest: +SKIP
        >>> view["plan_lines"]  # doctest: +SKIP
        ['int8 (1 node): fc2']
    """
    low = doc["tiers"][0]
    surgical = doc.get("method") == "surgical"
    #: The starting point: the user's model (surgical plans), or the recipe quantized at the lowest tier.
    start = "your INT8 model" if surgical else f"all {low}"
    if doc["already_met"]:
        verdict = f"already met by {start}"
    elif doc["reachable"]:
        verdict = "met"
        if doc.get("budget"):
            verdict = f"met ({doc['budget']}: verified, not the smallest plan)"
    elif doc.get("budget"):
        verdict = f"not reached ({doc['budget']} before any plan met the target)"
    else:
        verdict = f"not reachable: no plan short of every node at {doc['tiers'][-1]} meets the target"
    latency = [
        {
            "model": {"lowest": start}.get(x["model"], x["model"]),
            "p50": f"{x['p50_ms']:.2f} ms",
            "p90": f"{x['p90_ms']:.2f} ms",
            "speedup": "ref" if x.get("speedup") is None else f"{x['speedup']:.2f}x",
        }
        for x in doc["latency"]
    ]
    sizes = doc["sizes"]
    size = f"{start} {byte_size(sizes['lowest'])}"
    if "plan" in sizes and doc["plan"]:
        size += f", plan {byte_size(sizes['plan'])}"
    size += f", fp32 {byte_size(sizes['fp32'])}"
    met = doc["reachable"] and doc["plan"]
    return {
        "verdict": verdict,
        "target": doc["target"],
        "held_out": doc["split"]["held_out"],
        "nodes": [],
        "plan_lines": plan_lines(doc) if met else [],
        "metrics": metric_rows({"metrics": {"before": doc["before"], "after": doc["after"]}, "target": doc["target"]}),
        "latency": latency,
        "counts": f"{trials_phrase(doc.get('method', 'requantized'), doc['quantizations'], doc.get('splices', 0), 0)}"
        f" over {len(doc['candidates'])} candidate groups in {doc['seconds']:.1f} s; sizes: {size}",
        "trajectory_svg": "",
        "snippet": doc.get("snippet") or "",
        "fix_call": (splice_call(doc) if surgical else fix_call(doc["recipe"])) if met else "",
        "fix_lines": [],
        "recipe_line": (doc.get("recipe_origin") or {}).get("line", ""),
        "alternatives": [],
        "before_label": start,
        "after_label": "with the plan spliced in" if surgical else "the plan",
    }


def plan_lines(doc: dict[str, Any]) -> list[str]:
    """One line per tier: its nodes, or the projections they make up when that is shorter.

    Example:
        >>> plan_lines({"by_tier": {"int8": ["fc2"]}, "by_projection": {}})
        ['int8 (1 node): fc2']
    """
    lines = []
    for tier, nodes in doc["by_tier"].items():
        named = (doc.get("by_projection") or {}).get(tier) or ", ".join(nodes)
        lines.append(f"{tier} ({count_phrase(len(nodes), 'node')}): {named}")
    return lines


def splice_call(doc: dict[str, Any]) -> str:
    """A surgical plan as the call that builds it from the user's model (what reproduce.py runs).

    Example:
        >>> splice_call({"plan": {"fc2": "int8", "fc1": "fp32"}})
        'diag.splice_to_file(FP32, INT8, ["fc1"], OUT, bits={"fc2": 8})'
    """
    in_float = [n for n, t in doc["plan"].items() if t == "fp32"]
    bits = {n: int(t[3:]) for n, t in doc["plan"].items() if t != "fp32"}
    nodes = json.dumps(in_float, ensure_ascii=False)
    wider = f", bits={json.dumps(bits, ensure_ascii=False)}" if bits else ""
    return f"diag.splice_to_file(FP32, INT8, {nodes}, OUT{wider})"


def fix_call(recipe: dict[str, Any]) -> str:
    """The plan in onnxruntime's terms: the ``MatMulNBitsQuantizer`` calls, or the quantizer's arguments.

    Example:
        >>> fix_call({"mode": "dynamic", "nodes_to_exclude": ["fc1"]})
        'nodes_to_exclude=["fc1"]'
    """
    r = Recipe.from_dict(recipe, "plan recipe")
    if r.mode == "weight_only":
        return "\n".join(quantizer_calls(r))
    parts = [f"nodes_to_exclude={json.dumps(list(r.nodes_to_exclude or []), ensure_ascii=False)}"]
    overrides = (r.extra_options or {}).get("TensorQuantOverrides")
    if overrides:
        parts.append(f"extra_options={{'TensorQuantOverrides': {json.dumps(overrides, ensure_ascii=False)}}}")
    return ", ".join(parts)
