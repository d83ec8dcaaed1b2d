"""Run diag on another CPU's integer kernels: the emulated-AVX2 leg of CI.

onnxruntime picks its int8 kernels from the CPU (u8s8 pairs saturate in int16 on AVX2 without VNNI,
are exact with VNNI) and offers no switch. ``qemu-x86_64 -cpu Haswell`` (Debian's qemu-user, QEMU
>= 7.2 emulates AVX2) gives onnxruntime a real AVX2-only CPU, so the tests marked ``kernel_path``
run in CI a second time as ``QEMU_CPU=Haswell qemu-x86_64 python -m pytest -m kernel_path``.
qemu-user does not follow ``exec``: a test that starts ``diag`` in a subprocess takes its interpreter
from :func:`python_command` (directly or through ``diag_forks.DiagForks``), which keeps the
subprocess on the emulated CPU.

NOTE: QEMU 7.2 crashes in numpy's AVX2 sort (``np.argsort`` on some arrays, a segmentation fault);
the emulated leg runs with numpy's own AVX2/AVX-512 paths off (``NPY_DISABLE_CPU_FEATURES``).
numpy's results do not depend on them, and onnxruntime still sees and uses the emulated AVX2.
"""

from __future__ import annotations

import os
import shutil
import sys


def emulated_cpu() -> str | None:
    """The CPU model qemu emulates for this run (``QEMU_CPU``), or None on the real CPU."""
    return os.environ.get("QEMU_CPU") or None


def python_command() -> list[str]:
    """``python`` on the CPU this test runs on, emulated or real."""
    cpu = emulated_cpu()
    if cpu is None:
        return [sys.executable]
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "QEMU_CPU is set but qemu-x86_64 is not installed"
    return [qemu, "-cpu", cpu, sys.executable]
