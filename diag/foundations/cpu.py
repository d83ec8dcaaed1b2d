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
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from diag.foundations.ortfacts import weight_operands

#: Ops whose input at this index is a quantized weight onnxruntime multiplies in u8s8 kernels.
_WEIGHT_INPUT = {op: w.index for op, w in weight_operands(lambda op: op.u8s8).items()}
# NOTE: QDQ models are left out: diag's exact mode computes their DequantizeLinear in float, so its
# per-tensor figures do not depend on the CPU (deployed, onnxruntime fuses them into u8s8 kernels).
#: Beyond this span a signed weight tensor uses the full 8 bits (reduce_range keeps it within 7).
_SEVEN_BIT_SPAN = 128
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8")


#: /proc/cpuinfo flags that choose onnxruntime's (MLAS) int8 GEMM kernel, in the order they are shown.
_ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX512",
    "avx512bw": "AVX512BW",
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx_vnni_int8": "AVX-VNNI-INT8",
    "amx_int8": "AMX-INT8",
    "asimddp": "ARM-DOTPROD",
    "i8mm": "ARM-I8MM",
}
_X86 = ("x86_64", "amd64", "i686", "x86")


def _cpu_flags() -> list[str] | None:
    """The first ``flags`` (x86) or ``Features`` (ARM) line of /proc/cpuinfo; None where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class KernelPath:
    """Which integer kernels onnxruntime picks on this machine: what makes INT8 numbers CPU-dependent.

    Recorded next to every figure measured with integer kernels (dynamic / QOperator models, or any
    model at an optimization level that fuses QDQ into them), so two reports that disagree can be
    told apart by their machine instead of by guesswork.
    """

    machine: str
    isa: tuple[str, ...]
    vnni: bool | None
    onnxruntime: str
    providers: tuple[str, ...]  # the execution providers diag's sessions run on

    def to_dict(self) -> dict[str, Any]:
        """The diag.json / exclusion.json / sweep.json record."""
        return {
            "machine": self.machine,
            "isa": list(self.isa),
            "vnni": self.vnni,
            "onnxruntime": self.onnxruntime,
            "providers": list(self.providers),
            "u8s8": self.u8s8(),
        }

    def u8s8(self) -> str:
        """How u8 x s8 products are summed: exact in int32 (VNNI, ARM dot product) or pairwise in int16."""
        if self.vnni:
            return "exact (VNNI)"
        if "ARM-DOTPROD" in self.isa or "ARM-I8MM" in self.isa:
            return "exact (ARM dot product)"
        if self.vnni is False and "AVX2" in self.isa:
            return "pairs summed in int16, can saturate (AVX2 without VNNI)"
        return "unknown"

    def describe(self) -> str:
        """One line for report and summary, e.g. ``x86_64 AVX2 AVX512 AVX512-VNNI · onnxruntime 1.20.1 CPU``."""
        isa = " ".join(self.isa) or "no SIMD int8 flags seen"
        providers = ", ".join(p.removesuffix("ExecutionProvider") for p in self.providers)
        return f"{self.machine} {isa} · onnxruntime {self.onnxruntime} {providers} · u8s8 {self.u8s8()}"


@functools.cache
def kernel_path() -> KernelPath:
    """This machine's :class:`KernelPath` (read once per process).

    Example:
        >>> kernel_path().machine == platform.machine()
        True
    """
    import onnxruntime as ort

    flags = set(_cpu_flags() or ())
    return KernelPath(
        machine=platform.machine(),
        isa=tuple(label for flag, label in _ISA_FLAGS.items() if flag in flags),
        vnni=has_vnni(),
        onnxruntime=str(ort.__version__),
        providers=("CPUExecutionProvider",),  # the only one diag's sessions use (diag.core.run)
    )


@functools.cache
def has_vnni() -> bool | None:
    """True / False on x86 Linux (from /proc/cpuinfo flags); None where it cannot be told (or is not x86).

    Example:
        >>> has_vnni() in (True, False, None)
        True
    """
    if platform.machine().lower() not in _X86:
        return None
    flags = _cpu_flags()
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
