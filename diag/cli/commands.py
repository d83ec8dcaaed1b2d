"""The ``diag`` command line: each verb parses flags into options, makes one library call and
prints the library's own lines (:mod:`diag.cli.verbs`).

Exit codes live here: 0 ok, 1 internal error (a bug: please report), 2 user error (one line
``diag: error[<slug>]: ...``), 3 a CI gate failed, 130 interrupted. ``--debug`` shows tracebacks.

NOTE: the library (numpy, onnx, onnxruntime, matplotlib behind it) is imported inside the verbs and
the options builders, not at module top, so that ``diag --help`` is instant
(``tests/test_cli.py::test_help_is_instant_because_heavy_modules_are_not_imported``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diag.foundations import files
from diag.foundations.environment import __version__, printable, use_custom_op_libraries
from diag.foundations.errors import GATE_FAILED, INTERNAL_ERROR, INTERRUPTED, OK, USER_ERROR, DiagError
from diag.foundations.metricnames import gates, objective_help, objective_names, target_help
from diag.foundations.ortfacts import DEPLOY_LEVEL, OPT_LEVELS
from diag.foundations.summary import Summary
from diag.report.diff import DiffOptions, run_diff
from diag.report.gate import CheckOptions, Gates, run_check

if TYPE_CHECKING:
    from diag.analysis.compare import CompareOptions
    from diag.cli.verbs import (
        DemoOptions,
        InspectOptions,
        LintOptions,
        MergeOptions,
        ReportOptions,
    )
    from diag.core.feeds import FeedSpec

if TYPE_CHECKING:  # the options of the fixing verbs (their modules import numpy and onnx)
    from diag.fix.bench import BenchOptions
    from diag.fix.exclude import ExcludeOptions
    from diag.fix.quantize import QuantizeOptions
    from diag.fix.sweep import SweepOptions
    from diag.fix.tiers import TierOptions

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
    return printable(text)


def _emit(summary: Summary) -> int:
    """Print a verb's lines (made printable) and turn its gate into the exit code."""
    for line in summary.lines:
        print(_safe(line))
    return GATE_FAILED if summary.failed else OK


# ---------------------------------------------------------------- flag groups
# Each flag that several verbs take is defined once here: its name, type and metavar; the verb
# gives only the help text that says what the flag means for it.


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


def _add_out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, metavar="DIR", help=f"output folder (default {default})")


def _add_threads(p: argparse.ArgumentParser, default: str = "physical cores", help: str | None = None) -> None:
    p.add_argument("--threads", type=int, help=help or f"intra-op threads per session (default: {default})")


def _add_quiet(p: argparse.ArgumentParser, what: str = "bar") -> None:
    p.add_argument("--quiet", action="store_true", help=f"no progress {what}")


def _add_scheduler(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--scheduler", metavar="ADDRESS|local[:N]", help=help)


def _add_target(p: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    p.add_argument("--target", required=required, metavar="METRIC>=V", help=help)


def _add_recipe(p: argparse.ArgumentParser, help: str, metavar: str = "R", required: bool = False) -> None:
    p.add_argument("--recipe", required=required, metavar=metavar, help=help)


def _add_labels(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--labels", metavar="PATH", help=help)


def _add_metric(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--metric", metavar="MOD:FUNC", help=help)


def _add_holdout(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--holdout", type=float, default=0.5, metavar="F", help=help)


# ---------------------------------------------------------------- options builders
# Flags -> the options of the verb's one library call (tests/test_verb_flags.py checks each).


def feed_spec(args: argparse.Namespace) -> FeedSpec:
    """The inputs flags (:func:`_add_feed_flags`) as a :class:`diag.core.feeds.FeedSpec`."""
    from diag.core.feeds import FeedSpec, parse_shapes

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


def compare_options(args: argparse.Namespace) -> CompareOptions:
    """`diag compare`'s flags as :class:`diag.analysis.compare.CompareOptions` (the inputs: :func:`feed_spec`)."""
    from diag.analysis.compare import CompareOptions
    from diag.core.outputs import parse_output_kinds
    from diag.core.run import parse_effect_samples, parse_local_samples, parse_shard, parse_size

    return CompareOptions(
        opt_level=args.ort_opt_level,
        threads=args.threads,
        max_memory=parse_size(args.max_memory) if args.max_memory else None,
        shard=parse_shard(args.shard) if args.shard else None,
        local=not args.no_local,
        local_samples=parse_local_samples(args.local_samples),
        progress=not args.quiet,
        labels=args.labels,
        distributions=not args.no_distributions,
        outlier_factor=args.outlier_factor,
        sensitivity=args.sensitivity,
        recipe=args.recipe,
        output_kinds=parse_output_kinds(args.output_kind),
        effects=args.effects,
        effect_samples=parse_effect_samples(args.effect_samples),
        accuracy_level_check=args.accuracy_level_check,
        deploy_isa=args.deploy_isa,
        metric=args.metric,
        reductions=args.reductions,
        scheduler=args.scheduler,
        mask_input=args.mask_input,
        no_mask=args.no_mask,
        encodings=args.encodings,
        settings=args.settings,
    )


def inspect_options(args: argparse.Namespace) -> InspectOptions:
    from diag.cli.verbs import InspectOptions

    return InspectOptions(args.model, recipe=args.recipe, recipe_out=args.recipe_out)


def merge_options(args: argparse.Namespace) -> MergeOptions:
    from diag.cli.verbs import MergeOptions

    return MergeOptions(tuple(args.parts), out=args.out, fp32=args.fp32, int8=args.int8)


def report_options(args: argparse.Namespace) -> ReportOptions:
    from diag.cli.verbs import ReportOptions

    return ReportOptions(args.json, out=args.out)


def demo_options(args: argparse.Namespace) -> DemoOptions:
    from diag.cli.verbs import DemoOptions

    return DemoOptions(
        out=args.out,
        fixture=args.fixture,
        format=args.format,
        samples=args.samples,
        progress=not args.quiet,
        fix=not args.no_fix,
    )


def check_options(args: argparse.Namespace) -> CheckOptions:
    bounds = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag in gates()}
    gates_given = Gates(**bounds, max_grade=args.max_grade, outputs=tuple(args.output))
    return CheckOptions(args.json, gates_given)


def diff_options(args: argparse.Namespace) -> DiffOptions:
    return DiffOptions(args.a, args.b, top=args.top, as_json=args.json)


def lint_options(args: argparse.Namespace) -> LintOptions:
    from diag.cli.verbs import LintOptions
    from diag.core.feeds import FeedSpec

    if args.inputs and not args.model:
        raise DiagError(
            "bad-option", "--inputs", "needs --model (the FP32 model the lines are measured on)", "add --model FP32"
        )
    inputs = FeedSpec(inputs=args.inputs, batch=args.batch) if args.inputs else None
    return LintOptions(args.recipe, model=args.model, inputs=inputs, measure=not args.no_measure, threads=args.threads)


# ---------------------------------------------------------------- verbs


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a model's quantization format, opsets, op counts, subgraphs and visible problems.

    With --recipe, print instead the recipe that made an INT8 model (mode, format, types,
    per-channel, symmetric, reduce_range, excluded nodes) as a TOML recipe file; fields a model
    cannot tell (calibrate_method) are commented out with the reason. --recipe-out FILE writes it
    (.toml with the comments, .json without)."""
    from diag.cli import verbs

    return _emit(verbs.inspect(inspect_options(args)))


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare an FP32 model and its INT8 version tensor by tensor; write diag.json, report.html
    and summary.md into --out."""
    from diag.cli import verbs

    return _emit(verbs.compare_to_dir(args.fp32, args.int8, feed_spec(args), args.out, compare_options(args)))


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge the diag.json files of diag compare --shard K/N runs into the result of one run; write
    diag.json, report.html and summary.md into --out."""
    from diag.cli import verbs

    return _emit(verbs.merge(merge_options(args)))


def cmd_demo(args: argparse.Namespace) -> int:
    """Build a bundled fixture with a known defect, quantize it with onnxruntime, compare, then
    derive and verify the fix (the fewest nodes to keep in float for cosine>=0.999 on held-out
    samples) with diag exclude. Works offline."""
    from diag.cli.demo import demo

    return _emit(demo(demo_options(args)))


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render report.html and summary.md from a diag.json without re-running any model."""
    from diag.cli import verbs

    return _emit(verbs.report(report_options(args)))


def cmd_check(args: argparse.Namespace) -> int:
    """CI gate on a diag.json: every gate is applied to every model output and printed as PASS, FAIL or
    SKIP with its margin; exit code 3 when any gate fails.

    A gate on a metric an output does not have (top-1 agreement of a non-class-like output, accuracy
    drop without --labels) is skipped for that output with a printed note, and FAILS when it applies
    to no output at all: a gate that cannot measure anything never passes."""
    return _emit(run_check(check_options(args)))


def cmd_diff(args: argparse.Namespace) -> int:
    """Show what got better or worse between two diag.json runs (b relative to a): grade, per-output
    metric deltas, nodes whose quantized status or role changed, largest SQNR changes, nodes in one
    run only, changed settings and versions."""
    return _emit(run_diff(diff_options(args)))


def cmd_lint(args: argparse.Namespace) -> int:
    """Check a recipe file for what onnxruntime would silently ignore or reject.

    Flags extra_options keys the installed onnxruntime never reads (OpTypesToExclude,
    QuantizationPrecision), node names and op types that match no node of the FP32 model (PyTorch
    module names get the ONNX node names that contain them), and options that contradict each
    other or the format.

    With --model each line the recipe sets is also measured on the model: quantized with and
    without it, a line that changes nothing is a warning, one that changes the model a note with
    what it changes (and, with --inputs, the output SQNR with and without it as deployed).

    Every finding is one line: error, warning or note. Exit code 3 when there is an error
    (onnxruntime would ignore or reject part of the recipe), 0 otherwise."""
    from diag.cli import verbs

    return _emit(verbs.lint(lint_options(args)))


def cmd_bench(args: argparse.Namespace) -> int:
    """Time FP32, INT8 and mixed models on the same inputs: p50/p90/p99, noise, speedup.

    Prints p50 / p90 / p99 latency, the noise band (min-max), samples per second and the speedup
    of each model's p50 over the first model's. Sessions use onnxruntime's default optimization
    level (all), as deployed, with the same intra-op thread count each (default: physical cores);
    models run interleaved, batch by batch, so background load hits them alike. One batch = one
    timed run; batches are cycled."""
    from diag.cli import verbs

    return _emit(verbs.bench_to_json(args.models, feed_spec(args), _bench_options(args)))


def _bench_options(args: argparse.Namespace) -> BenchOptions:
    """``diag bench``'s flags as :class:`diag.fix.bench.BenchOptions`."""
    from diag.fix.bench import BenchOptions

    return BenchOptions(
        runs=args.runs, warmup=args.warmup, threads=args.threads, progress=not args.quiet, json_path=args.json
    )


def cmd_exclude(args: argparse.Namespace) -> int:
    """Find the fewest nodes to keep in float so that the quantized model meets --target on held-out
    inputs; write exclusion.json, the mixed-precision model and reproduce.py into --out.

    With --int8 YOUR_INT8.onnx (the usual case) every trial is your INT8 model with float regions
    spliced in: no quantizer runs, "before" is the model you ship, and the mixed model written is
    your model with those nodes in float, unchanged everywhere else. Without it (or with
    --requantize, after proving the recipe rebuilds your model exactly) trials re-quantize the
    recipe. The first part of the samples ranks the nodes (diag compare); the rest (--holdout) is
    held out and judges every candidate list. Search: exponential then binary search on the ranked
    prefix, then each excluded node is re-included in turn and stays quantized when the target
    still holds; every answer is verified exact and at --deploy-level. --max-trials / --time-budget
    cap the search. Exit code 3 when no list short of keeping (nearly) every quantized node in float
    meets the target, or when the budget ran out before any list met it."""
    from diag.cli import verbs

    if args.tiers:  # a mixed-precision plan across tiers (diag.fix.tiers)
        tiers = _tier_options(args)
        return _emit(verbs.tier_plan_to_dir(args.fp32, args.recipe, feed_spec(args), tiers, args.out))
    return _emit(verbs.exclude_to_dir(args.fp32, args.recipe, feed_spec(args), _exclude_options(args), args.out))


def _search_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags diag exclude and diag exclude --tiers share, as :class:`diag.fix.exclude.SearchOptions` fields."""
    from diag.core.run import parse_size

    if args.requantize and not args.int8:
        raise DiagError(
            "bad-option",
            "--requantize",
            "needs --int8 (the model whose recipe is re-applied)",
            "add --int8 YOUR_INT8.onnx",
        )
    if args.encodings and not args.int8:
        raise DiagError(
            "bad-option",
            "--encodings",
            "needs --int8 (AIMET's FP32 export the encodings belong to)",
            "add --int8 YOUR_EXPORT.onnx",
        )
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
        "int8": args.int8,
        "deploy_level": args.deploy_level,
        "max_memory": parse_size(args.max_memory) if args.max_memory else None,
        "requantize": args.requantize,
        "encodings": args.encodings,
    }


def _exclude_options(args: argparse.Namespace) -> ExcludeOptions:
    """``diag exclude``'s flags as :class:`diag.fix.exclude.ExcludeOptions`."""
    from diag.fix.exclude import ExcludeOptions

    return ExcludeOptions(**_search_options(args), estimates=not args.no_estimates, scheduler=args.scheduler)


def _tier_options(args: argparse.Namespace) -> TierOptions:
    """``diag exclude --tiers``'s flags as :class:`diag.fix.tiers.TierOptions`."""
    from diag.fix.tiers import TierOptions

    for flag, given in (
        ("--scheduler", args.scheduler),
        ("--no-estimates", args.no_estimates),
    ):
        if given:
            raise DiagError(
                "bad-option", f"{flag} with --tiers", "is not supported by the tier search", f"drop {flag} or --tiers"
            )
    return TierOptions(**_search_options(args), tiers=args.tiers)


EXCLUDE_TARGET_HELP = (
    """\
Targets (--target METRIC>=VALUE or METRIC<=VALUE), measured on the held-out samples only,
FP32 output x vs quantized output y:
"""
    + target_help()
    + """\
  NAME>=V / NAME<=V a value a --metric plugin's finalize() returns, computed by the plugin on the
                    held-out outputs (>= for names it declares "higher" is better, <= for "lower")
"""
)


SWEEP_HELP = (
    """\
Objectives (--objective), accuracy on held-out samples, FP32 output x vs INT8 output y:
"""
    + objective_help()
    + """\
Grid file (TOML): a list is an axis, a scalar is fixed, e.g.
  mode = ["dynamic", "static"]
  quant_format = ["QDQ", "QOperator"]
  per_channel = [false, true]
  [extra_options]
  ActivationSymmetric = [false, true]
"""
)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize an FP32 model with onnxruntime as a recipe says, guarded and verified.

    Pre-flight fixes, each reported: Constant-node weights lifted to initializers, opset upgraded to
    13 for per-channel QDQ, quant_pre_process retried without symbolic shape inference (or sympy),
    external data for large models. The INT8 model is written (atomically) only after it loads in
    onnxruntime. A recipe with "mode": "weight_only" runs MatMulNBitsQuantizer (bits, block_size,
    is_symmetric, accuracy_level; node_bits quantizes named nodes at another width).
    """
    from diag.cli import verbs

    return _emit(verbs.quantize_to_file(args.fp32, _quantize_options(args)))


def _quantize_options(args: argparse.Namespace) -> QuantizeOptions:
    """``diag quantize``'s flags as :class:`diag.fix.quantize.QuantizeOptions`."""
    from diag.core.feeds import FeedSpec
    from diag.fix.quantize import QuantizeOptions

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
    from diag.cli import verbs

    return _emit(verbs.sweep_to_dir(args.fp32, feed_spec(args), args.out, _sweep_options(args)))


def _sweep_options(args: argparse.Namespace) -> SweepOptions:
    """``diag sweep``'s flags as :class:`diag.fix.sweep.SweepOptions`."""
    from diag.core.feeds import FeedSpec
    from diag.fix.sweep import SweepOptions

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


# ---------------------------------------------------------------- flags of each verb


def _inspect_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx model (FP32 or INT8)")
    p.add_argument("--recipe", action="store_true", help="print the recipe that made this INT8 model (TOML)")
    p.add_argument("--recipe-out", metavar="FILE", help="write that recipe to FILE (.toml or .json)")


def _compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("fp32", help="the FP32 model")
    p.add_argument("int8", help="its INT8 version (quantize_dynamic or quantize_static, QDQ or QOperator)")
    _add_feed_flags(p)
    _add_out(p, "diag-out")
    p.add_argument(
        "--deploy-level",
        "--ort-opt-level",
        dest="ort_opt_level",
        choices=OPT_LEVELS,
        default=DEPLOY_LEVEL,
        help="the onnxruntime graph optimization level you deploy with: the outputs are graded as the INT8 model "
        "runs there (one extra INT8 run per batch; exact-mode grades beside them); every tensor is compared "
        "in exact mode either way (default: all, onnxruntime's default; disabled: grade exact mode)",
    )
    _add_threads(p, help="intra-op threads of every session; they run one after the other (default: every core)")
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
        "--mask-input",
        metavar="NAME",
        help="the [batch, seq] input whose zeros mark padding: per-tensor errors count the real positions only "
        "(default: an input named attention_mask, when the model has one); diag.json keeps the all-positions "
        "figures beside them",
    )
    p.add_argument("--no-mask", action="store_true", help="count every position, padding included")
    p.add_argument(
        "--encodings",
        metavar="PATH",
        help="AIMET's .encodings JSON for an FP32 second model (AIMET's export): diag builds the QDQ model it "
        "describes and diagnoses that (default: <stem>.encodings beside the second model, when there is one)",
    )
    p.add_argument(
        "--local-samples",
        default="auto",
        metavar="N",
        help="measure local error on the first N samples only, or all (default auto: all, but the first 16 "
        "for FP32 weights of 1 GiB and more, where it costs a model run per sample)",
    )
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
    _compare_analysis_flags(p)


def _compare_analysis_flags(p: argparse.ArgumentParser) -> None:
    """`diag compare`'s flags past the run itself: what is measured on top, task metrics, the cluster."""
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
    _add_recipe(p, "the recipe that made the INT8 model (file or inline JSON; diag inspect INT8 --recipe writes one)")
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
        "--settings",
        choices=["auto", "always", "off"],
        default="auto",
        help="measure the recipe's settings (per_channel, reduce_range, weight_type, symmetry) as causes: when no "
        "node alone explains the error and the recipe (--recipe, or the one read back from a dynamic model) "
        "rebuilds the INT8 model exactly, each is changed alone, re-quantized and measured (default auto: for "
        "FP32 weights under 1 GiB, as each setting re-quantizes the model; always; off)",
    )
    p.add_argument(
        "--effect-samples",
        default="auto",
        metavar="N|auto",
        help="samples each effect check runs on, the first N (default auto: 8, but 4 for FP32 weights of 1 GiB "
        "and more)",
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
        "--deploy-isa",
        choices=["avx2"],
        default=None,
        help="predict what the INT8 model's u8s8 nodes (QInt8 weights) do on an AVX2 CPU without VNNI, where "
        "onnxruntime sums pairs of products in saturating int16: simulated in numpy on this run's captured inputs, "
        "so a VNNI machine learns what an AVX2 server computes",
    )
    _add_labels(
        p,
        ".npy of class indices, one per sample in input order: grades the accuracy drop and the macro-F1 drop "
        "of the first output (macro and micro F1 in diag.json)",
    )
    _add_metric(
        p,
        "task-metric plugin: import MOD and call FUNC() for an object with update(fp32_outputs, int8_outputs, "
        "labels_or_None), merge(other), finalize() -> {name: value} and better = {name: 'higher'|'lower'}; "
        "its values are reported with the outputs (with --shard it also needs state() / from_state())",
    )
    _add_scheduler(
        p,
        "run the batches as shards on the Dask scheduler at ADDRESS (tcp://host:8786), or on a LocalCluster "
        'of N worker processes (default N: every core); same answer as without; needs pip install "diag[dask]"',
    )
    _add_quiet(p)


def _merge_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("parts", nargs="+", metavar="PART", help="diag.json of every shard (diag compare --shard K/N)")
    _add_out(p, "diag-out")
    p.add_argument("--fp32", metavar="PATH", help="the FP32 model, when it moved since the shards ran")
    p.add_argument("--int8", metavar="PATH", help="the INT8 model, when it moved since the shards ran")


def _report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("json", help="a diag.json written by diag compare")
    p.add_argument(
        "--out",
        default="diag-out",
        metavar="DIR|FILE.html",
        help="folder for report.html + summary.md, or a single .html path",
    )


def _add_int8_flags(p: argparse.ArgumentParser) -> None:
    """``--int8`` and ``--requantize``: where a search starts (the user's model) and whether it re-quantizes."""
    p.add_argument(
        "--int8",
        metavar="MODEL",
        help="your INT8 model, whatever quantizer made it: every trial is that model with float regions spliced "
        "in (no re-quantization), so 'before' is the model you ship and the fix is your model with those nodes in "
        "float; with --recipe (or --requantize), the recipe is first proven to rebuild it exactly",
    )
    p.add_argument(
        "--requantize",
        action="store_true",
        help="with --int8: re-quantize every trial from the recipe read back from it (or --recipe), so that "
        "calibration sees the exclusions; refused (recipe-mismatch, exit 2) unless the recipe rebuilds your "
        "INT8 model exactly",
    )
    p.add_argument(
        "--encodings",
        metavar="PATH",
        help="with --int8 AIMET's FP32 export: its .encodings JSON (default: <stem>.encodings beside it); every "
        "trial is the QDQ model your encodings describe with the float nodes' encodings taken out, and the fix "
        "is written as your encodings file, edited",
    )


def _exclude_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("fp32", help="the FP32 model")
    _add_recipe(
        p,
        "recipe .json/.toml (onnxruntime's argument names); default: --int8's recipe, else "
        '{"mode": "dynamic"} (onnxruntime\'s defaults)',
        metavar="PATH",
    )
    _add_int8_flags(p)
    _add_target(p, "goal on held-out inputs, e.g. cosine>=0.999", required=True)
    p.add_argument(
        "--deploy-level",
        choices=OPT_LEVELS,
        default=DEPLOY_LEVEL,
        help="the onnxruntime graph optimization level you deploy with: a list meets the target only when it "
        "holds in exact mode (what the search compares) and at this level, where fused integer kernels can undo "
        "an exclusion (default: all, onnxruntime's default; disabled: exact mode only)",
    )
    _add_feed_flags(p)
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="as in diag compare: budget for one batch's exposed tensors in the ranking pass (e.g. 4GB); above "
        "it they are split into passes",
    )
    _add_holdout(p, "share of the samples held out for verification, cut on batch boundaries (default 0.5)")
    _add_labels(p, ".npy of class indices (accuracy_drop / f1_drop targets)")
    _add_metric(
        p,
        "task-metric plugin (as in diag compare --metric): the names its better declares are targets, "
        "e.g. --target map50>=0.6",
    )
    _add_threads(p, "onnxruntime's")
    p.add_argument(
        "--bench-runs", type=int, default=20, metavar="N", help="timed runs per model for latency (0: skip; default 20)"
    )
    p.add_argument(
        "--max-trials",
        type=int,
        metavar="N",
        help="at most N trials, the baseline included (quantizations, or models spliced from your --int8 model "
        "plus the model itself); when reached, the answer is the smallest list that "
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
        "promoted one tier at a time; writes tiers.json, recipe.json, the plan model and reproduce.py. With "
        "--int8 the plan is spliced into your model (fp32 nodes in float, weight-only nodes re-blocked at a "
        "wider width from the FP32 weight): no quantizer runs",
    )
    _add_out(p, "diag-exclude")
    _add_scheduler(
        p,
        "run the search's trials as Dask tasks on the scheduler at ADDRESS (tcp://host:8786), or on a "
        "LocalCluster of N worker processes (default N: every core); same list as without; needs "
        'pip install "diag[dask]"',
    )
    _add_quiet(p, "lines")


def _demo_flags(p: argparse.ArgumentParser) -> None:
    _add_out(p, "diag-demo")
    p.add_argument(
        "--fixture",
        default="transformer",
        choices=["transformer", "convnet", "ctc", "llama"],
        help="which bundled model (default transformer: an outlier hidden dimension; convnet: an outlier "
        "conv channel; ctc: a CTC text-recognizer head, [batch, steps, classes]; llama: a Llama-shaped "
        "decoder with external data, 4-bit MatMulNBits, one planted down_proj channel, fixed by a tier plan)",
    )
    p.add_argument(
        "--format",
        default=None,
        choices=["dynamic", "qdq", "qoperator", "int4", "aimet"],
        help="quantization format to demonstrate (default: int4 for llama, dynamic for the others; aimet: AIMET's "
        "export, the FP32 graph plus a .encodings file holding onnxruntime's static QDQ quantization, fixed in "
        "its encodings)",
    )
    p.add_argument("--samples", type=int, default=32, help="samples to compare (default 32)")
    p.add_argument("--no-fix", action="store_true", help="diagnose only; skip the verified exclusion in DIR/fix")
    _add_quiet(p)


def _quantize_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("fp32", help="the FP32 model (never modified)")
    _add_recipe(
        p,
        "recipe file (.json or .toml; see README 'Recipe file') or inline JSON such as '{\"mode\": \"dynamic\"}'",
        required=True,
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
    _add_quiet(p)


def _check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("json", help="a diag.json written by diag compare")
    for flag, (_, _, gate) in gates().items():
        p.add_argument(f"--{flag}", type=float, metavar=gate.metavar, help=gate.help.replace("%", "%%"))
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


def _diff_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="the baseline diag.json")
    p.add_argument("b", help="the new diag.json (deltas are b - a)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="nodes per SQNR ranking (default 10)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON instead of text")


def _bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", help="models to time, FP32 first (speedup is relative to the first)")
    _add_feed_flags(p)
    p.add_argument("--runs", type=int, default=50, help="timed runs per model, one batch each (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per model first (default 5)")
    _add_threads(p)
    p.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    _add_quiet(p)


def _lint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a recipe file (.json or .toml)")
    p.add_argument(
        "--model",
        metavar="FP32",
        help="the FP32 model: check node names and op types against it, and measure each recipe line on it "
        "(quantized with and without the line: 'changes nothing' or what it changes)",
    )
    p.add_argument(
        "--inputs",
        metavar="NPZ",
        help="with --model: also measure each line's effect on the outputs (SQNR against FP32 as onnxruntime runs "
        "the model by default, first 16 samples)",
    )
    p.add_argument("--batch", type=int, default=1, metavar="N", help="samples per run with --inputs (default 1)")
    p.add_argument("--no-measure", action="store_true", help="with --model: check names only, quantize nothing")
    p.add_argument("--threads", type=int, metavar="N", help="onnxruntime intra-op threads for the measurement")


def _sweep_flags(p: argparse.ArgumentParser) -> None:
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
        choices=list(objective_names()),
        help="what the table is sorted by and the best recipe is chosen on (default cosine)",
    )
    _add_target(p, "the best recipe must meet this, e.g. cosine>=0.999")
    _add_labels(p, ".npy of class indices (accuracy_drop / f1_drop)")
    _add_holdout(p, "without --calib: share of the samples held out for metrics and latency (default 0.5)")
    p.add_argument("--runs", type=int, default=20, help="timed runs per model and repeat (0: no latency; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per model and repeat (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="latency repeats; their spread is the noise (default 3)")
    _add_threads(p)
    _add_out(p, "diag-sweep")
    _add_scheduler(
        p,
        "quantize and measure the recipes as Dask tasks on the scheduler at ADDRESS (tcp://host:8786), or on a "
        "LocalCluster of N worker processes (default N: every core); latency is timed afterwards on this machine; "
        'needs pip install "diag[dask]"',
    )
    _add_quiet(p, "lines")


# ---------------------------------------------------------------- the verb registry


@dataclass(frozen=True)
class Verb:
    """One CLI verb, registered once (:data:`VERBS`): its subparser, its line in ``diag --help``,
    the dispatch in :func:`main` and every test or docs check that lists the verbs derive from it.

    Its help is its handler's docstring: the first sentence in ``diag --help``'s verb list, all of
    it in ``diag VERB --help``.
    """

    name: str
    #: ``cmd_<verb>``: parse the flags, build the options, make one library call, print its Summary.
    handler: Callable[[argparse.Namespace], int]
    #: Adds the verb's flags to its subparser (from the flag groups above).
    add_flags: Callable[[argparse.ArgumentParser], None]
    #: Printed after the flags by ``diag VERB --help`` (how its metrics or targets are computed).
    epilog: str | None = None

    @property
    def description(self) -> str:
        """The handler's whole docstring, as ``diag VERB --help`` prints it."""
        return inspect.cleandoc(self.handler.__doc__ or "")

    @property
    def help(self) -> str:
        """The docstring's first sentence, however many lines it spans: the verb's line in ``diag --help``."""
        paragraph = " ".join(self.description.split("\n\n")[0].split())
        return paragraph.split(". ")[0].rstrip(".") + "."

    def add_parser(self, sub: Any) -> argparse.ArgumentParser:
        """The verb's subparser, with its flags and its own ``--debug``."""
        p: argparse.ArgumentParser = sub.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=self.epilog,
        )
        p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
        p.add_argument("--custom-op-library", action="append", default=[], metavar="PATH", help=CUSTOM_OPS_HELP)
        self.add_flags(p)
        return p


#: Every verb, in the order ``diag --help`` lists them: the one registry (a new verb is one row).
VERBS: dict[str, Verb] = {
    v.name: v
    for v in (
        Verb("inspect", cmd_inspect, _inspect_flags),
        Verb("compare", cmd_compare, _compare_flags, TARGET_HELP),
        Verb("merge", cmd_merge, _merge_flags),
        Verb("report", cmd_report, _report_flags),
        Verb("exclude", cmd_exclude, _exclude_flags, EXCLUDE_TARGET_HELP),
        Verb("demo", cmd_demo, _demo_flags),
        Verb("quantize", cmd_quantize, _quantize_flags),
        Verb("check", cmd_check, _check_flags, TARGET_HELP),
        Verb("diff", cmd_diff, _diff_flags),
        Verb("bench", cmd_bench, _bench_flags),
        Verb("lint", cmd_lint, _lint_flags),
        Verb("sweep", cmd_sweep, _sweep_flags, SWEEP_HELP),
    )
}


#: ``--custom-op-library``'s help, on ``diag`` and on every verb.
CUSTOM_OPS_HELP = (
    "a shared library of onnxruntime custom ops the models need (e.g. AMD Quark's libcustom_ops.so for "
    "com.amd.quark Extended(De)QuantizeLinear); every session registers it (repeatable; also "
    "DIAG_CUSTOM_OP_LIBRARIES, paths separated by ':')"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``diag`` parser: global flags, then one subparser per verb of :data:`VERBS`."""
    parser = argparse.ArgumentParser(
        prog="diag",
        description="Find which operator broke your INT8 ONNX model, and what to do about it.",
        epilog="Exit codes: 0 ok, 1 internal error, 2 user error, 3 gate failed, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"diag {__version__}")
    parser.add_argument("--debug", dest="global_debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument(
        "--custom-op-library",
        dest="global_custom_ops",
        action="append",
        default=[],
        metavar="PATH",
        help=CUSTOM_OPS_HELP,
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in VERBS.values():
        verb.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return USER_ERROR
    # `diag --debug VERB` and `diag VERB --debug` alike: the verb's own default must not undo the global flag.
    args.debug = bool(args.debug or getattr(args, "global_debug", False))
    files.reset()
    try:
        libraries = [*getattr(args, "global_custom_ops", []), *getattr(args, "custom_op_library", [])]
        if libraries:  # every onnxruntime session of this run (and of its worker processes) registers them
            use_custom_op_libraries(libraries)
        with warnings.catch_warnings(), files.sigterm_as_interrupt():
            if not args.debug:
                # NOTE: library warnings (numpy overflow, matplotlib glyphs, onnxruntime advice) would
                # break the one-line contract of stdout/stderr; --debug shows them.
                warnings.simplefilter("ignore")
            return VERBS[args.verb].handler(args)
    except DiagError as e:
        files.remove_created_empty_folders()
        if args.debug:
            raise
        print(f"diag: error[{e.slug}]: {_safe(e.message())}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `diag ... | head`: the reader left, nothing more to say
        return OK
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, in any verb: say what is on disk (diag.foundations.files)
        print(f"diag: interrupted; {_safe(files.interrupt_state())}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # a bug: say so, one line, keep the traceback behind --debug
        files.remove_created_empty_folders()
        if args.debug:
            raise
        print(
            f"diag: internal error: {type(e).__name__}: {_safe(e)} (re-run with --debug and report it)", file=sys.stderr
        )
        return INTERNAL_ERROR


if __name__ == "__main__":  # python -m diag.cli.commands, as python -m diag
    raise SystemExit(main())
