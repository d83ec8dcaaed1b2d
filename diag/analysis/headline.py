"""The verdict's headline as typed data: what kind of answer it is, and the sentence worded once.

The headline used to be a finished sentence that later stages edited: the spread-error remedies
were swapped for the recipe's own (``str.replace``), the words "an exclusion search (diag
exclude)" for the command to run, then for "the exclusion search this report holds"; and the
terminal and the report read the kind of answer back by substring ("no single root cause",
"rounding-level"). Each edit silently did nothing when the sentence it looked for had changed
(issue 42 item 6). Here a headline is a :class:`Headline`: its :attr:`~Headline.kind`, the
clause its deciding function worded (:mod:`diag.analysis.effects`, :mod:`diag.analysis.analyze`,
:mod:`diag.analysis.fp16health`), and two typed slots the later stages *set*, never edit: the
spread-error remedies (:class:`SpreadRemedies`: the INT8 format, then the recipe once it is
known, then the remedies measured by re-quantizing) and the exclusion search it points to
(:class:`NextSearch`). :meth:`Headline.text` words the whole sentence, in this module only;
diag.json keeps both the sentence and the typed fields (``verdict.headline``).

The user's names inside a sentence (nodes, tensors, outputs, the command to run) are
:class:`Name` parts, never plain text: the terminal prints them as they are, summary.md as code
spans (a name copied from the raw Markdown is the model's own, ``self_attn/v_proj``, not
``self\\_attn``: issue 46) and report.html as ``<code>``, from the same parts (diag.json's
``verdict.headline.parts``, which :mod:`diag.report.view` renders).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from diag.analysis.remedies import GENERIC_SPREAD, SEARCH_REMEDY, WEIGHT_ONLY_FORMATS, spread_remedies

#: What a headline says, decided once after every grade is final:
#:
#: * ``single-cause``: one node is the cause (its measured effect, a destroyed Concat part, or the
#:   first FP16 node to overflow);
#: * ``likely``: the locally worst node, hedged: its effect on the outputs was not measured;
#: * ``lever``: a recipe lever's group of nodes is the measured cause (``MatMulConstBOnly=False``);
#: * ``setting``: a recipe setting, changed alone and re-quantized, is the measured cause (``per_channel=False``);
#: * ``refuted``: the locally worst node was measured and does not fix the outputs;
#: * ``spread``: no single root cause: the error accumulates over many nodes;
#: * ``rounding``: no node has a bad local error and the outputs grade well;
#: * ``no-local``: local error was not measured (``--no-local``), so no cause is named.
#: A fix listing more nodes than this is not written into the headline's sentence (:attr:`Headline.fix_code`).
NAMES_IN_SENTENCE = 4

HeadlineKind = Literal["single-cause", "likely", "lever", "setting", "refuted", "spread", "rounding", "no-local"]


@dataclass(frozen=True)
class Name:
    """A name from the user's model (or a command to run) inside a sentence: one part of :data:`Said`."""

    text: str


#: A sentence as parts: prose, and the names it mentions (:class:`Name`), in order.
Said = tuple["str | Name", ...]


def plain(said: Said) -> str:
    """The parts as one plain string (the terminal's form).

    Example:
        >>> plain(("single root cause: ", Name("conv2"), " (89%)"))
        'single root cause: conv2 (89%)'
    """
    return "".join(p.text if isinstance(p, Name) else p for p in said)


def group_name(fp_nodes: Sequence[str]) -> Said:
    """A node group's label (``conv3 (+relu3)``: the main node and what was fused into it) with each
    FP32 node a :class:`Name`, so that each copies as the model's own name.

    Example:
        >>> group_name(["conv3", "relu3"])
        (Name(text='conv3'), ' (+', Name(text='relu3'), ')')
        >>> plain(group_name(["a", "b", "c"]))
        'a (+b, c)'
    """
    first, *fused = fp_nodes
    if not fused:
        return (Name(first),)
    rest: list[str | Name] = []
    for i, node in enumerate(fused):
        rest += [", "] if i else []
        rest.append(Name(node))
    return (Name(first), " (+", *rest, ")")


@dataclass(frozen=True)
class ExcludeCommand:
    """The ``diag exclude`` command that verifies a suggested list, in parts: a merge of shards
    re-targets it without parsing the command back.

    Example:
        >>> print(ExcludeCommand("m.onnx", "q.onnx", "--inputs x.npz", "cosine>=0.99"))
        diag exclude m.onnx --int8 q.onnx --inputs x.npz --target 'cosine>=0.99'
    """

    fp32: str
    int8: str
    #: The input flags, already shell-quoted (``--inputs x.npz --batch 8``).
    feeds: str
    target: str
    #: ``--encodings``: AIMET's encodings file, when given elsewhere than beside ``int8``.
    encodings: str | None = None

    def __str__(self) -> str:
        encodings = f" --encodings {shlex.quote(self.encodings)}" if self.encodings else ""
        return (
            f"diag exclude {shlex.quote(self.fp32)} --int8 {shlex.quote(self.int8)}{encodings} {self.feeds} "
            f"--target {shlex.quote(self.target)}"
        )


@dataclass
class NextSearch:
    """The exclusion search a headline points to.

    Attributes:
        command: the exact command to run (None: named as "diag exclude" only, before the paths
            are known).
        held_here: the report is the exclusion search's own (``diag exclude`` writes its
            diagnosis): the command would name a work folder that is gone.
    """

    command: ExcludeCommand | None = None
    held_here: bool = False

    def words(self) -> Said:
        """The remedy's words in the headline; the command is a :class:`Name` (a code span in Markdown).

        Example:
            >>> plain(NextSearch().words()), plain(NextSearch(held_here=True).words())
            ('an exclusion search (diag exclude)', 'the exclusion search this report holds')
        """
        if self.held_here:
            return ("the exclusion search this report holds",)
        if self.command is not None:
            return ("an exclusion search: ", Name(str(self.command)))
        return (SEARCH_REMEDY,)


@dataclass
class SpreadRemedies:
    """The model-wide remedies a spread-error headline ends with.

    Attributes:
        fmt: the INT8 model's format family (weight-only formats get the weight-only family).
        settings: the recipe diag was given or inferred, once known (None before).
        recipe_known: whether :attr:`settings` was looked up (a model without a recipe keeps
            ``settings`` None but gets the list for its format).
        measured: the weight-only remedies re-quantized and measured, best first, as
            :meth:`diag.fix.remedycheck.RemedyChecks.text` words them ("" when not measured).
        measured_samples: the samples they were measured on.
    """

    fmt: str
    settings: dict[str, Any] | None = None
    recipe_known: bool = False
    measured: str = ""
    measured_samples: int = 0

    def words(self, search: NextSearch) -> Said:
        """The list, ``a, b, or c``, its last item the exclusion search as ``search`` words it."""
        if self.measured:
            return (
                f"{self.measured}, measured by re-quantizing on {self.measured_samples} samples; or ",
                *search.words(),
            )
        if self.recipe_known or self.fmt in WEIGHT_ONLY_FORMATS:
            items = spread_remedies(self.fmt, self.settings)[:-1]
        else:
            items = list(GENERIC_SPREAD)
        if not items:
            return search.words()
        return (", ".join(items) + ", or ", *search.words())


@dataclass
class Headline:
    """The verdict's headline (see the module doc).

    Attributes:
        kind: what it says (:data:`HeadlineKind`).
        cause: the clause its deciding function worded, without the subject and the remedies.
        subject: the failing outputs, when some pass and others fail ("output x fails while the
            others pass; "), else "".
        spread: the spread-error remedies that end the sentence (spread error only).
        search: the exclusion search the remedies point to.
        node: the FP32 label of the node it names: the cause (single-cause), the hedged cause
            (likely) or the refuted one (refuted); else "".
    """

    kind: HeadlineKind
    cause: Said
    subject: Said = ()
    spread: SpreadRemedies | None = None
    search: NextSearch = field(default_factory=NextSearch)
    node: str = ""
    #: The fix as code too long for the sentence (a group's ``nodes_to_exclude`` list of more than
    #: :data:`NAMES_IN_SENTENCE` nodes): the sentence counts the nodes and every surface shows this
    #: on its own, copyable line under it; "" when the sentence holds the whole fix.
    fix_code: str = ""

    @property
    def single_cause(self) -> bool:
        """One node is the cause (not a hedged guess, not a group)."""
        return self.kind == "single-cause"

    def said(self) -> Said:
        """The whole sentence as parts: subject, cause, then the spread-error remedies."""
        tail: Said = (". What fits spread error: ", *self.spread.words(self.search)) if self.spread is not None else ()
        return (*self.subject, *self.cause, *tail)

    def text(self) -> str:
        """The sentence, worded here and nowhere else (plain: the terminal's and diag.json's form).

        Example:
            >>> h = Headline("spread", "no single root cause",
            ...              spread=SpreadRemedies("dynamic", {"per_channel": True}, recipe_known=True))
            >>> h.text()  # doctest: +ELLIPSIS
            'no single root cause. What fits spread error: static calibration instead of dynamic, or an ...'
        """
        return plain(self.said())

    def to_dict(self) -> dict[str, Any]:
        """diag.json's ``verdict.headline``: the typed fields beside the sentence."""
        return {
            "kind": self.kind,
            "node": self.node or None,
            "subject": plain(self.subject),
            "cause": plain(self.cause),
            # The sentence as parts: a name (node, tensor, output, command) or prose, in order.
            "parts": [
                {"text": p.text, "name": True} if isinstance(p, Name) else {"text": p, "name": False}
                for p in self.said()
            ],
            "spread": asdict(self.spread) if self.spread is not None else None,
            "fix_code": self.fix_code or None,
            "search": {
                "command": asdict(self.search.command) if self.search.command is not None else None,
                "held_here": self.search.held_here,
            },
        }
