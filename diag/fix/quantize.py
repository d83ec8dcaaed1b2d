"""Guarded quantization: onnxruntime's own quantizer, with the pre-flight fixes real models need.

``quantize_model`` runs ``quantize_dynamic`` or ``quantize_static`` with a :class:`~diag.core.recipe.Recipe`
and first fixes what makes onnxruntime fail or write a broken model on real exports, saying what
it did in plain sentences (:attr:`QuantizeReport.actions`):

* weights stored as ``Constant`` nodes (paddle2onnx) are lifted to initializers: ``quantize_dynamic``
  fails with "Expected ... to be an initializer", and ``quantize_static`` quantizes such weights
  like activations (runtime QuantizeLinear, activation type, per-tensor; seen on PP-OCRv4 det);
* per-channel QDQ on opset < 13 writes ``DequantizeLinear`` with an ``axis`` attribute that such
  an opset forbids: the model is upgraded with ``onnx.version_converter`` first;
* ``quant_pre_process`` needs ``sympy`` and its symbolic shape inference fails on some exports:
  it is retried without symbolic shape inference;
* models with external data (or over 2 GB) are quantized with ``use_external_data_format``;
* what onnxruntime would silently ignore is caught first: node names the model lacks and op types
  no model can have are errors, ``extra_options`` keys it never reads are warnings.

Guarantees: the input model is never modified; the output is written to a temp file in the
output's folder and renamed only after onnxruntime has loaded it in an ``InferenceSession``
(default optimization level, as deployed);
onnxruntime's temp files and augmented models live in a private temp folder that is always
removed; onnxruntime's logging is captured into :attr:`QuantizeReport.log`, not printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import io
import logging
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from diag.core.feeds import FeedSource, FeedSpec
from diag.core.load import (
    LoadedModel,
    ModelFormat,
    constant_weights,
    detect_format,
    float_model_from_path,
    iter_nodes,
)
from diag.core.protos import default_opset
from diag.core.recipe import Recipe, recipe_from_option
from diag.fix.fp16convert import convert_model
from diag.fix.lint import onnxruntime_extra_options
from diag.fix.modelprep import (
    EXTERNAL_DATA_BYTES,
    PER_AXIS_OPSET,
    STEP_EXTERNAL_DATA,
    STEP_LIFT_CONSTANTS,
    STEP_PREPROCESS,
    STEP_PREPROCESS_SKIP_SYMBOLIC,
    STEP_UPGRADE_AFTER_LOAD_ERROR,
    STEP_UPGRADE_OPSET,
    QuantizeReport,
    checked_out,
    lift_constants,
    load_error,
    publish,
    upgrade_opset,
    weight_bytes,
)
from diag.fix.weightonly import quantize_weight_only
from diag.foundations.errors import DiagError
from diag.foundations.files import work_dir
from diag.foundations.ortfacts import kind_made_by
from diag.foundations.progress import Progress


@dataclass(frozen=True)
class QuantizeOptions:
    """What `diag quantize` takes besides the FP32 model.

    Attributes:
        recipe: a :class:`Recipe`, or a recipe file / inline JSON as ``--recipe`` takes it.
        out: the INT8 ``.onnx`` to write (``-o``).
        calibration: calibration inputs for static recipes (``--calib`` / ``--reader`` with
            ``--batch``); None uses the recipe's own ``calibration``.
        samples: calibrate on the first N samples (``--samples``).
        progress: a calibration progress bar on a terminal (``--quiet`` turns it off).
        verbose: print onnxruntime's own log messages (``--verbose``).

    Example:
        >>> QuantizeOptions("recipe.json", "int8.onnx").samples is None
        True
    """

    recipe: Recipe | str | os.PathLike[str]
    out: str | os.PathLike[str]
    calibration: FeedSpec | None = None
    samples: int | None = None
    progress: bool = True
    verbose: bool = False


# ---------------------------------------------------------------- public entry point


def quantize_model(
    fp32_path: str | os.PathLike[str],
    recipe: Recipe | str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    calibration: FeedSource | FeedSpec | None = None,
    progress: bool = False,
    samples: int | None = None,
    calibration_cache: str | os.PathLike[str] | None = None,
) -> QuantizeReport:
    """Quantize ``fp32_path`` with ``recipe`` into ``out_path``, guarded and verified.

    Static recipes calibrate on ``calibration`` (a feed source or spec), or on the recipe's own
    ``calibration`` path when it is None. The output is written atomically and only after it
    loads in onnxruntime; the input model is never modified.

    Args:
        fp32_path: the float model (external data next to it is read, never written).
        recipe: a :class:`Recipe`, or a recipe file / inline JSON as ``--recipe`` takes it.
        out_path: the INT8 ``.onnx`` to write (its folder is created).
        calibration: calibration inputs for static recipes; None uses ``recipe.calibration``.
        progress: show a calibration progress bar on a terminal.
        samples: calibrate on the first N samples (overrides ``recipe.calibration_samples``).
        calibration_cache: static recipes: a JSON file of calibrated tensor ranges (onnxruntime's
            ``calibration_cache_path``). Written by the first call, read (no calibration pass) by
            every later one. Valid only for the same FP32 model, calibration data and
            ``calibrate_method``, and for ``op_types_to_quantize`` that are the first call's or
            fewer: ranges do not depend on ``nodes_to_exclude`` (the FP32 model is what is
            calibrated), so an exclusion search calibrates once.

    Example:
        >>> r = quantize_model("det.onnx", Recipe(mode="dynamic"), "det.int8.onnx")  # doctest: +SKIP
        >>> r.actions[0]  # doctest: +SKIP
        "lifted 342 Constant node(s) to initializers: quantize_dynamic fails with 'Expected ... ...
    """
    start = time.perf_counter()
    recipe = _validated_recipe(recipe)
    if recipe.mode == "fp16":
        return convert_model(fp32_path, recipe, out_path)
    recipe = _with_calibration_samples(recipe, samples, calibration is not None)
    loaded = float_model_from_path(fp32_path)
    out = checked_out(out_path, loaded.path)
    _check_node_names(recipe, loaded.proto)
    source = _calibration_source(recipe, calibration, loaded.proto) if recipe.mode == "static" else None
    job = _Job(recipe, source, actions=_unread_extra_options(recipe))
    with (
        tempfile.TemporaryDirectory(prefix="diag-quantize-") as tmp_name,
        work_dir(out.parent, "quantize") as stage_dir,
    ):
        tmp = Path(tmp_name).resolve()
        staged = stage_dir.resolve() / out.name  # same folder as the output: publishing is a rename
        with _captured_ort_logging(job.log):
            src, upgraded = _source_model(job, loaded, tmp, out.name)
            if recipe.preprocess:
                src = _preprocess(src, tmp / "pre" / "model.onnx", job.external, job.actions, job.log)
                skipped = any("skip_symbolic_shape=True" in a for a in job.actions)
                job.steps.append(STEP_PREPROCESS_SKIP_SYMBOLIC if skipped else STEP_PREPROCESS)
            _check_names_survived(recipe, src, job.actions)
            job.cache = Path(calibration_cache) if calibration_cache is not None and _caches(recipe) else None
            _run_quantizer(job, src, staged, progress)
            error = load_error(staged)
            if error and "axis" in error and not upgraded and 0 < default_opset(_structure(src)) < PER_AXIS_OPSET:
                error = _quantize_upgraded(job, src, tmp, staged, error)
        fmt = _verified_format(job, staged, loaded.path, error)
        publish(staged, out)
    actions = list(dict.fromkeys(job.actions))
    return QuantizeReport(out, actions, time.perf_counter() - start, fmt.kind, job.log, job.steps, job.calibrations)


@dataclass
class _Job:
    """One quantize_model call: what it quantizes with, and what it records as it goes.

    ``actions`` become the report's sentences, ``steps`` the replayable step names of
    :attr:`QuantizeReport.steps`, ``log`` onnxruntime's captured messages.
    """

    recipe: Recipe
    source: FeedSource | None
    #: weights stored as external data (the input has them, or the model is too big for one protobuf)
    external: bool = False
    #: the calibration cache file static recipes read or write (None: calibrate every time)
    cache: Path | None = None
    actions: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    #: calibration passes run
    calibrations: int = 0


def _source_model(job: _Job, loaded: LoadedModel, tmp: Path, out_name: str) -> tuple[Path, bool]:
    """The model the quantizer reads, after :func:`_preflight`'s fixes: (path, opset upgraded?).

    Usually a fixed copy in ``tmp``. A weight-only recipe (its quantizer loads the model itself)
    on a model that needs no fix and no pre-processing reads the input as it is: at 500M
    parameters the copy was a 2 GB load and a 2 GB write per quantization, and a tier search
    quantizes a dozen times. The input is only read, never written, either way.
    """
    fp32 = loaded.path
    structure = onnx.load(str(fp32), load_external_data=False)  # embedded weights come with it
    # NOTE: loaded.has_external_data sees every tensor (Constant values, subgraphs), not only initializers.
    job.external = (
        loaded.has_external_data
        or weight_bytes(structure) > EXTERNAL_DATA_BYTES
        or bool(job.recipe.use_external_data_format)  # asked for: onnxruntime's own argument (issue 45)
    )
    as_is = job.recipe.mode == "weight_only" and not job.recipe.preprocess and not _has_constants(structure)
    if as_is:
        _preflight(job, structure, out_name)  # records the external-data step; changes nothing here
        return fp32, False
    del structure
    model = onnx.load(str(fp32))  # with weights: the quantizer needs them
    model, upgraded = _preflight(job, model, out_name)
    src = _save(model, tmp / "fp32" / "model.onnx", job.external)
    return src, upgraded


def _has_constants(model: onnx.ModelProto) -> bool:
    """Whether :func:`lift_constants` would lift anything (Constant nodes in the main graph)."""
    return any(n.op_type == "Constant" for n in model.graph.node)


def _validated_recipe(recipe: Recipe | str | os.PathLike[str]) -> Recipe:
    """The recipe as a file would give it: a recipe built in code gets the same checks (enum names, types, keys)."""
    if not isinstance(recipe, Recipe):
        return recipe_from_option(recipe)
    base_dir = recipe.base_dir
    checked = Recipe.from_dict(recipe.to_dict(), "recipe")
    checked.base_dir = base_dir
    return checked


def _with_calibration_samples(recipe: Recipe, samples: int | None, has_calibration: bool) -> Recipe:
    """The recipe with ``--samples`` applied; calibration inputs for a recipe that does not calibrate are refused."""
    if samples is not None:
        if samples < 1:
            raise DiagError("bad-option", "--samples", "must be at least 1", "pass e.g. --samples 64")
        recipe = dataclasses.replace(recipe, calibration_samples=samples)
    if recipe.mode != "static" and has_calibration:
        raise DiagError(
            "bad-option",
            "calibration inputs",
            f"only apply to static quantization but the recipe's mode is '{recipe.mode}'",
            'drop --calib/--reader, or set "mode": "static" in the recipe',
        )
    return recipe


def _preflight(job: _Job, model: onnx.ModelProto, out_name: str) -> tuple[onnx.ModelProto, bool]:
    """The fixes real exports need before onnxruntime's quantizer sees them: (model, opset upgraded?).

    External data for big models, Constant weights lifted to initializers, and opset 13 for
    per-channel QDQ: each one recorded as an action and a replayable step.
    """
    if job.external:
        job.steps.append(STEP_EXTERNAL_DATA)
        job.actions.append(
            "quantized with use_external_data_format=True: the model's weights are stored as external data "
            f"(written next to the output as {out_name}.data)"
        )
    # Only the Constants the quantizer reads as weights: the rest of the export stays as it is.
    mode = "static" if job.recipe.mode == "static" else "dynamic"  # weight-only reads MatMul weights too
    model, lifted = lift_constants(model, set(constant_weights(model, mode)))
    if lifted:
        job.steps.append(STEP_LIFT_CONSTANTS)
        why = (
            "quantize_dynamic fails with 'Expected ... to be an initializer' on any other weight"
            if job.recipe.mode == "dynamic"
            else "quantize_static would quantize those weights like activations (a QuantizeLinear at run time, "
            "activation_type, per-tensor), ignoring weight_type and per_channel"
        )
        job.actions.append(f"lifted {lifted} Constant node(s) to initializers: {why}")
    opset = default_opset(model)
    if not (_needs_per_axis(job.recipe) and 0 < opset < PER_AXIS_OPSET):
        return model, False
    model = upgrade_opset(model)
    job.steps.append(STEP_UPGRADE_OPSET)
    job.actions.append(
        f"upgraded opset {opset} -> {PER_AXIS_OPSET} with onnx.version_converter: per-channel QDQ writes "
        "DequantizeLinear with an axis attribute, which opset < 13 forbids (the INT8 model would not load)"
    )
    return model, True


def _quantize_upgraded(job: _Job, src: Path, tmp: Path, staged: Path, error: str) -> str | None:
    """Quantize again from the model upgraded to opset 13: the first INT8 model did not load (an axis on opset < 13).

    Returns the new model's load error (None: it loads).
    """
    old = default_opset(_structure(src))
    src = _save(upgrade_opset(onnx.load(str(src))), tmp / "fp32-upgraded" / "model.onnx", job.external)
    job.actions.append(
        f"upgraded opset {old} -> {PER_AXIS_OPSET} with onnx.version_converter and quantized again: "
        f"the first INT8 model did not load in onnxruntime ({error})"
    )
    job.steps.append(STEP_UPGRADE_AFTER_LOAD_ERROR)
    for p in staged.parent.iterdir():
        p.unlink()
    if job.cache is not None:
        job.cache.unlink(missing_ok=True)  # ranges of the model before the upgrade
    _run_quantizer(job, src, staged, False)
    return load_error(staged)


def _verified_format(job: _Job, staged: Path, fp32_path: Path, error: str | None) -> ModelFormat:
    """The staged INT8 model's format, once it is verified to load; notes when it is not what the recipe asked for."""
    if not error and _raise_ir_version(staged, job.actions):
        error = load_error(staged)  # verified as written
    if error:
        raise DiagError(
            "quantize-failed",
            f"INT8 model for '{fp32_path}'",
            f"does not load in onnxruntime ({error})",
            (
                "nothing was written; try another algorithm, bits or block_size, or report the model"
                if job.recipe.mode == "weight_only"
                else "nothing was written; try per_channel=false or preprocess=true, or report the model"
            ),
        )
    job.actions.extend(_notable(job.log))
    fmt = detect_format(_structure(staged))
    if not fmt.is_quantized:
        job.actions.append(
            "warning: no operator was quantized (check op_types_to_quantize / nodes_to_quantize "
            "against the model's op types)"
        )
    recipe = job.recipe
    wanted = kind_made_by(recipe.mode, recipe.quant_format) or recipe.quant_format.lower()
    if fmt.is_quantized and fmt.family != wanted:
        ev = ", ".join(f"{k} x{v}" for k, v in fmt.evidence.items())
        job.actions.append(f"note: the recipe asked for {wanted} but the output is {fmt.kind} ({ev})")
    job.actions.append(f"verified: the INT8 model loads in onnxruntime (format {fmt.kind})")
    return fmt


# ---------------------------------------------------------------- steps


def _raise_ir_version(staged: Path, actions: list[str]) -> bool:
    """Give the INT8 model the IR version its opsets need (an IR-3 input stays IR 3 otherwise).

    onnxruntime's quantizer keeps the input's ``ir_version`` but writes newer opsets and scale
    initializers that are not graph inputs, which IR 3 forbids: onnx.checker, and so every other
    verb, would refuse a model diag itself produced and verified. Only the header changes.
    """
    model = onnx.load(str(staged), load_external_data=False)
    need = max(4, onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    if model.ir_version >= need:
        return False
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    actions.append(
        f"raised the IR version {model.ir_version} -> {need}: the quantizer wrote opsets {opsets} and "
        "initializers that are not graph inputs, which the input's IR version forbids"
    )
    model.ir_version = need
    onnx.save(model, str(staged))
    return True


def _check_node_names(recipe: Recipe, model: onnx.ModelProto) -> None:
    """Node names onnxruntime would silently ignore are a user error here."""

    names = {n.name for n in iter_nodes(model.graph) if n.name}
    types = {n.op_type for n in iter_nodes(model.graph)}
    for key in ("nodes_to_exclude", "nodes_to_quantize", "node_bits"):
        for name in getattr(recipe, key) or []:
            if name not in names:
                close = difflib.get_close_matches(name, sorted(names), n=1)
                hint = f"did you mean '{close[0]}'?" if close else "use FP32 node names (diag inspect lists the model)"
                raise DiagError("bad-recipe", f"{key} entry '{name}'", "names no node of the FP32 model", hint)
    known = {schema.name for schema in onnx.defs.get_all_schemas_with_history()}
    for t in recipe.op_types_to_quantize or []:
        # A shared recipe may list op types this model lacks; a name no model can have is a typo.
        if t not in types and t not in known:
            close = difflib.get_close_matches(t, sorted(known | types), n=1)
            raise DiagError(
                "bad-recipe",
                f"op_types_to_quantize entry '{t}'",
                "is not an ONNX op type nor one of the model's",
                f"did you mean '{close[0]}'?" if close else f"the model has: {', '.join(sorted(types))}",
            )


def _unread_extra_options(recipe: Recipe) -> list[str]:
    """A warning per ``extra_options`` key the installed onnxruntime never reads (it ignores them silently)."""

    known = onnxruntime_extra_options()
    names = set(known.quantizer) | set(known.calibrator)
    out = []
    for key in recipe.extra_options:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.8)
            maybe = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(
                f"warning: extra_options key '{key}' is not read by onnxruntime {known.version}: "
                f"it has no effect{maybe}"
            )
    return out


def _calibration_source(
    recipe: Recipe, calibration: FeedSource | FeedSpec | None, model: onnx.ModelProto
) -> FeedSource:
    if isinstance(calibration, FeedSource):
        return calibration
    if calibration is None:
        path = recipe.calibration_path()
        if path is None:
            raise DiagError(
                "bad-recipe",
                "static quantization",
                "needs calibration inputs and none were given",
                'set "calibration": "calib.npz" in the recipe or pass --calib PATH (or use mode dynamic)',
            )
        calibration = FeedSpec(inputs=str(path), samples=recipe.calibration_samples)
    elif calibration.samples is None and recipe.calibration_samples is not None:
        calibration = FeedSpec(**{**calibration.__dict__, "samples": recipe.calibration_samples})
    return calibration.source(model)


def _caches(recipe: Recipe) -> bool:
    """Whether this onnxruntime can reuse calibrated ranges for ``recipe`` (``calibration_cache_path``).

    SmoothQuant rewrites the model from the calibration data itself: its ranges cannot be cached.
    """

    from onnxruntime.quantization import quantize_static

    return (
        recipe.mode == "static"
        and not recipe.extra_options.get("SmoothQuant")
        and "calibration_cache_path" in inspect.signature(quantize_static).parameters
    )


def _needs_per_axis(recipe: Recipe) -> bool:
    return recipe.per_channel and recipe.mode == "static" and recipe.quant_format == "QDQ"


def _structure(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def _save(model: onnx.ModelProto, path: Path, external: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save_model(model, str(path))
    return path


def _preprocess(src: Path, dst: Path, external: bool, actions: list[str], log: list[str]) -> Path:
    """``quant_pre_process``, retried without symbolic shape inference when that part fails."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    dst.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"save_as_external_data": external, "all_tensors_to_one_file": True}
    if external:
        kwargs["external_data_location"] = dst.name + ".data"
    before = len(log)
    with _working_dir(dst.parent):
        how = _run_preprocess(quant_pre_process, src, dst, kwargs, actions)
    if any("Optimization Failed" in line for line in log[before:]):
        actions.append("quant_pre_process: onnxruntime's graph optimization step failed and was skipped")
    if how:
        actions.append("ran quant_pre_process (shape inference and graph optimization) before quantizing")
    return dst


def _run_preprocess(quant_pre_process: Any, src: Path, dst: Path, kwargs: dict[str, Any], actions: list[str]) -> bool:
    """Returns True when the full pre-processing ran, False when it was retried without symbolic shapes."""
    try:
        quant_pre_process(str(src), str(dst), **kwargs)
        return True
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200].rstrip(".")
        if isinstance(e, ImportError) and "sympy" in str(e):
            why = "sympy is not installed (pip install sympy to enable symbolic shape inference)"
        elif "symbolic" in str(e).lower() or _raised_in(e, "symbolic_shape_infer"):
            why = f"symbolic shape inference failed ({first}{_where(e)})"
        else:
            why = f"it failed with {type(e).__name__}: {first}"
    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=True, **kwargs)
    except Exception as e2:
        raise DiagError(
            "quantize-failed",
            "quant_pre_process",
            f"failed with and without symbolic shape inference ({type(e2).__name__}: {str(e2)[:200]})",
            'set "preprocess": false in the recipe',
        ) from e2
    actions.append(f"ran quant_pre_process with skip_symbolic_shape=True because {why}")
    return False


#: onnxruntime log messages worth a line of their own (the rest stays in ``QuantizeReport.log``).
NOTABLE = (
    (
        "Please use QuantFormat.QDQ for activation type QInt8 and weight type QInt8",
        "note: onnxruntime warns that QOperator with QInt8 activations and weights is slow on x64 "
        "(use quant_format QDQ or activation_type QUInt8)",
    ),
)


def _notable(log: list[str]) -> list[str]:
    return [sentence for needle, sentence in NOTABLE if any(needle in line for line in log)]


def _raised_in(e: BaseException, module: str) -> bool:
    return any(module in frame.filename for frame in traceback.extract_tb(e.__traceback__))


def _where(e: BaseException) -> str:
    """`` in _infer_Concat`` for a bare assertion: the only clue symbolic shape inference gives."""
    if str(e).strip():
        return ""
    frames = traceback.extract_tb(e.__traceback__)
    return f" in {frames[-1].name}" if frames else ""


def _check_names_survived(recipe: Recipe, src: Path, actions: list[str]) -> None:
    """Pre-processing and opset conversion may rename or fuse nodes that the recipe names."""
    names = {n.name for n in iter_nodes(_structure(src).graph)}
    for key in ("nodes_to_exclude", "nodes_to_quantize"):
        gone = [n for n in getattr(recipe, key) or [] if n not in names]
        if gone:
            shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
            actions.append(
                f"warning: {len(gone)} {key} name(s) no longer exist after pre-processing ({shown}); "
                "onnxruntime ignores them (set preprocess to false to keep FP32 node names)"
            )


def _run_quantizer(job: _Job, src: Path, dst: Path, progress: bool) -> None:
    """One call of onnxruntime's quantizer (or MatMulNBitsQuantizer) from ``src`` to ``dst``.

    Static recipes calibrate on ``job.source``, or reuse ``job.cache``'s ranges when the file
    exists; anything onnxruntime raises becomes one ``quantize-failed`` line.
    """
    from onnxruntime.quantization import quantize_dynamic, quantize_static

    recipe, source, cache = job.recipe, job.source, job.cache
    dst.parent.mkdir(parents=True, exist_ok=True)
    if recipe.mode == "weight_only":
        quantize_weight_only(recipe, src, dst, job.external, job.actions)
        return
    kwargs = recipe.ort_kwargs()
    kwargs["use_external_data_format"] = job.external
    try:
        if recipe.mode == "dynamic":
            quantize_dynamic(str(src), str(dst), **kwargs)
        else:
            assert source is not None
            reader = _reader(source, progress, recipe.calibration_samples)
            if cache is not None:
                kwargs["calibration_cache_path"] = str(cache)
            hit = cache is not None and cache.is_file()
            quantize_static(str(src), str(dst), reader, **kwargs)
            if hit and cache is not None:
                job.actions.append(f"reused the calibrated ranges of {cache.name} (no calibration pass)")
            else:
                job.calibrations += 1
                job.actions.append(
                    f"calibrated with {recipe.calibrate_method} on {reader.samples} sample(s) from {source.description}"
                )
    except DiagError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
        raise DiagError(
            "quantize-failed",
            f"quantize_{recipe.mode}",
            f"raised {type(e).__name__}: {first}",
            "fix the recipe setting onnxruntime names, or exclude the node it names; --debug shows the traceback",
        ) from e


def _reader(source: FeedSource, progress: bool, limit: int | None = None) -> Any:
    """Wrap a feed source into an onnxruntime ``CalibrationDataReader`` (one batch per get_next).

    ``limit`` stops after that many samples; the last batch is cut when its arrays share the
    sample axis, so the count is exact.
    """
    from onnxruntime.quantization import CalibrationDataReader

    total = source.total_samples if limit is None or source.total_samples is None else min(limit, source.total_samples)

    class _FeedReader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._batches: Iterator[Any] | None = None
            self.samples = 0
            self._bar = Progress(total, "calibrating", progress)

        def get_next(self) -> dict[str, Any] | None:
            if self._batches is None:
                self._batches = iter(source)
            batch = None if limit is not None and self.samples >= limit else next(self._batches, None)
            if batch is None:
                self._bar.close()
                return None
            feeds, size = batch.feeds, batch.size
            if limit is not None and self.samples + size > limit:
                keep = limit - self.samples
                if size > 1 and all(getattr(a, "ndim", 0) and a.shape[0] == size for a in feeds.values()):
                    feeds, size = {k: a[:keep] for k, a in feeds.items()}, keep
            self.samples += size
            self._bar.advance(size)
            return feeds

        def rewind(self) -> None:
            self._batches = None
            self.samples = 0

    return _FeedReader()


@contextlib.contextmanager
def _working_dir(path: Path) -> Iterator[None]:
    """Run with ``path`` as the current folder.

    NOTE: onnxruntime's symbolic shape inference, when it fails, saves ``sym_shape_infer_temp.onnx``
    and a ``<uuid>.data`` file into the *current* folder and never removes them (seen on PP-OCRv4
    det). Running the quantizer from diag's own temp folder keeps the user's folders clean. The
    current folder is process-wide: do not quantize from several threads at once.
    """
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _captured_ort_logging(log: list[str]) -> Iterator[None]:
    """Route onnxruntime's Python logging, prints and warnings into ``log``; quiet its C++ logger.

    NOTE: the quantizer logs through the root logger and ``print``; left alone it floods the
    terminal with advice ("Please consider to run pre-processing...") that diag acts on itself.
    """
    import onnxruntime as ort

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.append(f"{record.levelname.lower()}: {record.getMessage()}")

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers = [_Collect(logging.INFO)]
    root.setLevel(logging.WARNING)
    out = io.StringIO()
    ort.set_default_logger_severity(3)
    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        stack.enter_context(contextlib.redirect_stdout(out))
        try:
            yield
        finally:
            root.handlers = saved_handlers
            root.setLevel(saved_level)
            ort.set_default_logger_severity(2)
            log.extend(line for line in out.getvalue().splitlines() if line.strip())
            log.extend(f"warning: {w.message}" for w in caught or [])
