"""Concrete remedies for unhealthy tensors, in onnxruntime's own argument names.

Every :class:`Suggestion` carries a *recipe delta* in the names `quantize_dynamic` /
`quantize_static` take (the recipe file uses the same names), and the exact Python text to paste.
A test applies each kind with real onnxruntime quantization and checks that the named tensor
improves, so nothing here is folklore.

NOTE: there is no ``OpTypesToExclude`` option in onnxruntime; keeping nodes in float is
``nodes_to_exclude``. 16-bit activations exist only in QDQ format (``TensorQuantOverrides``).
SmoothQuant needs the separate ``neural-compressor`` package; it is suggested only with that
caveat and never as the first remedy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import onnx

from diag.analysis.weights import WeightFinding
from diag.core.distributions import TensorHealth
from diag.core.match import Matching, NodeGroup, TopLevelIndex
from diag.foundations.jsonnum import json_number
from diag.foundations.ortfacts import kinds_where
from diag.foundations.producers import ORT_RECIPE_PRODUCERS, PRODUCERS, node_fix_call

#: Effective bits this far below the grid's bits mean the tails waste the grid.
WASTED_BITS = 3.0
#: Ops SmoothQuant can migrate activation outliers into (a weight on the other operand).
SMOOTHABLE = frozenset({"MatMul", "Gemm"})


@dataclass(frozen=True)
class Suggestion:
    """One remedy for one tensor: what is wrong, the onnxruntime argument that fixes it, and why."""

    tensor: str
    problem: str
    remedy: str
    recipe: dict[str, Any]
    python: str
    applies_to: str
    note: str = ""
    consumers: list[str] = field(default_factory=list)
    #: Share of the failing output's error the remedy removed, as the effect check measured it (a
    #: ``nodes_to_exclude`` remedy whose nodes the check kept in float); None: not measured.
    measured: float | None = None
    #: The measurement in one sentence (:func:`diag.analysis.effects.judge_remedies`), "" if none.
    measured_note: str = ""
    #: False when measured and it does not help: shown as "measured, does not help", never advised
    #: (issue 42 item 2: a remedy with a negative measured effect was the report's remedy 2).
    advised: bool = True
    #: The tool that made the model (a :data:`~diag.foundations.producers.PRODUCERS` key): a node
    #: exclusion is worded in its terms (:func:`in_producer_terms`). Not in the JSON: ``python`` is.
    producer: str = "onnxruntime"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "problem": self.problem,
            "remedy": self.remedy,
            "recipe": self.recipe,
            "python": self.python,
            "applies_to": self.applies_to,
            "note": self.note,
            "consumers": self.consumers,
            "measured": json_number(self.measured) if self.measured is not None else None,
            "measured_note": self.measured_note,
            "advised": self.advised,
        }


#: QuantType members a recipe names as strings.
_QUANT_TYPES = ("QInt16", "QUInt16", "QInt8", "QUInt8", "QInt4", "QUInt4")


def _py(value: Any, key: str | None = None) -> str:
    """Python literal text for a recipe value, as onnxruntime takes it when pasted.

    QuantType names become enum members (a string is silently ignored), and ``rmin`` / ``rmax`` /
    ``scale`` numbers ``np.float32`` (onnxruntime's TensorQuantOverrides calls ``.dtype`` on them:
    a plain float raises AttributeError inside quantize_static). Built value by value, so a tensor
    called ``true_branch`` keeps its name.

    Example:
        >>> print(_py({"true_out": [{"rmin": -0.5, "quant_type": "QInt16"}]}))
        {"true_out": [{"rmin": np.float32(-0.5), "quant_type": QuantType.QInt16}]}
    """
    if isinstance(value, dict):
        items = (f"{json.dumps(str(k), ensure_ascii=False)}: {_py(v, str(k))}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_py(v, key) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return f"QuantType.{value}" if value in _QUANT_TYPES else json.dumps(value, ensure_ascii=False)
    if key in ("rmin", "rmax", "scale") and isinstance(value, int | float):
        return f"np.float32({value!r})"
    return repr(value)


def quantized_consumers(
    index: TopLevelIndex, group_of: dict[str, NodeGroup], matching: Matching, tensor: str
) -> tuple[list[str], list[str]]:
    """FP32 node names (for ``nodes_to_exclude``) and op types of the quantized nodes reading ``tensor``.

    The names of a quantized *producer* come last in the list (op types cover consumers only):
    in static formats a quantized producer writes its output through a Q/DQ pair whatever its
    consumers are, so keeping the tensor in float means excluding the producer too.
    """
    names: list[str] = []
    ops: list[str] = []
    for i in dict.fromkeys(index.consumers.get(tensor, [])):
        g = group_of.get(index.ids[i])
        # Unnamed nodes cannot be named in nodes_to_exclude (the report says to name them).
        if g is not None and g.quantized and not g.unnamed:
            for n in g.fp_nodes:
                if n not in names:
                    names.append(n)
            ops.append(index.nodes[i].op_type)
    pair = matching.pairs.get(tensor)
    producer = group_of.get(pair.producer) if pair is not None and pair.producer else None
    if producer is not None and producer.quantized and names:
        names.extend(n for n in producer.fp_nodes if n not in names)
    return names, ops


#: Levels a median channel spans above which an outlier channel is harmless (an 8-bit grid's worth).
ROOMY_LEVELS = 256
#: Formats whose activation grids come (or, mixed, may come) from calibration: clipping,
#: percentile-calibration and 16-bit-activation remedies apply (:data:`diag.foundations.ortfacts.FORMATS`).
CALIBRATED_FORMATS = kinds_where(lambda f: f.calibrated)


def suggestions_for(
    name: str, health: TensorHealth, fmt: str, consumers: list[str], consumer_ops: list[str]
) -> list[Suggestion]:
    """Remedies for one tensor, most targeted first. Empty when the tensor is healthy.

    An outlier channel decides alone (its remedies fix the range problems too); otherwise a
    clipped calibration range and a range wasted on rare tails each get theirs.

    Example:
        >>> suggestions_for("t", health, "qdq", ["fc1"], ["MatMul"])[0].remedy  # doctest: +SKIP
        'qint16-activation'
    """
    if health.grid == "none":
        return []
    static = fmt in CALIBRATED_FORMATS
    # On a 16-bit grid a typical channel can still span more levels than a whole 8-bit grid: the
    # outlier channel then costs nothing and needs no remedy.
    roomy = health.median_channel_levels is not None and health.median_channel_levels >= ROOMY_LEVELS
    if health.outliers and not roomy:
        return _outlier_remedies(name, health, fmt, consumers, consumer_ops)
    out: list[Suggestion] = []
    if static and health.clips and health.clip_fraction is not None:
        out.append(_clipping_remedy(name, health, consumers))
    out += _wasted_range_remedies(name, health, fmt, consumers)
    return out


def _outlier_remedies(
    name: str, health: TensorHealth, fmt: str, consumers: list[str], consumer_ops: list[str]
) -> list[Suggestion]:
    """An outlier channel crushes the others under one scale: 16 bits, float consumers, or SmoothQuant."""
    static = fmt in CALIBRATED_FORMATS
    out: list[Suggestion] = []
    top = health.outliers[0]
    dims = ", ".join(str(o.index) for o in health.outliers[:5])
    levels = f"{health.median_channel_levels:.1f}" if health.median_channel_levels is not None else "few"
    n = len(health.outliers)
    which = f"channel {dims} reaches" if n == 1 else f"{n} channels ({dims}{', ...' if n > 5 else ''}) reach up to"
    problem = (
        f"{which} {top.max_abs:.3g}, {top.times_median:.0f}x the median channel; "
        f"with one per-tensor scale a typical channel spans only {levels} levels"
    )
    if static and (health.grid_bits or 8) < 16:  # not for a tensor already on a 16-bit grid
        override = {"TensorQuantOverrides": {name: [{"quant_type": "QInt16"}]}}
        recipe: dict[str, Any] = {"extra_options": override}
        note = "16-bit activations exist only in QDQ format"
        if fmt == "qoperator":
            recipe = {"quant_format": "QDQ", "extra_options": override}
            note += ": this also switches the model to QDQ"
        out.append(
            Suggestion(
                name,
                problem,
                "qint16-activation",
                recipe,
                f"extra_options={_py(override)}" + (", quant_format=QuantFormat.QDQ" if fmt == "qoperator" else ""),
                "quantize_static",
                note,
                consumers,
            )
        )
    if consumers:
        out.append(_exclude(name, problem, consumers, fmt))
    if static and health.axis is not None and set(consumer_ops) & SMOOTHABLE:
        opts = {"SmoothQuant": True, "SmoothQuantAlpha": 0.5}
        out.append(
            Suggestion(
                name,
                problem,
                "smoothquant",
                {"extra_options": opts},
                f"extra_options={_py(opts)}",
                "quantize_static",
                "needs `pip install neural-compressor`; migrates the outlier into the MatMul weights",
                consumers,
            )
        )
    return out


def _clipping_remedy(name: str, health: TensorHealth, consumers: list[str]) -> Suggestion:
    """Values beyond the calibrated range are clipped: give the tensor the range its inputs reach."""
    rng = {"rmin": round(health.fp_min, 6), "rmax": round(health.fp_max, 6)}
    override = {"TensorQuantOverrides": {name: [rng]}}
    return Suggestion(
        name,
        f"{health.clip_fraction:.2%} of values fall outside the calibrated range "
        f"[{_range(health)}] (inputs reach [{health.fp_min:.4g}, {health.fp_max:.4g}])",
        "calibration-range",
        {"extra_options": override},
        f"extra_options={_py(override)}",
        "quantize_static",
        "or calibrate on inputs that cover this range (more / more representative samples)",
        consumers,
    )


def _wasted_range_remedies(name: str, health: TensorHealth, fmt: str, consumers: list[str]) -> list[Suggestion]:
    """Rare tail values set the range and the bulk gets few bits: percentile calibration, or float consumers."""
    wasted = (
        health.effective_bits is not None
        and health.grid_bits is not None
        and health.effective_bits < health.grid_bits - WASTED_BITS
    )
    if not wasted:
        return []
    out: list[Suggestion] = []
    problem = (
        f"the bulk (P0.1..P99.9) spans {health.effective_bits:.1f} of {health.grid_bits:.0f} bits: "
        f"rare tail values set the range ({health.range_over_bulk:.0f}x the bulk)"
    )
    if fmt in CALIBRATED_FORMATS:
        opts = {"CalibPercentile": 99.99}
        out.append(
            Suggestion(
                name,
                problem,
                "percentile-calibration",
                {"calibrate_method": "Percentile", "extra_options": opts},
                f"calibrate_method=CalibrationMethod.Percentile, extra_options={_py(opts)}",
                "quantize_static",
                "applies to every activation; clips the rarest 0.01 % of values",
                consumers,
            )
        )
    if consumers:
        out.append(_exclude(name, problem, consumers, fmt))
    return out


def _range(h: TensorHealth) -> str:
    if h.grid_range is None:
        return "?"
    return f"{h.grid_range[0]:.4g}, {h.grid_range[1]:.4g}"


def _exclude(name: str, problem: str, consumers: list[str], fmt: str) -> Suggestion:
    api = "quantize_dynamic" if fmt == "dynamic" else "quantize_static"
    note = "keeps the reading node(s) in float; costs their INT8 speed-up"
    if fmt != "dynamic":
        note = "keeps the tensor and the nodes around it in float (static formats quantize a quantized node's output)"
    return Suggestion(
        name,
        problem,
        "exclude-consumers",
        {"nodes_to_exclude": consumers},
        f"nodes_to_exclude={_py(consumers)}",
        api,
        note,
        consumers,
    )


#: A per-tensor weight whose worst output channel is below this SQNR while per-channel would fix it.
BAD_CHANNEL_DB = 20.0


def per_channel_suggestions(
    weights: list[WeightFinding], fmt: str, producer: str = "onnxruntime", opset: int = 13
) -> list[Suggestion]:
    """``per_channel=True`` when per-tensor weights ruin some output channels, in the terms of the
    tool that made the model (``producer``, a :data:`diag.foundations.producers.PRODUCERS` key).

    One suggestion (it is a model-wide switch) naming the worst weights.

    Example:
        >>> per_channel_suggestions([], "qdq")
        []
    """
    ruined = [
        w
        for w in weights
        if w.axis is None and not w.is_bias and w.channels and min(c.sqnr_db for c in w.channels) < BAD_CHANNEL_DB
    ]
    if not ruined:
        return []
    worst = ruined[0]
    ch = min(worst.channels, key=lambda c: c.sqnr_db)
    names = ", ".join(w.fp_name for w in ruined[:3]) + (f" and {len(ruined) - 3} more" if len(ruined) > 3 else "")
    python, api, note = per_channel_switch(fmt, producer, opset)
    return [
        Suggestion(
            worst.fp_name,
            f"per-tensor weight scale: channel {ch.channel} of {worst.fp_name} keeps {ch.sqnr_db:.1f} dB SQNR "
            f"(whole tensor {worst.sqnr_db:.1f} dB); {len(ruined)} weight(s) affected: {names}",
            "per-channel-weights",
            {"per_channel": True},
            python,
            api,
            note,
            list(worst.fp_nodes),
        )
    ]


def per_channel_switch(fmt: str, producer: str, opset: int) -> tuple[str, str, str]:
    """(the change, the tool it is made in, why) of per-channel weights for the tool that made the
    model (:attr:`diag.foundations.producers.Producer.per_channel_fix`).

    NNCF has no per-channel switch to turn on: it quantizes weights per channel from opset 13 and
    falls back to one scale per tensor below it, so its fix is the FP32 model's opset.

    Example:
        >>> per_channel_switch("qdq", "nncf", 11)[0]
        'model = onnx.version_converter.convert_version(model, 13)  # then nncf.quantize(model, ...)'
        >>> per_channel_switch("qdq", "quark", 17)[0]
        'QLayerConfig(weight=Int8Spec(quant_granularity=QuantGranularity.Channel)) in your QConfig'
        >>> per_channel_switch("qdq", "onnxruntime", 17)[0]
        'per_channel=True'
    """
    row = PRODUCERS.get(producer)
    if row is not None and row.per_channel_fix is not None and (producer != "nncf" or opset < 13):
        why = (
            f"NNCF quantizes weights per channel from opset 13 and falls back to one scale per tensor below it "
            f"(your FP32 model: opset {opset}); upgrade the model, then quantize it again"
            if producer == "nncf"
            else f"one scale per output channel, with {row.name}'s own setting; then quantize again"
        )
        return row.per_channel_fix, row.name, why
    api = "quantize_dynamic" if fmt == "dynamic" else "quantize_static"
    return "per_channel=True", api, "one scale per output channel; onnxruntime needs opset >= 13 for per-channel QDQ"


def all_suggestions(
    model: onnx.ModelProto,
    matching: Matching,
    health: dict[str, TensorHealth],
    fmt: str,
    weights: list[WeightFinding] | None = None,
    producer: str = "onnxruntime",
    opset: int = 13,
) -> list[Suggestion]:
    """Suggestions for every unhealthy tensor, worst first (outliers, then clipping, then tails),
    then per-channel weights when per-tensor weights ruin channels (worded for ``producer``, the
    tool that made the model, whose ``opset`` it was)."""

    def badness(item: tuple[str, TensorHealth]) -> tuple[int, float]:
        h = item[1]
        if h.outliers:
            return (0, -h.outliers[0].times_median)
        if h.clips and h.clip_fraction is not None:
            return (1, -h.clip_fraction)
        return (2, h.effective_bits if h.effective_bits is not None else 99.0)

    index = TopLevelIndex(model)
    group_of = {n: g for g in matching.groups for n in g.fp_nodes}
    out: list[Suggestion] = []
    for name, h in sorted(health.items(), key=badness):
        if not h.unhealthy_reasons:
            continue
        nodes, ops = quantized_consumers(index, group_of, matching, name)
        if fmt == "dynamic":
            nodes = nodes[: len(ops)] if ops else nodes  # dynamic quantizes activations at the consumer only
        out.extend(suggestions_for(name, h, fmt, nodes, ops))
    out += per_channel_suggestions(weights or [], fmt, producer, opset)
    return [in_producer_terms(s, producer) for s in out]


def in_producer_terms(suggestion: Suggestion, producer: str) -> Suggestion:
    """``suggestion`` for a model ``producer`` made: a node exclusion becomes that tool's own switch
    (``nncf.IgnoredScope(names=[...])``, Quark's ``exclude``...); onnxruntime's recipe remedies stay
    as they are, and say so by their ``applies_to``.

    Example:
        >>> s = Suggestion("t", "p", "exclude-consumers", {"nodes_to_exclude": ["fc"]}, "", "quantize_static")
        >>> in_producer_terms(s, "nncf").python
        "nncf.IgnoredScope(names=['fc']) in your nncf.quantize call"
    """
    nodes = suggestion.recipe.get("nodes_to_exclude")
    mine = replace(suggestion, producer=producer)
    if nodes is None or set(suggestion.recipe) != {"nodes_to_exclude"} or producer in ORT_RECIPE_PRODUCERS:
        return mine
    name = PRODUCERS[producer].name if producer in PRODUCERS else mine.applies_to
    return replace(mine, python=node_fix_call(producer, list(nodes)), applies_to=name)


#: Formats whose weights alone are quantized (``MatMulNBits``, block-wise int4 ``DequantizeLinear``):
#: their activations stay float, so INT8-activation remedies change nothing on them.
WEIGHT_ONLY_FORMATS = kinds_where(lambda f: f.weight_only)

#: The spread-error headline's model-wide remedies before a recipe is known (the exclusion search,
#: :data:`SEARCH_REMEDY`, always ends the list: :class:`diag.analysis.headline.SpreadRemedies`).
GENERIC_SPREAD = ("per_channel=True", "static calibration instead of dynamic", "16-bit activations (QDQ)")
#: The last remedy of every spread-error list, before the command to run is known.
SEARCH_REMEDY = "an exclusion search (diag exclude)"


def spread_remedies(fmt: str, settings: dict[str, Any] | None) -> list[str]:
    """The model-wide remedies for spread error that change something for this format and recipe.

    ``settings`` is the recipe diag was given or inferred (``diag.fix.infer.fix_recipe``'s
    ``settings``); a remedy already in effect (``per_channel=True`` on a per-channel model, static
    calibration on a static model) is left out, so every remedy listed re-quantizes to a different
    model. Weight-only formats get the weight-only family (block size, symmetry, accuracy level,
    keeping the last MatMul at 8 bits) instead of INT8-activation advice.

    Example:
        >>> spread_remedies("dynamic", {"mode": "dynamic", "per_channel": True})
        ['static calibration instead of dynamic', 'an exclusion search (diag exclude)']
    """
    s = settings or {}
    if fmt in WEIGHT_ONLY_FORMATS or s.get("mode") == "weight_only":
        return [text for text, _ in weight_only_changes(s, None)] + [SEARCH_REMEDY]
    out = []
    if not s.get("per_channel"):
        out.append("per_channel=True")
    if fmt == "dynamic" or s.get("mode") == "dynamic":
        out.append("static calibration instead of dynamic")
    acts = str(s.get("activation_type", ""))
    if fmt != "dynamic" and s.get("mode") != "dynamic" and "16" not in acts:
        out.append("16-bit activations (QDQ)")
    return [*out, SEARCH_REMEDY]


def weight_only_changes(settings: dict[str, Any], last_matmul: str | None) -> list[tuple[str, dict[str, Any]]]:
    """(remedy text, recipe keys it sets) of each weight-only remedy that changes ``settings``.

    ``last_matmul``: the node the lm_head remedy puts at 8 bits (None: named in the text only; its
    change is then empty and :mod:`diag.fix.remedycheck` leaves it out).

    Example:
        >>> [t for t, _ in weight_only_changes({"block_size": 32, "accuracy_level": 4}, "head")][:2]
        ['a smaller block_size (16)', 'accuracy_level=0 (no int8 quantization of the input inside the kernel)']
    """
    out: list[tuple[str, dict[str, Any]]] = []
    block = settings.get("block_size")
    if not isinstance(block, int) or block > 16:
        smaller = max(16, (block or 32) // 2)
        out.append((f"a smaller block_size ({smaller})", {"block_size": smaller}))
    sym = settings.get("is_symmetric")
    if sym is not None:
        out.append((f"is_symmetric={not sym}", {"is_symmetric": not sym}))
    if settings.get("accuracy_level") not in (None, 0):
        out.append(("accuracy_level=0 (no int8 quantization of the input inside the kernel)", {"accuracy_level": 0}))
    if not settings.get("node_bits"):
        change = {"node_bits": {last_matmul: 8}} if last_matmul else {}
        # NOTE: named as the model's own node when known; "lm_head" only where a decoder has one
        # (an int4 encoder was told to keep "lm_head" at 8 bits: issue 42 item 5).
        head = f"the output head {last_matmul}" if last_matmul else "the output head (the last MatMul)"
        out.append((f"{head} at 8 bits (node_bits)", change))
    return out


def in_effect(suggestion: Suggestion, settings: dict[str, Any] | None) -> bool:
    """Whether re-quantizing with ``suggestion``'s delta gives the same recipe ``settings`` already has.

    Only top-level keys are compared (``per_channel``, ``calibrate_method``, ``quant_format``);
    ``extra_options`` and node lists count as a change unless ``settings`` holds them equal.

    Example:
        >>> s = Suggestion("w", "p", "per-channel-weights", {"per_channel": True}, "", "quantize_dynamic")
        >>> in_effect(s, {"per_channel": True})
        True
    """
    if not settings:
        return False
    return all(settings.get(k) == v for k, v in suggestion.recipe.items())


def applicable_suggestions(suggestions: list[Suggestion], settings: dict[str, Any] | None) -> list[Suggestion]:
    """``suggestions`` without those already in effect under the recipe ``settings``.

    A per-channel remedy dropped because ``per_channel`` is already on is replaced by its reason:
    the weights it names kept one scale because onnxruntime has no per-channel path for their op
    (or they are a scalar), so the suggestion becomes a node exclusion with that note.
    """
    out: list[Suggestion] = []
    for s in suggestions:
        if not in_effect(s, settings):
            out.append(s)
        elif s.remedy == "per-channel-weights" and s.consumers:
            out.append(
                in_producer_terms(
                    Suggestion(
                        s.tensor,
                        s.problem,
                        "exclude-consumers",
                        {"nodes_to_exclude": list(s.consumers)},
                        f"nodes_to_exclude={_py(list(s.consumers))}",
                        s.applies_to,
                        "per-channel weights are already in effect: this weight kept one scale because its "
                        "quantizer has no per-channel path for its op (or it is a scalar); keep the node in float "
                        "instead",
                        list(s.consumers),
                    ),
                    s.producer,
                )
            )
    return out
