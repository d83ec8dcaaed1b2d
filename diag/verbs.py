"""The library call behind each CLI verb: options in, the verb's output set written all-or-nothing, summary lines out.

The searches and measurements below this layer (:mod:`diag.exclude`, :mod:`diag.tiers`,
:mod:`diag.sweep`, :mod:`diag.bench`, :mod:`diag.quantize`) return results and write nothing;
each function here checks the outputs before any work, runs one of them (on a Dask cluster when
the options name a scheduler: :mod:`diag.cluster`), renders the documents and writes the set
with :func:`diag.files.write_set`.
"""

# --- fixing verbs ---

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diag.bench import DEPLOY_OPT_LEVEL, BenchOptions, LatencyStats, bench_models, format_table
from diag.cluster import ClusterRecipes, ClusterTrialRunner
from diag.compare import CompareResult, environment
from diag.exclude import ExcludeOptions, ExclusionResult, derive_exclusions, reproduce_snippet
from diag.feeds import FeedSource, FeedSpec
from diag.files import check_outputs, internal_writes, output_file, work_dir, write_set
from diag.files import out_dir as checked_out_dir
from diag.load import checked_path
from diag.plots_sweep import pareto_plot
from diag.quantize import QuantizeOptions, QuantizeReport, quantize_model
from diag.recipe import Recipe, recipe_file_text
from diag.report import OUTPUT_NAMES, document_from_result, output_texts
from diag.sweep import (
    JSONL,
    SweepEntry,
    SweepOptions,
    SweepResult,
    load_grid,
    recipe_file_dict,
    render_html,
    render_markdown,
    sweep_model,
    sweep_view,
)
from diag.sweep import OUTPUT_NAMES as SWEEP_OUTPUT_NAMES
from diag.tiers import TierOptions, TierPlan, derive_tier_plan, plan_snippet


def exclude_to_dir(
    fp32_path: str | Path, recipe: Recipe, feeds: FeedSpec, options: ExcludeOptions, out_dir: str | Path
) -> tuple[ExclusionResult, dict[str, Path]]:
    """`diag exclude` end to end: derive, then write exclusion.json, the mixed model and reproduce.py.

    The mixed model and the snippet are written only when the target is reachable. With
    ``options.scheduler`` the trials run on Dask (:class:`diag.cluster.ClusterTrialRunner`).

    Example:
        >>> res, files = exclude_to_dir("fp32.onnx", recipe, FeedSpec(inputs="d.npz"),
        ...                             ExcludeOptions("cosine>=0.999"), "out")  # doctest: +SKIP
        >>> sorted(files)  # doctest: +SKIP
        ['exclusion.json', 'mixed.onnx', 'reproduce.py']
    """
    stem = Path(fp32_path).name.removesuffix(".onnx").removesuffix(".fp32")
    names_out = ["exclusion.json", f"{stem}.mixed.onnx", "reproduce.py", f"{stem}.reproduced.onnx", *OUTPUT_NAMES]
    check_outputs(out_dir, names_out, [fp32_path, feeds.inputs, options.labels, recipe.calibration_path()])
    out = checked_out_dir(out_dir)
    trials = ClusterTrialRunner(options.scheduler, fp32_path, recipe, feeds, options) if options.scheduler else None
    with work_dir(out, "exclude") as work:
        with internal_writes():  # candidate models are not this verb's outputs
            result = derive_exclusions(fp32_path, recipe, feeds, options, str(work), trials)
        contents, names, remove = _exclusion_files(result, recipe, feeds, out, stem)
        exclusion = result.to_dict()
        contents = {out / "exclusion.json": json.dumps(exclusion, indent=1, ensure_ascii=False) + "\n", **contents}
        # One report: the diagnosis of the baseline INT8 model, then the verified fix. The diagnosed
        # model is the recipe's baseline, quantized in a temp folder now gone.
        report, stale = diagnosis_outputs(
            out, result.diagnosis, "baseline INT8 (the recipe as given, quantized by diag exclude)", exclusion
        )
        written = write_set({**contents, **report}, remove=remove + stale)
    files = {"exclusion.json": out / "exclusion.json", **names}
    files.update({k: v for k, v in written.items() if k in OUTPUT_NAMES})
    return result, files


def _exclusion_files(
    result: ExclusionResult, recipe: Recipe, feeds: FeedSpec, out: Path, stem: str
) -> tuple[dict[Path, str | bytes | Path], dict[str, Path], list[Path]]:
    """The mixed model (and its external data) and reproduce.py, or the stale ones to remove.

    NOTE: one set, written all or nothing: exclusion.json, the mixed model (and its external
    data), reproduce.py and the report. When there is no answer, a mixed model left by an
    earlier run in the same folder would read as this run's answer: it is removed in the same step.
    """
    mixed, reproduce, again = out / f"{stem}.mixed.onnx", out / "reproduce.py", out / f"{stem}.reproduced.onnx"
    contents: dict[Path, str | bytes | Path] = {}
    names: dict[str, Path] = {}
    if not (result.reachable and result.model):
        return contents, names, [mixed, reproduce, again]
    staged = Path(result.model)
    for extra in sorted(staged.parent.glob(staged.name + ".*")):  # external data next to the model
        contents[out / extra.name.replace(staged.name, mixed.name, 1)] = extra
    contents[mixed] = staged
    result.model = str(mixed)
    names["mixed model"] = mixed
    calib, count, batch = _calibration_of(recipe, feeds, result.split)
    # NOTE: never the verified model's path: running reproduce.py must not overwrite the answer.
    result.snippet = reproduce_snippet(result, str(again), str(calib) if calib else None, count, batch)
    contents[reproduce] = result.snippet
    names["reproduce.py"] = reproduce
    return contents, names, []


def _calibration_of(recipe: Recipe, feeds: FeedSpec, split: dict[str, Any]) -> tuple[Any, int | None, int]:
    """What reproduce.py calibrates on: the recipe's own data, else the ranking split of the inputs."""
    if recipe.calibration:
        return recipe.calibration_path(), recipe.calibration_samples, 1
    return feeds.inputs, split["ranking_samples"], split["batch"]


def diagnosis_outputs(
    out: Path, diagnosis: CompareResult | None, model_note: str, exclusion: dict[str, Any] | None = None
) -> tuple[dict[Path, str], list[Path]]:
    """The report of a search's diagnosis (diag.json, report.html, summary.md) for ``write_set``.

    Returns (files to write, files to remove): without a diagnosis (the target was already met) an
    earlier run's report would read as this run's, so it is removed in the same step.
    """
    if diagnosis is None:
        return {}, [out / name for name in OUTPUT_NAMES]
    doc = document_from_result(diagnosis)
    doc["models"]["int8"]["path"] = model_note
    if exclusion is not None:
        doc["exclusion"] = exclusion
    return {out / name: text for name, text in output_texts(doc).items()}, []


def tier_plan_to_dir(
    fp32_path: str | Path, recipe: Recipe, feeds: FeedSpec, options: TierOptions, out_dir: str | Path
) -> tuple[TierPlan, dict[str, Path]]:
    """`diag exclude --tiers` end to end: derive the plan, write tiers.json, recipe.json, the model and reproduce.py.

    Example:
        >>> plan, files = tier_plan_to_dir("fp32.onnx", recipe, FeedSpec(inputs="x.npz"),
        ...                                TierOptions("cosine>=0.94", tiers="int4,int8,fp32"), "out")  # doctest: +SKIP
        >>> sorted(files)  # doctest: +SKIP
        ['plan model', 'recipe.json', 'reproduce.py', 'tiers.json']
    """
    stem = Path(fp32_path).name.removesuffix(".onnx").removesuffix(".fp32")
    plan_name = f"{stem}.plan.onnx"
    names_out = ["tiers.json", plan_name, "reproduce.py", "recipe.json", f"{stem}.reproduced.onnx", *OUTPUT_NAMES]
    check_outputs(out_dir, names_out, [fp32_path, feeds.inputs, options.labels, recipe.calibration_path()])
    out = checked_out_dir(out_dir)
    # NOTE: one set, written all or nothing (diag.files.write_set), as diag exclude writes its own:
    # tiers.json, the plan model, recipe.json, reproduce.py and the diagnosis report. Without a plan,
    # an earlier run's model, recipe and script would read as this run's answer: they are removed.
    with work_dir(out, "tiers") as work:
        with internal_writes():  # trial models are not this verb's outputs
            plan = derive_tier_plan(fp32_path, recipe, feeds, options, work_dir=work)
        contents, names, remove = _plan_files(plan, recipe, feeds, out, stem)
        contents = {out / "tiers.json": json.dumps(plan.to_dict(), indent=1, ensure_ascii=False) + "\n", **contents}
        # The diagnosis of the all-lowest model: what ranked the nodes (weight blocks included).
        note = f"all {plan.tiers[0]} (the recipe as given, quantized by diag exclude --tiers)"
        report, stale = diagnosis_outputs(out, plan.diagnosis, note)
        written = write_set({**contents, **report}, remove=remove + stale)
    files = {"tiers.json": out / "tiers.json", **names}
    files.update({k: v for k, v in written.items() if k in OUTPUT_NAMES})
    return plan, files


def _plan_files(
    plan: TierPlan, recipe: Recipe, feeds: FeedSpec, out: Path, stem: str
) -> tuple[dict[Path, str | bytes | Path], dict[str, Path], list[Path]]:
    """The plan model, recipe.json and reproduce.py, or the stale ones to remove."""
    model, reproduce, recipe_out = out / f"{stem}.plan.onnx", out / "reproduce.py", out / "recipe.json"
    contents: dict[Path, str | bytes | Path] = {}
    names: dict[str, Path] = {}
    if not (plan.reachable and plan.model):
        return contents, names, [model, reproduce, recipe_out]
    contents[model] = Path(plan.model)
    plan.model = str(model)
    names["plan model"] = model
    final = Recipe.from_dict(plan.recipe, "plan recipe")
    contents[recipe_out] = recipe_file_text(final, recipe_out)
    names["recipe.json"] = recipe_out
    calib, count, batch = _calibration_of(recipe, feeds, plan.split)
    again = str(out / f"{stem}.reproduced.onnx")
    plan.snippet = plan_snippet(plan, final, again, str(calib) if calib else None, count, batch)
    contents[reproduce] = plan.snippet
    names["reproduce.py"] = reproduce
    return contents, names, []


def sweep_to_dir(
    fp32_path: str | Path,
    feeds: FeedSpec,
    out_dir: str | Path,
    options: SweepOptions | None = None,
    on_entry: Callable[[SweepEntry], None] | None = None,
) -> tuple[SweepResult, dict[str, Path]]:
    """`diag sweep` end to end: sweep, then write sweep.json, sweep.md, sweep.html, pareto.svg, best.recipe.json.

    ``options.grid`` is what ``--grid`` takes (a file, inline JSON, or None for
    :data:`diag.sweep.DEFAULT_GRID`). ``best.recipe.json`` is written only when a recipe
    qualifies (a stale one is removed). ``on_entry``: see :func:`diag.sweep.sweep_model`.

    Example:
        >>> res, files = sweep_to_dir("fp32.onnx", FeedSpec(inputs="d.npz", batch=8), "sweep")  # doctest: +SKIP
        >>> sorted(files)  # doctest: +SKIP
        ['best.recipe.json', 'pareto.svg', 'sweep.html', 'sweep.json', 'sweep.jsonl', 'sweep.md']
    """
    o = options if options is not None else SweepOptions()
    grid_dict, grid_dir = load_grid(o.grid)
    given = [fp32_path, feeds.inputs, o.calib.inputs if o.calib else None, o.labels]
    check_outputs(out_dir, [*SWEEP_OUTPUT_NAMES, JSONL], given)  # before any recipe is measured
    out = checked_out_dir(out_dir)
    runner = ClusterRecipes(o.scheduler, feeds, o) if o.scheduler is not None else None
    result = sweep_model(fp32_path, feeds, out, o, grid=(grid_dict, grid_dir), on_entry=on_entry, runner=runner)
    doc = result.to_dict()
    view = sweep_view(doc)
    best_path = out / "best.recipe.json"
    contents: dict[Path, str | bytes | Path] = {
        out / "sweep.json": json.dumps(doc, indent=1, ensure_ascii=False) + "\n",
        out / "sweep.md": render_markdown(view),
        out / "sweep.html": render_html(view),
        out / "pareto.svg": pareto_plot(doc),
    }
    if result.best_recipe is not None:
        if result.best_recipe.mode == "dynamic":  # the static-only keys would be inert
            contents[best_path] = json.dumps(recipe_file_dict(result.best_recipe), indent=2) + "\n"
        else:  # rebases the calibration path onto the recipe's folder
            contents[best_path] = recipe_file_text(result.best_recipe, best_path)
    # NOTE: one set, all or nothing; a best recipe of an earlier run goes in the same step.
    written = write_set(contents, remove=[] if best_path in contents else [best_path])
    files = {name: written[name] for name in ("sweep.json", "sweep.md", "sweep.html", "pareto.svg")}
    files["sweep.jsonl"] = out / JSONL
    if best_path.name in written:
        files["best.recipe.json"] = best_path
    return result, files


def bench_to_json(
    paths: list[str | Path], feeds: FeedSource | FeedSpec, options: BenchOptions
) -> tuple[list[LatencyStats], str, Path | None]:
    """`diag bench` end to end: bench, format the table, write the JSON file when asked.

    The JSON file is ``{"schema": "diag/bench", "schema_version": 1, "environment": ...,
    "models": [LatencyStats.to_dict(), ...]}``, written atomically.

    Example:
        >>> stats, table, path = bench_to_json(["fp32.onnx", "int8.onnx"], FeedSpec(random=True),
        ...                                    BenchOptions(json_path="bench.json"))  # doctest: +SKIP
    """
    if options.json_path is not None:
        for path in paths:  # remembered as inputs first: --json may not name one of them
            checked_path(path, "model")
        output_file(options.json_path, "--json")
    stats = bench_models(paths, feeds, options)
    table = format_table(stats)
    written = None
    if options.json_path is not None:
        doc = {
            "schema": "diag/bench",
            "schema_version": 1,
            "environment": environment(),
            "opt_level": DEPLOY_OPT_LEVEL,
            "models": [s.to_dict() for s in stats],
        }
        written = Path(options.json_path)
        write_set({written: json.dumps(doc, indent=2) + "\n"}, "--json")
    return stats, table, written


def quantize_to_file(fp32_path: str | Path, options: QuantizeOptions) -> tuple[QuantizeReport, list[str]]:
    """`diag quantize`: quantize as the recipe says (written atomically, verified) and the lines to print.

    Example:
        >>> report, lines = quantize_to_file("fp32.onnx", QuantizeOptions("recipe.json", "int8.onnx"))  # doctest: +SKIP
        >>> lines[-1]  # doctest: +SKIP
        'wrote int8.onnx (QDQ) in 1.2 s'
    """
    o = options
    report = quantize_model(fp32_path, o.recipe, o.out, o.calibration, progress=o.progress, samples=o.samples)
    lines = list(report.actions)
    if o.verbose:
        lines += [f"onnxruntime: {line}" for line in report.log]
    elif report.log:
        lines.append(f"onnxruntime logged {len(report.log)} message(s) (--verbose shows them)")
    lines.append(f"wrote {report.output} ({report.format}) in {report.seconds:.1f} s")
    return report, lines
