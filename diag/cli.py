"""The ``diag`` command line: each verb parses flags and makes one library call.

Exit codes live here: 0 ok, 1 internal error (a bug: please report), 2 user error (one line
``diag: error[<slug>]: ...``), 3 a CI gate failed, 130 interrupted. ``--debug`` shows tracebacks.
Heavy modules (numpy, onnx, onnxruntime, matplotlib) are imported inside the verbs so that
``diag --help`` is instant.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from diag import __version__
from diag.errors import INTERNAL_ERROR, INTERRUPTED, OK, USER_ERROR, DiagError

if TYPE_CHECKING:  # the options of the fixing verbs (their modules import numpy and onnx)
    from diag.bench import BenchOptions
    from diag.exclude import ExcludeOptions
    from diag.quantize import QuantizeOptions
    from diag.sweep import SweepOptions
    from diag.tiers import TierOptions

TARGET_HELP = """\
Metrics (all computed over every element of every sample, FP32 x vs INT8 y, e = y - x):
  SQNR dB       10*log10(sum x^2 / sum e^2); higher is better, inf = identical
  cosine        sum(x*y) / sqrt(sum x^2 * sum y^2)
  max abs       max |e|
  rmse/scale    sqrt(mean e^2) / quantization step; pure rounding noise is 0.289
  top-1 agr.    share of rows (last axis = classes) whose argmax agrees
With --labels (first output, [batch, classes], argmax vs label; classes = those in the labels):
  macro-F1      mean over classes of 2TP / (2TP + FP + FN); the drop is FP32 minus INT8
  micro-F1      2TP / (2TP + FP + FN) with TP, FP, FN summed over classes (= accuracy here)
"""


def _safe(text: object) -> str:
    """Printable text only: names from model files must not drive the terminal."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(text))


def _add_feed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inputs (exactly one of --inputs, --random, --reader)")
    g.add_argument(
        "--inputs",
        metavar="PATH",
        help=".npz with one array per model input stacked along axis 0 (one row per sample), "
        "a .npy for single-input models, or a folder whose every .npz is one feed dict",
    )
    g.add_argument("--random", action="store_true", help="seeded random inputs (see --shape, --int-range)")
    g.add_argument(
        "--reader",
        metavar="MOD:FACTORY",
        help="import MOD and call FACTORY(): an iterable of feed dicts or a CalibrationDataReader",
    )
    g.add_argument("--samples", type=int, metavar="N", help="use the first N samples (random: default 8)")
    g.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="B",
        help="samples per run when the model's first axis is symbolic (default 1)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    g.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="full shape for an input with symbolic dims (repeatable)",
    )
    g.add_argument(
        "--int-range",
        default="0,100",
        metavar="LO,HI",
        help="range [LO, HI) for random integer inputs such as token ids (default 0,100)",
    )


def _feed_spec(args: argparse.Namespace) -> Any:
    from diag.feeds import FeedSpec, parse_shapes

    try:
        lo, hi = (int(x) for x in args.int_range.split(","))
    except ValueError as e:
        raise DiagError(
            "bad-option", f"--int-range {args.int_range!r}", "is not LO,HI", "write e.g. --int-range 0,30522"
        ) from e
    if hi <= lo:
        raise DiagError("bad-option", f"--int-range {args.int_range!r}", "needs LO < HI", "e.g. 0,100")
    return FeedSpec(
        inputs=args.inputs,
        random=args.random,
        reader=args.reader,
        samples=args.samples,
        batch=args.batch,
        seed=args.seed,
        shapes=parse_shapes(args.shape),
        int_range=(lo, hi),
    )


# ---------------------------------------------------------------- verbs


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a model's quantization format, opsets, op counts, subgraphs and visible problems.

    With --recipe, print instead the recipe that made an INT8 model (mode, format, types,
    per-channel, symmetric, reduce_range, excluded nodes) as a TOML recipe file; fields a model
    cannot tell (calibrate_method) are commented out with the reason. --recipe-out FILE writes it
    (.toml with the comments, .json without)."""
    if args.recipe or args.recipe_out:
        return _inspect_recipe(args)
    from diag.load import model_summary

    s = model_summary(args.model)
    print(f"model:      {_safe(s.path)}")
    ev = ", ".join(f"{k} x{v}" for k, v in s.format.evidence.items())
    print(f"format:     {s.format.kind}" + (f"  ({_safe(ev)})" if ev else ""))
    if s.format.precisions:
        from diag.precision import describe

        print(f"precision:  {_safe(describe(s.format.precisions))}")
    print(
        f"opsets:     {', '.join(f'{k} {v}' for k, v in s.opsets.items())}; IR {s.ir_version}; "
        f"producer {_safe(s.producer) or '?'}"
    )
    print(f"inputs:     {_safe(', '.join(s.inputs))}")
    print(f"outputs:    {_safe(', '.join(s.outputs))}")
    print(
        f"nodes:      {s.node_count} ({s.quantized_nodes} quantization ops, {s.float_nodes} other)"
        + ("; external data" if s.external_data else "")
    )
    ops = ", ".join(f"{_safe(k)} {v}" for k, v in s.op_counts.items())
    print("op counts:  " + textwrap.fill(ops, 96, subsequent_indent=" " * 12))
    if s.precision:
        print(f"precision:  {_safe(', '.join(f'{k} x{v}' for k, v in s.precision.items()))}")
    if s.subgraph_nodes:
        print(f"subgraphs:  {_safe(', '.join(s.subgraph_nodes))}")
    for w in s.warnings:
        print(f"warning:    {_safe(w)}")
    for p in s.problems:
        print(f"problem:    {_safe(p)}")
    if not s.problems:
        print("problems:   none found")
    return OK


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare an FP32 model and its INT8 version tensor by tensor; write diag.json, report.html
    and summary.md into --out."""
    from diag.compare import CompareOptions, compare_to_dir
    from diag.outputs import parse_output_kinds
    from diag.run import parse_shard, parse_size

    options = CompareOptions(
        opt_level=args.ort_opt_level,
        threads=args.threads,
        max_memory=parse_size(args.max_memory) if args.max_memory else None,
        shard=parse_shard(args.shard) if args.shard else None,
        local=not args.no_local,
        progress=not args.quiet,
        labels=args.labels,
        distributions=not args.no_distributions,
        outlier_factor=args.outlier_factor,
        sensitivity=args.sensitivity,
        recipe=args.recipe,
        output_kinds=parse_output_kinds(args.output_kind),
        effects=args.effects,
        effect_samples=args.effect_samples,
        accuracy_level_check=args.accuracy_level_check,
        metric=args.metric,
        reductions=args.reductions,
        scheduler=args.scheduler,
    )
    result, files = compare_to_dir(args.fp32, args.int8, _feed_spec(args), args.out, options)
    _print_result(result, files)
    return OK


def _print_result(result: Any, files: dict[str, Any]) -> None:
    for model in (result.fp32, result.int8):
        for w in getattr(model, "warnings", []):
            print(f"warning: {_safe(w)}")
    print(f"verdict: {result.grade.upper()} - {_safe(result.cause_sentence)}")
    for v in result.verdicts:
        print(f"  output {_safe(v.name)}: {v.grade} ({_safe('; '.join(v.reasons))})")
    from diag.taskmetrics import task_lines

    for line in task_lines(getattr(result, "task_metrics", {}) or {}):
        print(f"  {_safe(line)}")
    exact = {v.name: v.per_sample for v in result.verdicts}
    for name, d in getattr(result, "deployed", {}).items():
        e = exact.get(name)
        print(
            f"  deployed ({result.options.opt_level}) output {_safe(name)}: cosine min {d.cosine_min:.6f}, "
            f"max abs {d.max_abs:.3g}"
            + (f" (exact mode: cosine min {e.cosine_min:.6f}, max abs {e.max_abs:.3g})" if e is not None else "")
        )
    if getattr(result, "fused", None):
        hidden = {n for k in result.fused for n in k.fp_nodes}
        print(
            f"  {len(result.fused)} fused onnxruntime kernel(s) hide {len(hidden)} FP32 node(s) "
            "(diag.json deployed.fused_kernels)"
        )
    roots = sorted((f for f in result.findings if f.role == "root-cause"), key=lambda f: f.rank_local)
    for f in roots[:3]:
        print(
            f"  root cause: {_safe(f.group.label)} ({f.group.op_type}) local SQNR "
            f"{f.local.sqnr_db:.1f} dB, accumulated {f.accumulated.sqnr_db:.1f} dB"
            # SQNR is over finite values: say when the node writes NaN/Inf even fed FP32 inputs.
            + (
                f" (its own NaN/Inf: {f.local.nonfinite_int8 - f.local.nonfinite_fp} with FP32 inputs)"
                if f.local.nonfinite_int8 > f.local.nonfinite_fp
                else ""
            )
        )
    from diag.analyze import nonfinite_origins

    for model, f in nonfinite_origins(result.findings).items():
        count = f.accumulated.nonfinite_fp if model == "FP32" else f.accumulated.nonfinite_int8
        print(
            f"  NaN/Inf: first produced in the {model} model by {_safe(f.group.label)} ({f.group.op_type}): "
            f"{count} value(s) in '{_safe(f.tensor)}'"
        )
    if result.state is not None and result.state.fp16_ranges:
        from diag.fp16 import fp16_range_lines

        for line in fp16_range_lines(result.findings, result.state.fp16_ranges):
            print(f"  {_safe(line)}")
    for out, path in result.paths.items():
        labels = [f.group.label for f in path]
        if len(labels) > 5:
            labels = [*labels[:2], f"... {len(labels) - 4} more ...", *labels[-2:]]
        print(f"  error path to {_safe(out)}: {_safe(' -> '.join(labels))}")
    flagged = [(k, h) for k, h in result.health.items() if h.outliers and h.grid != "none"]
    for name, h in sorted(flagged, key=lambda kv: -kv[1].outliers[0].times_median)[:2]:
        o = h.outliers[0]
        print(f"  outlier: channel {o.index} of {_safe(name)} is {o.times_median:.0f}x the median channel")
    for p in result.persistent[:1]:
        print(
            f"  persistent outlier: channel {p.index} in {len(p.tensors)} of {p.of_tensors} tensors "
            f"of width {p.channels}"
        )
    for s in result.suggestions[:2]:
        print(f"  remedy for {_safe(s.tensor)}: {_safe(s.python)}")
    blocks = result.weights.worst_blocks(1) if getattr(result, "weights", None) is not None else []
    for b in blocks:  # block-wise weights (MatMulNBits, int4 QDQ): see diag.nbits
        print(
            f"  worst weight block: {_safe(b.weight)} {b.where()}: "
            f"error {b.rel_rmse:.2f}x the weight's rms, {b.levels} levels used, max |w| {b.peak_ratio:.0f}x the median"
        )
    level = getattr(result, "accuracy_level", None)
    if level is not None and level.worst_node() is not None:
        node, db = level.worst_node()  # type: ignore[misc]
        outs = ", ".join(f"{_safe(k)} {v:.1f} dB" for k, v in level.outputs.items())
        print(
            f"  accuracy_level {level.level} vs 0 (MatMulNBits inputs quantized inside the kernel): SQNR {outs}; "
            f"worst node {_safe(node)} {db:.1f} dB ({level.samples} samples)"
        )
    effects = getattr(result, "effects", None)
    if effects is not None and effects.best is not None and "rounding-level" not in result.cause_sentence:
        shown = [e for e in effects.effects[:3] if e.recovered > 0.01]
        if shown:
            print(
                f"  effect on {_safe(effects.target)} of keeping one node in float: "
                + ", ".join(f"{_safe(e.finding.group.label)} {e.recovered:.0%}" for e in shown)
                + f" ({effects.samples} samples)"
            )
    for v in result.verdicts:
        for label, (part, acc, local) in v.per_sample.parts.items():
            print(
                f"  output {_safe(v.name)} part {_safe(label)}: SQNR {acc.sqnr_db:.1f} dB, min cosine "
                f"{part.cosine_min:.4f}" + (f", local SQNR {local.sqnr_db:.1f} dB" if local is not None else "")
            )
    if result.sensitivity is not None and result.sensitivity.rows:
        best = result.sensitivity.rows[0]
        print(
            f"  sensitivity: keeping {_safe(best.candidate.label)} in float recovers "
            f"{best.cosine_recovered:+.4f} output cosine ({result.sensitivity.quantizations} quantizations)"
        )
    _print_cluster(getattr(result, "cluster", {}), "  ")
    m = result.matching
    print(
        f"  matched {len(result.accumulated)}/{len(m.fp_float_tensors)} FP32 float tensors "
        f"({len(m.unmatched_tensors)} unmatched, listed in the report); {result.samples} samples "
        + (f"({result.passes} passes, memory budget) " if getattr(result, "passes", 1) > 1 else "")
        + f"in {result.seconds:.1f} s"
    )
    for name, path in files.items():
        print(f"wrote {name}: {path}")


def _print_cluster(info: dict[str, Any], indent: str = "") -> None:
    """One line on what ``--scheduler`` did: workers, tasks, retries, where latency was measured."""
    if not info:
        return
    shards = f"{info['shards']} shards, " if "shards" in info else ""
    unused = f", {info['unused_tasks']} computed ahead and not needed" if info.get("unused_tasks") else ""
    where = f"; latency measured on {info['latency_measured_on']}" if "latency_measured_on" in info else ""
    print(
        f"{indent}cluster: {info['workers']} worker(s) at {_safe(info['scheduler'])}, {shards}{info['tasks']} tasks"
        f"{unused}, {info['retries']} retried after a worker died{_safe(where)}"
    )


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge the diag.json files of diag compare --shard K/N runs into the result of one run; write
    diag.json, report.html and summary.md into --out."""
    from diag.merge import merge_to_dir

    result, files = merge_to_dir(args.parts, args.out, args.fp32, args.int8)
    _print_result(result, files)
    return OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Build a bundled fixture with a known defect, quantize it with onnxruntime, compare, then
    derive and verify the fix (the fewest nodes to keep in float for cosine>=0.999 on held-out
    samples) with diag exclude. Works offline."""
    from diag.demo import run_demo

    result, files, fix = run_demo(
        args.out, args.fixture, args.format, samples=args.samples, progress=not args.quiet, fix=not args.no_fix
    )
    _print_result(result, files)
    if fix is not None:
        before, after = fix.before.cosine, fix.after.cosine if fix.after else None
        if fix.reachable and fix.nodes_to_exclude:
            print(
                f"verified fix: keep {len(fix.nodes_to_exclude)} node(s) in float "
                f"({_safe(', '.join(fix.nodes_to_exclude))}): held-out cosine {before:.4f} -> {after:.4f} "
                f"({fix.target})"
            )
        else:
            print(f"verified fix: {fix.verdict} ({fix.target}, held-out cosine {before:.4f})")
        print(f"wrote the fix's report: {_safe(args.out)}/fix/report.html")
    return OK


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render report.html and summary.md from a diag.json without re-running any model."""
    from diag.report import report_to_dir

    for path in report_to_dir(args.json, args.out).values():
        print(f"wrote {_safe(path)}")
    return OK


def cmd_check(args: argparse.Namespace) -> int:
    """CI gate on a diag.json: every gate is applied to every model output and printed as PASS, FAIL or
    SKIP with its margin; exit code 3 when any gate fails.

    A gate on a metric an output does not have (top-1 agreement of a non-class-like output, accuracy
    drop without --labels) is skipped for that output with a printed note, and FAILS when it applies
    to no output at all: a gate that cannot measure anything never passes."""
    from diag.errors import GATE_FAILED
    from diag.gate import Gates, check_file, summary_line

    gates = Gates(
        min_sqnr=args.min_sqnr,
        min_cosine=args.min_cosine,
        max_abs=args.max_abs,
        min_agreement=args.min_agreement,
        max_accuracy_drop=args.max_accuracy_drop,
        max_f1_drop=args.max_f1_drop,
        max_grade=args.max_grade,
        outputs=tuple(args.output),
    )
    results = check_file(args.json, gates)
    for r in results:
        print(_safe(r.line()))
    print(summary_line(results))
    return GATE_FAILED if any(r.failed for r in results) else OK


def cmd_diff(args: argparse.Namespace) -> int:
    """Show what got better or worse between two diag.json runs (b relative to a): grade, per-output
    metric deltas, nodes whose quantized status or role changed, largest SQNR changes, nodes in one
    run only, changed settings and versions."""
    import json

    from diag.diff import diff_files

    diff = diff_files(args.a, args.b, top=args.top)
    if args.json:
        print(json.dumps(diff.to_dict(), indent=2))
    else:
        for line in diff.lines():
            print(_safe(line))
    return OK


def _inspect_recipe(args: argparse.Namespace) -> int:
    from diag.infer import recipe_to_file, recipe_to_toml

    if args.recipe_out:
        path, notes = recipe_to_file(args.model, args.recipe_out)
        print(f"wrote recipe: {_safe(path)}")
        for note in notes:
            print(f"note: {_safe(note)}")
    else:
        print(_safe_lines(recipe_to_toml(args.model)))
    return OK


def _safe_lines(text: str) -> str:
    return "\n".join(_safe(line) for line in text.splitlines())


def cmd_bench(args: argparse.Namespace) -> int:
    """Time FP32, INT8 and mixed models on the same inputs: p50/p90/p99, noise, speedup.

    Prints p50 / p90 / p99 latency, the noise band (min-max), samples per second and the speedup
    of each model's p50 over the first model's. Sessions use onnxruntime's default optimization
    level (all), as deployed, with the same intra-op thread count each (default: physical cores);
    models run interleaved, batch by batch, so background load hits them alike. One batch = one
    timed run; batches are cycled."""
    from diag.verbs import bench_to_json

    _, table, written = bench_to_json(args.models, _feed_spec(args), _bench_options(args))
    print(_safe_lines(table))
    if written is not None:
        print(f"wrote {_safe(written)}")
    return OK


def _bench_options(args: argparse.Namespace) -> BenchOptions:
    """``diag bench``'s flags as :class:`diag.bench.BenchOptions`."""
    from diag.bench import BenchOptions

    return BenchOptions(
        runs=args.runs, warmup=args.warmup, threads=args.threads, progress=not args.quiet, json_path=args.json
    )


def cmd_lint(args: argparse.Namespace) -> int:
    """Check a recipe file for what onnxruntime would silently ignore or reject.

    Flags extra_options keys the installed onnxruntime never reads (OpTypesToExclude,
    QuantizationPrecision), node names and op types that match no node of the FP32 model (PyTorch
    module names get the ONNX node names that contain them), and options that contradict each
    other or the format.

    Every finding is one line, error or warning. Exit code 3 when there is an error (onnxruntime
    would ignore or reject part of the recipe), 0 with warnings only (legal but probably not meant)."""
    from diag.errors import GATE_FAILED
    from diag.lint import lint_recipe_file, summary_line

    findings = lint_recipe_file(args.recipe, args.model)
    for f in findings:
        print(_safe(f.line()))
    print(_safe(summary_line(args.recipe, findings)))
    return GATE_FAILED if any(f.severity == "error" for f in findings) else OK


def cmd_exclude(args: argparse.Namespace) -> int:
    """Find the fewest nodes to keep in float so that the quantized model meets --target on held-out
    inputs; write exclusion.json, the mixed-precision model and reproduce.py into --out.

    The first part of the samples ranks the nodes (diag compare on the recipe's INT8 model) and
    calibrates a static recipe without calibration data; the rest (--holdout) is held out and judges
    every candidate list. Search: exponential then binary search on the ranked prefix, then each
    excluded node is re-included in turn and stays quantized when the target still holds. The search
    runs first on estimates (the INT8 model with those nodes computed in float, as nodes_to_exclude
    would: no re-quantization), then its answer is re-quantized, verified and pruned for real. A
    static recipe is calibrated once; --max-trials / --time-budget cap the search. Exit code 3 when no
    list short of keeping every quantized node in float meets the target, or when the budget ran
    out before any list met it."""
    from diag.errors import GATE_FAILED
    from diag.exclude import summary_lines
    from diag.recipe import Recipe, recipe_from_option
    from diag.verbs import exclude_to_dir

    recipe = recipe_from_option(args.recipe) if args.recipe else Recipe(mode="dynamic")
    if args.tiers:
        return _exclude_tiers(args, recipe)
    result, files = exclude_to_dir(args.fp32, recipe, _feed_spec(args), _exclude_options(args), args.out)
    for line in summary_lines(result):
        print(_safe(line))
    _print_cluster(result.cluster)
    for name, path in files.items():
        print(f"wrote {name}: {path}")
    return OK if result.reachable else GATE_FAILED


def _search_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags diag exclude and diag exclude --tiers share, as :class:`diag.exclude.SearchOptions` fields."""
    return {
        "target": args.target,
        "holdout": args.holdout,
        "labels": args.labels,
        "threads": args.threads,
        "bench_runs": args.bench_runs,
        "progress": not args.quiet,
        "max_trials": args.max_trials,
        "time_budget": args.time_budget,
        "metric": args.metric,
    }


def _exclude_options(args: argparse.Namespace) -> ExcludeOptions:
    """``diag exclude``'s flags as :class:`diag.exclude.ExcludeOptions`."""
    from diag.exclude import ExcludeOptions

    return ExcludeOptions(**_search_options(args), estimates=not args.no_estimates, scheduler=args.scheduler)


def _tier_options(args: argparse.Namespace) -> TierOptions:
    """``diag exclude --tiers``'s flags as :class:`diag.tiers.TierOptions`."""
    from diag.tiers import TierOptions

    for flag, given in (("--scheduler", args.scheduler), ("--no-estimates", args.no_estimates)):
        if given:
            raise DiagError(
                "bad-option", f"{flag} with --tiers", "is not supported by the tier search", f"drop {flag} or --tiers"
            )
    return TierOptions(**_search_options(args), tiers=args.tiers)


def _exclude_tiers(args: argparse.Namespace, recipe: Any) -> int:
    """`diag exclude --tiers`: a mixed-precision plan across tiers (see diag.tiers)."""
    from diag.errors import GATE_FAILED
    from diag.tiers import summary_lines
    from diag.verbs import tier_plan_to_dir

    options = _tier_options(args)
    plan, files = tier_plan_to_dir(args.fp32, recipe, _feed_spec(args), options, args.out)
    for line in summary_lines(plan):
        print(_safe(line))
    for name, path in files.items():
        print(f"wrote {name}: {path}")
    return OK if plan.reachable else GATE_FAILED


EXCLUDE_TARGET_HELP = """\
Targets (--target METRIC>=VALUE or METRIC<=VALUE), measured on the held-out samples only,
FP32 output x vs quantized output y:
  cosine>=V         min over samples and outputs of the per-sample cosine sum(x*y)/sqrt(sum x^2 * sum y^2)
  max_abs<=V        max |y - x| over every element of every output
  agreement>=V      top-1 agreement: share of rows (last axis = classes) whose argmax equals FP32's
                    (worst class-like output)
  accuracy_drop<=V  top-1 accuracy FP32 minus quantized on the first output, against --labels
  f1_drop<=V        macro-F1 (mean over labelled classes of 2TP/(2TP+FP+FN)) FP32 minus quantized,
                    first output, against --labels
  NAME>=V / NAME<=V a value a --metric plugin's finalize() returns, computed by the plugin on the
                    held-out outputs (>= for names it declares "higher" is better, <= for "lower")
"""


SWEEP_HELP = """\
Objectives (--objective), accuracy on held-out samples, FP32 output x vs INT8 output y:
  cosine         min over samples and outputs of sum(x*y)/sqrt(sum x^2 * sum y^2) (higher is better)
  cosine_mean    mean per-sample cosine, worst output
  max_abs        max |y - x| over every output element (lower is better)
  agreement      top-1 agreement with FP32, worst class-like output
  accuracy_drop  FP32 minus INT8 top-1 accuracy, first output, --labels
  f1_drop        FP32 minus INT8 macro-F1, first output, --labels
  latency        speedup = FP32 p50 / INT8 p50 (median over --repeats); recipes whose speedup ranges
                 overlap or differ by < 5 % share a rank ("no measurable difference")
  size           INT8 model file size
Grid file (TOML): a list is an axis, a scalar is fixed, e.g.
  mode = ["dynamic", "static"]
  quant_format = ["QDQ", "QOperator"]
  per_channel = [false, true]
  [extra_options]
  ActivationSymmetric = [false, true]
"""


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize an FP32 model with onnxruntime as a recipe says, guarded and verified.

    Pre-flight fixes, each reported: Constant-node weights lifted to initializers, opset upgraded to
    13 for per-channel QDQ, quant_pre_process retried without symbolic shape inference (or sympy),
    external data for large models. The INT8 model is written (atomically) only after it loads in
    onnxruntime. A recipe with "mode": "weight_only" runs MatMulNBitsQuantizer (bits, block_size,
    is_symmetric, accuracy_level; node_bits quantizes named nodes at another width).
    """
    from diag.verbs import quantize_to_file

    _, lines = quantize_to_file(args.fp32, _quantize_options(args))
    for line in lines:
        print(_safe(line))
    return OK


def _quantize_options(args: argparse.Namespace) -> QuantizeOptions:
    """``diag quantize``'s flags as :class:`diag.quantize.QuantizeOptions`."""
    from diag.feeds import FeedSpec
    from diag.quantize import QuantizeOptions

    calib = FeedSpec(inputs=args.calib, reader=args.reader, batch=args.batch) if args.calib or args.reader else None
    return QuantizeOptions(
        recipe=args.recipe,
        out=args.o,
        calibration=calib,
        samples=args.samples,
        progress=not args.quiet,
        verbose=args.verbose,
    )


def cmd_sweep(args: argparse.Namespace) -> int:
    """Quantize a model with every recipe of a grid and measure each: metrics, size, latency, noise.

    Default grid: mode {dynamic, static QDQ, static QOperator} x weight_type {QInt8, QUInt8} x
    per_channel x reduce_range x ActivationSymmetric (48 recipes; static recipes use QUInt8
    activations). --grid FILE (.toml/.json) or inline JSON: a list is an axis, a scalar a fixed key.
    Metrics on held-out samples (all of --inputs with --calib, else the last --holdout share; the
    first part calibrates). Latency: --repeats x (--runs timed runs) of FP32 and INT8 interleaved;
    speed differences inside the noise are "no measurable difference". Recipes onnxruntime rejects
    are skipped with its reason. Writes sweep.json, sweep.md, sweep.html, pareto.svg and
    best.recipe.json into --out; every finished recipe is appended to sweep.jsonl, so an interrupted
    sweep resumes where it stopped when run again."""
    from diag.errors import INTERRUPTED
    from diag.sweep import summary_lines
    from diag.verbs import sweep_to_dir

    try:
        result, files = sweep_to_dir(args.fp32, _feed_spec(args), args.out, _sweep_options(args))
    except KeyboardInterrupt:
        from pathlib import Path

        jsonl = Path(args.out) / "sweep.jsonl"
        finished = jsonl.is_file() and jsonl.stat().st_size > 0
        state = interrupt_state()
        if finished and state == "no output was written":
            state = f"finished recipes are in {_safe(jsonl)}: run the same command again to resume"
        print(f"diag: interrupted; {state}", file=sys.stderr)
        return INTERRUPTED
    for line in summary_lines(result):
        print(_safe(line))
    _print_cluster(result.cluster)
    for name, path in files.items():
        print(f"wrote {name}: {_safe(path)}")
    return OK


def _sweep_options(args: argparse.Namespace) -> SweepOptions:
    """``diag sweep``'s flags as :class:`diag.sweep.SweepOptions`."""
    from diag.feeds import FeedSpec
    from diag.sweep import SweepOptions

    return SweepOptions(
        grid=args.grid,
        calib=FeedSpec(inputs=args.calib, batch=args.batch) if args.calib else None,
        objective=args.objective,
        target=args.target,
        labels=args.labels,
        holdout=args.holdout,
        runs=args.runs,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        progress=not args.quiet,
        scheduler=args.scheduler,
    )


# ---------------------------------------------------------------- parser

VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect,
    "compare": cmd_compare,
    "merge": cmd_merge,
    "report": cmd_report,
    "demo": cmd_demo,
    "quantize": cmd_quantize,
    "bench": cmd_bench,
    "lint": cmd_lint,
    "check": cmd_check,
    "diff": cmd_diff,
    "exclude": cmd_exclude,
    "sweep": cmd_sweep,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diag",
        description="Find which operator broke your INT8 ONNX model, and what to do about it.",
        epilog="Exit codes: 0 ok, 1 internal error, 2 user error, 3 gate failed, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"diag {__version__}")
    parser.add_argument("--debug", dest="global_debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")

    def verb(name: str, **kw: Any) -> argparse.ArgumentParser:
        doc = inspect.cleandoc(VERBS[name].__doc__ or "")
        # The verb list shows the docstring's first sentence, however many lines it spans.
        paragraph = " ".join(doc.split("\n\n")[0].split())
        summary = paragraph.split(". ")[0].rstrip(".") + "."
        p = sub.add_parser(
            name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kw
        )
        p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
        return p

    p = verb("inspect")
    p.add_argument("model", help="an .onnx model (FP32 or INT8)")
    p.add_argument("--recipe", action="store_true", help="print the recipe that made this INT8 model (TOML)")
    p.add_argument("--recipe-out", metavar="FILE", help="write that recipe to FILE (.toml or .json)")

    p = verb("compare", epilog=TARGET_HELP)
    p.add_argument("fp32", help="the FP32 model")
    p.add_argument("int8", help="its INT8 version (quantize_dynamic or quantize_static, QDQ or QOperator)")
    _add_feed_flags(p)
    p.add_argument("--out", default="diag-out", metavar="DIR", help="output folder (default diag-out)")
    p.add_argument(
        "--ort-opt-level",
        choices=["disabled", "basic", "extended", "all"],
        default="disabled",
        help="onnxruntime graph optimizations; 'disabled' (default) keeps every tensor comparable",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="intra-op threads of every session; they run one after the other (default: every core)",
    )
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="budget for one batch's exposed tensors (e.g. 4GB); above it they are split into passes",
    )
    p.add_argument(
        "--shard",
        metavar="K/N",
        help="run batches K, K+N, K+2N, ... only and keep the mergeable state (combine with diag merge)",
    )
    p.add_argument(
        "--reductions",
        choices=["graph", "numpy"],
        default="numpy",
        help="where per-tensor statistics are computed: 'numpy' (default) exposes every tensor and reduces it "
        "in numpy (the reference); 'graph' computes them inside onnxruntime, one diagnostic graph per pass",
    )
    p.add_argument("--no-local", action="store_true", help="skip the local-error pass (faster, no root causes)")
    p.add_argument(
        "--no-distributions",
        action="store_true",
        help="skip histograms, quantization health and outlier channels (faster)",
    )
    p.add_argument(
        "--outlier-factor",
        type=float,
        default=6.0,
        metavar="X",
        help="a channel is an outlier when its max |x| exceeds the median channel's X times (default 6)",
    )
    p.add_argument(
        "--sensitivity",
        type=int,
        nargs="?",
        const=5,
        default=0,
        metavar="K",
        help="skip-one sensitivity: re-quantize with each of the top K (default 5) local-ranking nodes kept in "
        "float and measure the outputs; needs --recipe",
    )
    p.add_argument(
        "--recipe",
        metavar="R",
        help="the recipe that made the INT8 model (file or inline JSON; diag inspect INT8 --recipe writes one)",
    )
    p.add_argument(
        "--output-kind",
        action="append",
        metavar="NAME=KIND",
        help="what an output is, when the graph evidence guesses wrong (repeatable): logits (top-1 agreement + "
        "max abs error), probabilities (agreement + cosine), probability-map (mask IoU at 0.5 + cosine), "
        "embedding (min per-sample cosine), boxes / regression (cosine + max abs error relative to the largest "
        "|value|), detector (each Concat part by its own kind)",
    )
    p.add_argument(
        "--effects",
        type=int,
        default=8,
        metavar="K",
        help="confirm root causes by effect: keep each of K candidates (worst local error, error-path roots, "
        "output heads) in float in the INT8 model and measure how much output error it removes (default 8; 0 off)",
    )
    p.add_argument(
        "--effect-samples",
        type=int,
        default=8,
        metavar="N",
        help="samples each effect check runs on (the first N; default 8)",
    )
    p.add_argument(
        "--accuracy-level-check",
        type=int,
        metavar="LEVEL",
        default=0,
        help="weight-only models: also run every MatMulNBits node at accuracy_level LEVEL (4: int8 inputs) and "
        "measure it against accuracy_level 0 (float inputs) on the first --effect-samples samples",
    )
    p.add_argument(
        "--labels",
        metavar="PATH",
        help=".npy of class indices, one per sample in input order: grades the accuracy drop and the macro-F1 drop "
        "of the first output (macro and micro F1 in diag.json)",
    )
    p.add_argument(
        "--metric",
        metavar="MOD:FUNC",
        help="task-metric plugin: import MOD and call FUNC() for an object with update(fp32_outputs, int8_outputs, "
        "labels_or_None), merge(other), finalize() -> {name: value} and better = {name: 'higher'|'lower'}; "
        "its values are reported with the outputs (with --shard it also needs state() / from_state())",
    )
    p.add_argument(
        "--scheduler",
        metavar="ADDRESS|local[:N]",
        help="run the batches as shards on the Dask scheduler at ADDRESS (tcp://host:8786), or on a LocalCluster "
        'of N worker processes (default N: every core); same answer as without; needs pip install "diag[dask]"',
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = verb("merge")
    p.add_argument("parts", nargs="+", metavar="PART", help="diag.json of every shard (diag compare --shard K/N)")
    p.add_argument("--out", default="diag-out", metavar="DIR", help="output folder (default diag-out)")
    p.add_argument("--fp32", metavar="PATH", help="the FP32 model, when it moved since the shards ran")
    p.add_argument("--int8", metavar="PATH", help="the INT8 model, when it moved since the shards ran")

    p = verb("report")
    p.add_argument("json", help="a diag.json written by diag compare")
    p.add_argument(
        "--out",
        default="diag-out",
        metavar="DIR|FILE.html",
        help="folder for report.html + summary.md, or a single .html path",
    )

    p = verb("exclude", epilog=EXCLUDE_TARGET_HELP)
    p.add_argument("fp32", help="the FP32 model")
    p.add_argument(
        "--recipe",
        metavar="PATH",
        help='recipe .json/.toml (onnxruntime\'s argument names); default {"mode": "dynamic"}',
    )
    p.add_argument("--target", required=True, metavar="METRIC>=V", help="goal on held-out inputs, e.g. cosine>=0.999")
    _add_feed_flags(p)
    p.add_argument(
        "--holdout",
        type=float,
        default=0.5,
        metavar="F",
        help="share of the samples held out for verification, cut on batch boundaries (default 0.5)",
    )
    p.add_argument("--labels", metavar="PATH", help=".npy of class indices (accuracy_drop / f1_drop targets)")
    p.add_argument(
        "--metric",
        metavar="MOD:FUNC",
        help="task-metric plugin (as in diag compare --metric): the names its better declares are targets, "
        "e.g. --target map50>=0.6",
    )
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: onnxruntime's)")
    p.add_argument(
        "--bench-runs", type=int, default=20, metavar="N", help="timed runs per model for latency (0: skip; default 20)"
    )
    p.add_argument(
        "--max-trials",
        type=int,
        metavar="N",
        help="at most N quantizations (the baseline included); when reached, the answer is the smallest list that "
        "met the target so far, reported as 'budget exhausted' (default: no cap)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="start no new trial after SECONDS; as --max-trials when reached (default: no limit)",
    )
    p.add_argument(
        "--no-estimates",
        action="store_true",
        help="re-quantize every trial instead of searching on float-region estimates of the INT8 model first "
        "(slower; the answer is verified by re-quantization either way)",
    )
    p.add_argument(
        "--tiers",
        metavar="T1,T2,...",
        help="mixed-precision plan across tiers, lowest (the recipe's) first: int4,int8,fp32 (weight_only), "
        "int8,a16,fp32 (static: a16 = 16-bit activations via TensorQuantOverrides), int8,fp32; nodes are "
        "promoted one tier at a time; writes tiers.json, recipe.json, the plan model and reproduce.py",
    )
    p.add_argument("--out", default="diag-exclude", metavar="DIR", help="output folder (default diag-exclude)")
    p.add_argument(
        "--scheduler",
        metavar="ADDRESS|local[:N]",
        help="run the search's trials as Dask tasks on the scheduler at ADDRESS (tcp://host:8786), or on a "
        "LocalCluster of N worker processes (default N: every core); same list as without; needs "
        'pip install "diag[dask]"',
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")

    p = verb("demo")
    p.add_argument("--out", default="diag-demo", metavar="DIR", help="output folder (default diag-demo)")
    p.add_argument(
        "--fixture",
        default="transformer",
        choices=["transformer", "convnet"],
        help="which bundled model (default transformer: an outlier hidden dimension)",
    )
    p.add_argument(
        "--format",
        default="dynamic",
        choices=["dynamic", "qdq", "qoperator"],
        help="quantization format to demonstrate (default dynamic)",
    )
    p.add_argument("--samples", type=int, default=32, help="samples to compare (default 32)")
    p.add_argument("--no-fix", action="store_true", help="diagnose only; skip the verified exclusion in DIR/fix")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = verb("quantize")
    p.add_argument("fp32", help="the FP32 model (never modified)")
    p.add_argument(
        "--recipe",
        required=True,
        metavar="R",
        help="recipe file (.json or .toml; see README 'Recipe file') or inline JSON such as '{\"mode\": \"dynamic\"}'",
    )
    p.add_argument("-o", required=True, metavar="OUT.onnx", help="the INT8 model to write")
    g = p.add_argument_group('calibration inputs (static recipes; default: the recipe\'s "calibration")')
    g.add_argument(
        "--calib",
        metavar="PATH",
        help=".npz with one array per model input stacked along axis 0, or a folder whose every .npz is one feed dict",
    )
    g.add_argument(
        "--reader", metavar="MOD:FACTORY", help="FACTORY(): an iterable of feed dicts or a CalibrationDataReader"
    )
    g.add_argument("--samples", type=int, metavar="N", help="calibrate on the first N samples")
    g.add_argument("--batch", type=int, default=1, metavar="B", help="samples per calibration run (default 1)")
    p.add_argument("--verbose", action="store_true", help="print onnxruntime's own log messages")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = verb("check", epilog=TARGET_HELP)
    p.add_argument("json", help="a diag.json written by diag compare")
    p.add_argument("--min-sqnr", type=float, metavar="DB", help="fail when an output's SQNR is below DB")
    p.add_argument("--min-cosine", type=float, metavar="C", help="fail when an output's min per-sample cosine < C")
    p.add_argument("--max-abs", type=float, metavar="E", help="fail when an output's max abs error > E")
    p.add_argument(
        "--min-agreement", type=float, metavar="F", help="fail when a class-like output's top-1 agreement < F (0.99)"
    )
    p.add_argument(
        "--max-accuracy-drop",
        type=float,
        metavar="F",
        help="fail when the FP32 - INT8 top-1 accuracy drop (run with --labels) > F (0.005 = 0.5 %%)",
    )
    p.add_argument(
        "--max-f1-drop",
        type=float,
        metavar="F",
        help="fail when the FP32 - INT8 macro-F1 drop (run with --labels) > F (0.005 = 0.5 %%)",
    )
    p.add_argument(
        "--max-grade",
        choices=["excellent", "acceptable", "marginal", "reject"],
        help="fail when the model's verdict grade is worse",
    )
    p.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="NAME",
        help="apply the metric gates to this output only (repeatable; default: every output)",
    )

    p = verb("diff")
    p.add_argument("a", help="the baseline diag.json")
    p.add_argument("b", help="the new diag.json (deltas are b - a)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="nodes per SQNR ranking (default 10)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON instead of text")

    p = verb("bench")
    p.add_argument("models", nargs="+", help="models to time, FP32 first (speedup is relative to the first)")
    _add_feed_flags(p)
    p.add_argument("--runs", type=int, default=50, help="timed runs per model, one batch each (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per model first (default 5)")
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: physical cores)")
    p.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = verb("lint")
    p.add_argument("recipe", help="a recipe file (.json or .toml)")
    p.add_argument("--model", metavar="FP32", help="the FP32 model: check node names and op types against it")

    p = verb("sweep", epilog=SWEEP_HELP)
    p.add_argument("fp32", help="the FP32 model (never modified)")
    _add_feed_flags(p)
    p.add_argument(
        "--calib",
        metavar="PATH",
        help="calibration inputs for static recipes (.npz or folder); then every --inputs sample is held out",
    )
    p.add_argument("--grid", metavar="FILE|JSON", help="grid .toml/.json file or inline JSON (default: the 48 recipes)")
    p.add_argument(
        "--objective",
        default="cosine",
        choices=["cosine", "cosine_mean", "max_abs", "agreement", "accuracy_drop", "f1_drop", "latency", "size"],
        help="what the table is sorted by and the best recipe is chosen on (default cosine)",
    )
    p.add_argument("--target", metavar="METRIC>=V", help="the best recipe must meet this, e.g. cosine>=0.999")
    p.add_argument("--labels", metavar="PATH", help=".npy of class indices (accuracy_drop / f1_drop)")
    p.add_argument(
        "--holdout",
        type=float,
        default=0.5,
        metavar="F",
        help="without --calib: share of the samples held out for metrics and latency (default 0.5)",
    )
    p.add_argument("--runs", type=int, default=20, help="timed runs per model and repeat (0: no latency; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per model and repeat (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="latency repeats; their spread is the noise (default 3)")
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: physical cores)")
    p.add_argument("--out", default="diag-sweep", metavar="DIR", help="output folder (default diag-sweep)")
    p.add_argument(
        "--scheduler",
        metavar="ADDRESS|local[:N]",
        help="quantize and measure the recipes as Dask tasks on the scheduler at ADDRESS (tcp://host:8786), or on a "
        "LocalCluster of N worker processes (default N: every core); latency is timed afterwards on this machine; "
        'needs pip install "diag[dask]"',
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from diag import files

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return USER_ERROR
    # `diag --debug VERB` and `diag VERB --debug` alike: the verb's own default must not undo the global flag.
    args.debug = bool(args.debug or getattr(args, "global_debug", False))
    files.reset()
    try:
        with warnings.catch_warnings(), _sigterm_as_interrupt():
            if not args.debug:
                # NOTE: library warnings (numpy overflow, matplotlib glyphs, onnxruntime advice) would
                # break the one-line contract of stdout/stderr; --debug shows them.
                warnings.simplefilter("ignore")
            return VERBS[args.verb](args)
    except DiagError as e:
        files.remove_created_empty_folders()
        if args.debug:
            raise
        print(f"diag: error[{e.slug}]: {_safe(e.message())}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `diag ... | head`: the reader left, nothing more to say
        return OK
    except KeyboardInterrupt:
        print(f"diag: interrupted; {interrupt_state()}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # a bug: say so, one line, keep the traceback behind --debug
        files.remove_created_empty_folders()
        if args.debug:
            raise
        print(
            f"diag: internal error: {type(e).__name__}: {_safe(e)} (re-run with --debug and report it)", file=sys.stderr
        )
        return INTERNAL_ERROR


def interrupt_state() -> str:
    """What is on disk after Ctrl-C: output sets are written whole (diag.files.write_set) or not at all."""
    from diag import files

    written = files.written_sets()
    files.remove_created_empty_folders()
    if not written:
        return "no output was written"
    names = ", ".join(_safe(p) for s in written for p in s)
    return f"the new outputs are complete ({names})"


class _sigterm_as_interrupt:
    """SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so work folders are removed on the way out."""

    def __enter__(self) -> None:
        import signal
        import threading

        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
