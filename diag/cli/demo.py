"""`diag demo`: build a bundled fixture, quantize it with real onnxruntime, compare. Offline.

``--fixture llama`` is the LLM case: a Llama-shaped decoder saved with external data, quantized
to 4 bits (``MatMulNBits``), diagnosed per layer and projection, and fixed with a verified
mixed-precision plan (``diag exclude --tiers int4,int8,fp32``) instead of a float exclusion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from diag.analysis.compare import CompareOptions, CompareResult
from diag.cli.verbs import DemoOptions, compare_to_dir, exclude_to_dir, tier_plan_to_dir
from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fix.exclude import ExcludeOptions, ExclusionResult, ranked_fixes
from diag.fix.tiers import TierOptions, TierPlan
from diag.fix.tiers import summary_lines as tier_lines
from diag.fixtures import llm_models, models, producers, quantize
from diag.foundations.errors import DiagError
from diag.foundations.files import out_dir as checked_out_dir
from diag.foundations.summary import Summary

#: The LLM fixture's name on the command line, and the one format it is quantized to.
LLM_FIXTURE = "llama"
INT4 = "int4"
#: What the LLM demo's plan must meet on held-out samples (4-bit noise in every projection stays).
LLM_TARGET = "cosine>=0.95"
LLM_RECIPE = Recipe(mode="weight_only", bits=4, block_size=32, is_symmetric=True)


def build_fixture_files(folder: Path, fixture: str, fmt: str, samples: int = 32) -> dict[str, Path]:
    """Write ``<fixture>.fp32.onnx``, ``<fixture>.<fmt>.onnx``, ``calib.npz`` and ``inputs.npz``.

    Calibration and comparison inputs are drawn from different seeds, as in real use.
    """
    if fixture == LLM_FIXTURE:
        fx = llm_models.llama_decoder()
    elif fixture == "transformer":
        fx = models.transformer(outlier_factor=DEMO_OUTLIER_FACTOR)
    else:
        fx = models.build(fixture)
    folder.mkdir(parents=True, exist_ok=True)
    fp = folder / f"{fixture}.fp32.onnx"
    if fixture == LLM_FIXTURE:
        llm_models.save_with_external_data(fx.model, fp)  # as LLM exports ship
    else:
        onnx.save(fx.model, fp)
    calib = fx.make_inputs(32, 11)
    np.savez(folder / "calib.npz", **calib)  # type: ignore[arg-type]
    inputs = fx.make_inputs(samples, 12)
    np.savez(folder / "inputs.npz", **inputs)  # type: ignore[arg-type]
    q = folder / f"{fixture}.{fmt}.onnx"
    if fmt == INT4:
        llm_models.quantize_int4(fp, q)
    elif fmt == AIMET:  # AIMET's export: the FP32 graph, and beside it the encodings of a static QDQ model
        qdq = folder / f"{fixture}.qdq.onnx"
        quantize.quantize(fp, qdq, "qdq", calib, weight_type=DEMO_DYNAMIC_WEIGHTS)  # u8u8: exact on every CPU
        q.write_bytes(fp.read_bytes())
        encodings = producers.aimet_encodings(onnx.load(str(qdq)), "1.0.0")
        q.with_suffix(".encodings").write_text(json.dumps(encodings, indent=1) + "\n")
        qdq.unlink()
    else:
        quantize.quantize(fp, q, fmt, calib, weight_type=DEMO_DYNAMIC_WEIGHTS if fmt == "dynamic" else "QInt8")
    return {"fp32": fp, "int8": q, "calib": folder / "calib.npz", "inputs": folder / "inputs.npz"}


#: NOTE: the demo's dynamic model uses QUInt8 weights. onnxruntime's default QInt8 runs as u8s8
#: integer kernels, which saturate on x86 CPUs without VNNI (AVX2 only), so the same model gives
#: different numbers on different machines; u8u8 is exact everywhere, and the demo must print the
#: same thing on every machine.
DEMO_DYNAMIC_WEIGHTS = "QUInt8"

#: The demo transformer's outlier dimension, this many times the others: its defect fails the seeds'
#: bands (top-1 agreement 90.6 %: marginal) and its fix passes them (issue 45: at the fixture's
#: default 40x the demo "fixed" a model its own bands call excellent).
DEMO_OUTLIER_FACTOR = 80.0

#: ``--format aimet``: AIMET's standard export (an FP32 ``.onnx`` and its ``.encodings``), fixed in its encodings.
AIMET = "aimet"

#: The accuracy target the demo's exclusion must meet on held-out samples.
DEMO_TARGET = "cosine>=0.999"


@dataclass(frozen=True)
class DemoResult:
    """What `diag demo` computed, for a library caller: the two verbs it ran, each as it returned.

    NOTE: the demo is `diag compare` then `diag exclude` (or ``--tiers``), and each returns its
    own :class:`~diag.foundations.summary.Summary`; one ``Summary.result`` cannot hold both, so the demo's
    result keeps both whole (each verb's result and the files it wrote) instead of a tuple the
    caller unpacks.
    """

    compare: Summary[CompareResult]
    #: The exclusion (a TierPlan for the int4 LLM fixture) and its files in ``out/fix``; None without the fix.
    fix: Summary[ExclusionResult] | Summary[TierPlan] | None


def run_demo(
    out: str | Path,
    fixture: str = "transformer",
    fmt: str | None = None,
    samples: int = 32,
    progress: bool = True,
    fix: bool = True,
) -> Summary[DemoResult]:
    """Build, quantize and compare one fixture (report in ``out``), then derive and verify the
    fix with ``diag exclude`` (report in ``out/fix``) unless ``fix`` is False.

    ``fmt`` None: ``int4`` for the LLM fixture, ``dynamic`` for the others. An int4 model's fix is
    a tier plan (``--tiers int4,int8,fp32``). Returns the lines `diag demo` prints, the two verbs'
    summaries as ``result`` (:class:`DemoResult`) and the comparison's files as ``files``.

    Example:
        >>> s = run_demo("demo", progress=False)  # doctest: +SKIP
        >>> sorted(s.files), s.result.fix.files["exclusion.json"]  # doctest: +SKIP
        (['diag.json', 'report.html', 'summary.md'], PosixPath('demo/fix/exclusion.json'))
    """
    fmt = fmt or (INT4 if fixture == LLM_FIXTURE else "dynamic")
    if fixture == LLM_FIXTURE and fmt != INT4:
        raise DiagError(
            "bad-option",
            f"--format {fmt}",
            f"the {LLM_FIXTURE} fixture is a 4-bit weight-only model",
            f"leave --format out or pass --format {INT4}",
        )
    shown = out  # as given: the lines name the fix's report under it
    out = checked_out_dir(out)
    files = build_fixture_files(out / "models", fixture, fmt, samples)
    feeds = FeedSpec(inputs=str(files["inputs"]), batch=8)
    compared = compare_to_dir(files["fp32"], files["int8"], feeds, out, CompareOptions(progress=progress))
    fixed: Summary[ExclusionResult] | Summary[TierPlan] | None = None
    if fix and fmt == INT4:
        tiers = TierOptions(LLM_TARGET, tiers="int4,int8,fp32", progress=progress)
        fixed = tier_plan_to_dir(files["fp32"], LLM_RECIPE, feeds, tiers, out / "fix")
    elif fix and fmt == AIMET:  # the fix is made in the user's encodings, not by a quantizer
        options = ExcludeOptions(DEMO_TARGET, bench_runs=10, progress=progress, int8=str(files["int8"]))
        fixed = exclude_to_dir(files["fp32"], None, feeds, options, out / "fix")
    elif fix:
        recipe = (
            Recipe(mode="dynamic", weight_type=DEMO_DYNAMIC_WEIGHTS)
            if fmt == "dynamic"
            else Recipe(
                mode="static",
                quant_format="QDQ" if fmt == "qdq" else "QOperator",
                calibration=str(files["calib"].resolve()),
            )
        )
        options = ExcludeOptions(DEMO_TARGET, bench_runs=10, progress=progress)
        fixed = exclude_to_dir(files["fp32"], recipe, feeds, options, out / "fix")
    lines = list(compared.lines)
    if fixed is not None and fixed.result is not None:
        lines += _fix_lines(fixed.result, shown)
    return Summary(lines, result=DemoResult(compared, fixed), files=compared.files)


def _fix_lines(fix: ExclusionResult | TierPlan, out: str | Path) -> list[str]:
    """The demo's lines about its fix: the verified fix (or plan) in one line, and where its report is."""
    if isinstance(fix, TierPlan):
        lines = [f"verified plan: {line.strip()}" if i == 0 else line for i, line in enumerate(tier_lines(fix)[:2])]
        return [*lines, f"wrote the plan's report: {out}/fix/report.html"]
    before = fix.before.cosine
    best = ranked_fixes(fix)
    if best:
        # The best-ranked fix, as the report's first screen shows it: an op-type change can beat the node list.
        f = best[0]
        nodes = f["nodes_to_exclude"]
        change = f"keep {len(nodes)} node(s) in float ({', '.join(nodes)})"
        if f["op_types_to_quantize"] and f["kind"] == "op_types_to_quantize":
            op_types = f"op_types_to_quantize={json.dumps(f['op_types_to_quantize'])}"
            change = f"{op_types} and {change}" if nodes else op_types
        line = f"verified fix: {change}: held-out cosine {before:.4f} -> {f['metric']:.4f} ({fix.target})"
    else:
        line = f"verified fix: {fix.verdict} ({fix.target}, held-out cosine {before:.4f})"
    # AIMET's export: the fix is the user's encodings file, edited (the answer a QNN build reads)
    edited = [f"wrote the fixed encodings: {fix.encodings.file}"] if fix.encodings and fix.encodings.file else []
    return [line, *edited, f"wrote the fix's report: {out}/fix/report.html"]


def demo(options: DemoOptions) -> Summary[DemoResult]:
    """`diag demo`: :func:`run_demo` with the verb's options."""
    return run_demo(
        options.out,
        options.fixture,
        options.format,
        samples=options.samples,
        progress=options.progress,
        fix=options.fix,
    )
