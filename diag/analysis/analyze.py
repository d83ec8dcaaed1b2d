"""Turn per-tensor error into node findings: rankings, roles, output verdicts.

Two errors per node:

* **accumulated** - the node's output in the real INT8 model versus FP32: everything upstream
  included. Tells *where* the INT8 model is wrong.
* **local** - the node's INT8 version fed with the FP32 model's inputs: its own contribution.
  Tells *why*.

Roles (for nodes whose accumulated SQNR is below the "bad" threshold):

* ``root-cause``: the node's local error is itself bad (local SQNR below threshold);
* ``amplifier``: local error fine, but the node turns the error it receives into much more
  (accumulated SQNR at least ``AMPLIFY_DB`` below its worst input's);
* ``victim``: local error fine, it just inherits error from upstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import networkx as nx

from diag.analysis.headline import Name, Said
from diag.core.graph import input_tensors
from diag.core.match import NodeGroup
from diag.core.metrics import ErrorStats, OutputStats

T = TypeVar("T")

#: SQNR under which a tensor counts as badly quantized. ~ 4.6 bits of effective precision.
BAD_SQNR_DB = 20.0
#: A node "amplifies" when its output SQNR is this much below its worst input's SQNR.
AMPLIFY_DB = 6.0
#: A node whose output SQNR is within this of its worst input's merely passes error on.
INHERIT_DB = 1.0
#: No single root cause when the best local culprit explains less than this share of the
#: total local error energy among bad nodes.
SINGLE_CAUSE_SHARE = 0.5

#: Acceptance bands from the quantization guides our users follow (docs/verdict-bands.md).
BANDS = {
    "top1_agreement": {"excellent": 0.99, "acceptable": 0.95, "reject_below": 0.90},
    "max_abs": {"excellent": 0.1, "acceptable": 0.3, "reject_above": 0.5},
    "cosine_min": {"excellent": 0.999, "acceptable": 0.99, "reject_below": 0.98},
    "accuracy_drop": {"excellent": 0.005, "acceptable": 0.015, "reject_above": 0.02},
    # diag's own bands (docs/verdict-bands.md): a mask IoU reads like an agreement; a regression
    # error of 1 % of the output's range is invisible, 5 % moves a box by a visible margin.
    "mask_iou": {"excellent": 0.99, "acceptable": 0.95, "reject_below": 0.90},
    "rel_max_abs": {"excellent": 0.01, "acceptable": 0.03, "reject_above": 0.05},
}
GRADES = ("excellent", "acceptable", "marginal", "reject")


@dataclass
class NodeFinding:
    """One FP32 node (or fused group) with its accumulated and local error and its role."""

    group: NodeGroup
    index: int
    tensor: str
    accumulated: ErrorStats | None
    local: ErrorStats | None
    input_sqnr_db: float | None
    role: str = "ok"
    rank_accumulated: int = 0
    rank_local: int = 0
    #: Compared tensors the node reads (from other nodes; weights and model inputs excluded).
    inputs: tuple[str, ...] = ()
    #: Whether what the node writes reaches a model output or a quantized node's input directly.
    #: NOTE: a NaN/Inf counts only where it reaches one of those (see :func:`nonfinite_origins`):
    #: a causal mask writes -inf by design and Softmax turns it back into finite values.
    exposed: bool = True

    @property
    def amplification_db(self) -> float | None:
        """How many dB of SQNR the node loses relative to its worst input (positive = adds error)."""
        if self.accumulated is None or self.input_sqnr_db is None:
            return None
        if math.isinf(self.input_sqnr_db) and math.isinf(self.accumulated.sqnr_db):
            return 0.0
        return self.input_sqnr_db - self.accumulated.sqnr_db


@dataclass
class OutputVerdict:
    """Grade of one model output against the bands in :data:`BANDS`."""

    name: str
    stats: ErrorStats
    per_sample: OutputStats
    grade: str
    reasons: list[str]
    accuracy_fp32: float | None = None
    accuracy_int8: float | None = None

    @property
    def accuracy_drop(self) -> float | None:
        if self.accuracy_fp32 is None or self.accuracy_int8 is None:
            return None
        return self.accuracy_fp32 - self.accuracy_int8


def _worst(stats: list[ErrorStats]) -> ErrorStats | None:
    return min(stats, key=lambda s: s.sqnr_db) if stats else None


def node_findings(
    groups: list[NodeGroup],
    accumulated: dict[str, ErrorStats],
    local: dict[str, ErrorStats],
    graph: nx.DiGraph,
    outputs: Iterable[str] | None = None,
) -> list[NodeFinding]:
    """One finding per node group, ranked by accumulated and by local error, roles assigned.

    ``outputs`` (the model's output names) decides which findings are ``exposed``; ``None`` treats
    every finding as exposed (no NaN/Inf is then ever hidden).
    """
    findings: list[NodeFinding] = []
    quantized_nodes = {n for g in groups if g.quantized for n in g.fp_nodes}
    model_outputs = set(outputs) if outputs is not None else None
    for g in groups:
        outs = [o for o in g.outputs if o in accumulated]
        if not outs:
            continue
        worst_out = min(outs, key=lambda o: accumulated[o].sqnr_db)
        acc = accumulated[worst_out]
        loc = local.get(worst_out)
        head = g.fp_nodes[0]
        ins = [t for t in input_tensors(graph, head) if t in accumulated] if head in graph else []
        in_sqnr = min((accumulated[t].sqnr_db for t in ins), default=None)
        index = graph.nodes[g.key]["index"] if g.key in graph else 0
        exposed = model_outputs is None or any(
            o in model_outputs
            or any(
                d["tensor"] == o and v in quantized_nodes
                for n in g.fp_nodes
                if n in graph
                for _, v, d in graph.out_edges(n, data=True)
            )
            for o in g.outputs
        )
        findings.append(NodeFinding(g, index, worst_out, acc, loc, in_sqnr, inputs=tuple(ins), exposed=exposed))
    _rank(findings)
    for f in findings:
        f.role = classify(f)
    return findings


def _sort_key(value: float) -> float:
    return math.inf if math.isnan(value) else value


def inherits_error(f: NodeFinding) -> bool:
    """True when a node's output is about as bad as its worst input: it passes error on."""
    amp = f.amplification_db
    return amp is not None and amp < INHERIT_DB


def _rank(findings: list[NodeFinding]) -> None:
    # NOTE: accumulated error alone ranks a chain of victims (bias Add, GELU, ...) as high as the
    # node that introduced the error, in arbitrary order. Nodes that lose less than INHERIT_DB
    # relative to their worst input are therefore listed after the nodes that add error.
    by_acc = sorted(
        findings,
        key=lambda f: (inherits_error(f), _sort_key(f.accumulated.sqnr_db) if f.accumulated else math.inf, f.index),
    )
    for r, f in enumerate(by_acc, 1):
        f.rank_accumulated = r
    by_loc = sorted(findings, key=lambda f: (_sort_key(f.local.sqnr_db) if f.local else math.inf, f.index))
    for r, f in enumerate(by_loc, 1):
        f.rank_local = r


def classify(f: NodeFinding) -> str:
    """Role of one node: ok, root-cause, amplifier or victim (see module docstring)."""
    if f.accumulated is None or f.accumulated.sqnr_db >= BAD_SQNR_DB:
        return "ok"
    if f.local is not None and f.local.sqnr_db < BAD_SQNR_DB:
        return "root-cause"
    amp = f.amplification_db
    if amp is not None and amp >= AMPLIFY_DB:
        return "amplifier"
    return "victim"


def first_nonfinite(counts: Iterable[tuple[T, int, int]]) -> dict[str, T]:
    """The one NaN/Inf origin rule, over ``(node, FP32 count, INT8 count)`` in graph order.

    ``"FP32"`` is the first node whose FP32 output is non-finite (the float model itself is broken
    on these inputs); ``"INT8"`` the first whose INT8 output holds more non-finite values than
    FP32 (quantization created them, e.g. a Log or Div of a value rounded to zero). Used on
    findings (:func:`nonfinite_origins`) and on a diag.json's nodes (the report).

    Example:
        >>> first_nonfinite([("a", 0, 0), ("b", 0, 3), ("c", 2, 5)])
        {'INT8': 'b', 'FP32': 'c'}
    """
    origins: dict[str, T] = {}
    for node, fp, q in counts:
        if fp and "FP32" not in origins:
            origins["FP32"] = node
        if q > fp and "INT8" not in origins:
            origins["INT8"] = node
    return origins


def nonfinite_origins(findings: list[NodeFinding]) -> dict[str, NodeFinding]:
    """Where NaN/Inf first appear, per model (:func:`first_nonfinite` over the findings in graph order).

    Example:
        >>> nonfinite_origins(result.findings)["INT8"].group.label  # doctest: +SKIP
        'the_log'
    """
    return first_nonfinite(
        (f, a.nonfinite_fp, a.nonfinite_int8) for f in reaching_nonfinite(findings) if (a := f.accumulated) is not None
    )


def reaching_nonfinite(findings: list[NodeFinding]) -> list[NodeFinding]:
    """The findings, in graph order, whose NaN/Inf reach a model output or a quantized node's input.

    A walk back from every exposed finding that holds NaN/Inf, through the inputs that hold them
    too. A causal mask (``Where`` writing -inf or ``finfo.min`` into ``Add`` -> ``Softmax``) reaches
    neither: Softmax writes finite values, so nothing is said about it.

    Example:
        >>> [f.group.label for f in reaching_nonfinite(result.findings)]  # doctest: +SKIP
        ['the_log', 'head']
    """
    producer = {o: f for f in findings for o in f.group.outputs}

    def nonfinite(f: NodeFinding) -> bool:
        a = f.accumulated
        return a is not None and (a.nonfinite_fp > 0 or a.nonfinite_int8 > 0)

    seen: set[int] = set()
    stack = [f for f in findings if f.exposed and nonfinite(f)]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        stack += [p for t in f.inputs if (p := producer.get(t)) is not None and nonfinite(p)]
    return sorted((f for f in findings if id(f) in seen), key=lambda f: f.index)


#: Grades that fail: an output graded so is what the headline is about.
FAILING_GRADES = ("marginal", "reject")


def failing_outputs(verdicts: list[OutputVerdict]) -> list[OutputVerdict]:
    """The outputs a headline must be about, worst first: those with a failing grade when some
    outputs pass (silero VAD: ``output`` excellent, ``stateN`` reject), else none (every output
    fails, or none does: the whole model is the subject)."""
    failing = [v for v in verdicts if v.grade in FAILING_GRADES]
    if not failing or len(failing) == len(verdicts):
        return []
    return sorted(failing, key=lambda v: (-GRADES.index(v.grade), v.stats.sqnr_db, v.name))


def aimed_outputs(verdicts: list[OutputVerdict]) -> list[str]:
    """The outputs the effect check scores nodes on: the failing ones (:func:`failing_outputs`), else
    all; of those, the model's answers before its KV-cache outputs.

    A decoder step's ``present.*`` carry the same projections' error as its logits, one Concat
    later; scored on the cache with the lowest SQNR, the headline's "biggest contributor" was a
    k_proj that barely moved the tokens. The caches are the subject only when nothing else fails.

    Example:
        >>> import numpy as np
        >>> from diag.core.metrics import ErrorAccumulator, OutputStats
        >>> acc = ErrorAccumulator()
        >>> acc.update(np.ones(4, np.float32), np.full(4, 1.1, np.float32))
        >>> def v(name, grade, cache=None):
        ...     return OutputVerdict(name, acc.finalize(), OutputStats(4, 1, 1, 0, None, cache_of=cache), grade, [])
        >>> aimed_outputs([v("logits", "reject"), v("present.0.key", "marginal", "past.0.key"), v("x", "excellent")])
        ['logits']
        >>> aimed_outputs([v("logits", "excellent"), v("present.0.key", "marginal", "past.0.key")])
        ['present.0.key']
    """
    subject = [v.name for v in failing_outputs(verdicts)] or [v.name for v in verdicts]
    caches = {v.name for v in verdicts if v.per_sample.cache_of is not None}
    return [n for n in subject if n not in caches] or subject


def failing_clause(failing: list[OutputVerdict]) -> Said:
    """ "output stateN fails: min per-sample cosine 0.83000 (reject); " — the headline's subject.

    KV-cache outputs (``present.*``: one per layer and per key / value) are counted as one
    subject, named by the worst of them, so a 32-layer decoder's headline is one line. Output
    names are :class:`diag.analysis.headline.Name` parts.

    Example:
        >>> from diag.analysis.headline import plain
        >>> from diag.core.metrics import ErrorAccumulator, OutputStats
        >>> def v(name, cache=None):
        ...     stats = OutputStats(4, .9, .9, 0, None, cache_of=cache)
        ...     return OutputVerdict(name, ErrorAccumulator().finalize(), stats, "reject", ["cosine 0.9 (reject)"])
        >>> caches = [v("present.1.key", "past.1.key"), v("present.0.key", "past.0.key")]
        >>> print(plain(failing_clause([v("logits"), *caches])))  # doctest: +ELLIPSIS
        outputs logits (cosine 0.9 (reject)) and 2 KV-cache outputs (worst present.1.key: cosine 0.9 (reject)) ...
        >>> plain(failing_clause([v("logits")]))
        'output logits (cosine 0.9 (reject)) fails while the others pass; '
    """
    if not failing:
        return ()

    def reason(v: OutputVerdict) -> str:
        return next((r for r in v.reasons if r.endswith(f"({v.grade})")), v.reasons[0] if v.reasons else v.grade)

    caches = [v for v in failing if v.per_sample.cache_of is not None]
    parts: list[Said] = [(Name(v.name), f" ({reason(v)})") for v in failing if v.per_sample.cache_of is None]
    if len(caches) == 1:
        parts.append((Name(caches[0].name), f" ({reason(caches[0])})"))
    elif caches:  # failing is worst first: the first cache is the worst
        parts.append((f"{len(caches)} KV-cache outputs (worst ", Name(caches[0].name), f": {reason(caches[0])})"))
    one = len(failing) == 1
    listed: list[str | Name] = []
    for i, part in enumerate(parts):
        listed += [*([", " if i < len(parts) - 1 else " and "] if i else []), *part]
    return ("output " if one else "outputs ", *listed, f" {'fails' if one else 'fail'} while the others pass; ")


def upstream_of(findings: list[NodeFinding], outputs: Iterable[str]) -> list[NodeFinding]:
    """The findings whose error can reach ``outputs`` (the nodes that write them and their ancestors).

    A node that feeds only a passing output cannot be the cause of a failing one: the headline's
    candidates are restricted to these.
    """
    writer = {t: f for f in findings for t in f.group.outputs}
    seen: set[int] = set()
    stack = [w for t in outputs if (w := writer.get(t)) is not None]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        stack += [p for t in f.inputs if (p := writer.get(t)) is not None]
    return [f for f in findings if id(f) in seen]


def single_cause(findings: list[NodeFinding]) -> tuple[bool, str, NodeFinding | None]:
    """Whether one node explains most of the local error, with a sentence saying so (and the node
    the sentence names: the single cause, or the locally worst node when there is none)."""
    bad = [f for f in findings if f.local is not None and f.local.sqnr_db < BAD_SQNR_DB and f.group.quantized]
    if not bad:
        return False, "no node has a bad local error: the INT8 model adds only rounding-level noise", None
    # Error energy relative to signal: 10^(-SQNR/10).
    energy = sorted(((10 ** (-f.local.sqnr_db / 10), f) for f in bad if f.local), key=lambda t: -t[0])
    total = sum(e for e, _ in energy)
    top_e, top = energy[0]
    share = top_e / total if total > 0 else 1.0
    if len(bad) == 1 or share >= SINGLE_CAUSE_SHARE:
        return (
            True,
            f"single root cause: {top.group.label} ({share:.0%} of the local error of {len(bad)} bad node(s))",
            top,
        )
    return (
        False,
        f"no single root cause: {len(bad)} nodes have bad local error and the worst, "
        f"{top.group.label}, explains only {share:.0%} of it",
        top,
    )


def band_grade(value: float, metric: str) -> str:
    """Grade ``value`` with ``BANDS[metric]``; a band has ``reject_below`` (higher is better) or
    ``reject_above`` (lower is better). Values between acceptable and reject are "marginal"."""
    band = BANDS[metric]
    if "reject_below" in band:
        if value >= band["excellent"]:
            return "excellent"
        if value >= band["acceptable"]:
            return "acceptable"
        return "reject" if value < band["reject_below"] else "marginal"
    if value < band["excellent"]:
        return "excellent"
    if value < band["acceptable"]:
        return "acceptable"
    return "reject" if value > band["reject_above"] else "marginal"


def agreement_grades(
    per_sample: OutputStats, add: Callable[[float | None, str, str], None], grades: list[tuple[int, str]]
) -> None:
    """Top-1 agreement of a class-like output; for a sequence output (``[N, T, classes]``: a CTC or
    OCR head, token logits) per position, with the share of samples right at every position beside it.

    NOTE: a CTC line agrees as text when its decoded string does, which whole-sequence agreement
    understates (a shifted repeat or blank changes nothing once decoded) and per-position agreement
    overstates (one wrong character in 25 positions is 96% and a wrong word). Neither is graded as
    the text: a decoder is the user's (``--metric``, docs/sequence-outputs.md). The per-position
    figure is graded with the top-1 bands; the whole-sequence share is shown, not banded.
    """
    a = per_sample.top1_agreement
    if a is None:
        return
    if per_sample.positions is None or per_sample.sequence_agreement is None:
        add(a, "top1_agreement", f"top-1 agreement {a:.2%}")
        return
    n, positions = per_sample.samples, per_sample.positions
    add(a, "top1_agreement", f"per-position top-1 agreement {a:.2%} over {positions} positions of {n} samples")
    whole = round(per_sample.sequence_agreement * n)
    grades.append((0, f"{whole} of {n} samples agree at every position"))
    if per_sample.earliest_divergence is not None:
        grades.append(
            (
                0,
                f"first differing prediction at position {per_sample.earliest_divergence} at the earliest"
                f" (median {per_sample.median_divergence} over the {per_sample.diverged_samples} samples that differ)",
            )
        )
    if per_sample.kl_mean is not None and per_sample.kl_max is not None:
        kl = f"KL(FP32 || INT8) {per_sample.kl_mean:.4f} nats per position on average, {per_sample.kl_max:.3f} at worst"
        grades.append((0, kl))


def grade_output(
    name: str, stats: ErrorStats, per_sample: OutputStats, labelled: dict[str, int] | None = None
) -> OutputVerdict:
    """Grade one output with the metrics that mean something for its kind (``per_sample.kind``).

    logits: top-1 agreement and max abs error (logits bands); probabilities: top-1 agreement and
    min per-sample cosine; probability maps: mask IoU and cosine; embeddings: cosine; boxes and
    regression: cosine (boxes also max abs error relative to the output's largest magnitude); a detector
    (Concat of parts): each part by its own kind. Any sample with NaN/Inf rejects the output.
    Outputs of unknown kind keep the old rule (agreement when class-like, else cosine).
    """
    grades: list[tuple[int, str]] = []

    def add(value: float | None, metric: str, text: str) -> None:
        if value is None or math.isnan(value):
            return
        g = band_grade(value, metric)
        grades.append((GRADES.index(g), f"{text} ({g})"))

    kind = per_sample.kind
    broken = per_sample.nonfinite_samples
    if broken:
        # NOTE: the figures of the finite samples alone would read "max abs error 0.01 (excellent)"
        # next to NaN outputs. The NaN samples are the verdict; nothing else is graded.
        total = per_sample.total_samples or per_sample.samples + broken
        grades.append((GRADES.index("reject"), f"{broken} of {total} samples have NaN/Inf in the INT8 output"))
    elif per_sample.samples == 0:
        grades.append((GRADES.index("reject"), "no finite samples to compare"))
    elif kind == "detector" and per_sample.parts:
        for label, (part, acc, _local) in per_sample.parts.items():
            sub = grade_output(f"{name} {label}", acc, part)
            grades.append((GRADES.index(sub.grade), f"{label}: {'; '.join(sub.reasons)}"))
    elif kind in ("logits", None) and per_sample.top1_agreement is not None:
        agreement_grades(per_sample, add, grades)
        m = per_sample.max_abs
        add(m, "max_abs", f"max abs error {m:.3g}")
    elif kind == "probabilities":
        agreement_grades(per_sample, add, grades)
        c = per_sample.cosine_min
        add(c, "cosine_min", f"min per-sample cosine {c:.5f}")
    elif kind == "probability-map":
        if per_sample.mask_iou is not None:
            add(per_sample.mask_iou, "mask_iou", f"mask IoU (> 0.5) {per_sample.mask_iou:.2%}")
        c = per_sample.cosine_min
        add(c, "cosine_min", f"min per-sample cosine {c:.5f}")
    elif kind in ("boxes", "regression"):
        c = per_sample.cosine_min
        add(c, "cosine_min", f"min per-sample cosine {c:.5f}")
        r = per_sample.rel_max_abs
        if r is not None and kind == "boxes":
            add(r, "rel_max_abs", f"max abs error {per_sample.max_abs:.3g} = {r:.2%} of the largest |value|")
        elif r is not None:
            # NOTE: "regression" is also the kind of outputs diag cannot place: only the cosine is
            # graded; the relative error is shown, not banded (--output-kind NAME=boxes grades it).
            grades.append((0, f"max abs error {per_sample.max_abs:.3g} = {r:.2%} of the largest |value|"))
    else:
        c = per_sample.cosine_min
        add(c, "cosine_min", f"min per-sample cosine {c:.5f}")
    if kind != "detector" and per_sample.parts and not broken:
        # Parts of an output that is not a detector are still graded: a destroyed part must show.
        for label, (part, acc, _local) in per_sample.parts.items():
            if part.samples and part.cosine_min < BANDS["cosine_min"]["acceptable"]:
                sub = grade_output(f"{name} {label}", acc, part)
                grades.append((GRADES.index(sub.grade), f"part {label}: {'; '.join(sub.reasons)}"))
    acc_fp = acc_q = None
    if labelled and labelled["n"]:
        acc_fp = labelled["fp32"] / labelled["n"]
        acc_q = labelled["int8"] / labelled["n"]
        drop = acc_fp - acc_q
        g = band_grade(drop, "accuracy_drop")
        grades.append((GRADES.index(g), f"accuracy {acc_fp:.2%} -> {acc_q:.2%}, drop {drop:.2%} ({g})"))
    if stats.nonfinite_int8 > stats.nonfinite_fp and not per_sample.nonfinite_samples:
        grades.append((GRADES.index("reject"), f"{stats.nonfinite_int8} NaN/Inf values in INT8 output"))
    if not grades:
        grades.append((0, "identical"))
    worst = max(grades)[0]
    return OutputVerdict(name, stats, per_sample, GRADES[worst], [r for _, r in grades], acc_fp, acc_q)


def recommended_nodes(findings: list[NodeFinding]) -> tuple[list[str], list[str]]:
    """(FP32 node names to keep in float, unnamed root causes): the root causes, best local rank first.

    The one list a compare run suggests (its summary, report, ``diag.json`` and the estimate in
    :func:`diag.analysis.effects.estimate_list` all use it). Unnamed nodes only have diag's stand-in ids
    (``MatMul#2``), which ``nodes_to_exclude`` cannot take: they are listed apart. When the effect
    check refuted every locally bad node as *the* cause (each is a ``contributor``, none a root
    cause), the list is those nodes: together they may still help, and the estimate measures it.
    """
    roots = sorted((f for f in findings if f.role == "root-cause"), key=lambda f: f.rank_local)
    if not roots:
        roots = sorted(
            (f for f in findings if f.role == "contributor" and f.local is not None and f.local.sqnr_db < BAD_SQNR_DB),
            key=lambda f: f.rank_local,
        )
    exclude = [name for f in roots if f.group.quantized and not f.group.unnamed for name in f.group.fp_nodes]
    return exclude, [f.group.label for f in roots if f.group.unnamed]


def overall_grade(verdicts: list[OutputVerdict]) -> str:
    return GRADES[max((GRADES.index(v.grade) for v in verdicts), default=0)]


#: Longest error path followed back from an output (a guard for very deep graphs).
MAX_PATH = 500


def shortened_path(steps: list[T], ends: int, longest: int, more: str) -> list[T | str]:
    """The one rule for printing an error path: all of it up to ``longest`` steps, else the first
    and last ``ends`` steps around one ``more.format(n)`` step that counts the ``n`` left out.

    Example:
        >>> shortened_path(list("abcdefg"), 2, 5, "... {} more ...")
        ['a', 'b', '... 3 more ...', 'f', 'g']
    """
    if len(steps) <= longest:
        return list(steps)
    return [*steps[:ends], more.format(len(steps) - 2 * ends), *steps[-ends:]]


def error_paths(findings: list[NodeFinding], outputs: list[str]) -> dict[str, list[NodeFinding]]:
    """For each model output, the path of largest error back to where it entered, root first.

    From the node that writes the output, step to the input with the worst accumulated SQNR while
    the error was inherited (that input is within ``INHERIT_DB`` of the current node, or worse) or
    came from upstream (the input is bad and the current node is not a root cause). The walk stops
    at the root cause that added the error, or at a node that made good inputs bad (an amplifier).
    Outputs whose producer is not compared, or that are exact, get no path.

    Example:
        >>> [f.group.label for f in error_paths(result.findings, ["logits"])["logits"]]  # doctest: +SKIP
        ['conv3 (+relu3)', 'pool', 'flatten', 'fc']
    """
    writer: dict[str, NodeFinding] = {}
    for finding in findings:
        for t in finding.group.outputs:
            writer[t] = finding
    paths: dict[str, list[NodeFinding]] = {}
    for out in outputs:
        f = writer.get(out)
        if f is None or f.accumulated is None or math.isinf(f.accumulated.sqnr_db):
            continue
        path = [f]
        seen = {id(f)}
        while len(path) < MAX_PATH:
            preds = [writer[t] for t in f.inputs if t in writer and writer[t].accumulated is not None]
            preds = [p for p in preds if id(p) not in seen]
            if not preds:
                break
            worst = min(preds, key=lambda p: _sort_key(p.accumulated.sqnr_db))  # type: ignore[union-attr]
            w, here = worst.accumulated.sqnr_db, f.accumulated.sqnr_db  # type: ignore[union-attr]
            inherited = w <= here + INHERIT_DB
            from_upstream = w < BAD_SQNR_DB and f.role != "root-cause"
            if not (inherited or from_upstream):
                break
            path.append(worst)
            seen.add(id(worst))
            f = worst
        paths[out] = path[::-1]
    return paths
