"""Each recipe line measured on the model (`diag lint RECIPE --model FP32 [--inputs X]`, issue 42 item 4).

A rule of thumb about a recipe line ("ActivationSymmetric only affects quantize_static") is right
for some settings and wrong for others (with QInt8 weights quantize_dynamic reads it for Gather
tables). So the linter does not guess where it can measure: the recipe is quantized as written
and once without each line it sets, and the line is judged by what it does to *this* model —
nothing (byte-identical: a warning), or a change (the op counts or initializers that differ, and
with inputs the outputs' SQNR with and without it, as onnxruntime runs the model by default).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.core.feeds import FeedSpec
from diag.core.load import float_model_from_path
from diag.core.metrics import ErrorAccumulator
from diag.core.recipe import Recipe, load_recipe
from diag.core.run import session_from_model
from diag.fix.lint import Finding, all_nodes, onnxruntime_extra_options, quantizable_op_types
from diag.fix.quantize import quantize_model
from diag.foundations.errors import DiagError
from diag.foundations.ortfacts import DEPLOY_LEVEL, EXACT_LEVEL

#: Samples the measured lines run on (the first ones of ``--inputs``).
MEASURE_SAMPLES = 16


def measure_lines(
    recipe_path: str | os.PathLike[str],
    model_path: str | os.PathLike[str],
    feeds: FeedSpec | None = None,
    threads: int | None = None,
) -> list[Finding]:
    """Each recipe line's effect on this model, measured: quantize with and without it (issue 42 item 4).

    The lines are the ``extra_options`` keys onnxruntime reads, and ``per_channel`` / ``reduce_range``
    when set. A line whose removal gives a byte-identical model does nothing here (a warning: it
    only reads as if it mattered); one that changes the model is a note saying what it changes (op
    counts, or how many initializers) and, with ``feeds``, the outputs' SQNR against FP32 as
    onnxruntime runs them by default, with and without it. Static recipes need their calibration
    data; without it, and for weight-only or fp16 recipes, nothing is measured (a note says so).

    Example:
        >>> [f.line() for f in measure_lines("recipe.json", "fp32.onnx")]  # doctest: +SKIP
        ['warning[no-effect] extra_options.EnableSubgraph: changes nothing in this model (...)...']
    """
    try:
        recipe = load_recipe(recipe_path)
    except DiagError:
        return []  # the recipe's own errors are already listed; nothing can be quantized from it
    if recipe.mode not in ("dynamic", "static"):
        return []
    if recipe.mode == "static" and not recipe.calibration:
        return [
            Finding(
                "note",
                "not-measured",
                "recipe",
                "a static recipe without calibration data: its lines were not measured on the model",
                'add "calibration": "calib.npz" to measure what each line changes',
            )
        ]
    lines = _lines(recipe, model_path)
    if not lines:
        return []
    out: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="diag-lint-") as tmp:
        base = Path(tmp) / "recipe.onnx"
        try:
            quantize_model(model_path, recipe, base)
        except DiagError as e:  # e.g. a node name the errors above already report
            return [
                Finding(
                    "note",
                    "not-measured",
                    "recipe",
                    f"its lines were not measured on the model: quantizing it stops at {e.obj} ({e.problem})",
                    "fix the errors above, then lint again",
                )
            ]
        reference = _Reference(model_path, feeds, threads) if feeds is not None else None
        base_sqnr = reference.sqnr(base) if reference is not None else None
        for where, change in lines:
            variant = Path(tmp) / "without.onnx"
            changed = Recipe.from_dict({**recipe.to_dict(), **change})
            changed.base_dir = recipe.base_dir  # the calibration data is where the recipe file says
            quantize_model(model_path, changed, variant)
            if "op_types_to_quantize" in change:
                out.append(_hint_finding(where, change["op_types_to_quantize"], base, variant))
                continue
            if variant.read_bytes() == base.read_bytes():
                out.append(
                    Finding(
                        "warning",
                        "no-effect",
                        where,
                        "changes nothing in this model (quantized without it, the model is byte-identical)",
                        "remove it: it only reads as if it mattered",
                    )
                )
                continue
            message = f"changes the model: {_model_change(base, variant)}"
            if reference is not None and base_sqnr is not None:
                without = reference.sqnr(variant)
                message += f"; output SQNR {base_sqnr:.1f} dB with it, {without:.1f} dB without (as deployed)"
            out.append(Finding("note", "measured", where, message))
    return out


def _lines(recipe: Recipe, model_path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """(where, the recipe keys that undo it) for every line to measure: each ``extra_options`` key
    onnxruntime reads, ``per_channel`` / ``reduce_range`` when set, and the ``op_types_to_quantize``
    an invented ``OpTypesToExclude``'s hint would write instead."""
    known = onnxruntime_extra_options()
    extra = dict(recipe.extra_options or {})
    lines: list[tuple[str, dict[str, Any]]] = [
        (f"extra_options.{k}", {"extra_options": {x: v for x, v in extra.items() if x != k}})
        for k in extra
        if k in known.quantizer
    ]
    lines += [(k, {k: False}) for k in ("per_channel", "reduce_range") if getattr(recipe, k)]
    invented = extra.get("OpTypesToExclude")
    if isinstance(invented, list) and not recipe.op_types_to_quantize:
        model = float_model_from_path(model_path).proto
        kinds = set(quantizable_op_types("dynamic" if recipe.mode == "dynamic" else "qdq"))
        hint = sorted((kinds & {n.op_type for n in all_nodes(model)}) - {str(x) for x in invented})
        if hint:
            lines.append(("extra_options.OpTypesToExclude", {"op_types_to_quantize": hint}))
    return lines


def _hint_finding(where: str, op_types: list[str], base: Path, variant: Path) -> Finding:
    """What the invented OpTypesToExclude's hint (``op_types_to_quantize``) does to this model."""
    if variant.read_bytes() == base.read_bytes():
        return Finding(
            "warning",
            "no-effect",
            where,
            f"its fix, op_types_to_quantize={json.dumps(op_types)}, changes nothing in this model "
            "(byte-identical): the types it leaves out are not quantized here anyway",
            "remove the key; nothing needs excluding",
        )
    change = _model_change(base, variant, ("as written", "with the fix"))
    return Finding("note", "measured", where, f"its fix changes the model: {change}")


def _model_change(with_it: Path, without: Path, labels: tuple[str, str] = ("with it", "without")) -> str:
    """What a line changes: the op counts that differ, else how many initializers differ."""
    a, b = onnx.load(str(with_it)), onnx.load(str(without))
    ca = Counter(n.op_type for n in a.graph.node)
    cb = Counter(n.op_type for n in b.graph.node)
    differ = [op for op in set(ca) | set(cb) if ca[op] != cb[op]]
    # the quantized ops first (MatMulInteger, QLinearConv, DequantizeLinear ...), then the float ones
    differ.sort(key=lambda op: (not any(w in op for w in ("Integer", "QLinear", "Quantize", "NBits")), op))
    ops = [f"{op} {ca[op]} {labels[0]}, {cb[op]} {labels[1]}" for op in differ]
    if ops:
        return "; ".join(ops[:4])
    inits_b = {t.name: t.SerializeToString() for t in b.graph.initializer}
    changed = sum(1 for t in a.graph.initializer if inits_b.get(t.name) != t.SerializeToString())
    return f"{changed} initializer(s) differ (scales, zero points or weights), same ops"


class _Reference:
    """The FP32 model's exact outputs on the first :data:`MEASURE_SAMPLES` samples, computed once:
    every measured line compares its model with them (the FP32 model is loaded and run one time)."""

    def __init__(self, fp32: str | os.PathLike[str], feeds: FeedSpec, threads: int | None) -> None:
        fp = float_model_from_path(fp32)
        spec = dataclasses.replace(feeds, samples=min(feeds.samples or MEASURE_SAMPLES, MEASURE_SAMPLES))
        self.threads = threads or 1
        sess = session_from_model(fp.proto, "FP32 model", EXACT_LEVEL, self.threads, fp.external_dir)
        self.batches = [(b.feeds, sess.run(None, b.feeds)) for b in spec.source(fp.proto)]

    def sqnr(self, model: Path) -> float:
        """SQNR (dB) of every output of ``model`` as onnxruntime runs it by default (what the user deploys)."""
        q_sess = session_from_model(onnx.load(str(model)), "INT8 model", DEPLOY_LEVEL, self.threads, None)
        acc = ErrorAccumulator()
        for feeds, ref in self.batches:
            for x, y in zip(ref, q_sess.run(None, feeds), strict=True):
                if np.shape(x) == np.shape(y) and np.issubdtype(np.asarray(x).dtype, np.floating):
                    acc.update(np.asarray(x), np.asarray(y))
        return acc.finalize().sqnr_db


def shown_lines(findings: list[Finding]) -> list[str]:
    """The measured recipe lines a verb prints (compare and exclude alike): warnings, and the notes
    that carry a measurement; the plain notes stay in the JSON and the report.

    Example:
        >>> unused = Finding("warning", "no-effect", "extra_options.EnableSubgraph", "changes nothing", "remove it")
        >>> shown_lines([unused, Finding("note", "hint", "recipe", "a note", "")])  # doctest: +ELLIPSIS
        ['recipe line: warning[no-effect] extra_options.EnableSubgraph: changes nothing...']
    """
    return [f"recipe line: {f.line()}" for f in findings if f.severity != "note" or f.code == "measured"]
