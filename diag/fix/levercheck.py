"""Recipe settings measured as causes: each changed alone, re-quantized, run (issue 42 item 1).

Spread error is often one setting of the recipe, not a node: per-tensor weight scales
(``per_channel=False``) round the small output channels of *every* weight to a few levels, and no
node kept in float recovers much. The float-region effect check cannot measure such a lever (it
changes every weight's grid, not which nodes are quantized), so this module re-quantizes: the FP32
model with the recipe and one setting changed (:func:`diag.analysis.levers.recipe_changes`), run
whole on the effect check's samples at its optimization level and scored on its target like a
candidate (:meth:`diag.analysis.effects.EffectCheck.measure_model`).

NOTE: the user's INT8 model is the ground. A re-quantized model measures a change *of the user's
model* only when the unchanged recipe rebuilds that model exactly, so the round trip is proved
first (:func:`diag.fix.roundtrip.prove_roundtrip`); when it fails nothing is measured and the line
says why. A change that rebuilds the user's model byte for byte does nothing here and is said so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import onnx

from diag.analysis.effects import EffectCheck
from diag.analysis.levers import RecipeChange, RecipeChangeEffect, RecipeLevers, recipe_changes
from diag.core.feeds import FeedSpec
from diag.core.load import model_from_path
from diag.core.recipe import Recipe
from diag.fix.quantize import quantize_model
from diag.fix.roundtrip import prove_roundtrip, roundtrip_difference, roundtrip_line
from diag.foundations.errors import DiagError
from diag.foundations.files import internal_writes
from diag.foundations.progress import Progress


def changed_recipe(recipe: Recipe, change: RecipeChange) -> Recipe:
    """``recipe`` with ``change`` applied (an ``extra_options.<Key>`` change sets that key).

    Example:
        >>> from diag.analysis.levers import RecipeChange
        >>> change = RecipeChange("extra_options.WeightSymmetric", True, False)
        >>> changed_recipe(Recipe(mode="dynamic"), change).extra_options
        {'WeightSymmetric': False}
    """
    if change.key.startswith("extra_options."):
        return replace(recipe, extra_options={**recipe.extra_options, change.name: change.after})
    return replace(recipe, **{change.key: change.after})


def measure_recipe_levers(  # NOTE: 8 parameters: the two models, the recipe and its origin, the check, run knobs
    fp32_path: str | os.PathLike[str],
    int8_path: str | os.PathLike[str],
    recipe: Recipe,
    source: str,
    check: EffectCheck,
    calibration: FeedSpec | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> RecipeLevers:
    """Prove the recipe rebuilds the INT8 model, then measure every one-setting change of it.

    ``source``: ``"given"`` or ``"inferred"`` (whose recipe it is, for the sentence). Static
    recipes calibrate on their own ``calibration`` or else on ``calibration`` (the inputs): the
    round trip is exact only with the data the user calibrated on. Every model is written to a
    temporary folder, removed before returning; the user's files are only read.

    Example:
        >>> recipe = Recipe(mode="dynamic")
        >>> levers = measure_recipe_levers("fp32.onnx", "int8.onnx", recipe, "inferred", check)  # doctest: +SKIP
        >>> levers.best.change.setting, round(levers.best.recovered, 2)  # doctest: +SKIP
        ('per_channel=True', 0.99)
    """
    static = str(getattr(recipe.mode, "name", recipe.mode)) == "static"
    calib = calibration if static and not recipe.calibration else None
    changes = recipe_changes(recipe.to_dict())
    header: dict[str, Any] = {"source": source, "target": check.target, "samples": check.samples, "level": check.level}
    with tempfile.TemporaryDirectory(prefix="diag-settings-") as tmp, internal_writes():
        try:
            rt = prove_roundtrip(fp32_path, int8_path, recipe, Path(tmp) / "roundtrip", calib)
        except Exception as e:  # the diagnosis stands without this check: say why it is missing
            said = f"{e.obj}: {e.problem}" if isinstance(e, DiagError) else str(e).splitlines()[0][:200]
            why = f"the recipe could not be re-quantized: {said}"
            return RecipeLevers(proof=why, proved=False, **header)
        proof = roundtrip_line(rt)
        if not rt.identical:
            return RecipeLevers(proof=proof, proved=False, **header)
        user = model_from_path(int8_path, "INT8 model")
        effects: list[RecipeChangeEffect] = []
        bar = Progress(len(changes), "recipe settings", enabled=progress)
        try:
            for i, change in enumerate(changes):
                out = Path(tmp) / f"setting{i}" / "model.onnx"
                out.parent.mkdir()
                effects.append(
                    _measured(fp32_path, user.proto, user.external_dir, recipe, change, out, check, calib, threads)
                )
                shutil.rmtree(out.parent, ignore_errors=True)  # one re-quantized model on disk at a time
                bar.advance(1)
        finally:
            bar.close()
    effects.sort(key=lambda e: (e.recovered is None or e.identical, -(e.recovered or 0.0)))
    return RecipeLevers(proof=proof, proved=True, effects=tuple(effects), **header)


def settings_skipped(source: str, check: EffectCheck, weight_bytes: int) -> RecipeLevers:
    """The settings not measured by default on a large model: each would re-quantize all of it.

    Example:
        >>> settings_skipped("inferred", EffectCheck("logits", [], 4, 0.0), 3 << 30).line()  # doctest: +ELLIPSIS
        'recipe settings not measured: FP32 weights of 3.0 GiB, and each setting re-quantizes the whole model (...)'
    """
    why = (
        f"FP32 weights of {weight_bytes / 2**30:.1f} GiB, and each setting re-quantizes the whole model "
        "(--settings always measures them)"
    )
    return RecipeLevers(source, why, False, check.target, check.samples, check.level)


def _measured(  # NOTE: 9 parameters: one change's quantization inputs and the check it is scored on
    fp32_path: str | os.PathLike[str],
    user: onnx.ModelProto,
    user_dir: Path | None,
    recipe: Recipe,
    change: RecipeChange,
    out: Path,
    check: EffectCheck,
    calibration: FeedSpec | None,
    threads: int | None,
) -> RecipeChangeEffect:
    """One change re-quantized into ``out`` and scored; a change onnxruntime cannot build is reported."""
    try:
        quantize_model(fp32_path, changed_recipe(recipe, change), out, calibration=calibration)
        rebuilt = onnx.load(str(out), load_external_data=False)
        if roundtrip_difference(user, rebuilt, user_dir, out.parent).identical:
            return RecipeChangeEffect(change, 0.0, identical=True)
        recovered, after = check.measure_model(out, f"INT8 model with {change.setting}", threads)
    except Exception as e:  # a setting onnxruntime cannot build or run is reported, never fatal
        problem = e.problem if isinstance(e, DiagError) else str(e).splitlines()[0][:200]
        return RecipeChangeEffect(change, None, error=problem)
    return RecipeChangeEffect(change, recovered, after)
