"""The lines under the verdict, worded once from diag.json: the terminal, summary.md and report.html
all render this list (issue 42 item 6).

`diag compare` used to word its lines from the in-memory ``CompareResult`` while summary.md and the
report worded theirs from the document, and the two drifted apart (an error path shortened
differently, a root cause with and without its input's outlier, SmoothQuant's Muls printed but
absent from diag.json). Now each finding is worded here, by one function, from the document's
typed values; `diag compare`, `diag merge`, `diag demo` and `diag report` print or render the same
:class:`BriefLine` list, so the terminal of a run and the summary.md written beside it say the same
sentences (``tests/test_brief.py``).

A line is :data:`~diag.analysis.headline.Said` parts: the user's names (nodes, tensors, outputs,
code to paste) are :class:`~diag.analysis.headline.Name` parts, printed as they are by the
terminal, as code spans by summary.md and as ``<code>`` by report.html.

What each line shows is cut here too (the 3 worst root causes, 2 outlier tensors, 2 remedies ...):
the report's tables and diag.json have the rest.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.analysis.analyze import GRADES, first_nonfinite, shortened_path
from diag.analysis.effects import LEVELS_DISAGREE
from diag.analysis.headline import Name, Said, plain
from diag.analysis.levers import RecipeLevers
from diag.core.positions import Padding
from diag.core.saturation import prediction_sentence
from diag.core.taskmetrics import task_lines
from diag.fix.linecheck import shown_lines
from diag.fix.lint import Finding
from diag.foundations.jsonnum import number_from_json
from diag.foundations.numfmt import fmt_db, fmt_num, fmt_pct

#: Root causes listed under the verdict (by local rank; the report lists more).
ROOT_CAUSES = 3
#: Tensors with outlier channels listed (the worst first).
OUTLIER_TENSORS = 2
#: Remedies listed, and remedies measured not to help.
REMEDIES = 2
#: Nodes listed under each effect line, and u8s8 nodes under the AVX2 prediction.
EFFECTS = 3
#: Steps of an error path printed in full; a longer one keeps its first and last three.
PATH_STEPS = 7
#: Tensors named in a persistent-outlier sentence.
PERSISTENT_TENSORS = 8
#: Causes of unmatched tensors given a sentence each (the largest groups), and tensors named in one.
UNMATCHED_CAUSES = 4
NAMED_TENSORS = 3


@dataclass(frozen=True)
class BriefLine:
    """One line under the verdict: its words as parts, and its depth (1: a detail of the line before)."""

    parts: Said
    depth: int = 0

    @property
    def text(self) -> str:
        """The line as the terminal prints it (without its indent).

        Example:
            >>> BriefLine(("output ", Name("logits"), ": marginal")).text
            'output logits: marginal'
        """
        return plain(self.parts)


def brief(doc: dict[str, Any]) -> list[BriefLine]:
    """Every line under the verdict of one diag.json, in the order the terminal prints them: the
    model files, the outputs, what caused the error, the activations and weights, what was measured
    beyond the error, and how the run went."""
    said: list[Said] = []
    said += _model_lines(doc["models"])
    said += _output_lines(doc)
    said += task_metric_lines(doc.get("task_metrics") or {})
    said += _deployed_lines(doc)
    said += _cause_lines(doc)
    said += _activation_lines(doc)
    said += _weight_lines(doc.get("weights") or {})
    lines = [BriefLine(s) for s in said]
    lines += _measured_lines(doc)
    lines += [BriefLine(s) for s in _run_lines(doc)]
    return lines


# ---------------------------------------------------------------- the models and the outputs


def _model_lines(models: dict[str, Any]) -> list[Said]:
    """How diag built the INT8 model it diagnosed (AIMET encodings), and the files' warnings."""
    int8 = models["int8"]
    lines: list[Said] = []
    if int8.get("built"):
        lines.append(("note: INT8 model ", Name(Path(int8["path"]).name), f" {int8['built']}"))
    lines += [(f"warning: {w}",) for k in ("fp32", "int8") for w in models[k].get("warnings", [])]
    return lines


def _output_lines(doc: dict[str, Any]) -> list[Said]:
    """One line per graded output; the KV-cache outputs as one line (the worst named)."""
    outputs = doc["verdict"]["outputs"]
    lines: list[Said] = [
        ("output ", Name(o["name"]), f": {o['grade']} ({'; '.join(o['reasons'])})")
        for o in outputs
        if not o.get("cache_of")
    ]
    caches = cache_outputs(outputs)
    if caches:
        worst, counts = caches[0], Counter(o["grade"] for o in caches)
        grades = ", ".join(f"{counts[g]} {g}" for g in reversed(GRADES) if counts[g])
        lines.append(
            (
                f"{len(caches)} KV-cache outputs: {grades}; worst ",
                Name(worst["name"]),
                f": {worst['grade']} ({'; '.join(worst['reasons'])})",
            )
        )
    return lines


def cache_outputs(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The KV-cache outputs (``present.*``) of a document, worst first (grade, then SQNR): they get
    one line, named by the first, instead of one per layer and per key / value."""
    return sorted(
        (o for o in outputs if o.get("cache_of")),
        key=lambda o: (-GRADES.index(o["grade"]) if o.get("grade") in GRADES else 0, db(o.get("sqnr_db")), o["name"]),
    )


def task_metric_lines(task_metrics: dict[str, Any]) -> list[Said]:
    """F1 against ``--labels`` (macro and micro, as deployed) and each ``--metric`` plugin value."""
    lines: list[Said] = []
    f1 = task_metrics.get("f1")
    if f1:
        v = {k: number_from_json(x) for k, x in f1["values"].items()}
        macro, micro = (
            f"{fmt_pct(v[f'f1_{k}_fp32'])} \u2192 {fmt_pct(v[f'f1_{k}_int8'])} (drop {fmt_pct(v[f'f1_{k}_drop'])})"
            for k in ("macro", "micro")
        )
        lines.append(
            (
                "F1 of output ",
                Name(f1["output"]),
                f" against --labels ({f1['samples']} samples): macro {macro}, micro {micro}",
            )
        )
    plugin = task_metrics.get("plugin")
    if plugin:
        values = {k: number_from_json(v) for k, v in plugin["values"].items()}
        lines += [(line,) for line in task_lines({"plugin": {**plugin, "values": values}})]
    return lines


def _deployed_lines(doc: dict[str, Any]) -> list[Said]:
    """An output whose exact-mode grade differs from its grade as deployed says so, with the fused
    kernels behind the difference."""
    verdict = doc["verdict"]
    level = verdict.get("graded_at", "disabled")
    graded = {o["name"]: o for o in verdict["outputs"]}
    lines: list[Said] = []
    for e in verdict.get("exact_outputs") or []:
        o = graded.get(e["name"])
        if o is not None and o["grade"] != e["grade"] and not o.get("cache_of"):
            lines.append(
                (
                    "output ",
                    Name(e["name"]),
                    f" in exact mode (optimizations off): {e['grade']} ({'; '.join(e['reasons'])}); graded "
                    f"{o['grade']} as onnxruntime runs it at level {level}",
                )
            )
    fused = (doc.get("deployed") or {}).get("fused_kernels") or []
    if lines and fused:
        hidden = {n for k in fused for n in k["fp_nodes"]}
        lines.append(
            (
                f"{len(fused)} fused onnxruntime kernel(s) hide {len(hidden)} FP32 node(s) at level {level} "
                "(diag.json deployed.fused_kernels)",
            )
        )
    return lines


# ---------------------------------------------------------------- causes


def _cause_lines(doc: dict[str, Any]) -> list[Said]:
    """The worst root causes, where NaN/Inf first appear, FP16 range facts, the error paths, the layers."""
    nodes = doc.get("nodes") or []
    dist_tensors = (doc.get("distributions") or {}).get("tensors", {})
    spread = (doc["verdict"].get("headline") or {}).get("kind") == "spread"
    # A "no single root cause" headline lists no root cause under it (issue 25, item 5).
    role = "locally worst: " if spread else "root cause: "
    lines: list[Said] = [(role, *root_cause_said(n, dist_tensors)) for n in root_causes(nodes)[:ROOT_CAUSES]]
    lines += nonfinite_lines(nodes)
    lines += _fp16_lines(doc.get("fp16"))
    lines += [("error path to ", *p) for p in error_paths(doc["verdict"]["outputs"], nodes)]
    if doc.get("decoder"):
        lines.append((layer_sentence(doc["decoder"]),))
    return lines


def root_causes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The root-cause nodes of a document, by local rank."""
    return [n for n in sorted(nodes, key=lambda n: n["rank_local"]) if n["role"] == "root-cause"]


def root_cause_said(n: dict[str, Any], dist_tensors: dict[str, Any]) -> Said:
    """``fc1 (MatMul): local SQNR 6.9 dB, accumulated 6.8 dB; in Linear in layer1 (ffn/fc1); input 'x'
    has outlier channel 7 (88.2x the median)``: a root cause with both errors, the pattern it sits
    in, and what its own NaN/Inf and its inputs' outlier channels say about it."""
    local, acc = n.get("local") or {}, n.get("accumulated") or {}
    own = int(local.get("nonfinite_int8") or 0) - int(local.get("nonfinite_fp") or 0)
    return (
        Name(n["name"]),
        f" ({n['op_type']}): local SQNR {fmt_db(local.get('sqnr_db'))} dB, accumulated {fmt_db(acc.get('sqnr_db'))} dB",
        # SQNR is over finite values: say when the node writes NaN/Inf even fed FP32 inputs.
        f" (its own NaN/Inf: {own} with FP32 inputs)" if own > 0 else "",
        f"; in {n['pattern']}" if n.get("pattern") else "",
        *_input_outliers(n, dist_tensors),
    )


def _input_outliers(node: dict[str, Any], dist_tensors: dict[str, Any]) -> Said:
    """ "; input 'x' has outlier channel 7 (88.2x the median)" for the first two inputs with an outlier."""
    said: list[str | Name] = []
    flagged = [n for n in node.get("inputs") or [] if (dist_tensors.get(n) or {}).get("outliers")]
    for name in flagged[:2]:
        o = dist_tensors[name]["outliers"][0]
        said += [
            "; input '",
            Name(name),
            f"' has outlier channel {o['index']} ({_ratio(o['times_median'], 1)}x the median)",
        ]
    return tuple(said)


def _ratio(value: Any, decimals: int) -> str:
    """A ratio from the document with ``decimals`` decimals; "inf", "nan" or none as :func:`fmt_num` shows them.

    Example:
        >>> _ratio(88.23, 1), _ratio("inf", 1)
        ('88.2', 'inf')
    """
    v = _finite(value)
    return f"{v:.{decimals}f}" if v is not None else fmt_num(value)


def nonfinite_lines(nodes: list[dict[str, Any]]) -> list[Said]:
    """Where NaN/Inf first appear in each model (:func:`diag.analysis.analyze.first_nonfinite` on the document).

    Only over the nodes whose NaN/Inf reach an output or a quantized input
    (:func:`diag.analysis.analyze.reaching_nonfinite`): a causal mask's -inf, which Softmax absorbs, is no
    finding. Documents older than that flag count every node.
    """
    ordered = sorted((n for n in nodes if n.get("nonfinite_reaches", True)), key=lambda n: n["index"])
    counts = (
        (n, (n["accumulated"] or {}).get("nonfinite_fp") or 0, (n["accumulated"] or {}).get("nonfinite_int8") or 0)
        for n in ordered
    )
    lines: list[Said] = []
    for model, n in first_nonfinite(counts).items():
        a = n["accumulated"] or {}
        count = a.get("nonfinite_fp" if model == "FP32" else "nonfinite_int8") or 0
        said: Said = (f"NaN/Inf first produced in the {model} model by ", Name(n["name"]), f" ({n['op_type']}): ")
        said += (f"{count} value(s) in '", Name(n["tensor"]), "'")
        if model == "FP32":
            said += ("; the float model itself is broken on these inputs, so its errors are not quantization's",)
        lines.append(said)
    return lines


def _fp16_lines(fp16: dict[str, Any] | None, top: int = 3) -> list[Said]:
    """An FP16 model: the fix, then the tensors out of FP16's range (overflow, then flushed to zero)."""
    if not fp16:
        return []
    lines: list[Said] = []
    blocked = (fp16.get("fix") or {}).get("node_block_list")
    if blocked:
        lines.append(("FP16 fix: ", Name(f"convert_float_to_float16(..., node_block_list={blocked!r})")))
    ranges = fp16.get("ranges") or {}
    over = sorted((r["overflow"], n) for n, r in ranges.items() if r["overflow"])
    for count, name in over[::-1][:top]:
        r = ranges[name]
        lines.append(
            _range_line(name, f"' reaches {r['peak']:.3g} in FP32: {count} of {r['count']} values overflow to inf")
        )
    under = sorted((r["flushed"] / r["count"], n) for n, r in ranges.items() if r["count"] and r["flushed"])
    for share, name in under[::-1][:top]:
        r = ranges[name]
        flushed = (
            f"': {r['flushed']} of {r['count']} values ({share:.1%}) flush to zero, {r['subnormal']} are subnormal"
        )
        lines.append(_range_line(name, flushed))
    return lines


def _range_line(tensor: str, rest: str) -> Said:
    """ "FP16 range: 'x' ...": one tensor out of FP16's range, ``rest`` worded after its name."""
    return ("FP16 range: '", Name(tensor), rest)


def error_paths(outputs: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> list[Said]:
    """ "logits: conv3 (+relu3) [root-cause, 9.5 dB] → pool [17.6 dB] → … → fc [18.4 dB]".

    Of the KV-cache outputs (``present.*``, one per layer and per key / value) only the one with
    the lowest SQNR gets a line, saying how many it stands for.
    """
    by_name = {n["name"]: n for n in nodes}
    caches = cache_outputs(outputs)
    shown = [o for o in outputs if not o.get("cache_of")] + caches[:1]
    lines: list[Said] = []
    for o in shown:
        path = [by_name[p] for p in o.get("error_path", []) if p in by_name]
        if not path:
            continue
        steps: list[Said] = []
        for n in path:
            role = f"{n['role']}, " if n["role"] not in ("ok", "victim") else ""
            steps.append((Name(n["name"]), f" [{role}{fmt_db((n['accumulated'] or {}).get('sqnr_db'))} dB]"))
        cut = shortened_path(steps, 3, PATH_STEPS, "\u2026 {} more \u2026")
        more = f" (the worst of {len(caches)} KV-cache outputs)" if o.get("cache_of") and len(caches) > 1 else ""
        said: list[str | Name] = [Name(o["name"]), f"{more}: "]
        for i, step in enumerate(cut):
            said += ([" \u2192 "] if i else []) + (list(step) if isinstance(step, tuple) else [step])
        lines.append(tuple(said))
    return lines


def db(value: Any) -> float:
    """An SQNR from the document (None, or a string such as ``"inf"``) as a float to sort on."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf


def layer_sentence(decoder: dict[str, Any]) -> str:
    """One line on a transformer stack: the worst layer and projection, and the residual stream's loss.

    Example:
        >>> layer_sentence({"layers": [
        ...     {"index": 0, "worst_local_node": "l0/fc", "worst_local_sqnr_db": 20.8, "accumulated_sqnr_db": 25.0},
        ...     {"index": 1, "worst_local_node": "l1/fc", "worst_local_sqnr_db": 10.8, "accumulated_sqnr_db": 12.0,
        ...      "worst_local_projection": "mlp/down_proj"}]})  # doctest: +NORMALIZE_WHITESPACE
        'per layer (2 layers): worst is layer 1 (mlp/down_proj: l1/fc, local SQNR 10.8 dB) (worst node of the
        other layers: 20.8-20.8 dB); accumulated SQNR 25.0 dB after layer 0, 12.0 dB after layer 1'
    """
    layers = decoder["layers"]
    first, last = layers[0], layers[-1]
    stream = (
        f"accumulated SQNR {fmt_db(first['accumulated_sqnr_db'])} dB after layer {first['index']}, "
        f"{fmt_db(last['accumulated_sqnr_db'])} dB after layer {last['index']}"
    )
    scored = [r for r in layers if isinstance(r.get("worst_local_sqnr_db"), (int, float)) and r.get("worst_local_node")]
    if not scored:
        return f"per layer ({len(layers)} layers): {stream}"
    worst = min(scored, key=lambda r: (r["worst_local_sqnr_db"], r["index"]))
    others = [r["worst_local_sqnr_db"] for r in scored if r is not worst]
    spread = f" (worst node of the other layers: {min(others):.1f}-{max(others):.1f} dB)" if others else ""
    node, projection = worst["worst_local_node"], worst.get("worst_local_projection")
    where = projection or node
    if projection and projection not in node:
        where = f"{projection}: {node}"  # node_linear_17 says nothing alone
    return (
        f"per layer ({len(layers)} layers): worst is layer {worst['index']} ({where}, local SQNR "
        f"{worst['worst_local_sqnr_db']:.1f} dB){spread}; {stream}"
    )


# ---------------------------------------------------------------- activations and weights


def _activation_lines(doc: dict[str, Any]) -> list[Said]:
    """The worst outlier channels, the persistent one, and the remedies (measured, and measured not to help)."""
    dist = doc.get("distributions") or {}
    tensors = dist.get("tensors", {})
    flagged = [(k, h) for k, h in tensors.items() if h.get("outliers") and h.get("grid") != "none"]
    flagged.sort(key=lambda kv: -(_finite(kv[1]["outliers"][0]["times_median"]) or 0.0))
    lines: list[Said] = [
        (
            f"outlier: channel {h['outliers'][0]['index']} of ",
            Name(k),
            f" is {_ratio(h['outliers'][0]['times_median'], 0)}x the median channel",
        )
        for k, h in flagged[:OUTLIER_TENSORS]
    ]
    lines += [("persistent outlier: ", *p) for p in persistent_said(dist)[:1]]
    suggestions = doc.get("suggestions") or []
    lines += [
        (
            "remedy for ",
            Name(s["tensor"]),
            ": ",
            Name(s["python"]),
            f" ({s['measured_note']})" if s.get("measured_note") else "",
        )
        for s in suggestions
        if s.get("advised", True)
    ][:REMEDIES]
    lines += [
        ("not advised for ", Name(s["tensor"]), ": ", Name(s["python"]), f" ({s['measured_note']})")
        for s in suggestions
        if not s.get("advised", True)
    ][:REMEDIES]
    return lines


def persistent_said(dist: dict[str, Any]) -> list[Said]:
    """One sentence per channel index that is an outlier in several tensors of the same width."""
    lines: list[Said] = []
    for p in dist.get("persistent_outliers", []):
        tensors = p["tensors"]
        more = (" ...",) if len(tensors) > PERSISTENT_TENSORS else ()
        lines.append(
            (
                f"channel {p['index']} is an outlier in {len(tensors)} of the {p['of_tensors']} tensors "
                f"with {p['channels']} channels: ",
                *names(tensors[:PERSISTENT_TENSORS]),
                *more,
            )
        )
    return lines


def _weight_lines(weights: dict[str, Any]) -> list[Said]:
    """The worst block of a block-wise weight, the producer's SmoothQuant Muls and bias correction."""
    lines: list[Said] = []
    for b in (weights.get("blocks") or [])[:1]:  # block-wise weights (MatMulNBits, int4 QDQ): see diag.core.nbits
        lines.append(
            (
                "worst weight block: ",
                Name(b["weight"]),
                f" {b.get('where') or block_where(b)}: error {fmt_num(b['rel_rmse'], 3)}x the weight's rms, "
                f"{b['levels']} levels used, max |w| {fmt_num(b['peak_ratio'], 3)}x the median",
            )
        )
    smoothing = weights.get("smoothing") or []
    if smoothing:  # inserted by the producer (NNCF's SmoothQuant): the strongest one, and how many
        s = smoothing[0]
        more = f" (+{len(smoothing) - 1} more SmoothQuant Muls in diag.json)" if len(smoothing) > 1 else ""
        lines.append(
            (
                "SmoothQuant's ",
                Name(s["mul"]),
                f" divides channel {s['strongest_channel']} of ",
                Name(s["tensor"]),
                f" by {fmt_num(s['divided_by'], 3)} ({s['channels']} channels) and multiplies it into ",
                *names(s["weights"]),
                more,
            )
        )
    corrected = weights.get("bias_corrections") or []
    if corrected:
        top = corrected[0]
        lines.append(
            (
                f"bias correction: {len(corrected)} float bias(es) differ from the FP32 model's on purpose (the "
                "producer's bias correction, not quantization error); the largest, ",
                Name(top["name"]),
                f", by {fmt_num(top['max_change'], 3)} "
                + (
                    f"({fmt_pct(top['relative'])} of its largest value)"
                    if isinstance(top.get("relative"), (int, float))
                    else "(the FP32 bias is all zero)"
                ),
            )
        )
    return lines


def names(items: Iterable[str]) -> Said:
    """Names joined with ", ", each a :class:`~diag.analysis.headline.Name`.

    Example:
        >>> plain(names(["a", "b"]))
        'a, b'
    """
    said: list[str | Name] = []
    for i, item in enumerate(items):
        said += [", "] if i else []
        said.append(Name(item))
    return tuple(said)


def block_where(b: dict[str, Any]) -> str:
    """``column 3 rows 32-63`` (``row 3 columns 32-63`` for a transposed Gather table), as
    :meth:`diag.core.nbits.BlockError.where` says it."""
    a, rows = ("row", "columns") if b.get("transposed") else ("column", "rows")
    return f"{a} {b['channel']} {rows} {b['rows'][0]}-{b['rows'][1] - 1}"


# ---------------------------------------------------------------- measured beyond the error


def _measured_lines(doc: dict[str, Any]) -> list[BriefLine]:
    """accuracy_level, the AVX2 prediction, the effect checks, the recipe settings, output parts, sensitivity."""
    lines = [BriefLine(s) for s in _accuracy_level_lines(doc.get("accuracy_level"))]
    isa = doc.get("deploy_isa")
    if isa:
        lines.append(BriefLine((prediction_sentence(isa),)))
        lines += [BriefLine((str(e["sentence"]),), 1) for e in isa["nodes"][:EFFECTS] if e["saturated_pairs"]]
    lines += [BriefLine(s) for s in _effect_lines(doc)]
    if doc.get("recipe_settings"):
        lines.append(BriefLine((RecipeLevers.from_dict(doc["recipe_settings"]).line(),)))
    remedies = doc.get("remedy_checks") or {}
    if remedies and not remedies.get("proved", True):
        lines.append(BriefLine((f"weight-only remedies not measured: {remedies.get('proof', '')}",)))
    for o in doc["verdict"]["outputs"]:
        for p in o.get("parts") or []:
            local = f", local SQNR {fmt_db(p['local_sqnr_db'])} dB" if p.get("local_sqnr_db") is not None else ""
            lines.append(
                BriefLine(
                    (
                        "output ",
                        Name(o["name"]),
                        f" part {p['label']}: SQNR {fmt_db(p['sqnr_db'])} dB, "
                        f"min cosine {fmt_num(p['cosine_min'], 6)}{local}",
                    )
                )
            )
    rows = (doc.get("sensitivity") or {}).get("rows") or []
    if rows:
        best = rows[0]
        lines.append(
            BriefLine(
                (
                    "sensitivity: keeping ",
                    Name(best["label"]),
                    f" in float recovers {number_from_json(best['cosine_recovered']):+.4f} output cosine "
                    f"({doc['sensitivity']['quantizations']} quantizations)",
                )
            )
        )
    return lines


def _accuracy_level_lines(level: dict[str, Any] | None) -> list[Said]:
    """What a MatMulNBits ``accuracy_level`` costs, measured against level 0."""
    if not level or not level.get("nodes"):
        return []
    node, node_db = next(iter(level["nodes"].items()))
    outs: list[str | Name] = []
    for i, (k, v) in enumerate(level["outputs"].items()):
        outs += [", " if i else "", Name(k), f" {fmt_db(v)} dB"]
    return [
        (
            f"accuracy_level {level['level']} vs 0 (MatMulNBits inputs quantized inside the kernel): SQNR ",
            *outs,
            "; worst node ",
            Name(node),
            f" {fmt_db(node_db)} dB ({level['samples']} samples)",
        )
    ]


def _effect_lines(doc: dict[str, Any]) -> list[Said]:
    """The effect on the failing output of keeping one node, then one recipe-lever group, in float."""
    effects = doc.get("effects") or {}
    kind = (doc["verdict"].get("headline") or {}).get("kind")
    lines: list[Said] = []
    rows = effects.get("effects") or []
    shown = [e for e in rows[:EFFECTS] if _share(e.get("recovered")) > 0.01 or _disagree(e)]
    if shown and kind != "rounding":
        said: list[str | Name] = ["effect on ", Name(effects["target"]), " of keeping one node in float: "]
        for i, e in enumerate(shown):
            exact = f" (exact mode {_share(e['exact_recovered']):.0%})" if _disagree(e) else ""
            said += ([", "] if i else []) + [Name(e["node"]), f" {_share(e.get('recovered')):.0%}{exact}"]
        said.append(f" ({effects['samples']} samples, optimization level {effects.get('level', 'all')})")
        lines.append(tuple(said))
    groups = effects.get("groups") or []
    if groups:
        lines.append(
            (
                "effect on ",
                Name(effects["target"]),
                " of keeping a recipe-lever group in float: "
                + ", ".join(
                    f"{g['label']} ({g['lever']}) {max(_share(g.get('recovered')), 0.0):.0%}" for g in groups[:EFFECTS]
                ),
            )
        )
    return lines


def _share(value: Any) -> float:
    """A recovered share from the document ("nan", None: nothing recovered)."""
    v = _finite(value)
    return 0.0 if v is None else v


def _finite(value: Any) -> float | None:
    """A number from the document as a finite float; None for "inf", "nan", None or text."""
    v = number_from_json(value) if isinstance(value, (int, float, str)) else math.nan
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _disagree(e: dict[str, Any]) -> bool:
    """The deployed and exact-mode shares differ by :data:`~diag.analysis.effects.LEVELS_DISAGREE` or more."""
    exact = e.get("exact_recovered")
    return isinstance(exact, (int, float)) and abs(exact - _share(e.get("recovered"))) >= LEVELS_DISAGREE


# ---------------------------------------------------------------- the run


def _run_lines(doc: dict[str, Any]) -> list[Said]:
    """The cluster, the coverage and the run, the measured recipe lines, the padding left out."""
    run, m = doc["run"], doc["matching"]
    lines: list[Said] = []
    cluster = cluster_line(run.get("cluster") or {})
    if cluster is not None:
        lines.append((cluster,))
    level = doc["verdict"].get("graded_at", "disabled")
    samples, local = int(run["samples"]), run.get("local_samples")
    lines.append(
        (
            f"matched {m['compared']}/{m['float_tensors']} FP32 float tensors "
            f"({len(m['unmatched_tensors'])} unmatched, "
            "listed in the report); outputs graded "
            + (f"as deployed (level {level}); " if level != "disabled" else "in exact mode; ")
            + f"{samples} samples "
            + (f"({run['passes']} passes, memory budget) " if int(run.get("passes", 1)) > 1 else "")
            + f"in {float(run['seconds']):.1f} s"
            + (
                f" (local error on the first {int(local)}; --local-samples all for every one)"
                if run.get("local_error") and local is not None and int(local) < samples
                else ""
            ),
        )
    )
    lines += unmatched_lines(m.get("unmatched_causes") or [], doc["models"]["int8"].get("producer"))
    lines += [(line,) for line in shown_lines(recipe_findings(doc.get("recipe_lines") or []))]
    padding = Padding.from_dict(run.get("positions"))
    if padding is not None:
        lines.append((padding.sentence(),))
    return lines


def unmatched_lines(causes: list[dict[str, Any]], producer: str | None) -> list[Said]:
    """One sentence per cause of the unmatched tensors (diag.json ``matching.unmatched_causes``),
    the largest first, in the producer's name when its marks say which tool made the model: what
    was fused, folded, renamed or removed, instead of one reason per tensor.

    Example:
        >>> cause = {"kind": "folded", "op_type": "Conv", "merged_with": "BatchNormalization", "tensors": ["c1", "c2"]}
        >>> plain(unmatched_lines([cause], "AMD Quark")[0])  # doctest: +NORMALIZE_WHITESPACE
        'unmatched: 2 Conv outputs folded with the BatchNormalization after them into one INT8 node by
        AMD Quark; compared after the BatchNormalization: c1, c2'
    """
    who = producer or "the quantizer"
    lines: list[Said] = []
    for c in causes[:UNMATCHED_CAUSES]:
        n, tensors, merged = len(c["tensors"]), c["tensors"], c.get("merged_with") or ""
        nameless = f"{n} tensor(s)" if c["kind"] == "shape" else f"{n} graph input(s)"
        what = f"{n} {c['op_type']} output{'s' if n > 1 else ''}" if c["op_type"] else nameless
        them = "them" if n > 1 else "it"
        merged_by = f"into one INT8 node by {who}; compared after the {merged}"
        head = {
            "fused": f"{what} fused with the {merged} after {them} {merged_by}",
            "folded": f"{what} folded with the {merged} after {them} {merged_by}",
            "renamed": f"{what} renamed, not fused: the INT8 model still computes {them}, under other names",
            "identity": f"{what} passed on by an identity {merged} (x * 1, x + 0) removed by {who}; compared after it"
            if merged
            else f"{what} of an identity (x * 1, x + 0), removed by {who}",
            "missing": f"{what} without an INT8 tensor of the same name: {who} removed or renamed {them}",
            "shape": f"{what} whose shape differs in the INT8 model at run time",
        }.get(c["kind"], f"{what} ({c['kind']})")
        said: list[str | Name] = [f"unmatched: {head}: ", *names(tensors[:NAMED_TENSORS])]
        if n > NAMED_TENSORS:
            said.append(f" and {n - NAMED_TENSORS} more (diag.json matching.unmatched_tensors)")
        lines.append(tuple(said))
    rest = causes[UNMATCHED_CAUSES:]
    if rest:
        count = sum(len(c["tensors"]) for c in rest)
        lines.append((f"unmatched: {count} more tensor(s) of {len(rest)} other cause(s), listed in the report",))
    return lines


def recipe_findings(rows: Iterable[dict[str, Any]]) -> list[Finding]:
    """diag.json's ``recipe_lines`` back as lint's findings (each worded by :meth:`Finding.line`)."""
    return [Finding(**r) for r in rows]


def cluster_line(info: dict[str, Any]) -> str | None:
    """One line on what ``--scheduler`` did: workers, tasks, retries, where latency was measured."""
    if not info:
        return None
    shards = f"{info['shards']} shards, " if "shards" in info else ""
    unused = f", {info['unused_tasks']} computed ahead and not needed" if info.get("unused_tasks") else ""
    where = f"; latency measured on {info['latency_measured_on']}" if "latency_measured_on" in info else ""
    return (
        f"cluster: {info['workers']} worker(s) at {info['scheduler']}, {shards}{info['tasks']} tasks"
        f"{unused}, {info['retries']} retried after a worker died{where}"
    )
