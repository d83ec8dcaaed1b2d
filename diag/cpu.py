"""What this machine's CPU does to int8 arithmetic, where it changes the numbers diag reports.

onnxruntime runs an INT8 model with signed 8-bit weights (its default ``QInt8``) and unsigned
8-bit activations as u8s8 integer kernels. On x86 CPUs with VNNI (``vpdpbusd``) those are exact;
on CPUs with AVX2 only, the kernels add pairs of u8 x s8 products into 16 bits (``vpmaddubsw``),
which saturates when both weights of a pair are large: the *same* INT8 model is then measurably
worse on that machine (the demo transformer: held-out min cosine 0.975 instead of 0.997; with
per-channel QInt8 weights -0.26). Weights that fit 7 bits (``reduce_range=True``) or unsigned
weights (``QUInt8``, u8u8 kernels) are exact everywhere.
"""

from __future__ import annotations

import functools
import platform

import numpy as np
import onnx
from onnx import numpy_helper

#: Ops whose input at this index is a quantized weight onnxruntime multiplies in u8s8 kernels.
_WEIGHT_INPUT = {
    "MatMulInteger": 1,
    "ConvInteger": 1,
    "DynamicQuantizeMatMul": 1,
    "QLinearConv": 3,
    "QLinearMatMul": 3,
}
# NOTE: QDQ models are left out: diag's exact mode computes their DequantizeLinear in float, so its
# per-tensor figures do not depend on the CPU (deployed, onnxruntime fuses them into u8s8 kernels).
#: Beyond this span a signed weight tensor uses the full 8 bits (reduce_range keeps it within 7).
_SEVEN_BIT_SPAN = 128
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8")


@functools.cache
def has_vnni() -> bool | None:
    """True / False on x86 Linux (from /proc/cpuinfo flags); None where it cannot be told (or is not x86).

    Example:
        >>> has_vnni() in (True, False, None)
        True
    """
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    return any(f in flags for f in _VNNI_FLAGS)


def full_range_int8_weights(model: onnx.ModelProto) -> list[str]:
    """Names of signed 8-bit weights (initializers, data in the proto) that need all 8 bits.

    Example:
        >>> full_range_int8_weights(onnx.load("int8.onnx"))[:1]  # doctest: +SKIP
        ['layer1/ffn/fc1/weight_quantized']
    """
    inits = {i.name: i for i in model.graph.initializer}
    found: list[str] = []
    for node in model.graph.node:
        k = _WEIGHT_INPUT.get(node.op_type)
        if k is None or len(node.input) <= k:
            continue
        t = inits.get(node.input[k])
        if t is None or t.data_type != onnx.TensorProto.INT8 or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        values = numpy_helper.to_array(t).astype(np.int16)
        if values.size > 1 and int(values.max()) - int(values.min()) > _SEVEN_BIT_SPAN:
            found.append(t.name)
    return found


def saturation_warning(model: onnx.ModelProto) -> str | None:
    """A sentence when this CPU's u8s8 kernels can saturate on ``model``'s weights, else None."""
    if has_vnni() is not False:
        return None
    weights = full_range_int8_weights(model)
    if not weights:
        return None
    return (
        f"this CPU has no VNNI: onnxruntime's u8s8 kernels can saturate on the {len(weights)} full-range QInt8 "
        "weight(s) of the INT8 model, so its error here can be larger than on a VNNI CPU (and than where it "
        "is deployed); quantize with reduce_range=True or weight_type=QUInt8 for the same numbers everywhere"
    )
