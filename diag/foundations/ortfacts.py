"""What onnxruntime defines that several diag modules read: its quantized ops' input signatures, its
quantization formats (one row of facts per format kind) and its graph optimization levels, written once.

Every module that reads a quantized op's inputs (``load``'s format detection, ``match``'s grids,
``weights``' dequantizing, ``infer``'s recipe, ``cpu`` and ``saturation``'s u8s8 weights) derives
its view from :data:`QUANTIZED_OPS`; ``tests/test_ortfacts.py`` checks every signature against the
op schemas of the installed onnxruntime (``com.microsoft`` ops included, which ``onnx.defs`` lacks).
The modules that branch on a model's format kind (``load``, ``match``, ``weights``, ``infer``,
``remedies``, ``fixcode``) read :data:`FORMATS` instead of spelling the kinds in tuples.

A foundation module: it imports nothing from diag, and nothing heavy (``cli`` reads the levels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

#: The quantization formats whose quantizers (or optimizers) write an op.
Family = Literal["dynamic", "qoperator", "qdq", "nbits"]


@dataclass(frozen=True)
class Operand:
    """Where one operand of a quantized op is: its input index and its grid's (None: not an input).

    Dynamic integer ops (``MatMulInteger``, ``ConvInteger``) take no scale: it is computed at run
    time and applied downstream.
    """

    index: int
    scale: int | None
    zero_point: int | None


@dataclass(frozen=True)
class QuantizedOp:
    """One op that exists only in quantized graphs, by its onnxruntime schema.

    Attributes:
        op_type: the op's name.
        domain: its schema's domain (``""`` = ai.onnx).
        family: the format whose tool writes it (see :data:`Family`).
        inputs: the schema's input names, in order (checked against onnxruntime by a test).
        operands: the inputs it computes with, first the activation, then the second operand (the
            weight of a weighted op); each one's scale and zero point are the inputs named
            ``<operand>_scale`` / ``<operand>_zero_point`` (case as the schema spells it, or not).
        output: the stem of its output's grid inputs (``y`` -> ``y_scale``, ``y_zero_point``);
            None when its output is float.
        bias: the int32 bias input (scale = activation scale x weight scale, zero point 0).
        float_op: the FP32 op it computes.
        weighted: its second operand is a weight, quantized with the recipe's ``weight_type``.
        u8s8: onnxruntime runs it on MLAS's integer GEMM, whose AVX2 kernels without VNNI
            saturate on u8 x s8 products (:mod:`diag.foundations.cpu`).
    """

    op_type: str
    domain: str
    family: Family
    inputs: tuple[str, ...]
    operands: tuple[str, ...] = ()
    output: str | None = None
    bias: str | None = None
    float_op: str | None = None
    weighted: bool = False
    u8s8: bool = False

    def _index(self, name: str) -> int | None:
        lowered = [i.lower() for i in self.inputs]
        return lowered.index(name.lower()) if name.lower() in lowered else None

    def operand(self, position: int) -> Operand:
        """The operand at ``position`` (0: activation, 1: second operand / weight).

        Example:
            >>> QUANTIZED_OPS["QGemm"].operand(1)
            Operand(index=3, scale=4, zero_point=5)
        """
        name = self.operands[position]
        index = self._index(name)
        assert index is not None, f"{self.op_type}: operand {name} is not an input"
        return Operand(index, self._index(f"{name}_scale"), self._index(f"{name}_zero_point"))

    @property
    def output_grid(self) -> tuple[int, int] | None:
        """Input indices of the output's scale and zero point, or None (float output).

        Example:
            >>> QUANTIZED_OPS["QGemm"].output_grid, QUANTIZED_OPS["QLinearConcat"].output_grid
            ((7, 8), (0, 1))
        """
        if self.output is None:
            return None
        scale, zero_point = self._index(f"{self.output}_scale"), self._index(f"{self.output}_zero_point")
        assert scale is not None and zero_point is not None, f"{self.op_type}: no grid for {self.output}"
        return scale, zero_point

    @property
    def bias_index(self) -> int | None:
        return None if self.bias is None else self._index(self.bias)


def _op(op_type: str, domain: str, family: Family, inputs: str, **facts: Any) -> QuantizedOp:
    return QuantizedOp(op_type, domain, family, tuple(inputs.split()), **facts)


_MS = "com.microsoft"
_CONV = "x x_scale x_zero_point w w_scale w_zero_point y_scale y_zero_point B"
_BINARY = "A A_scale A_zero_point B B_scale B_zero_point C_scale C_zero_point"
_UNARY = "X X_scale X_zero_point Y_scale Y_zero_point"
_POOL = "X x_scale x_zero_point y_scale y_zero_point"

#: Every op that only exists in quantized graphs, by op type (ONNX and onnxruntime's schemas).
QUANTIZED_OPS: dict[str, QuantizedOp] = {
    op.op_type: op
    for op in (
        # dynamic: quantize_dynamic, and onnxruntime's fusions of its output
        _op("DynamicQuantizeLinear", "", "dynamic", "x"),
        _op(
            "MatMulInteger",
            "",
            "dynamic",
            "A B a_zero_point b_zero_point",
            operands=("A", "B"),
            float_op="MatMul",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "ConvInteger",
            "",
            "dynamic",
            "x w x_zero_point w_zero_point",
            operands=("x", "w"),
            float_op="Conv",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "DynamicQuantizeMatMul",
            _MS,
            "dynamic",
            "A B b_scale b_zero_point bias",
            operands=("A", "B"),
            float_op="MatMul",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "MatMulIntegerToFloat",
            _MS,
            "dynamic",
            "A B a_scale b_scale a_zero_point b_zero_point bias",
            operands=("A", "B"),
            float_op="MatMul",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "QAttention",
            _MS,
            "dynamic",
            "input weight bias input_scale weight_scale mask_index input_zero_point weight_zero_point past",
            operands=("input", "weight"),
            float_op="Attention",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "DynamicQuantizeLSTM",
            _MS,
            "dynamic",
            "X W R B sequence_lens initial_h initial_c P W_scale W_zero_point R_scale R_zero_point",
            float_op="LSTM",
        ),
        # qoperator: quantize_static(quant_format=QOperator)
        _op(
            "QLinearConv",
            "",
            "qoperator",
            _CONV,
            operands=("x", "w"),
            output="y",
            bias="B",
            float_op="Conv",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "QLinearConvTranspose",
            "com.ms.internal.nhwc",
            "qoperator",
            _CONV,
            operands=("x", "w"),
            output="y",
            bias="B",
            float_op="ConvTranspose",
            weighted=True,
        ),
        _op(
            "QLinearMatMul",
            "",
            "qoperator",
            "a a_scale a_zero_point b b_scale b_zero_point y_scale y_zero_point",
            operands=("a", "b"),
            output="y",
            float_op="MatMul",
            weighted=True,
            u8s8=True,
        ),
        _op(
            "QGemm",
            _MS,
            "qoperator",
            "A a_scale a_zero_point B b_scale b_zero_point C y_scale y_zero_point",
            operands=("A", "B"),
            output="y",
            bias="C",
            float_op="Gemm",
            weighted=True,
            u8s8=True,
        ),
        _op("QLinearAdd", _MS, "qoperator", _BINARY, operands=("A", "B"), output="C", float_op="Add"),
        _op("QLinearMul", _MS, "qoperator", _BINARY, operands=("A", "B"), output="C", float_op="Mul"),
        _op(
            "QLinearSoftmax",
            _MS,
            "qoperator",
            "X X_scale x_zero_point y_scale y_zero_point",
            operands=("X",),
            output="y",
            float_op="Softmax",
        ),
        _op(
            "QLinearGlobalAveragePool",
            _MS,
            "qoperator",
            _POOL,
            operands=("X",),
            output="y",
            float_op="GlobalAveragePool",
        ),
        _op("QLinearAveragePool", _MS, "qoperator", _POOL, operands=("X",), output="y", float_op="AveragePool"),
        _op("QLinearSigmoid", _MS, "qoperator", _UNARY, operands=("X",), output="Y", float_op="Sigmoid"),
        _op("QLinearLeakyRelu", _MS, "qoperator", _UNARY, operands=("X",), output="Y", float_op="LeakyRelu"),
        _op(
            "QLinearReduceMean",
            _MS,
            "qoperator",
            "data data_scale data_zero_point reduced_scale reduced_zero_point",
            operands=("data",),
            output="reduced",
            float_op="ReduceMean",
        ),
        # variadic: (tensor, scale, zero point) triples from input 2 on
        _op("QLinearConcat", _MS, "qoperator", "Y_scale Y_zero_point inputs", output="Y", float_op="Concat"),
        _op(
            "QLinearWhere",
            _MS,
            "qoperator",
            "condition X x_scale x_zero_point Y y_scale y_zero_point z_scale z_zero_point",
            operands=("X", "Y"),
            output="z",
            float_op="Where",
        ),
        _op(
            "QEmbedLayerNormalization",
            _MS,
            "qoperator",
            "input_ids segment_ids word_embedding_quant position_embedding_quant segment_embedding gamma_quant "
            "beta_quant mask word_embedding_scale position_embedding_scale segment_embedding_scale gamma_scale "
            "beta_scale word_embedding_zero_point position_embedding_zero_point segment_embedding_zero_point "
            "gamma_zero_point beta_zero_point",
            float_op="EmbedLayerNormalization",
        ),
        # qdq: quantize_static(quant_format=QDQ)
        _op("QuantizeLinear", "", "qdq", "x y_scale y_zero_point", operands=("x",), output="y"),
        _op("DequantizeLinear", "", "qdq", "x x_scale x_zero_point", operands=("x",)),
        # nbits: MatMulNBitsQuantizer (weight-only, block-wise)
        _op("MatMulNBits", _MS, "nbits", "A B scales zero_points g_idx bias", float_op="MatMul"),
        _op("GatherBlockQuantized", _MS, "nbits", "data indices scales zero_points", float_op="Gather"),
    )
}
# NOTE: QAttention is dynamic: onnxruntime's quantizer makes it in IntegerOps mode only (registry
# IntegerOpsRegistry), next to the DynamicQuantizeLinear of its input. QEmbedLayerNormalization is
# made in both modes (CommonOpsRegistry) and stays with QOperator.


def ops_where(keep: Callable[[QuantizedOp], bool]) -> frozenset[str]:
    """The op types of :data:`QUANTIZED_OPS` that ``keep`` accepts.

    Example:
        >>> sorted(ops_where(lambda op: op.family == "qdq"))
        ['DequantizeLinear', 'QuantizeLinear']
    """
    return frozenset(name for name, op in QUANTIZED_OPS.items() if keep(op))


def weight_operands(keep: Callable[[QuantizedOp], bool] = lambda op: True) -> dict[str, Operand]:
    """Weighted op -> its weight operand, for the weighted ops ``keep`` accepts.

    Example:
        >>> weight_operands()["QLinearConv"]
        Operand(index=3, scale=4, zero_point=5)
    """
    return {name: op.operand(1) for name, op in QUANTIZED_OPS.items() if op.weighted and keep(op)}


#: Every value of ``ModelFormat.kind`` (:mod:`diag.core.load`): one row of :data:`FORMATS` each; an
#: INT8 model's is one of diag.schema.json's ``models.int8.format`` enum (``tests/test_ortfacts.py``
#: checks the Literal, the table and the enum are the same list), ``fp32`` the FP32 model's.
FormatKind = Literal[
    "fp32",
    "dynamic",
    "qdq",
    "qoperator",
    "mixed",
    "fp16",
    "qdq-a16w8",
    "qdq16",
    "qdq-fp8",
    "matmulnbits",
    "qdq-int4-blocked",
]
#: The recipe's ``mode`` that makes a kind (:class:`diag.core.recipe.Recipe`).
Mode = Literal["dynamic", "static", "weight_only", "fp16"]


@dataclass(frozen=True)
class FormatFacts:
    """What the modules that branch on a model's format kind read about it, written once.

    Attributes:
        family: the op family whose ops mark the kind (:data:`Family`; the 16-bit and FP8 QDQ
            kinds are QDQ's); None for a float or mixed model.
        mode: the recipe's ``mode`` that makes it; None when no one call does (FP32, mixed).
        quant_format: onnxruntime's ``QuantFormat`` name, the recipe's ``quant_format``; None for
            dynamic (no such argument) and for kinds no quantizer call makes.
        calibrated: its activations' grids come (or, mixed, may come) from calibration: the
            static remedies (clipping, percentile calibration, 16-bit activations) apply.
        input_grids: its family's ops read a quantized input with that input's grid (``match``
            pairs those grids). A family-wide fact: every row of a family says the same.
        integer_weights: its family's weights are integer initializers read by the op itself,
            which ``weights`` dequantizes and ``infer`` reads the recipe from (QDQ's go through a
            ``DequantizeLinear``; block-wise ones through :mod:`diag.core.nbits`). Family-wide.
    """

    family: Family | None
    mode: Mode | None
    quant_format: Literal["QDQ", "QOperator"] | None = None
    calibrated: bool = False
    input_grids: bool = False
    integer_weights: bool = False

    @property
    def weight_only(self) -> bool:
        """Weights quantized block-wise, activations left in float (``mode = "weight_only"``)."""
        return self.mode == "weight_only"


_QDQ = FormatFacts("qdq", "static", "QDQ", calibrated=True, input_grids=True)
#: Format kind -> its facts, in the order of :data:`FormatKind`.
FORMATS: dict[str, FormatFacts] = {
    "fp32": FormatFacts(None, None),
    "dynamic": FormatFacts("dynamic", "dynamic", integer_weights=True),
    "qdq": _QDQ,
    "qoperator": FormatFacts("qoperator", "static", "QOperator", True, input_grids=True, integer_weights=True),
    "mixed": FormatFacts(None, None, calibrated=True),
    "fp16": FormatFacts(None, "fp16"),
    "qdq-a16w8": _QDQ,
    "qdq16": _QDQ,
    "qdq-fp8": _QDQ,
    "matmulnbits": FormatFacts("nbits", "weight_only", "QOperator"),
    "qdq-int4-blocked": FormatFacts("qdq", "weight_only", "QDQ", input_grids=True),
}


def kinds_where(keep: Callable[[FormatFacts], bool]) -> frozenset[str]:
    """The format kinds of :data:`FORMATS` that ``keep`` accepts.

    Example:
        >>> sorted(kinds_where(lambda f: f.weight_only))
        ['matmulnbits', 'qdq-int4-blocked']
    """
    return frozenset(kind for kind, f in FORMATS.items() if keep(f))


def kind_made_by(mode: str, quant_format: str) -> str | None:
    """The format kind a recipe of ``mode`` and ``quant_format`` makes with its 8-bit defaults, or None.

    The first row of :data:`FORMATS` with that mode and (unless it takes none) that ``QuantFormat``:
    the 16-bit and FP8 QDQ kinds come after ``qdq``, so their types are what makes them.

    Example:
        >>> kind_made_by("static", "QOperator"), kind_made_by("dynamic", "QDQ"), kind_made_by("weight_only", "QDQ")
        ('qoperator', 'dynamic', 'qdq-int4-blocked')
    """
    rows = (k for k, f in FORMATS.items() if f.mode == mode and f.quant_format in (None, quant_format))
    return next(rows, None)


def families_where(keep: Callable[[FormatFacts], bool]) -> frozenset[Family]:
    """The op families of the format kinds ``keep`` accepts.

    Example:
        >>> sorted(families_where(lambda f: f.integer_weights))
        ['dynamic', 'qoperator']
    """
    return frozenset(f.family for f in FORMATS.values() if f.family is not None and keep(f))


#: onnxruntime's graph optimization levels by the names diag's flags and documents use, in order.
OPT_LEVELS = ("disabled", "basic", "extended", "all")
#: Exact mode: no fusion, every tensor kept (what diag compares by default).
EXACT_LEVEL = "disabled"
#: onnxruntime's own default level (``ORT_ENABLE_ALL``): what a deployed session runs.
DEPLOY_LEVEL = "all"
