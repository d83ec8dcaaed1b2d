"""Root causes confirmed by their effect on the outputs: keep one node in float, measure again.

Local SQNR says which nodes quantize badly; it does not say whether the *outputs* care (a bad node
on a branch scaled down before a residual Add barely reaches them, and a node whose local error
looks moderate may destroy a small part of a detector output). So the headline cause is not
chosen from local error alone: for a handful of candidates — the worst local nodes, the nodes at
the root of each output's error path, and the heads that write the outputs (the Concat of a
detector output included) — diag builds the INT8 model with that one node's region computed in
float, runs it on the first few samples, and measures how much of the output error it removes.

"Region in float" is what ``nodes_to_exclude`` does in spirit: the FP32 node(s) of the group,
with their FP32 weights, read the INT8 model's float value of each input *before* that input was
quantized for them (the DynamicQuantizeLinear / Q-DQ pair is skipped; a QOperator integer input
is dequantized with its own scale), and the consumers read the float output (re-quantized with the
output's own scale where the consumer expects integers). No re-quantization, no calibration: one
INT8-sized run per candidate on ``samples`` inputs.

NOTE: the check never touches the models on disk; every candidate model is a new proto.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from diag.analysis.analyze import (
    BAD_SQNR_DB,
    NodeFinding,
    OutputVerdict,
    failing_clause,
    failing_outputs,
    single_cause,
    upstream_of,
)
from diag.analysis.headline import NAMES_IN_SENTENCE, Headline, Name, Said, SpreadRemedies, group_name
from diag.analysis.levers import HELPS_SHARE, GroupCandidate, RecipeLevers, group_candidates
from diag.analysis.remedies import Suggestion
from diag.core.feeds import FeedSource
from diag.core.instrument import exposed_model
from diag.core.load import LoadedModel
from diag.core.match import Matching
from diag.core.metrics import ErrorAccumulator, ErrorStats, OutputSpec
from diag.core.run import default_threads, run_batch, session_from_model
from diag.core.streaming import EFFECT_SAMPLES
from diag.core.surgery import float_region_model, node_reads, region_dirs
from diag.foundations.jsonnum import json_number
from diag.foundations.ortfacts import DEPLOY_LEVEL, EXACT_LEVEL
from diag.foundations.progress import Progress

#: Candidates checked by default: enough for the worst local nodes, the path roots and the heads.
DEFAULT_CANDIDATES = 8
#: Samples each candidate runs on (the first ones of the inputs).
DEFAULT_SAMPLES = EFFECT_SAMPLES
#: A node that removes at least this share of the worst output's error energy is a confirmed cause.
CONFIRMED_SHARE = 0.5
#: The best candidates are measured in exact mode too (one more run each), so a figure the fused
#: kernels change is shown beside the deployed one (issue 46).
EXACT_CANDIDATES = 3
#: Exact and deployed shares this far apart are shown side by side.
LEVELS_DISAGREE = 0.2
#: Effects are measured with the optimization level onnxruntime uses by default.
EFFECT_OPT_LEVEL = DEPLOY_LEVEL


@dataclass
class Effect:
    """What keeping one node group in float does to the outputs (on the first ``samples`` inputs)."""

    finding: NodeFinding
    #: Share of the target's error energy removed: 1 - Σe²(candidate) / Σe²(INT8). 1 = fully fixed.
    recovered: float
    #: Per output (and part, ``"out part"``): SQNR of the candidate model (the INT8 model's is in
    #: :attr:`EffectCheck.base`).
    sqnr_after: dict[str, float]
    why: list[str] = field(default_factory=list)
    #: The same share with onnxruntime's optimizations off (exact mode), for the best candidates
    #: (:data:`EXACT_CANDIDATES`); None when not measured there.
    exact_recovered: float | None = None

    @property
    def levels_disagree(self) -> bool:
        """Exact mode and the deployed level tell a different story (:data:`LEVELS_DISAGREE` apart)."""
        return self.exact_recovered is not None and abs(self.exact_recovered - self.recovered) >= LEVELS_DISAGREE

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.finding.group.label,
            "fp_nodes": list(self.finding.group.fp_nodes),
            "local_sqnr_db": json_number(self.finding.local.sqnr_db) if self.finding.local else None,
            "recovered": json_number(self.recovered),
            "exact_recovered": json_number(self.exact_recovered) if self.exact_recovered is not None else None,
            "sqnr_after": {k: json_number(v) for k, v in self.sqnr_after.items()},
            "why": self.why,
        }


@dataclass
class GroupEffect:
    """What keeping a whole recipe-lever group in float does to the outputs (:mod:`diag.analysis.levers`)."""

    group: GroupCandidate
    #: Share of the target's error energy removed, as :attr:`Effect.recovered`.
    recovered: float
    sqnr_after: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.group.kind,
            "label": self.group.label,
            "lever": self.group.lever,
            "fix": self.group.fix,
            "fp_nodes": self.group.fp_nodes,
            "recovered": json_number(self.recovered),
            "sqnr_after": {k: json_number(v) for k, v in self.sqnr_after.items()},
        }


@dataclass
class EffectCheck:
    """The candidates measured, best first, and the output (or part) they were measured on."""

    target: str
    effects: list[Effect]
    samples: int
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)
    #: Per output (and part): the INT8 model's error as given, on the same samples.
    base: dict[str, ErrorStats] = field(default_factory=dict)
    #: The FP32 outputs of the checked samples, kept for :func:`estimate_list` (not serialized):
    #: computing them again means loading the FP32 model once more (2 GB on a 500M decoder).
    reference: _OutputErrors | None = field(default=None, repr=False, compare=False)
    #: The onnxruntime optimization level the candidates (and the INT8 model) ran at: the deployed one.
    level: str = EFFECT_OPT_LEVEL
    #: Recipe-lever groups measured when no single node is confirmed, best first.
    groups: list[GroupEffect] = field(default_factory=list)

    @property
    def best_group(self) -> GroupEffect | None:
        return self.groups[0] if self.groups else None

    @property
    def sqnr_before(self) -> dict[str, float]:
        """Per output (and part): SQNR of the INT8 model as given."""
        return {k: s.sqnr_db for k, s in self.base.items()}

    @property
    def best(self) -> Effect | None:
        return self.effects[0] if self.effects else None

    def of(self, label: str) -> Effect | None:
        return next((e for e in self.effects if e.finding.group.label == label), None)

    def measure_model(self, model: Path, role: str, threads: int | None = None) -> tuple[float, dict[str, float]]:
        """Another INT8 model of the same FP32 model (the recipe re-quantized with one setting
        changed), run whole on this check's samples at its level, scored as a candidate: the share
        of the target's error it removes, and its SQNR per output (and part). Needs :attr:`reference`.
        """
        if self.reference is None:
            raise ValueError("the effect check's FP32 outputs are no longer kept")
        sess = session_from_model(model, role, self.level, threads or default_threads(), model.parent, takes_turns=True)
        got = self.reference.stats(sess, role)
        return _share_removed(self.base[self.target], got[self.target]), {k: s.sqnr_db for k, s in got.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "samples": self.samples,
            "level": self.level,
            "seconds": round(self.seconds, 2),
            "effects": [e.to_dict() for e in self.effects],
            "groups": [g.to_dict() for g in self.groups],
            "skipped": dict(self.skipped),
        }


def candidates_for(
    findings: list[NodeFinding],
    paths: dict[str, list[NodeFinding]],
    specs: dict[str, OutputSpec],
    limit: int = DEFAULT_CANDIDATES,
) -> list[tuple[NodeFinding, str]]:
    """The nodes worth checking, with why: worst local error, error-path roots, output heads.

    Example:
        >>> [(f.group.label, why) for f, why in candidates_for(r.findings, r.paths, specs)][:1]  # doctest: +SKIP
        [('layer1/ffn/fc1/MatMul', 'worst local SQNR 12.7 dB')]
    """
    chosen: dict[str, tuple[NodeFinding, list[str]]] = {}

    def add(f: NodeFinding, why: str) -> None:
        if not f.group.quantized or (f.local is None and f.accumulated is None):
            return
        chosen.setdefault(f.group.key, (f, []))[1].append(why)

    quantized = [f for f in findings if f.group.quantized and f.local is not None and not math.isinf(f.local.sqnr_db)]
    local_rank = sorted(quantized, key=lambda f: (f.local.sqnr_db if f.local else math.inf, f.index))
    for f in local_rank[: max(1, limit // 2)]:
        add(f, f"local SQNR {f.local.sqnr_db:.1f} dB (rank {f.rank_local})" if f.local else "local rank")
    for out, path in paths.items():
        if path:
            add(path[0], f"root of the error path to '{out}'")
    writer = {t: f for f in findings for t in f.group.outputs}
    for name, spec in specs.items():
        head = writer.get(name)
        if head is not None:
            add(head, f"writes output '{name}'")
        if spec.concat_node:
            c = next((x for x in findings if spec.concat_node in x.group.fp_nodes), None)
            if c is not None:
                add(c, f"Concat that builds '{name}' from parts")
    for f in local_rank[max(1, limit // 2) :]:
        if len(chosen) >= limit:
            break
        add(f, f"local SQNR {f.local.sqnr_db:.1f} dB (rank {f.rank_local})" if f.local else "local rank")
    return [(f, "; ".join(dict.fromkeys(why))) for f, why in chosen.values()]


#: A candidate model whose changed part holds more of its nodes than this share runs whole.
DOWNSTREAM_SHARE = 0.8
#: The most bytes of boundary values the INT8 run keeps for the downstream-only runs (all samples).
BOUNDARY_BYTES = 256 * 2**20


#: Producers a downstream part takes in with it, because onnxruntime fuses them into their reader.
_JOINS_ITS_READER = frozenset({"DequantizeLinear", "DynamicQuantizeLinear"})


@dataclass(frozen=True)
class _CandidateRuns:
    """How the effect check runs a candidate model: its downstream part when it has one and the
    INT8 run kept the boundary values (``known``, per batch), else the whole model."""

    measure: _OutputErrors
    threads: int
    region_dir: Path | None
    known: list[dict[str, np.ndarray]] | None
    #: onnxruntime's type string of every value the INT8 run returned
    types: dict[str, str]

    def stats(self, model: onnx.ModelProto, part: _Downstream | None, role: str) -> dict[str, ErrorStats]:
        if part is not None and self.known is not None:
            with contextlib.suppress(Exception):  # onnxruntime refuses the part: run the model whole
                sub = _downstream_model(model, part, self.types)
                sess = session_from_model(sub, role, EFFECT_OPT_LEVEL, self.threads, self.region_dir, takes_turns=True)
                return self.measure.stats(sess, role, self.known)
        sess = session_from_model(model, role, EFFECT_OPT_LEVEL, self.threads, self.region_dir, takes_turns=True)
        return self.measure.stats(sess, role)


@dataclass(frozen=True)
class _Downstream:
    """The part of a candidate model that differs from the INT8 model, and what it reads from the rest.

    A float region changes its own nodes and everything downstream of them; every other node is
    the INT8 model's own, reading the same values, so it computes what the INT8 model computes.
    The effect check runs the INT8 model once per sample keeping the ``boundary`` values, then
    runs only this part per candidate: the lm_head of a 22-layer decoder is one MatMul, not the
    model again (500M decoder, 8 candidates x 8 samples: most of the check's time).
    """

    #: indices of the part's nodes in the candidate model, in its order
    nodes: list[int]
    #: tensors the part reads that the rest of the model computes (graph inputs and weights aside)
    boundary: list[str]
    #: graph outputs the part computes (the others are the INT8 model's values)
    outputs: frozenset[str]


def _downstream(model: onnx.ModelProto, int8_nodes: set[bytes]) -> _Downstream | None:
    """The part of ``model`` (a float-region model) whose nodes are not the INT8 model's
    (``int8_nodes``: its nodes serialized), with everything downstream; None when that is most
    of the model (:data:`DOWNSTREAM_SHARE`) or nothing.

    A DequantizeLinear or DynamicQuantizeLinear feeding the part joins it: onnxruntime fuses
    DQ -> op -> Q into one integer op (and DynamicQuantizeLinear into the MatMul it feeds), and
    split between the two the part would compute that op another way (with the DQ in, the
    boundary values are exact integers; checked equal to whole runs in
    tests/test_effects_downstream.py).
    """
    nodes = list(model.graph.node)
    changed = [i for i, n in enumerate(nodes) if n.SerializeToString() not in int8_nodes]
    if not changed:
        return None
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in node_reads(n):
            readers.setdefault(t, []).append(i)
    part, stack = set(changed), list(changed)
    while stack:
        for o in nodes[stack.pop()].output:
            for r in readers.get(o, []):
                if r not in part:
                    part.add(r)
                    stack.append(r)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    for i in list(part):
        for t in node_reads(nodes[i]):
            p = producer.get(t)
            if p is not None and nodes[p].op_type in _JOINS_ITS_READER:
                part.add(p)
    if len(part) > DOWNSTREAM_SHARE * len(nodes):
        return None
    boundary = sorted({t for i in part for t in node_reads(nodes[i]) if t in producer and producer[t] not in part})
    written = {o for i in part for o in nodes[i].output}
    outputs = frozenset(o.name for o in model.graph.output if o.name in written)
    return _Downstream(sorted(part), boundary, outputs)


def _downstream_parts(
    q: onnx.ModelProto,
    cands: list[tuple[NodeFinding, str]],
    region: Callable[[NodeFinding], onnx.ModelProto],
) -> dict[str, _Downstream]:
    """Each candidate's :class:`_Downstream` part, by label (candidates that run whole are left out).

    Each region model is built here and dropped (the check builds it again to run it): holding
    every candidate's model at once would hold the INT8 model's proto that many times.
    """
    int8_nodes = {n.SerializeToString() for n in q.graph.node}
    parts: dict[str, _Downstream] = {}
    for f, _ in cands:
        try:
            part = _downstream(region(f), int8_nodes)
        except Exception:  # the check reports the region when it builds it again
            continue
        if part is not None:
            parts[f.group.label] = part
    return parts


def _downstream_model(model: onnx.ModelProto, part: _Downstream, types: dict[str, str]) -> onnx.ModelProto:
    """The nodes of ``part`` as a model of their own: the boundary tensors are graph inputs
    (element types from ``types``, onnxruntime's type strings), the weights they read come along."""
    g = model.graph
    keep = [g.node[i] for i in part.nodes]
    needed = {t for n in keep for t in node_reads(n)}
    sub = onnx.ModelProto()
    sub.ir_version = model.ir_version
    sub.opset_import.extend(model.opset_import)
    sub.functions.extend(model.functions)
    sg = sub.graph
    sg.name = g.name
    sg.node.extend(keep)
    sg.initializer.extend(i for i in g.initializer if i.name in needed)
    sg.sparse_initializer.extend(i for i in g.sparse_initializer if i.values.name in needed)
    sg.input.extend(i for i in g.input if i.name in needed)
    sg.input.extend(helper.make_tensor_value_info(t, _elem_type(types[t]), None) for t in part.boundary)
    sg.output.extend(o for o in g.output if o.name in part.outputs)
    return sub


def _elem_type(ort_type: str) -> int:
    """onnx's element type for onnxruntime's ``tensor(float16)``-style type string."""
    name = ort_type.removeprefix("tensor(").removesuffix(")")
    np_name = {"float": "float32", "double": "float64", "bool": "bool"}.get(name, name)
    return int(helper.np_dtype_to_tensor_dtype(np.dtype(np_name)))


@dataclass(frozen=True)
class EffectBudget:
    """How much an effect check may spend: candidates, samples, threads, and whether to show progress."""

    #: candidates checked (0: no check)
    candidates: int = DEFAULT_CANDIDATES
    #: samples each candidate runs on (the first ones of the inputs)
    samples: int = DEFAULT_SAMPLES
    threads: int | None = None
    progress: bool = True
    #: run only the part of each candidate model its float region changes, fed the INT8 model's
    #: values at its boundary (False: the whole model each time; same figures, see _downstream)
    downstream: bool = True
    #: the best candidates measured in exact mode too (0: none; compare sets 0 for models of
    #: LARGE_MODEL_BYTES of FP32 weights, whose effect check is already cut to 4 samples)
    exact: int = EXACT_CANDIDATES


def check_effects(  # NOTE: 9 parameters: the comparison's parts, as compare holds them, and its kept outputs
    fp: LoadedModel,
    q: LoadedModel,
    matching: Matching,
    feeds: FeedSource,
    findings: list[NodeFinding],
    paths: dict[str, list[NodeFinding]],
    specs: dict[str, OutputSpec],
    budget: EffectBudget = EffectBudget(),
    reference: list[dict[str, np.ndarray]] | None = None,
) -> EffectCheck | None:
    """Measure, for each candidate, how much output error keeping it in float removes.

    The target is the output — or Concat part — with the lowest SQNR in the INT8 model over the
    checked samples, among the outputs in ``specs`` (see :func:`effect_target`); every candidate is
    scored on it (and its SQNR on every output is kept). To aim the check at the outputs that fail
    (:func:`diag.analysis.analyze.failing_outputs`), pass only those in ``specs``, ``paths`` and the
    ``findings`` upstream of them. Returns None when there is nothing to check (no quantized
    candidate). Models with external data are read from their folders: only the candidates'
    FP32 weights are loaded, never a whole model. ``reference``: the FP32 outputs of the same
    first batches if the caller has them (the main pass keeps them, :mod:`diag.core.spill`); the
    FP32 model is then not loaded at all.

    Example:
        >>> check = check_effects(fp, q, m, feeds, r.findings, r.paths, specs)  # doctest: +SKIP
        >>> check.best.finding.group.label, round(check.best.recovered, 2)  # doctest: +SKIP
        ('conv3', 0.93)
    """
    if budget.candidates <= 0:
        return None
    start = time.perf_counter()
    cands = candidates_for(findings, paths, specs, budget.candidates)
    if not cands:
        return None
    threads = budget.threads or default_threads()
    batches, taken = _first_samples(feeds, budget.samples)
    # NOTE: measured as onnxruntime runs a model by default (all optimizations), because that is
    # where keeping a node in float pays off or not. Exact mode can disagree by a lot: on the
    # convnet fixture (QDQ), excluding conv2 takes the logits error from 0.12 to 0.002 with
    # optimizations off but to 0.147 with them on (onnxruntime fuses the remaining Q/DQ pairs).
    measure = _OutputErrors(fp, batches, specs, threads, reference)
    fp_dir, region_dir = region_dirs(fp, q)

    def region(f: NodeFinding) -> onnx.ModelProto:
        return float_region_model(fp.proto, q.proto, f.group.fp_nodes, matching, fp_dir=fp_dir)

    parts = _downstream_parts(q.proto, cands, region) if budget.downstream else {}
    keep = {t for part in parts.values() for t in part.boundary}
    # the outputs some candidate does not compute again come from the INT8 run as well
    keep |= {o.name for o in q.graph.output if any(o.name not in part.outputs for part in parts.values())}
    q_model = exposed_model(q.proto, sorted(keep - {o.name for o in q.graph.output})) if parts else q.proto
    q_sess = session_from_model(q_model, "INT8 model", EFFECT_OPT_LEVEL, threads, q.external_dir, takes_turns=True)
    base, known = measure.capture(q_sess, "INT8 model", keep, BOUNDARY_BYTES)
    runs = _CandidateRuns(measure, threads, region_dir, known, {o.name: o.type for o in q_sess.get_outputs()})
    del q_sess, q_model
    target = effect_target(base, list(specs))
    skipped: dict[str, str] = {}
    effects: list[Effect] = []
    bar = Progress(len(cands), "effect check", enabled=budget.progress)
    try:
        for f, why in cands:
            role = f"INT8 model with '{f.group.label}' in float"
            try:
                got = runs.stats(region(f), parts.get(f.group.label), role)
            except Exception as e:  # a region diag cannot rebuild is reported, never fatal
                skipped[f.group.label] = str(e).splitlines()[0][:200]
                bar.advance(1)
                continue
            effects.append(_effect(f, why, base[target], got, target))
            bar.advance(1)
    finally:
        bar.close()
    effects.sort(key=lambda e: (-e.recovered, e.finding.rank_local))
    if budget.exact > 0:
        _measure_exact(effects[: budget.exact], measure, q, target, threads, region, region_dir)
    groups: list[GroupEffect] = []
    if not effects or effects[0].recovered < CONFIRMED_SHARE:
        # No node alone explains the error: measure the groups one recipe change switches.
        for g in group_candidates(fp.proto, findings, q.format.family, q.producer_key()):
            role = f"INT8 model with {g.label} in float"
            try:
                model = float_region_model(fp.proto, q.proto, g.fp_nodes, matching, fp_dir=fp_dir)
                got = runs.stats(model, None, role)
            except Exception as e:  # a region diag cannot rebuild is reported, never fatal
                skipped[g.label] = str(e).splitlines()[0][:200]
                continue
            after = {k: s.sqnr_db for k, s in got.items()}
            groups.append(GroupEffect(g, _share_removed(base[target], got[target]), after))
        groups.sort(key=_cheapest_explanation_first)
    check = EffectCheck(target, effects, taken, time.perf_counter() - start, skipped, base, measure, EFFECT_OPT_LEVEL)
    check.groups = groups
    return check


def judge_remedies(suggestions: list[Suggestion], check: EffectCheck | None) -> None:
    """Give each ``nodes_to_exclude`` remedy the effect the check measured for those very nodes.

    A remedy that does not help (removes at most :data:`HELPS_SHARE` of the error, or adds to it)
    is no longer advised: it is listed as "measured, does not help" with the figure (issue 42 item
    2). Remedies whose nodes were not measured keep what they were (their note says nothing more).
    """
    if check is None:
        return
    measured: dict[frozenset[str], tuple[str, float]] = {
        frozenset(e.finding.group.fp_nodes): (e.finding.group.label, e.recovered) for e in check.effects
    }
    for g in check.groups:
        measured.setdefault(frozenset(g.group.fp_nodes), (g.group.label, g.recovered))
    for i, s in enumerate(suggestions):
        nodes = (s.recipe or {}).get("nodes_to_exclude")
        if set(s.recipe or {}) != {"nodes_to_exclude"} or not nodes:
            continue
        hit = measured.get(frozenset(str(n) for n in nodes))
        if hit is not None:
            suggestions[i] = _judged(s, *hit, check)


def _judged(s: Suggestion, label: str, recovered: float, check: EffectCheck) -> Suggestion:
    """``s`` with its measured effect and the sentence that words it (not advised when it does not help)."""
    # NOTE: the effect line beside it says the samples and the optimization level the check ran at.
    if recovered > HELPS_SHARE:
        note = f"measured: removes {recovered:.0%} of the error of {check.target}"
        return dataclasses.replace(s, measured=recovered, measured_note=note)
    if math.isinf(recovered):
        change = f"creates NaN/Inf in {check.target}"
    elif recovered < 0:
        change = f"adds {-recovered:.0%} to the error of {check.target}"
    else:
        change = f"removes only {max(recovered, 0.0):.0%} of the error of {check.target}"
    note = f"measured, does not help: keeping {label} in float {change}"
    return dataclasses.replace(s, measured=recovered, measured_note=note, advised=False)


def _measure_exact(
    effects: list[Effect],
    measure: _OutputErrors,
    q: LoadedModel,
    target: str,
    threads: int,
    region: Callable[[NodeFinding], onnx.ModelProto],
    region_dir: Path | None,
) -> None:
    """The same shares with optimizations off, for ``effects`` (the best few): where onnxruntime's fused
    integer kernels re-quantize what a float region keeps, the deployed share is low and the exact one
    high (a QDQ model's excluded Conv between remaining Q/DQ pairs), and the user must see both."""
    if not effects:
        return
    with contextlib.suppress(Exception):  # an extra figure: never fatal
        q_sess = session_from_model(
            q.proto, "INT8 model (exact)", EXACT_LEVEL, threads, q.external_dir, takes_turns=True
        )
        base = measure.stats(q_sess, "INT8 model (exact)")[target]
        del q_sess
        for e in effects:
            role = f"INT8 model with '{e.finding.group.label}' in float (exact)"
            sess = session_from_model(region(e.finding), role, EXACT_LEVEL, threads, region_dir, takes_turns=True)
            e.exact_recovered = _share_removed(base, measure.stats(sess, role)[target])


def _cheapest_explanation_first(g: GroupEffect) -> tuple[bool, float]:
    """Sort key of measured groups: those that explain the error (>= :data:`CONFIRMED_SHARE`) and leave
    most of the model quantized, fewest nodes in float first (the smallest change that works); then
    the rest, most error removed first."""
    if g.recovered >= CONFIRMED_SHARE and g.group.small:
        return False, float(len(g.group.fp_nodes))
    return True, -g.recovered


@dataclass
class ListEstimate:
    """What keeping a whole suggested list in float does to the effect check's target output.

    Measured like an :class:`Effect` (the list computed in float inside the INT8 model, on the
    effect check's samples, as onnxruntime runs it by default), never re-quantized and never on
    held-out samples: a starting point's estimate, not a verified fix (``diag exclude`` verifies).
    """

    nodes: list[str]
    target: str
    samples: int
    sqnr_before: float
    sqnr_after: float
    #: Share of the target's error energy removed (1 - Σe²(list) / Σe²(INT8); -inf: creates NaN/Inf).
    recovered: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "target": self.target,
            "samples": self.samples,
            "sqnr_before_db": json_number(self.sqnr_before),
            "sqnr_after_db": json_number(self.sqnr_after),
            "recovered": json_number(self.recovered),
            "opt_level": EFFECT_OPT_LEVEL,
        }


def estimate_list(
    fp: LoadedModel,
    q: LoadedModel,
    matching: Matching,
    feeds: FeedSource,
    nodes: list[str],
    check: EffectCheck | None,
    specs: dict[str, OutputSpec],
    threads: int | None = None,
) -> ListEstimate | None:
    """The measured effect of keeping every node of ``nodes`` in float, on ``check``'s target.

    A list that is one candidate the check already measured takes its figure; otherwise the list
    is spliced in float as a whole (one more session on the check's samples). None without a
    check, or when the region cannot be rebuilt (the list then stays a starting point, unmeasured).

    Example:
        >>> est = estimate_list(fp, q, m, feeds, ["conv3"], result.effects, specs)  # doctest: +SKIP
        >>> round(est.recovered, 2)  # doctest: +SKIP
        0.93
    """
    if check is None or not nodes or check.target not in check.base:
        return None
    before = check.base[check.target].sqnr_db
    same = next((e for e in check.effects if set(e.finding.group.fp_nodes) == set(nodes)), None)
    if same is not None:
        after = same.sqnr_after.get(check.target, math.nan)
        return ListEstimate(list(nodes), check.target, check.samples, before, after, same.recovered)
    threads = threads or default_threads()
    try:
        fp_dir, region_dir = region_dirs(fp, q)
        model = float_region_model(fp.proto, q.proto, list(nodes), matching, fp_dir=fp_dir)
        measure, taken = check.reference, check.samples  # the check's samples, FP32 outputs computed
        if measure is None:
            batches, taken = _first_samples(feeds, check.samples)
            measure = _OutputErrors(fp, batches, specs, threads)
        role = "INT8 model with the suggested list in float"
        sess = session_from_model(model, role, EFFECT_OPT_LEVEL, threads, region_dir)
        got = measure.stats(sess, "INT8 model with the suggested list in float")
    except Exception:  # a region diag cannot rebuild leaves the list unmeasured, never fatal
        return None
    if check.target not in got:
        return None
    recovered = _share_removed(check.base[check.target], got[check.target])
    return ListEstimate(list(nodes), check.target, taken, before, got[check.target].sqnr_db, recovered)


def _first_samples(feeds: FeedSource, samples: int) -> tuple[list[dict[str, np.ndarray]], int]:
    """The first batches holding at least ``samples`` samples (all, when there are fewer), and their count."""
    batches = []
    taken = 0
    for batch in feeds:
        batches.append(batch.feeds)
        taken += batch.size
        if taken >= samples:
            break
    return batches, taken


class _OutputErrors:
    """A model's error per output (and Concat part) against the FP32 outputs of the same batches.

    The FP32 outputs are computed once, here, and kept: ``samples`` is small (the first few
    inputs), and every candidate is measured against them. NOTE: the FP32 model runs in exact
    mode (the function every INT8 variant approximates, as in the main pass); only the INT8
    variants run as deployed. Optimizing it costs time and changed no figure of the golden reports
    (500M decoder: session 6.2 s at level all, 2.1 s in exact mode). ``reference``: those outputs
    already computed (by the main pass, in the same exact mode), one dict per batch of
    ``batches``; used only when it has every output of every batch.
    """

    def __init__(
        self,
        fp: LoadedModel,
        batches: list[dict[str, np.ndarray]],
        specs: dict[str, OutputSpec],
        threads: int,
        reference: list[dict[str, np.ndarray]] | None = None,
    ) -> None:
        self.names = [o.name for o in fp.graph.output]
        self.batches = batches
        self.specs = specs
        #: Whether the FP32 outputs came from the caller (no FP32 session was built).
        self.given = reference is not None and _covers(reference, batches, self.names)
        if self.given and reference is not None:
            self.refs = reference
            return
        fp_sess = session_from_model(fp.proto, "FP32 model", EXACT_LEVEL, threads, fp.external_dir, takes_turns=True)
        self.refs = [{k: v for k, v in run_batch(fp_sess, b, "FP32 model").items() if k in self.names} for b in batches]

    def stats(self, sess: Any, role: str, known: list[dict[str, np.ndarray]] | None = None) -> dict[str, ErrorStats]:
        """Run ``sess`` on the batches; its finalized error per output and per part (``"out part"``).

        ``known``: per batch, values a downstream-only session does not compute (see
        :func:`_downstream`): fed where it reads them, taken as outputs where it does not write them.
        """
        accs: dict[str, ErrorAccumulator] = {}
        for b, ref, got in self._runs(sess, role, known):
            self._update(accs, b, ref, got)
        return {k: a.finalize() for k, a in accs.items()}

    def capture(
        self, sess: Any, role: str, keep: set[str], limit: int
    ) -> tuple[dict[str, ErrorStats], list[dict[str, np.ndarray]] | None]:
        """:meth:`stats`, keeping each batch's values of ``keep`` for the downstream-only runs.

        The values kept are None when they would pass ``limit`` bytes over all batches (judged
        from the first batch): the candidates then run whole.
        """
        accs: dict[str, ErrorAccumulator] = {}
        kept: list[dict[str, np.ndarray]] | None = []
        for b, ref, got in self._runs(sess, role):
            if kept is not None:
                kept.append({k: v for k, v in got.items() if k in keep})
                if len(kept) == 1 and sum(v.nbytes for v in kept[0].values()) * len(self.batches) > limit:
                    kept = None
            self._update(accs, b, ref, got)
        return {k: a.finalize() for k, a in accs.items()}, kept

    def _runs(
        self, sess: Any, role: str, known: list[dict[str, np.ndarray]] | None = None
    ) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]]:
        """(batch, FP32 outputs, ``sess``'s values) per batch, ``known`` fed and merged as in :meth:`stats`."""
        wanted = {i.name for i in sess.get_inputs()} if known is not None else set()
        for i, (b, ref) in enumerate(zip(self.batches, self.refs, strict=True)):
            if known is None:
                yield b, ref, run_batch(sess, b, role)
            else:
                feeds = {k: v for k, v in [*b.items(), *known[i].items()] if k in wanted}
                yield b, ref, {**known[i], **run_batch(sess, feeds, role)}

    def _update(
        self,
        accs: dict[str, ErrorAccumulator],
        b: dict[str, np.ndarray],
        ref: dict[str, np.ndarray],
        got: dict[str, np.ndarray],
    ) -> None:
        for name in self.names:
            spec = self.specs.get(name)
            if spec is None:
                accs.setdefault(name, ErrorAccumulator()).update(ref[name], got[name])
                continue
            new_ref, new_got = spec.new_values(ref[name], b), spec.new_values(got[name], b)
            accs.setdefault(name, ErrorAccumulator()).update(new_ref, new_got)
            for p in spec.parts:
                sl = [slice(None)] * ref[name].ndim
                sl[spec.part_axis or 0] = slice(p.start, p.stop)
                key = f"{name} {p.label}"
                accs.setdefault(key, ErrorAccumulator()).update(ref[name][tuple(sl)], got[name][tuple(sl)])


def _covers(reference: list[dict[str, np.ndarray]], batches: list[dict[str, np.ndarray]], names: list[str]) -> bool:
    """Whether ``reference`` holds every output of every batch, with the batch's number of samples."""
    if len(reference) != len(batches):
        return False
    for ref, b in zip(reference, batches, strict=True):
        rows = {len(v) for v in b.values() if np.ndim(v)}
        for name in names:
            if name not in ref or (np.ndim(ref[name]) and rows and len(ref[name]) not in rows):
                return False
    return True


def effect_target(base: dict[str, ErrorStats], failing: Sequence[str] = ()) -> str:
    """The output (or ``"output part"``) the effect check scores candidates on: the lowest SQNR
    among the ``failing`` outputs and their parts, else among all.

    SQNR and grade disagree across output kinds: silero VAD's ``output`` (probabilities, graded
    excellent) has a lower SQNR than ``stateN`` (min per-sample cosine 0.83, reject). Measured on
    the lowest SQNR alone, the headline's "cause" fixed an output that did not need fixing.

    Example:
        >>> from diag.core.metrics import ErrorAccumulator
        >>> import numpy as np
        >>> def stats(noise):
        ...     acc = ErrorAccumulator()
        ...     acc.update(np.ones(4, np.float32), np.ones(4, np.float32) + noise)
        ...     return acc.finalize()
        >>> base = {"output": stats(0.5), "stateN": stats(0.1)}
        >>> effect_target(base), effect_target(base, ["stateN"])
        ('output', 'stateN')
    """
    keys = [k for k in base if any(k == f or k.startswith(f + " ") for f in failing)] or list(base)
    return min(keys, key=lambda k: (base[k].sqnr_db, k))


def _effect(f: NodeFinding, why: str, base: ErrorStats, got: dict[str, ErrorStats], target: str) -> Effect:
    """The share of ``target``'s error energy keeping ``f`` in float removes (-inf if it creates NaN/Inf)."""
    recovered = _share_removed(base, got[target])
    if math.isinf(recovered) and recovered < 0:
        why = f"{why}; creates NaN/Inf in {target}"
    return Effect(f, recovered, {k: s.sqnr_db for k, s in got.items()}, [why])


def _share_removed(base: ErrorStats, got: ErrorStats) -> float:
    """1 - Σe²(got) / Σe²(base) on the same samples; -inf when ``got`` creates NaN/Inf (the worst outcome)."""
    if got.nonfinite_int8 > base.nonfinite_int8:
        return -math.inf
    return 1.0 - got.mse / base.mse if base.mse > 0 else 0.0


#: A Concat part is "destroyed" when its SQNR is bad and this many dB below the whole output's.
HIDDEN_PART_DB = 10.0


def concat_cause(
    findings: list[NodeFinding],
    verdicts: list[OutputVerdict],
    specs: dict[str, OutputSpec],
    matching: Matching | None,
) -> tuple[NodeFinding, Said] | None:
    """The Concat that destroys one part of an output that its other parts keep looking fine.

    Boxes in pixels and scores in 0..1 share the Concat's one per-tensor scale: the scores round
    to a few grid steps while the whole output's SQNR (dominated by the pixels) looks healthy.
    """
    for v in verdicts:
        spec = specs.get(v.name)
        if spec is None or not spec.concat_node:
            continue
        concat = next((f for f in findings if spec.concat_node in f.group.fp_nodes), None)
        if concat is None:
            continue
        for label, (part, acc, local) in v.per_sample.parts.items():
            if acc.sqnr_db < BAD_SQNR_DB and v.stats.sqnr_db >= acc.sqnr_db + HIDDEN_PART_DB:
                pair = matching.pairs.get(v.name) if matching is not None else None
                scale = f" {pair.grid.per_tensor_scale:.3g}" if pair is not None and pair.grid is not None else ""
                where = f", local {local.sqnr_db:.1f} dB" if local is not None else ""
                return concat, (
                    "single root cause: ",
                    *group_name(concat.group.fp_nodes),
                    f" - part '{label}' of output '",
                    Name(v.name),
                    f"' is destroyed (SQNR {acc.sqnr_db:.1f} dB{where}, min cosine {part.cosine_min:.4f}) while the "
                    f"whole output reads {v.stats.sqnr_db:.1f} dB: the Concat's one output scale{scale} is set by its "
                    "largest part; keep the Concat in float or give the parts their own scales",
                )
    return None


def confirmed_cause(
    findings: list[NodeFinding],
    check: EffectCheck | None,
    grade: str,
    verdicts: list[OutputVerdict] | None = None,
    specs: dict[str, OutputSpec] | None = None,
    matching: Matching | None = None,
    fmt: str = "",
) -> Headline:
    """The headline from measured effects (falls back to local error when nothing was measured).

    ``fmt``: the INT8 model's format family, which decides the spread-error remedies named.

    Roles are updated to agree with the headline:
    under a single cause every other locally bad node becomes ``contributor`` (under a confirmed
    one its measured effect is in the check); otherwise roles stay as local error assigned them.

    When some outputs pass and others fail, the headline is about the failing ones (issue 25,
    item 5): it opens by naming them and only nodes upstream of them can be its cause.
    """
    failing = failing_outputs(verdicts or [])
    scope = upstream_of(findings, [v.name for v in failing]) if failing else findings
    headline = _headline(scope, check, grade, verdicts, specs, matching, fmt)
    if headline.single_cause:
        cause = next(f for f in scope if f.group.label == headline.node)
        _make_root_cause(findings, cause)  # a root cause feeding only passing outputs is no longer one
    headline.subject = failing_clause(failing)
    return headline


def _headline(
    findings: list[NodeFinding],
    check: EffectCheck | None,
    grade: str,
    verdicts: list[OutputVerdict] | None,
    specs: dict[str, OutputSpec] | None,
    matching: Matching | None,
    fmt: str = "",
) -> Headline:
    """:func:`confirmed_cause` over the nodes the headline may name."""
    bad_local = [f for f in findings if f.group.quantized and f.local is not None and f.local.sqnr_db < BAD_SQNR_DB]
    poor = grade in ("marginal", "reject")
    # A share of a negligible error is no cause: confirm only when there is something to explain.
    # NOTE: "something" is any grade short of excellent, bad local error or not: a measured effect
    # outranks the local-error rule of thumb (issue 46: every local SQNR >= 20 dB, and one node
    # kept in float removed 60 % of a speech encoder's output error).
    problem = bool(bad_local) or grade != "excellent"
    confirmed = problem and check is not None and check.best is not None and check.best.recovered >= CONFIRMED_SHARE
    part_cause = concat_cause(findings, verdicts or [], specs or {}, matching)
    best = check.best if check is not None else None
    if part_cause is not None and confirmed and best is not None and best.finding is not part_cause[0]:
        part_cause = None  # another node measurably fixes the outputs: the effect decides
    if part_cause is not None:
        return _concat_headline(findings, check, *part_cause)
    if check is None and not any(f.local is not None for f in findings if f.group.quantized):
        return Headline("no-local", _unmeasured_local_sentence(findings, poor))
    if check is None or check.best is None:
        one, _, top = single_cause(findings)
        if one and top is not None:
            # Without a measured effect a local-error cause is a guess: never "single root cause".
            return _likely_cause(findings, top, "its effect on the outputs was not measured")
        if not bad_local:
            return spread_sentence(_quantized(findings), None, fmt, findings) if poor else _rounding()
        assert top is not None  # several locally bad nodes, none measured: the worst is named
        share, bad = _local_share(findings, top)
        return Headline(
            "spread",
            (
                f"no single root cause: {bad} nodes have bad local error and the worst, ",
                *group_name(top.group.fp_nodes),
                f", explains only {share:.0%} of it",
            ),
        )
    if confirmed:
        return _confirmed_headline(findings, check, check.best, bad_local)
    group = check.best_group
    if problem and group is not None and group.recovered >= CONFIRMED_SHARE and group.group.small:
        return _group_headline(findings, check, group)
    return _unconfirmed_headline(findings, check, poor, bad_local, fmt)


def _group_headline(findings: list[NodeFinding], check: EffectCheck, group: GroupEffect) -> Headline:
    """A recipe lever is the cause: its group kept in float removes most of the error no node alone does.

    No node is the root cause then: a locally bad one is a contributor (its effect is in the check).
    """
    for f in findings:
        if f.role == "root-cause":
            f.role = "contributor"
    alone = max((e.recovered for e in check.effects), default=0.0)
    g = group.group
    long_list = g.fix_is_code and len(g.fp_nodes) > NAMES_IN_SENTENCE
    fix: Said = (Name(g.fix),) if g.fix_is_code and not long_list else (g.fix,)
    if long_list:  # a 22-name list would bury the sentence: counted here, shown whole under it
        fix = (f"keep its {len(g.fp_nodes)} nodes in float with nodes_to_exclude (the list is under this line)",)
    return Headline(
        "lever",
        (
            f"cause: {g.lever}: keeping {g.label} in float recovers {group.recovered:.0%} of the error of ",
            Name(check.target),
            f" on {check.samples} samples at optimization level {check.level}, one node alone at most "
            f"{max(alone, 0.0):.0%}; fix: ",
            *fix,
        ),
        fix_code=g.fix if long_list else "",
    )


def setting_headline(
    findings: list[NodeFinding], check: EffectCheck, levers: RecipeLevers, headline: Headline
) -> Headline:
    """The headline once the recipe's settings were measured (:class:`diag.analysis.levers.RecipeLevers`).

    A setting that, changed alone, removes at least :data:`CONFIRMED_SHARE` of the error, and at
    least as much as the node or group the headline names, is the cause: it keeps every node
    quantized, the cheapest fix there is. Otherwise a spread-error headline lists the settings with
    their measured shares instead of unmeasured advice. A single measured node stays the cause.
    """
    best = levers.best
    if headline.single_cause:
        return headline
    alone = max((e.recovered for e in check.effects), default=0.0)
    group = check.best_group
    named = group.recovered if headline.kind == "lever" and group is not None else alone
    if best is None or best.recovered is None or best.recovered < max(CONFIRMED_SHARE, named):
        if headline.spread is not None and levers.remedies():
            headline.spread.measured, headline.spread.measured_samples = levers.remedies(), levers.samples
        return headline
    for f in findings:
        if f.role == "root-cause":
            f.role = "contributor"
    cause: Said = (
        "cause: ",
        Name(best.change.lever),
        f": {levers.recipe_words} with ",
        Name(best.change.setting),
        f" instead, re-quantized, recovers {best.recovered:.0%} of the error of ",
        Name(check.target),
        f" on {check.samples} samples at optimization level {check.level}, one node alone at most "
        f"{max(alone, 0.0):.0%}; fix: ",
        Name(best.change.setting),
        f"; round trip: {levers.proof}",
        *amplifier_clause(findings),
    )
    return dataclasses.replace(headline, kind="setting", cause=cause, spread=None, node="", fix_code="")


def _unmeasured_local_sentence(findings: list[NodeFinding], poor: bool) -> Said:
    """``--no-local``: no claim about local error (none was measured), only where the accumulated error is worst."""
    measured = [f for f in findings if f.group.quantized and f.accumulated is not None]
    if not poor or not measured:
        return ("local error was not measured (--no-local), so no node is named",)
    worst = min(measured, key=lambda f: (f.accumulated.sqnr_db if f.accumulated else math.inf, f.index))
    assert worst.accumulated is not None
    return (
        "local error was not measured (--no-local), so no cause is named: the accumulated error is worst at ",
        *group_name(worst.group.fp_nodes),
        f" ({worst.accumulated.sqnr_db:.1f} dB); run without --no-local to find where it starts",
    )


def _quantized(findings: list[NodeFinding]) -> list[NodeFinding]:
    return [f for f in findings if f.group.quantized and f.local is not None]


def _make_root_cause(findings: list[NodeFinding], cause: NodeFinding) -> None:
    """``cause`` becomes the root cause; any other root cause is locally bad only: a contributor."""
    for other in findings:
        if other is cause:
            other.role = "root-cause"
        elif other.role == "root-cause":
            # Locally bad, but the outputs suffer from ``cause``: listed with its measured effect.
            other.role = "contributor"


def _concat_headline(
    findings: list[NodeFinding], check: EffectCheck | None, cause: NodeFinding, sentence: Said
) -> Headline:
    """A Concat that destroys one part of an output is the cause, with its measured effect when there is one."""
    e = check.of(cause.group.label) if check is not None else None
    if e is not None and check is not None:
        sentence += (
            f" (keeping it in float recovers {max(e.recovered, 0.0):.0%} of the error of ",
            Name(check.target),
            ")",
        )
    _make_root_cause(findings, cause)
    return Headline("single-cause", sentence, node=cause.group.label)


def _confirmed_headline(
    findings: list[NodeFinding], check: EffectCheck, best: Effect, bad_local: list[NodeFinding]
) -> Headline:
    """The best-measured node is the cause; say so when the worst local node is another one."""
    top_local = min(bad_local or [best.finding], key=lambda f: (f.rank_local, f.index))
    disagree: Said = ()
    if top_local is not best.finding and top_local.local is not None:
        e = check.of(top_local.group.label)
        measured = f"keeping it in float recovers only {max(e.recovered, 0):.0%}" if e else "it was not measured"
        disagree = (
            "; local error and output effect disagree: ",
            *group_name(top_local.group.fp_nodes),
            f" has the worst local SQNR ({top_local.local.sqnr_db:.1f} dB) but {measured}",
        )
    f = best.finding
    if not disagree and f.local is not None and f.local.sqnr_db >= BAD_SQNR_DB:
        # The headline names a node whose local SQNR passes the documented rule: say why, or the
        # "root cause" line under it reads as a contradiction (silero VAD: 27.9 dB).
        disagree = (
            f"; found by its effect, not its local error: its local SQNR {f.local.sqnr_db:.1f} dB is above "
            f"the {BAD_SQNR_DB:.0f} dB rule (a per-tensor SQNR is set by the largest channels and can hide "
            "error in the small ones)",
        )
    _make_root_cause(findings, f)
    return Headline(
        "single-cause",
        (
            "single root cause: ",
            *group_name(f.group.fp_nodes),
            f" (keeping it in float recovers {best.recovered:.0%} of the error of ",
            Name(check.target),
            f" on {check.samples} samples at optimization level {check.level})",
            *disagree,
        ),
        node=f.group.label,
    )


def _unconfirmed_headline(
    findings: list[NodeFinding], check: EffectCheck, poor: bool, bad_local: list[NodeFinding], fmt: str = ""
) -> Headline:
    """No measured node fixes the outputs: rounding noise, spread error, or a likely cause left unmeasured.

    NOTE: a node its own check refutes (kept alone in float, it removes less than
    :data:`CONFIRMED_SHARE` of the error) is never called a root cause, hedged or not (issue 46): the
    error is spread, and the headline says what was measured instead.
    """
    if not bad_local:
        return spread_sentence(_quantized(findings), check, fmt, findings) if poor else _rounding()
    one, _, _ = single_cause(findings)
    top_local = min(bad_local, key=lambda f: (f.rank_local, f.index))
    e = check.of(top_local.group.label)
    if one and e is None:
        return _likely_cause(findings, top_local, "its effect on the outputs was not measured")
    for f in findings:
        if f.role == "root-cause":
            f.role = "contributor"  # refuted by its measured effect: locally bad, not the cause
    if one and e is not None:
        share, bad = _local_share(findings, top_local)
        return Headline(
            "refuted",
            (
                "no single node to keep in float: ",
                *group_name(top_local.group.fp_nodes),
                f" has {share:.0%} of the local error of {bad} bad node(s), but keeping it alone in float recovers "
                f"only {max(e.recovered, 0.0):.0%} of the error of ",
                Name(check.target),
                f" (measured on {check.samples} samples at optimization level {check.level}; see the remedies for "
                "its tensors)",
                *levels_clause(check),
                *amplifier_clause(findings),
            ),
            node=top_local.group.label,
        )
    return spread_sentence(_quantized(findings), check, fmt, findings)


def _rounding() -> Headline:
    """Nothing is wrong: no node has a bad local error and the outputs grade well."""
    return Headline("rounding", ("no node has a bad local error: the INT8 model adds only rounding-level noise",))


def levels_clause(check: EffectCheck | None) -> Said:
    """``; in exact mode keeping conv2 in float recovers 98%, as deployed 0%: ...``, or ``""``.

    A node whose float region works in exact mode but not as deployed (onnxruntime's fused integer
    kernels quantize it again around the remaining Q/DQ pairs) is the fix a user would try first
    and see fail: said where the headline refutes the nodes (issue 46).
    """
    if check is None:
        return ()
    hidden = [e for e in check.effects if e.levels_disagree and (e.exact_recovered or 0) >= CONFIRMED_SHARE]
    if not hidden:
        return ()
    e = max(hidden, key=lambda x: x.exact_recovered or 0.0)
    return (
        "; in exact mode (optimizations off) keeping ",
        *group_name(e.finding.group.fp_nodes),
        f" in float recovers {e.exact_recovered:.0%}, as deployed {max(e.recovered, 0.0):.0%}: onnxruntime's fused "
        "integer kernels quantize its float region again",
    )


def _local_share(findings: list[NodeFinding], top: NodeFinding) -> tuple[float, int]:
    """``top``'s share of the local error energy of the locally bad quantized nodes, and their count."""
    bad = [f for f in findings if f.local is not None and f.local.sqnr_db < BAD_SQNR_DB and f.group.quantized]
    energy = {id(f): 10 ** (-f.local.sqnr_db / 10) for f in bad if f.local}
    total = sum(energy.values())
    return (energy.get(id(top), 0.0) / total if total > 0 else 1.0), len(bad)


def _likely_cause(findings: list[NodeFinding], top: NodeFinding, why: str) -> Headline:
    """The locally worst node as a hedged cause, when nothing measured it: ``likely root cause (by local error)``."""
    share, bad = _local_share(findings, top)
    return Headline(
        "likely",
        (
            "likely root cause (by local error): ",
            *group_name(top.group.fp_nodes),
            f" ({share:.0%} of the local error of {bad} bad node(s)); not confirmed: {why} (see the remedies for "
            "its inputs)",
        ),
        node=top.group.label,
    )


def amplifier_clause(findings: Sequence[NodeFinding]) -> Said:
    """``; amplified by X (Softmax on near-tied logits): inputs at 33.0 dB, output at 6.0 dB``, or ``""``.

    The node that loses the most SQNR between its worst input and its output, when it loses at
    least :data:`diag.analysis.analyze.AMPLIFY_DB`: spread error is often small everywhere and made
    large by one pattern (a Softmax over near-tied scores turns a small error into a big one).
    """
    amps = [f for f in findings if f.role == "amplifier" and f.amplification_db is not None and f.accumulated]
    if not amps:
        return ()
    f = max(amps, key=lambda x: (x.amplification_db or 0.0, -x.index))
    assert f.accumulated is not None and f.input_sqnr_db is not None
    pattern = " (Softmax on near-tied logits)" if "Softmax" in f.group.op_types else f" ({f.group.op_type})"
    return (
        "; amplified by ",
        *group_name(f.group.fp_nodes),
        f"{pattern}: inputs at {f.input_sqnr_db:.1f} dB, output at {f.accumulated.sqnr_db:.1f} dB",
    )


def spread_sentence(
    quantized: list[NodeFinding], check: EffectCheck | None, fmt: str = "", findings: Sequence[NodeFinding] = ()
) -> Headline:
    """ "No single root cause: error accumulates over N quantized nodes", with the biggest contributors;
    the remedies for the INT8 format ``fmt`` end it (:class:`diag.analysis.headline.SpreadRemedies`,
    made specific to the recipe once it is known)."""
    tail: Said
    if check is not None and check.effects:
        top = [e for e in check.effects[:3] if e.recovered > 0]
        tail = (
            f"; keeping one node in float recovers at most {check.effects[0].recovered:.0%} of the error of ",
            Name(check.target),
        )
        if top:
            tail += (
                " (biggest contributors: ",
                *_listed([(e.finding.group.fp_nodes, f"{e.recovered:.0%}") for e in top]),
                ")",
            )
    else:
        worst = sorted(quantized, key=lambda f: f.local.sqnr_db if f.local else math.inf)[:3]
        tail = (
            "; worst local SQNR: ",
            *_listed([(f.group.fp_nodes, f"{f.local.sqnr_db:.1f} dB") for f in worst if f.local]),
        )
    group = check.best_group if check is not None else None
    alone = max((e.recovered for e in check.effects), default=0.0) if check is not None else 0.0
    if group is not None and group.recovered > alone:
        tail += (
            f"; keeping {group.group.label} in float ({group.group.lever}) recovers {max(group.recovered, 0.0):.0%}",
        )
    tail += (*levels_clause(check), *amplifier_clause(findings))
    # NOTE: the recipe is not known here (it is inferred on the fix side); diag.cli.verbs.diagnose
    # sets it on the remedies, which then list only what changes something for the model's recipe.
    return Headline(
        "spread",
        (f"no single root cause: error accumulates over {len(quantized)} quantized nodes", *tail),
        spread=SpreadRemedies(fmt),
    )


def _listed(items: list[tuple[Sequence[str], str]]) -> Said:
    """``a (12%), b (5%)``: each node group's label as :func:`~diag.analysis.headline.group_name`
    parts, its figure in parentheses.

    Example:
        >>> from diag.analysis.headline import plain
        >>> plain(_listed([(["a"], "12%"), (["b", "c"], "5%")]))
        'a (12%), b (+c) (5%)'
    """
    out: list[str | Name] = []
    for i, (nodes, figure) in enumerate(items):
        out += [", "] if i else []
        out += [*group_name(nodes), f" ({figure})"]
    return tuple(out)
