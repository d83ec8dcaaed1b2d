"""Causes a user can switch that are not one node: recipe levers and structural groups.

Spread error is often one decision of the recipe, not one node: ``MatMulConstBOnly: False``
quantizes every activation x activation MatMul (a transformer's attention scores and context);
quantizing an op type quantizes every node of it. No single node recovers much when kept in
float, and the headline would say "no single root cause" while one line of the recipe is the
cause. So the effect check measures these groups like nodes: the group's float region spliced
into the user's INT8 model (:mod:`diag.core.surgery`), one run on the effect samples, the share
of the failing output's error removed. A group is named only with that measured effect.

The groups, each with the lever that switches it, in onnxruntime's terms:

* **activation x activation MatMuls** (both inputs computed, not weights): quantized only when
  ``MatMulConstBOnly`` is False (quantize_dynamic's default is True; quantize_static's is False);
* **every quantized node of one op type**, when the model quantizes several op types: what
  ``op_types_to_quantize`` without that type leaves in float;
* **one projection in every layer** of a transformer stack (``mlp/down_proj`` of layers 0..7, read
  off node names or torch's module scopes: :mod:`diag.analysis.decoder`), and **a whole layer**
  (the :data:`LAYER_GROUPS` layers with the worst local error): no recipe key switches these, so
  their fix is the ``nodes_to_exclude`` list that keeps exactly them in float;
* two **graph patterns**: the residual Adds (a transformer's residual stream, quantized at every
  Add in QDQ models) and the embedding Gathers (constant tables), their fix a node list as well.
  LayerNorm-adjacent MatMuls are not a group: in a pre-LN stack they are 4 of every 6 linear
  layers, over :data:`CAUSE_SHARE` of the model, which no fix keeps in float.

NOTE: a lever is worded from the INT8 format alone (dynamic vs static), never from a guess at the
recipe: an act x act MatMul quantized in a dynamic model means the recipe set the key to False.
A model another tool made (NNCF, ModelOpt, Quark, AIMET: :mod:`diag.foundations.producers`) gets
the switch in that tool's terms (NNCF's ``IgnoredScope(types=[...])``), or, where diag knows no
such switch, the group's nodes to keep in float with that tool's own exclusion list: an NNCF user
cannot set ``op_types_to_quantize``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import onnx

from diag.analysis.analyze import NodeFinding
from diag.analysis.decoder import layer_of, module_paths, projection_of
from diag.foundations.jsonnum import json_number
from diag.foundations.producers import ORT_RECIPE_PRODUCERS, PRODUCERS, op_types_change, type_fix_call

#: Formats whose quantizer has the ``MatMulConstBOnly`` key, and its default there.
CONST_B_ONLY_DEFAULT = {"dynamic": True, "qdq": False, "qoperator": False}
#: A lever group is a cause only when it holds less than this share of the quantized groups and weights.
CAUSE_SHARE = 0.5
#: A change (a float region or a recipe setting) that removes no more than this share of the error does not help.
HELPS_SHARE = 0.01
#: Layers measured as one group each (the worst by local error): a layer group costs one effect run.
LAYER_GROUPS = 2
#: A fix may keep at most this share of the quantized groups in float (more is the FP32 model
#: with a few quantized nodes left, not a fix): for exclusion lists and lever groups alike.
MAX_FLOAT_SHARE = 0.9


def nearly_all(in_float: int, quantized: int) -> bool:
    """Does keeping ``in_float`` of ``quantized`` groups in float leave (almost) nothing quantized?

    Example:
        >>> nearly_all(206, 207), nearly_all(7, 207), nearly_all(2, 2), nearly_all(1, 2)
        (True, False, True, False)
    """
    return (quantized > 0 and in_float >= quantized) or (quantized >= 10 and in_float > MAX_FLOAT_SHARE * quantized)


@dataclass(frozen=True)
class GroupCandidate:
    """Node groups the user switches with one recipe change, measured as one float region.

    Attributes:
        kind: ``"act_act_matmuls"``, ``"op_type"``, ``"projection"``, ``"layer"``, ``"residual_adds"`` or
            ``"embeddings"``.
        label: what the group is, for a sentence (``the 8 activation x activation MatMuls``).
        lever: the recipe setting that quantizes it (``MatMulConstBOnly=False``).
        fix: the change that leaves the group in float, in onnxruntime's terms.
        members: the quantized node groups it holds.
    """

    kind: str
    label: str
    lever: str
    fix: str
    members: tuple[NodeFinding, ...]
    #: Keeping the group in float leaves most of the model quantized: it holds under
    #: :data:`CAUSE_SHARE` of the quantized node groups and of their weights. Only such a group is
    #: named as the cause (every Conv of a 3-Conv net in float is the FP32 net, not a fix).
    small: bool = True
    #: ``fix`` is code the user pastes (``nodes_to_exclude=[...]``), not a sentence: shown as code.
    fix_is_code: bool = False

    @property
    def fp_nodes(self) -> list[str]:
        """Every FP32 node of the group, in graph order of the members (``nodes_to_exclude`` form)."""
        return [n for f in self.members for n in f.group.fp_nodes]


def group_candidates(
    fp: onnx.ModelProto, findings: list[NodeFinding], fmt: str, producer: str = "onnxruntime"
) -> list[GroupCandidate]:
    """The recipe-lever groups of the quantized ``findings`` worth measuring (see module doc).

    ``fmt``: the INT8 model's format family (``dynamic``, ``qdq``, ``qoperator``, ...). A group of
    one node is left out (the node's own effect measures it), and so is a group that holds (nearly)
    every quantized node (:func:`nearly_all`: in float, it is the FP32 model, not a fix).
    ``producer``: the key of the tool that made the INT8 model, whose terms the levers are worded in.

    Example:
        >>> [g.lever for g in group_candidates(fp.proto, result.findings, "dynamic")]  # doctest: +SKIP
        ['MatMulConstBOnly=False', 'op_types_to_quantize without MatMul']
    """
    quantized = [f for f in findings if f.group.quantized and (f.local is not None or f.accumulated is not None)]
    groups: list[GroupCandidate] = []
    act_act = _act_act_matmuls(fp, quantized)
    ort = producer in ORT_RECIPE_PRODUCERS
    if len(act_act) >= 2 and fmt in CONST_B_ONLY_DEFAULT and not nearly_all(len(act_act), len(quantized)):
        if ort:
            groups.append(_const_b_group(act_act, fmt))
        else:
            label = f"the {len(act_act)} activation x activation MatMuls"
            what = "activation x activation MatMuls quantized"
            groups.append(_own_exclusion_group(act_act, producer, "act_act_matmuls", label, what))
    by_type: dict[str, list[NodeFinding]] = {}
    for f in quantized:
        by_type.setdefault(f.group.op_types[0], []).append(f)
    if len(by_type) >= 2:
        for op, members in sorted(by_type.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            if len(members) < 2 or nearly_all(len(members), len(quantized)):
                continue
            groups.append(_op_type_group(op, members, sorted(t for t in by_type if t != op), producer))
    seen = {frozenset(g.fp_nodes) for g in groups}
    for g in [*_structural_groups(fp, quantized, producer), *_pattern_groups(fp, quantized, producer)]:
        if frozenset(g.fp_nodes) not in seen:
            seen.add(frozenset(g.fp_nodes))
            groups.append(g)
    weights = _weight_sizes(fp)
    total = sum(weights.get(n, 0) for f in quantized for n in f.group.fp_nodes)
    return [dataclasses.replace(g, small=_small(g, len(quantized), total, weights)) for g in groups]


def _op_type_group(op: str, members: list[NodeFinding], others: list[str], producer: str) -> GroupCandidate:
    """Every quantized node of ``op``, switched by the producer's change for op types
    (:func:`diag.foundations.producers.op_types_change`: onnxruntime's ``op_types_to_quantize``
    without it, NNCF's ``IgnoredScope(types=...)``, ...), or as nodes for its own exclusion list."""
    label = f"every quantized {op} ({len(members)})"
    ort = producer in ORT_RECIPE_PRODUCERS
    if not ort and type_fix_call(producer, [op]) is None:
        return _own_exclusion_group(members, producer, "op_type", label, f"{op} quantized")
    lever = f"op_types_to_quantize with {op}" if ort else f"{PRODUCERS[producer].name} quantizes every {op}"
    return GroupCandidate("op_type", label, lever, op_types_change(producer, [op], others), tuple(members))


def _structural_groups(fp: onnx.ModelProto, quantized: list[NodeFinding], producer: str) -> list[GroupCandidate]:
    """One projection across the layers, and the worst whole layers, of a transformer stack (module doc)."""
    paths = module_paths(fp)
    by_layer: dict[int, list[NodeFinding]] = {}
    by_projection: dict[str, dict[int, list[NodeFinding]]] = {}
    for f in quantized:
        first = f.group.fp_nodes[0] if f.group.fp_nodes else f.group.label
        path = paths.get(first, first)
        where = layer_of(path)
        if where is None:
            continue
        by_layer.setdefault(where[0], []).append(f)
        projection = projection_of(path)
        if projection is not None:
            by_projection.setdefault(projection, {}).setdefault(where[0], []).append(f)
    if len(by_layer) < 2:
        return []
    groups = []
    for projection, layers in sorted(by_projection.items()):
        members = [f for i in sorted(layers) for f in layers[i]]
        if len(layers) >= 2 and not nearly_all(len(members), len(quantized)):
            label = f"the {projection} projection of {len(layers)} layers"
            groups.append(
                _node_list_group("projection", label, f"{projection} quantized in every layer", members, producer)
            )
    worst = sorted(by_layer.items(), key=lambda kv: min(_local_db(f) for f in kv[1]))[:LAYER_GROUPS]
    for i, members in worst:
        if len(members) >= 2 and not nearly_all(len(members), len(quantized)):
            label = f"the {len(members)} quantized nodes of layer {i}"
            groups.append(_node_list_group("layer", label, f"layer {i} quantized", members, producer))
    return groups


def _pattern_groups(fp: onnx.ModelProto, quantized: list[NodeFinding], producer: str) -> list[GroupCandidate]:
    """Graph patterns quantized as a whole, each measured as one float region (module doc).

    * **residual Adds**: an Add of two computed tensors, one of which also feeds another node (the
      skip path fans out): a transformer's residual stream carries its outlier dimensions through
      every such Add, and a per-tensor scale on the stream rounds the other dimensions away;
    * **embedding Gathers**: a Gather reading a constant table (word, position and type embeddings).
    """
    constants = _constant_names(fp)
    readers: dict[str, int] = {}
    for n in fp.graph.node:
        for t in set(n.input):
            readers[t] = readers.get(t, 0) + 1
    by_name = {n.name: n for n in fp.graph.node if n.name}

    def residual(n: onnx.NodeProto) -> bool:
        computed = [t for t in n.input if t and t not in constants]
        return n.op_type == "Add" and len(computed) == 2 and any(readers.get(t, 0) >= 2 for t in computed)

    def embedding(n: onnx.NodeProto) -> bool:
        return n.op_type == "Gather" and len(n.input) == 2 and n.input[0] in constants

    groups = []
    for kind, test, noun in (
        ("residual_adds", residual, "residual Adds"),
        ("embeddings", embedding, "embedding Gathers"),
    ):
        members = [f for f in quantized if any(test(by_name[x]) for x in f.group.fp_nodes if x in by_name)]
        if len(members) >= 2 and not nearly_all(len(members), len(quantized)):
            label = f"the {len(members)} {noun}"
            groups.append(_node_list_group(kind, label, f"{noun} quantized", members, producer))
    return groups


def _constant_names(fp: onnx.ModelProto) -> set[str]:
    """Tensors the FP32 graph holds as constants: initializers and Constant node outputs."""
    return {i.name for i in fp.graph.initializer} | {
        o for n in fp.graph.node if n.op_type == "Constant" for o in n.output
    }


def _local_db(f: NodeFinding) -> float:
    """A finding's local SQNR (inf when unmeasured), to find the worst layers."""
    s = f.local if f.local is not None else f.accumulated
    return s.sqnr_db if s is not None and not math.isnan(s.sqnr_db) else math.inf


def _node_list_group(kind: str, label: str, what: str, members: list[NodeFinding], producer: str) -> GroupCandidate:
    """A structural group: no recipe key switches it, its fix is the node list in the producer's terms."""
    if producer not in ORT_RECIPE_PRODUCERS:
        return _own_exclusion_group(members, producer, kind, label, what)
    names = [n for f in members for n in f.group.fp_nodes]
    return GroupCandidate(kind, label, what, f"nodes_to_exclude={json.dumps(names)}", tuple(members), fix_is_code=True)


def _own_exclusion_group(members: list[NodeFinding], producer: str, kind: str, label: str, what: str) -> GroupCandidate:
    """A group whose switch diag knows only as a node list in the producer's own exclusion call."""
    name = PRODUCERS[producer].name
    return GroupCandidate(
        kind,
        label,
        f"{name}: {what}",
        f"keep these {len(members)} nodes in float with {name}'s own exclusion list "
        "(diag exclude --int8 words it in its terms and verifies it in your model)",
        tuple(members),
    )


def _weight_sizes(fp: onnx.ModelProto) -> dict[str, int]:
    """FP32 node name -> the elements of the initializers it reads (its weights)."""
    sizes = {i.name: int(math.prod(i.dims)) for i in fp.graph.initializer}
    return {n.name: sum(sizes.get(t, 0) for t in n.input) for n in fp.graph.node if n.name}


def _small(g: GroupCandidate, quantized: int, weights_total: int, weights: dict[str, int]) -> bool:
    """Under :data:`CAUSE_SHARE` of the quantized groups and of their weight elements."""
    held = sum(weights.get(n, 0) for n in g.fp_nodes)
    return len(g.members) < CAUSE_SHARE * quantized and (weights_total == 0 or held < CAUSE_SHARE * weights_total)


def _act_act_matmuls(fp: onnx.ModelProto, quantized: list[NodeFinding]) -> list[NodeFinding]:
    """Quantized MatMul groups whose FP32 MatMul reads two computed tensors (no weight)."""
    constants = _constant_names(fp)
    by_name = {n.name: n for n in fp.graph.node if n.name}
    out = []
    for f in quantized:
        nodes = [by_name.get(n) for n in f.group.fp_nodes]
        if any(
            n is not None and n.op_type == "MatMul" and len(n.input) == 2 and not set(n.input) & constants
            for n in nodes
        ):
            out.append(f)
    return out


def _const_b_group(members: list[NodeFinding], fmt: str) -> GroupCandidate:
    """The activation x activation MatMuls, with the ``MatMulConstBOnly`` change that leaves them float."""
    label = f"the {len(members)} activation x activation MatMuls"
    if CONST_B_ONLY_DEFAULT[fmt]:
        return GroupCandidate(
            "act_act_matmuls",
            label,
            "MatMulConstBOnly=False",
            "drop MatMulConstBOnly: False from extra_options (quantize_dynamic's default, True, keeps them in float)",
            tuple(members),
        )
    return GroupCandidate(
        "act_act_matmuls",
        label,
        "MatMulConstBOnly=False (quantize_static's default)",
        "extra_options={'MatMulConstBOnly': True} (quantize_static then keeps them in float)",
        tuple(members),
    )


# ---------------------------------------------------------------- recipe settings, re-quantized


#: The other 8-bit type of a ``QuantType`` name: what a ``weight_type`` / ``activation_type`` change tries.
OTHER_8BIT = {"QInt8": "QUInt8", "QUInt8": "QInt8"}


@dataclass(frozen=True)
class RecipeChange:
    """One setting of an onnxruntime recipe changed (``per_channel``: False -> True).

    Attributes:
        key: the ``quantize_*`` argument, or ``extra_options.<Key>`` for an extra option.
        before: the value the recipe has (onnxruntime's default when it does not set it).
        after: the value the change measures.
    """

    key: str
    before: Any
    after: Any

    @property
    def name(self) -> str:
        """The setting's name as the user writes it (``WeightSymmetric``, ``per_channel``)."""
        return self.key.removeprefix("extra_options.")

    @property
    def lever(self) -> str:
        """The setting as the recipe has it: ``per_channel=False``."""
        return f"{self.name}={self.before}"

    @property
    def setting(self) -> str:
        """The setting as the change makes it: ``per_channel=True``."""
        return f"{self.name}={self.after}"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "before": self.before, "after": self.after}


def recipe_changes(settings: dict[str, Any]) -> list[RecipeChange]:
    """The one-setting changes of an INT8 recipe worth measuring against spread error.

    The levers onnxruntime's quantizers read for every weight or activation, each in the direction
    that can help: ``per_channel`` off -> on, ``reduce_range`` on -> off (7-bit weights), the other
    8-bit ``weight_type`` (and ``activation_type``, static), and each symmetry switched
    (``WeightSymmetric``'s default follows the weight type: signed types are symmetric). Weight-only
    and fp16 recipes have their own family (:func:`diag.analysis.remedies.weight_only_changes`).

    Example:
        >>> [c.setting for c in recipe_changes({"mode": "dynamic", "weight_type": "QInt8"})]
        ['per_channel=True', 'weight_type=QUInt8', 'ActivationSymmetric=True', 'WeightSymmetric=False']
    """
    mode = settings.get("mode")
    if mode not in ("dynamic", "static"):
        return []
    out = []
    if not settings.get("per_channel"):
        out.append(RecipeChange("per_channel", False, True))
    if settings.get("reduce_range"):
        out.append(RecipeChange("reduce_range", True, False))
    weight_type = str(settings.get("weight_type") or "QInt8")
    if weight_type in OTHER_8BIT:
        out.append(RecipeChange("weight_type", weight_type, OTHER_8BIT[weight_type]))
    activation_type = str(settings.get("activation_type") or "QInt8")
    if mode == "static" and activation_type in OTHER_8BIT:
        out.append(RecipeChange("activation_type", activation_type, OTHER_8BIT[activation_type]))
    extra = settings.get("extra_options") or {}
    activation_symmetric = bool(extra.get("ActivationSymmetric", False))
    out.append(RecipeChange("extra_options.ActivationSymmetric", activation_symmetric, not activation_symmetric))
    weight_symmetric = bool(extra.get("WeightSymmetric", weight_type in ("QInt8", "QInt16", "QInt4")))
    out.append(RecipeChange("extra_options.WeightSymmetric", weight_symmetric, not weight_symmetric))
    return out


@dataclass(frozen=True)
class RecipeChangeEffect:
    """One recipe change re-quantized and measured on the effect check's samples and target.

    Attributes:
        change: the setting changed.
        recovered: share of the target's error energy removed (as an effect's); None: not measured.
        sqnr_after: per output (and part), the SQNR of the re-quantized model.
        identical: the change rebuilds the user's INT8 model byte for byte: it does nothing here.
        error: why it could not be measured ("" when it was).
    """

    change: RecipeChange
    recovered: float | None
    sqnr_after: dict[str, float] = dataclasses.field(default_factory=dict)
    identical: bool = False
    error: str = ""

    def clause(self) -> str:
        """``per_channel=True removes 97 %``-style words for a list (the target is said once, by the list)."""
        if self.identical:
            return f"{self.change.setting} changes nothing in this model (byte-identical)"
        if self.recovered is None:
            return f"{self.change.setting} could not be measured ({self.error})"
        if math.isinf(self.recovered):
            return f"{self.change.setting} creates NaN/Inf"
        if self.recovered < 0:
            return f"{self.change.setting} adds {-self.recovered:.0%}"
        return f"{self.change.setting} removes {self.recovered:.0%}"

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.change.to_dict(),
            "recovered": json_number(self.recovered) if self.recovered is not None else None,
            "sqnr_after": {k: json_number(v) for k, v in self.sqnr_after.items()},
            "identical": self.identical,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecipeChangeEffect:
        recovered = d.get("recovered")
        return cls(
            RecipeChange(str(d["key"]), d.get("before"), d.get("after")),
            float(recovered) if recovered is not None else None,
            {k: float(v) for k, v in (d.get("sqnr_after") or {}).items() if v is not None},
            bool(d.get("identical")),
            str(d.get("error") or ""),
        )


@dataclass(frozen=True)
class RecipeLevers:
    """The recipe's settings measured as causes: each changed alone, re-quantized, run on the effect
    check's samples (issue 42 item 1). Measured only after the recipe is proved to rebuild the
    user's INT8 model exactly: a change's "before" is then the user's model itself.

    Attributes:
        source: ``"given"`` (``--recipe``) or ``"inferred"`` (read back from the INT8 model).
        proof: the round trip's verdict in one line (:func:`diag.fix.roundtrip.roundtrip_line`), or
            why no round trip was tried.
        proved: the recipe rebuilds the user's INT8 model exactly; nothing is measured otherwise.
        target: the output (or part) the shares are of: the effect check's.
        samples: the effect check's samples.
        level: the onnxruntime optimization level the models ran at.
        effects: the changes, best first.
    """

    source: str
    proof: str
    proved: bool
    target: str
    samples: int
    level: str
    effects: tuple[RecipeChangeEffect, ...] = ()

    @property
    def best(self) -> RecipeChangeEffect | None:
        """The change that removes the most error, when it removes any."""
        measured = [e for e in self.effects if e.recovered is not None and not e.identical and e.recovered > 0]
        return max(measured, key=lambda e: e.recovered or 0.0) if measured else None

    @property
    def recipe_words(self) -> str:
        """Whose recipe was re-quantized, for a sentence."""
        return "your recipe" if self.source == "given" else "the recipe read back from your model"

    def line(self) -> str:
        """The one line terminal, summary.md and the report show; worded here and nowhere else.

        Example:
            >>> change = RecipeChangeEffect(RecipeChange("per_channel", False, True), 0.97)
            >>> RecipeLevers("inferred", "the recipe rebuilds your INT8 model exactly (6 quantized nodes)",
            ...     True, "y", 8, "all", (change,)).line()  # doctest: +NORMALIZE_WHITESPACE
            'recipe settings, each changed alone and re-quantized, on the error of y (8 samples, optimization level
            all): per_channel=True removes 97%; round trip: the recipe rebuilds your INT8 model exactly
            (6 quantized nodes)'
        """
        if not self.proved:
            return f"recipe settings not measured: {self.proof}"
        if not self.effects:
            return f"recipe settings: none to change ({self.proof})"
        listed = "; ".join(e.clause() for e in self.effects)
        return (
            f"recipe settings, each changed alone and re-quantized, on the error of {self.target} ({self.samples} "
            f"samples, optimization level {self.level}): {listed}; round trip: {self.proof}"
        )

    def remedies(self) -> str:
        """The spread-error headline's measured list: the changes that help, with their share, then
        those measured not to (issue 42 item 2: no advice without a measurement); "" when not measured."""
        if not self.proved or not self.effects:
            return ""
        helps = [e for e in self.effects if e.recovered is not None and not e.identical and e.recovered > HELPS_SHARE]
        failed = [e.change.setting for e in self.effects if e.recovered is None]
        rest = [e.change.setting for e in self.effects if e not in helps and e.recovered is not None]
        said = [f"{e.change.setting} (removes {e.recovered or 0.0:.0%} of the error of {self.target})" for e in helps]
        if rest:
            said.append(f"{'no recipe setting helps' if not helps else 'measured, does not help'}: {', '.join(rest)}")
        if failed:
            said.append(f"could not be measured: {', '.join(failed)}")
        return "; ".join(said)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "proof": self.proof,
            "proved": self.proved,
            "target": self.target,
            "samples": self.samples,
            "level": self.level,
            "effects": [e.to_dict() for e in self.effects],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecipeLevers:
        return cls(
            str(d.get("source") or ""),
            str(d.get("proof") or ""),
            bool(d.get("proved")),
            str(d.get("target") or ""),
            int(d.get("samples") or 0),
            str(d.get("level") or ""),
            tuple(RecipeChangeEffect.from_dict(e) for e in d.get("effects") or []),
        )
