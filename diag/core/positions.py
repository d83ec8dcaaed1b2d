"""Which sequence positions a statistic should count: padding masked out by the model's attention mask.

Sentence models pad every sample to a fixed length, and the pooled output (or the classifier
reading the first token) ignores the padding. A per-tensor statistic over every position is then
dominated by positions nothing downstream reads: on a real MiniLM layer, −5.7 dB over all tokens,
−11.8 dB on padding, 26.3 dB on the real tokens. So by default the error of every tensor that
carries a sequence axis is measured over the positions the mask keeps, and the all-positions
figure is kept beside it.

The rule that says which axis is the sequence is deliberately plain (a tensor's shape against the
mask's, batch by batch), so that a user can predict it: the mask is ``[batch, seq]``; a tensor
whose first axis is the batch and which has an axis of the sequence's length after it is masked
along the first such axis (``[batch, seq, hidden]``: axis 1; attention's ``[batch, heads, seq,
seq]`` and ``[batch, heads, seq, head_dim]``: axis 2, the query positions). Key positions of
attention scores are not masked: the mask's large negative value makes them equal in both models.
A tensor without such an axis (a pooled ``[batch, hidden]``) counts every value.

When the export names its dimensions (``attention_mask: [batch, sequence]``, as torch's exporters
and Optimum write it), the shapes ONNX infers from those names decide first
(:func:`symbolic_axes`): a ``[batch, heads, head_dim, sequence]`` Kᵀ whose head_dim equals the
sequence's length is masked on its last axis, and a pooled ``[batch, hidden]`` whose width equals
it counts every value; the shape rule above only decides where the names say nothing.

Guarantees: never changes a value; a batch whose mask keeps every position costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from diag.core.protos import structure_only
from diag.foundations.errors import DiagError

#: Input names read as an attention mask when ``--mask-input`` is not given (Hugging Face's name,
#: kept by every exporter and by Optimum).
AUTO_MASK_NAMES = ("attention_mask",)

_MASK_TYPES = {
    onnx.TensorProto.INT64,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.BOOL,
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
}


@dataclass(frozen=True)
class PositionMask:
    """The model input whose zeros mark padding, and how it was chosen."""

    #: The FP32 model's input name (``[batch, seq]``; non-zero = a real position).
    input_name: str
    #: ``"auto"`` (found by name, :data:`AUTO_MASK_NAMES`) or ``"--mask-input"``.
    chosen_by: str
    #: Tensors computed from the mask alone (its casts, its extended ``[batch, 1, 1, seq]`` form):
    #: counted at every position, since over the real positions they are a constant.
    derived: frozenset[str] = frozenset()
    #: The sequence axis of the tensors whose inferred shapes say it (:func:`symbolic_axes`);
    #: None: the shape says the tensor has none.
    axes: Mapping[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchPadding:
    """One batch's real positions, and which tensors are masked by them."""

    #: ``[batch, seq]``, True at a real position.
    keep: np.ndarray
    #: :attr:`PositionMask.derived`: never masked.
    derived: frozenset[str]
    #: No padding in this batch (read once per batch, not once per tensor).
    all_kept: bool = False
    #: :attr:`PositionMask.axes`.
    axes: Mapping[str, int | None] = field(default_factory=dict)

    def axis(self, name: str, shape: tuple[int, ...]) -> int | None:
        """The axis of tensor ``name`` the padding is masked along, or None when it counts every value.

        Example:
            >>> keep = np.ones((2, 4), bool)
            >>> BatchPadding(keep, frozenset(), axes={"kt": 3, "pooled": None}).axis("kt", (2, 2, 4, 4))
            3
            >>> BatchPadding(keep, frozenset(), axes={"pooled": None}).axis("pooled", (2, 4))  # shape rule: 1
        """
        if name in self.derived:
            return None
        if name in self.axes:
            axis = self.axes[name]
            batch, seq = self.keep.shape
            if axis is None or (len(shape) > axis and shape[0] == batch and shape[axis] == seq):
                return axis
        return sequence_axis(shape, self.keep)


@dataclass(frozen=True)
class Padding:
    """What a comparison left out: the mask input, and the positions it covered and marked padding."""

    input_name: str
    positions: int
    padding: int

    @property
    def share(self) -> float:
        """The fraction of positions that were padding (0 when none were counted)."""
        return self.padding / self.positions if self.positions else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"mask_input": self.input_name, "positions": self.positions, "padding": self.padding}

    def sentence(self) -> str:
        """The one wording of what was left out (terminal, summary.md and report.html print it).

        Example:
            >>> Padding("attention_mask", 1024, 640).sentence()[:60]
            'per-tensor errors count the 384 real positions of 1024: the '
        """
        if not self.padding:
            return f"per-tensor errors count every position: '{self.input_name}' marks no padding"
        real = self.positions - self.padding
        return (
            f"per-tensor errors count the {real} real positions of {self.positions}: the {self.share:.0%} padding "
            f"of '{self.input_name}' is left out (--no-mask counts it; diag.json has both figures)"
        )

    @classmethod
    def from_dict(cls, data: dict[str, object] | None) -> Padding | None:
        """The inverse of :meth:`to_dict` (None for a run that counted every position)."""
        if not data:
            return None
        return cls(str(data["mask_input"]), int(str(data["positions"])), int(str(data["padding"])))


def mask_for_model(graph: onnx.GraphProto, requested: str | None, disabled: bool) -> PositionMask | None:
    """The mask input of a model: ``requested`` (checked), else one found by name, else None.

    Raises ``bad-option`` when ``requested`` is not a rank-2 integer, bool or float input of the model.

    Example:
        >>> x = onnx.helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["b", "s"])
        >>> g = onnx.helper.make_graph([], "g", [x], [x])
        >>> mask_for_model(g, None, disabled=False).input_name
        'attention_mask'
        >>> mask_for_model(g, None, disabled=True) is None
        True
    """
    if disabled:
        if requested:
            raise DiagError(
                "bad-option", "--mask-input", "is given with --no-mask", "keep one: --no-mask counts every position"
            )
        return None
    inputs = {i.name: i for i in graph.input}
    if requested:
        value = inputs.get(requested)
        problem = _unfit(value) if value is not None else "is not an input of the FP32 model"
        if problem:
            names = ", ".join(sorted(inputs)[:8]) or "none"
            raise DiagError(
                "bad-option", f"--mask-input {requested}", problem, f"name a [batch, seq] input (inputs: {names})"
            )
        return PositionMask(requested, "--mask-input", _derived(graph, requested))
    for name in AUTO_MASK_NAMES:
        if name in inputs and not _unfit(inputs[name]):
            return PositionMask(name, "auto", _derived(graph, name))
    return None


def _derived(graph: onnx.GraphProto, mask: str) -> frozenset[str]:
    """Tensors whose every non-constant ancestor is the mask input (nodes in graph order)."""
    constant = {i.name for i in graph.initializer}
    derived = {mask}
    for node in graph.node:
        inputs = [i for i in node.input if i and i not in constant]
        if node.op_type == "Constant" or (inputs and all(i in derived for i in inputs)):
            (derived if node.op_type != "Constant" else constant).update(o for o in node.output if o)
    return frozenset(derived)


def _unfit(value: onnx.ValueInfoProto) -> str:
    """Why an input cannot be a padding mask ('' when it can)."""
    t = value.type.tensor_type
    if not value.type.HasField("tensor_type") or t.elem_type not in _MASK_TYPES:
        return "is not an integer, bool or float tensor"
    if t.HasField("shape") and len(t.shape.dim) != 2:
        return f"has rank {len(t.shape.dim)}, a mask is [batch, seq]"
    return ""


def kept_positions(feeds: dict[str, np.ndarray], mask: PositionMask | None) -> BatchPadding | None:
    """The batch's real positions, or None without a mask."""
    if mask is None or mask.input_name not in feeds:
        return None
    value = np.asarray(feeds[mask.input_name])
    if value.ndim != 2:
        return None
    keep = value != 0
    return BatchPadding(keep, mask.derived, bool(keep.all()), mask.axes)


def symbolic_axes(model: onnx.ModelProto, mask_input: str) -> dict[str, int | None]:
    """The sequence axis of every tensor whose inferred shape names it, from the mask's named dims.

    The mask input must be ``[B, S]`` with two different dimension names. A tensor whose inferred
    shape starts with ``B`` gets the first later axis named ``S``; one whose other dims are all
    fixed numbers gets None (it has no sequence axis). Any other tensor (a dim named otherwise, as
    ``past_sequence_length + sequence_length`` or a ``seq_len`` beside the mask's ``seq``, or one
    ONNX could not name) is left to the shape rule. Empty when the mask's dims are not named or
    shape inference fails.

    Example:
        >>> from onnx import TensorProto, helper
        >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])
        >>> m = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "s"])
        >>> y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])
        >>> mean = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
        >>> g = helper.make_graph([mean], "g", [x, m], [y])
        >>> symbolic_axes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), "attention_mask")
        {'x': 1, 'y': None}
        >>> g.input[0].type.tensor_type.shape.dim[1].dim_param = "seq_len"  # named otherwise: the shape rule
        >>> symbolic_axes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), "attention_mask")
        {'y': None}
    """
    inputs = {i.name: i for i in model.graph.input}
    mask = inputs.get(mask_input)
    dims = list(mask.type.tensor_type.shape.dim) if mask is not None else []
    if len(dims) != 2 or not dims[0].dim_param or not dims[1].dim_param or dims[0].dim_param == dims[1].dim_param:
        return {}
    batch, seq = dims[0].dim_param, dims[1].dim_param
    try:
        graph = onnx.shape_inference.infer_shapes(structure_only(model), strict_mode=False).graph
    except Exception:  # inference is a help, not a requirement: the shape rule decides
        return {}
    axes: dict[str, int | None] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type
        if value.name == mask_input or not value.type.HasField("tensor_type") or not t.HasField("shape"):
            continue
        shape = list(t.shape.dim)
        if not shape or shape[0].dim_param != batch:
            continue
        named = [i for i, d in enumerate(shape) if i > 0 and d.dim_param == seq]
        if named:
            axes[value.name] = named[0]
        elif all(d.HasField("dim_value") for d in shape[1:]):  # [batch, 768]: no sequence axis at all
            axes[value.name] = None
    return axes


def sequence_axis(shape: tuple[int, ...], keep: np.ndarray) -> int | None:
    """The axis of ``shape`` masked by ``keep`` (see the module doc), or None.

    Example:
        >>> keep = np.ones((2, 5), bool)
        >>> sequence_axis((2, 5, 8), keep), sequence_axis((2, 4, 5, 5), keep), sequence_axis((2, 8), keep)
        (1, 2, None)
    """
    batch, seq = keep.shape
    if len(shape) < 2 or shape[0] != batch:
        return None
    for axis in range(1, len(shape)):
        if shape[axis] == seq:
            return axis
    return None


def kept_values(value: np.ndarray, keep: np.ndarray, axis: int) -> np.ndarray:
    """The values of ``value`` at the positions ``keep`` marks real, in the tensor's own layout: the
    batch axis becomes 1 and ``axis`` holds every real position of the batch (a copy). A channel
    stays on its axis, so per-channel statistics read the result as they read the tensor.

    Example:
        >>> keep = np.array([[True, False], [True, True]])
        >>> x = np.arange(2 * 3 * 2).reshape(2, 3, 2)  # [batch, heads, seq]
        >>> kept_values(x, keep, 2).shape, kept_values(x, keep, 2)[0, 0].tolist()
        ((1, 3, 3), [0, 6, 7])
    """
    real = np.moveaxis(value, axis, 1)[keep]  # [positions, the other axes...]
    return np.moveaxis(real[None], 1, axis)
