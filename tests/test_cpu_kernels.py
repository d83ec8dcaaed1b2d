"""The CPU's integer-kernel path is recorded next to the figures that depend on it (diag.foundations.cpu.KernelPath)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from diag.analysis.compare import CompareOptions
from diag.core.feeds import FeedSpec
from diag.foundations.cpu import KernelPath, kernel_path
from diag.report.documents import read_document
from diag.report.view import md_escape


def _cpuinfo_flags() -> set[str]:
    """Read independently of diag.foundations.cpu: every flag of every ``flags``/``Features`` line."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    found: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            found.update(value.split())
    return found


def test_kernel_path_matches_proc_cpuinfo_and_onnxruntime() -> None:
    import onnxruntime as ort

    kp = kernel_path()
    flags = _cpuinfo_flags()
    assert kp.machine == platform.machine()
    assert kp.onnxruntime == ort.__version__
    assert kp.providers == ("CPUExecutionProvider",)
    assert ("AVX2" in kp.isa) == ("avx2" in flags)
    assert ("AVX512-VNNI" in kp.isa) == ("avx512_vnni" in flags)
    assert ("ARM-DOTPROD" in kp.isa) == ("asimddp" in flags)
    if platform.machine() == "x86_64" and flags:
        assert kp.vnni == bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8"})
    d = kp.to_dict()
    assert sorted(d) == ["isa", "machine", "onnxruntime", "providers", "u8s8", "vnni"]
    assert kp.onnxruntime in kp.describe() and kp.machine in kp.describe()


def test_u8s8_wording_follows_the_flags() -> None:
    avx2 = KernelPath("x86_64", ("AVX2",), False, "1.0", ("CPUExecutionProvider",))
    assert avx2.u8s8().startswith("pairs summed in int16")
    assert "AVX2 without VNNI" in avx2.describe()
    vnni = KernelPath("x86_64", ("AVX2", "AVX512-VNNI"), True, "1.0", ("CPUExecutionProvider",))
    assert vnni.u8s8() == "exact (VNNI)"
    arm = KernelPath("aarch64", ("ARM-DOTPROD",), None, "1.0", ("CPUExecutionProvider",))
    assert arm.u8s8() == "exact (ARM dot product)"


def test_diag_json_report_and_summary_carry_the_kernel_path(built, tmp_path) -> None:
    from diag.cli.verbs import compare_to_dir

    b = built("convnet")
    feeds = FeedSpec(inputs=str(b.inputs_path), samples=4, batch=4)
    opts = CompareOptions(progress=False, distributions=False)
    files = compare_to_dir(b.fp32, b.int8["dynamic"], feeds, tmp_path / "o", opts).files
    doc = json.loads(files["diag.json"].read_text())
    assert doc["run"]["kernel_path"] == json.loads(json.dumps(kernel_path().to_dict()))
    read_document(files["diag.json"])  # the shipped schema accepts it
    line = f"int8 kernels: {platform.machine()}"
    assert md_escape(line) in files["summary.md"].read_text()  # Markdown-escaped
    assert line in files["report.html"].read_text()
    assert f"onnxruntime {kernel_path().onnxruntime}" in files["summary.md"].read_text()
