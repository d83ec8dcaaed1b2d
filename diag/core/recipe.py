"""Recipe files: onnxruntime's own quantization arguments, one to one, in ``recipe.json`` or ``.toml``.

A recipe names exactly what a user would type in Python::

    quantize_static(fp32, int8, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)

becomes ``{"mode": "static", "quant_format": "QDQ", "per_channel": true, "activation_type": "QUInt8",
"weight_type": "QInt8"}``. Only three keys are diag's own: ``mode`` (which of the two functions),
``calibration`` / ``calibration_samples`` (where the calibration reader's data comes from) and
``preprocess`` (run ``quant_pre_process`` first).

NOTE: unknown keys are an error, never ignored. onnxruntime silently ignores misspelled
``extra_options`` keys and node names; a recipe that silently ignored ``op_type_to_quantize`` would
hand the user a model quantized with settings they did not ask for.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diag.foundations.errors import DiagError
from diag.foundations.files import input_file, output_file, write_set
from diag.foundations.untrusted import max_depth

MODES = ("dynamic", "static", "weight_only", "fp16")
QUANT_FORMATS = ("QDQ", "QOperator")
#: onnxruntime ``QuantType`` member names diag accepts for activations and weights.
QUANT_TYPES = ("QInt8", "QUInt8", "QInt16", "QUInt16", "QInt4", "QUInt4", "QFLOAT8E4M3FN")
#: onnxruntime ``CalibrationMethod`` member names.
CALIBRATE_METHODS = ("MinMax", "Entropy", "Percentile", "Distribution")
#: keys that only ``quantize_static`` takes.
STATIC_ONLY = ("quant_format", "activation_type", "calibrate_method", "calibration", "calibration_samples")
#: keys ``mode = "fp16"`` takes: ``convert_float_to_float16``'s arguments (see :mod:`diag.core.fp16`).
FP16_KEYS = ("keep_io_types", "op_block_list", "node_block_list")
#: keys that only ``MatMulNBitsQuantizer`` (``mode = "weight_only"``) takes; ``node_bits`` is diag's own.
WEIGHT_ONLY_KEYS = ("bits", "block_size", "is_symmetric", "accuracy_level", "node_bits", "algorithm")
#: the keys a weight-only recipe may hold (and writes): MatMulNBitsQuantizer's arguments; ``calibration``
#: and ``calibration_samples`` feed GPTQ only.
WEIGHT_ONLY_RECIPE = (
    "mode",
    "quant_format",
    "op_types_to_quantize",
    "nodes_to_exclude",
    *WEIGHT_ONLY_KEYS,
    "calibration",
    "calibration_samples",
)
#: ``MatMulNBitsQuantizer`` algorithms a weight-only recipe may name (``algo_config`` classes); RTN is
#: onnxruntime's default config (no ``algo_config``); HQQ and GPTQ need torch installed.
WEIGHT_ONLY_ALGORITHMS = ("RTN", "k_quant", "HQQ", "GPTQ")


class _DefaultFormat(str):
    """``"QDQ"`` as the dataclass default, told apart from an explicit ``"QDQ"`` (see ``Recipe.__post_init__``)."""


@dataclass
class Recipe:
    """onnxruntime's ``quantize_dynamic`` / ``quantize_static`` arguments, by their Python names.

    Attributes:
        mode: ``dynamic`` (``quantize_dynamic``), ``static`` (``quantize_static``) or ``fp16``
            (``onnxruntime.transformers.float16.convert_float_to_float16``, which takes only
            ``keep_io_types``, ``op_block_list`` and ``node_block_list``).
        quant_format: ``QDQ`` or ``QOperator`` (static only).
        activation_type: a ``QuantType`` name (static only; dynamic picks its own).
        weight_type: a ``QuantType`` name.
        per_channel: per-output-channel weight scales.
        reduce_range: 7-bit weights (for CPUs without VNNI).
        op_types_to_quantize: only these op types (None: every type the quantizer supports).
        nodes_to_quantize: only these FP32 node names (None: all).
        nodes_to_exclude: FP32 node names kept in float.
        calibrate_method: a ``CalibrationMethod`` name (static only).
        extra_options: passed to onnxruntime as is.
        calibration: calibration inputs (``.npz`` or folder), relative to the recipe file.
        calibration_samples: use the first N calibration samples.
        preprocess: run ``quant_pre_process`` (shape inference + graph cleanup) first.
        use_external_data_format: onnxruntime's own argument: write the quantized weights as external
            data beside the model (diag also does so by itself for models with external data or over 2 GB).
        bits: weight_only: ``MatMulNBitsQuantizer(bits=...)`` (2, 4 or 8; default 4).
        block_size: weight_only: rows per quantization block (default 128, as onnxruntime).
        is_symmetric: weight_only: no zero points (default false).
        accuracy_level: weight_only: ``MatMulNBits`` compute accuracy (0-4; None: onnxruntime's default).
        algorithm: weight_only: "RTN" (default), "k_quant", "HQQ" or "GPTQ" (GPTQ calibrates on
            ``calibration``; HQQ and GPTQ need torch).
        node_bits: weight_only: FP32 node name -> bits for nodes quantized at another width
            (diag runs a second ``MatMulNBitsQuantizer(bits=...)`` over them; see :mod:`diag.core.nbits`).
        keep_io_types: fp16: keep float32 model inputs and outputs (Casts at the boundary).
        op_block_list: fp16: op types kept in float32 (None: onnxruntime's default list).
        node_block_list: fp16: node names kept in float32.
        base_dir: the folder ``calibration`` is relative to (the recipe file's folder when loaded
            from a file); not part of the recipe itself, never written.
    """

    mode: str = "static"
    quant_format: str = _DefaultFormat("QDQ")
    activation_type: str = "QInt8"
    weight_type: str = "QInt8"
    per_channel: bool = False
    reduce_range: bool = False
    op_types_to_quantize: list[str] | None = None
    nodes_to_quantize: list[str] | None = None
    nodes_to_exclude: list[str] = field(default_factory=list)
    calibrate_method: str = "MinMax"
    extra_options: dict[str, Any] = field(default_factory=dict)
    calibration: str | None = None
    calibration_samples: int | None = None
    preprocess: bool = False
    use_external_data_format: bool = False
    bits: int | None = None
    block_size: int | None = None
    is_symmetric: bool | None = None
    accuracy_level: int | None = None
    node_bits: dict[str, int] | None = None
    algorithm: str | None = None
    keep_io_types: bool | None = None
    op_block_list: list[str] | None = None
    node_block_list: list[str] | None = None
    base_dir: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # NOTE: quantize_static defaults to QDQ, MatMulNBitsQuantizer to QOperator: a weight_only
        # recipe that does not name its format gets the quantizer's own default, in code as in files.
        if self.mode == "weight_only" and isinstance(self.quant_format, _DefaultFormat):
            self.quant_format = "QOperator"

    def with_excluded(self, nodes: Iterable[str]) -> Recipe:
        """A copy with ``nodes`` added to ``nodes_to_exclude`` (order kept, no duplicates).

        For an ``fp16`` recipe they go to ``node_block_list``, the converter's way to keep a node in float.

        Example:
            >>> Recipe(nodes_to_exclude=["a"]).with_excluded(["b", "a"]).nodes_to_exclude
            ['a', 'b']
        """
        if self.mode == "fp16":  # "keep in float" is the converter's node_block_list
            blocked = list(dict.fromkeys([*(self.node_block_list or []), *nodes]))
            return dataclasses.replace(self, node_block_list=blocked, extra_options=dict(self.extra_options))
        merged = list(dict.fromkeys([*self.nodes_to_exclude, *nodes]))
        return dataclasses.replace(self, nodes_to_exclude=merged, extra_options=dict(self.extra_options))

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain JSON types in a stable key order (the dataclass field order).

        ``None`` values are left out (TOML has no null), ``use_external_data_format`` unless true;
        ``base_dir`` is never written; an ``fp16``
        recipe writes ``mode`` and the converter's keys only.

        Example:
            >>> list(Recipe(mode="dynamic").to_dict())[:3]
            ['mode', 'quant_format', 'activation_type']
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "base_dir" or (self.mode == "weight_only" and f.name not in WEIGHT_ONLY_RECIPE):
                continue
            if self.mode == "fp16" and f.name not in ("mode", *FP16_KEYS):
                continue  # an fp16 recipe holds the converter's arguments only
            value = getattr(self, f.name)
            if value is None or (f.name == "use_external_data_format" and not value):
                continue  # (written only when asked for: every earlier recipe file stays the same)
            out[f.name] = json.loads(json.dumps(value))  # deep copy, plain types only
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "recipe") -> Recipe:
        """Validate ``data`` (parsed JSON/TOML) and build a Recipe.

        Raises ``bad-recipe`` on unknown keys (with a did-you-mean), wrong types, unknown enum
        names, and static-only settings in a dynamic recipe.

        Example:
            >>> Recipe.from_dict({"mode": "dynamic", "weight_type": "QUInt8"}).weight_type
            'QUInt8'
            >>> Recipe.from_dict({"op_type_to_quantize": ["Conv"]})
            Traceback (most recent call last):
            ...
            diag.foundations.errors.DiagError: recipe key 'op_type_to_quantize' | is not a recipe key. Hint: did you mean 'op_types_to_quantize'?
        """  # noqa: E501
        if not isinstance(data, dict):
            raise DiagError("bad-recipe", source, f"is a {type(data).__name__}, not a table of settings", _EXAMPLE)
        names = [f.name for f in dataclasses.fields(cls) if f.name != "base_dir"]
        for key in data:
            if key not in names:
                raise DiagError("bad-recipe", f"{source} key '{key}'", "is not a recipe key", _suggest(key, names))
        values: dict[str, Any] = {}
        for key, value in data.items():
            values[key] = _check_value(key, value, f"{source} key '{key}'")
        recipe = cls(**values)
        _check_weight_only(recipe, data, source)
        for key in data:
            fp16_key = key in FP16_KEYS
            if fp16_key != (recipe.mode == "fp16") and key != "mode":
                applies = "convert_float_to_float16" if fp16_key else "quantize_dynamic / quantize_static"
                raise DiagError(
                    "bad-recipe",
                    f"{source} key '{key}'",
                    f"only applies to {applies} but mode is '{recipe.mode}'",
                    f"remove '{key}'" + ("" if fp16_key else ' (mode "fp16" takes ' + ", ".join(FP16_KEYS) + ")"),
                )
        if recipe.mode == "dynamic":
            defaults = cls()
            for key in STATIC_ONLY:
                if key in data and getattr(recipe, key) != getattr(defaults, key):
                    raise DiagError(
                        "bad-recipe",
                        f"{source} key '{key}'",
                        "only applies to quantize_static but mode is 'dynamic'",
                        f'remove \'{key}\' or set "mode": "static"',
                    )
        return recipe

    def ort_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``quantize_dynamic`` / ``quantize_static``, enums resolved.

        Model paths and the calibration reader are not included: the caller supplies them.

        Example:
            >>> Recipe(mode="dynamic", weight_type="QUInt8").ort_kwargs()["weight_type"]  # doctest: +SKIP
            <QuantType.QUInt8: 1>
        """
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

        kwargs: dict[str, Any] = {
            "op_types_to_quantize": list(self.op_types_to_quantize) if self.op_types_to_quantize is not None else None,
            "per_channel": self.per_channel,
            "reduce_range": self.reduce_range,
            "weight_type": QuantType[self.weight_type],
            "nodes_to_quantize": list(self.nodes_to_quantize) if self.nodes_to_quantize is not None else None,
            "nodes_to_exclude": list(self.nodes_to_exclude),
            "extra_options": resolve_quant_types(json.loads(json.dumps(self.extra_options))),
        }
        if self.mode == "static":
            kwargs["quant_format"] = QuantFormat[self.quant_format]
            kwargs["activation_type"] = QuantType[self.activation_type]
            kwargs["calibrate_method"] = CalibrationMethod[self.calibrate_method]
        return kwargs

    def calibration_path(self) -> Path | None:
        """``calibration`` resolved against the recipe file's folder (None when not set).

        Example:
            >>> Recipe(calibration="calib.npz", base_dir="cfg").calibration_path()
            PosixPath('cfg/calib.npz')
        """
        if self.calibration is None:
            return None
        p = Path(self.calibration).expanduser()
        if not p.is_absolute() and self.base_dir is not None:
            p = Path(self.base_dir) / p
        return p


def resolve_quant_types(extra_options: dict[str, Any]) -> dict[str, Any]:
    """Turn recipe values inside ``TensorQuantOverrides`` into what onnxruntime expects (in place).

    QuantType names become enum members; ``rmin`` / ``rmax`` / ``scale`` numbers become float32.

    A recipe file is JSON/TOML, so ``{"quant_type": "QInt16"}`` arrives as a string; onnxruntime
    compares it with ``QuantType`` members and would silently ignore a string.

    Example:
        >>> resolve_quant_types({"TensorQuantOverrides": {"t": [{"quant_type": "QInt16"}]}})  # doctest: +SKIP
        {'TensorQuantOverrides': {'t': [{'quant_type': <QuantType.QInt16: 3>}]}}
    """
    from onnxruntime.quantization import QuantType

    overrides = extra_options.get("TensorQuantOverrides")
    if isinstance(overrides, dict):
        for entries in overrides.values():
            for entry in entries if isinstance(entries, list) else []:
                for holder in (entry, entry.get("convert") if isinstance(entry, dict) else None):
                    if isinstance(holder, dict) and isinstance(holder.get("quant_type"), str):
                        holder["quant_type"] = QuantType[holder["quant_type"]]
                    # onnxruntime does numpy arithmetic on these (rmin.dtype): plain floats crash it.
                    for key in ("rmin", "rmax", "scale"):
                        if isinstance(holder, dict) and isinstance(holder.get(key), (int, float)):
                            holder[key] = np.float32(holder[key])
    return extra_options


def _check_weight_only(recipe: Recipe, data: dict[str, Any], source: str) -> None:
    """Weight-only keys only in a weight_only recipe, static/dynamic-only keys never in one."""
    if recipe.mode != "weight_only":
        for key in WEIGHT_ONLY_KEYS:
            if data.get(key) is not None:
                raise DiagError(
                    "bad-recipe",
                    f"{source} key '{key}'",
                    f"only applies to MatMulNBitsQuantizer but mode is '{recipe.mode}'",
                    f'remove \'{key}\' or set "mode": "weight_only"',
                )
        return
    for key in data:
        if key not in WEIGHT_ONLY_RECIPE:
            raise DiagError(
                "bad-recipe",
                f"{source} key '{key}'",
                "is not a MatMulNBitsQuantizer argument (mode is 'weight_only')",
                f"weight_only recipes take: {', '.join(WEIGHT_ONLY_RECIPE)}",
            )
    _check_algorithm(recipe, source)
    widths = {recipe.bits or 4, *(recipe.node_bits or {}).values()}
    if recipe.quant_format == "QDQ" and widths != {4}:
        raise DiagError(
            "bad-recipe",
            f"{source} key 'quant_format'",
            "QDQ weight-only quantization is 4-bit only in onnxruntime (it leaves 2/8-bit MatMuls in float)",
            'use "quant_format": "QOperator" for bits 2/8',
        )


def _check_algorithm(recipe: Recipe, source: str) -> None:
    """HQQ/GPTQ: QOperator only (onnxruntime asserts it); GPTQ needs calibration, the others take none."""
    algo = recipe.algorithm or "RTN"
    if algo != "RTN" and recipe.quant_format == "QDQ":
        raise DiagError(
            "bad-recipe",
            f"{source} key 'algorithm'",
            f"{algo} writes MatMulNBits only",
            'use "quant_format": "QOperator"',
        )
    if algo == "GPTQ" and recipe.calibration is None:
        raise DiagError(
            "bad-recipe",
            f"{source} key 'algorithm'",
            "GPTQ needs calibration inputs and none were given",
            'set "calibration": "calib.npz" in the recipe (or use "algorithm": "RTN" or "HQQ")',
        )
    if algo != "GPTQ" and (recipe.calibration is not None or recipe.calibration_samples is not None):
        raise DiagError(
            "bad-recipe",
            f"{source} key 'calibration'",
            f"is read by GPTQ only (algorithm is {algo}: no calibration)",
            'remove it or set "algorithm": "GPTQ"',
        )
    if algo == "GPTQ" and (recipe.nodes_to_exclude or recipe.node_bits):
        # onnxruntime 1.32's GPTQ branch never reads nodes_to_exclude: the named nodes came out 4-bit.
        raise DiagError(
            "bad-recipe",
            f"{source} key 'algorithm'",
            "onnxruntime's GPTQ quantizes every MatMul at 4 bits whatever nodes_to_exclude / node_bits say",
            'remove nodes_to_exclude and node_bits, or use "algorithm": "RTN", "k_quant" or "HQQ"',
        )
    if algo in ("GPTQ", "HQQ") and (recipe.bits or 4) != 4:
        # HQQ at 8 bits writes float zero points that onnxruntime's CPU MatMulNBits refuses to load.
        why = "GPTQ is 4-bit only in onnxruntime" if algo == "GPTQ" else "HQQ's 8-bit MatMulNBits does not load on CPU"
        raise DiagError(
            "bad-recipe",
            f"{source} key 'algorithm'",
            why,
            'use "bits": 4 (under HQQ, nodes in "node_bits" at 8 bits are quantized by RTN)',
        )


_EXAMPLE = 'write e.g. {"mode": "dynamic", "weight_type": "QInt8", "per_channel": true}'

_ENUMS: dict[str, tuple[str, ...]] = {
    "mode": MODES,
    "quant_format": QUANT_FORMATS,
    "activation_type": QUANT_TYPES,
    "weight_type": QUANT_TYPES,
    "calibrate_method": CALIBRATE_METHODS,
    "algorithm": WEIGHT_ONLY_ALGORITHMS,
}
_ENUM_CLASS = {
    "quant_format": "QuantFormat",
    "activation_type": "QuantType",
    "weight_type": "QuantType",
    "calibrate_method": "CalibrationMethod",
}


def _suggest(word: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    lower = {c.lower(): c for c in choices}
    if not close and word.lower() in lower:
        close = [lower[word.lower()]]
    if close:
        return f"did you mean '{close[0]}'?"
    return f"one of: {', '.join(choices)}"


def _check_value(key: str, value: Any, obj: str) -> Any:
    """Type-check one recipe value; return it normalised (enum prefixes stripped)."""
    if key in _ENUMS:
        if not isinstance(value, str):
            raise DiagError("bad-recipe", obj, f"is {value!r}, not a name", f"one of: {', '.join(_ENUMS[key])}")
        prefix = _ENUM_CLASS.get(key)
        if prefix and value.startswith(prefix + "."):
            value = value[len(prefix) + 1 :]  # "QuantType.QInt8", as typed in Python
        if value not in _ENUMS[key]:
            raise DiagError("bad-recipe", obj, f"has unknown value {value!r}", _suggest(value, _ENUMS[key]))
        return value
    if key in ("per_channel", "reduce_range", "preprocess", "keep_io_types", "use_external_data_format"):
        if not isinstance(value, bool):
            raise DiagError("bad-recipe", obj, f"is {value!r}, not true/false", "write true or false")
        return value
    if key in ("op_types_to_quantize", "nodes_to_quantize", "nodes_to_exclude", "op_block_list", "node_block_list"):
        if value is None and key != "nodes_to_exclude":
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise DiagError("bad-recipe", obj, "is not a list of names", 'write e.g. ["Conv", "MatMul"]')
        return list(value)
    if key == "extra_options":
        if not isinstance(value, dict):
            raise DiagError(
                "bad-recipe", obj, f"is a {type(value).__name__}, not a table", 'e.g. {"WeightSymmetric": true}'
            )
        _check_plain(value, obj)
        return json.loads(json.dumps(value))
    if key == "calibration":
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise DiagError("bad-recipe", obj, "is not a path", 'write e.g. "calib.npz" (relative to the recipe file)')
        return value
    if key in ("bits", "block_size", "accuracy_level"):
        if value is None:
            return None
        allowed = {"bits": (2, 4, 8), "accuracy_level": (0, 1, 2, 3, 4)}.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or (allowed and value not in allowed):
            hint = f"one of: {', '.join(map(str, allowed))}" if allowed else "write e.g. 32 or 128"
            raise DiagError("bad-recipe", obj, f"is {value!r}", hint)
        if key == "block_size" and (value < 16 or value & (value - 1)):
            raise DiagError("bad-recipe", obj, f"is {value!r}, not a power of 2 >= 16", "write e.g. 32 or 128")
        return value
    if key == "is_symmetric":
        if value is not None and not isinstance(value, bool):
            raise DiagError("bad-recipe", obj, f"is {value!r}, not true/false", "write true or false")
        return value
    if key == "node_bits":
        if value is None:
            return None
        if not isinstance(value, dict) or not all(v in (2, 4, 8) and not isinstance(v, bool) for v in value.values()):
            raise DiagError("bad-recipe", obj, "is not a table of node name -> bits", 'write e.g. {"lm_head": 8}')
        return dict(value)
    if key == "calibration_samples":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DiagError("bad-recipe", obj, f"is {value!r}, not a positive integer", "write e.g. 64")
        return value
    raise AssertionError(f"unhandled recipe key {key}")  # pragma: no cover - keys are checked first


def _check_plain(value: Any, obj: str) -> None:
    """Only JSON types (TOML dates and NaN would not survive a round trip)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise DiagError("bad-recipe", obj, f"has a non-string key {k!r}", "use string keys")
            _check_plain(v, obj)
    elif isinstance(value, list):
        for v in value:
            _check_plain(v, obj)
    elif isinstance(value, float) and not math.isfinite(value):
        raise DiagError("bad-recipe", obj, f"holds {value!r}", "use finite numbers")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise DiagError("bad-recipe", obj, f"holds a {type(value).__name__}", "use strings, numbers, lists and tables")


def read_recipe_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a recipe file (``.toml`` by suffix, JSON otherwise) into a dict, without validating keys.

    Syntax errors become ``bad-recipe`` with the line and column, so the linter and
    :func:`load_recipe` report them alike.

    Example:
        >>> read_recipe_file("recipe.json")  # doctest: +SKIP
        {'mode': 'dynamic', 'per_channel': True}
    """
    p = input_file(path, "recipe", "pass a .json or .toml file")
    obj = f"recipe '{p}'"
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DiagError("unreadable", obj, f"cannot be read ({e.strerror})", "check permissions") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DiagError("bad-recipe", obj, "is not UTF-8 text", "save it as UTF-8 JSON or TOML") from e
    _refuse_hostile_text(text, obj)
    if p.suffix.lower() == ".toml":
        toml = _tomllib()
        try:
            data: Any = toml.loads(text)
        except (toml.TOMLDecodeError, ValueError) as e:
            raise DiagError("bad-recipe", obj, f"is not valid TOML ({e})", "fix the syntax at the reported line") from e
    else:
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            raise DiagError(
                "bad-recipe", obj, f"has key '{e.args[0]}' twice", "JSON keeps only the last one; merge them"
            ) from e
        except ValueError as e:
            if not isinstance(e, json.JSONDecodeError):  # an integer longer than Python parses
                raise DiagError("bad-recipe", obj, "has an integer too long to read", "use a plain number") from e
            raise DiagError(
                "bad-recipe",
                obj,
                f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                "fix the syntax (JSON has no comments or trailing commas); or use a .toml file",
            ) from e
    if not isinstance(data, dict):
        raise DiagError("bad-recipe", obj, f"holds a {type(data).__name__}, not a table of settings", _EXAMPLE)
    return data


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice would silently lose its first value."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _tomllib() -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as e:
            raise DiagError(
                "bad-recipe",
                "TOML recipe",
                "needs Python >= 3.11 or the tomli package",
                "pip install tomli, or use JSON",
            ) from e
    return tomllib


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file; ``calibration`` stays relative to the file's folder.

    Example:
        >>> load_recipe("recipe.json").mode  # doctest: +SKIP
        'dynamic'
    """
    p = Path(path)
    recipe = Recipe.from_dict(read_recipe_file(p), f"recipe '{p}'")
    recipe.base_dir = str(p.parent)
    return recipe


#: A recipe or grid is a table of scalars, lists and one level of extra_options; far deeper is hostile.
MAX_RECIPE_DEPTH = 16


def _refuse_hostile_text(text: str, obj: str) -> None:
    """Deep nesting would exhaust the parser's recursion (JSON) or blow the stack (TOML): refuse it first."""

    if max_depth(text) > MAX_RECIPE_DEPTH:
        raise DiagError(
            "bad-recipe", obj, f"is nested deeper than {MAX_RECIPE_DEPTH} levels", "a recipe is a flat table of options"
        )


def inline_json(text: str, flag: str, example: str) -> Any:
    """Parse the inline JSON given to ``flag`` (``--recipe``, ``--grid``); a syntax error is bad-recipe.

    Example:
        >>> inline_json('{"mode": "dynamic"}', "--recipe", "{}")
        {'mode': 'dynamic'}
    """
    _refuse_hostile_text(text, f"inline {flag}")
    try:
        return json.loads(text)
    except ValueError as e:
        if not isinstance(e, json.JSONDecodeError):
            raise DiagError(
                "bad-recipe", f"inline {flag}", "has an integer too long to read", "use a plain number"
            ) from e
        raise DiagError(
            "bad-recipe",
            f"inline {flag}",
            f"is not valid JSON ({e.msg} at column {e.colno})",
            f"quote it for the shell: {flag} '{example}'",
        ) from e


def recipe_from_option(value: str | os.PathLike[str]) -> Recipe:
    """A recipe from a ``--recipe`` value: a ``.json`` / ``.toml`` file, or inline JSON starting with ``{``.

    An inline recipe's ``calibration`` is relative to the current folder.

    Example:
        >>> recipe_from_option('{"mode": "dynamic", "per_channel": true}').per_channel
        True
    """
    text = str(value)
    if not text.lstrip().startswith("{"):
        return load_recipe(value)
    recipe = Recipe.from_dict(inline_json(text, "--recipe", '{"mode": "dynamic"}'), "inline recipe")
    recipe.base_dir = "."
    return recipe


def save_recipe(recipe: Recipe, path: str | os.PathLike[str]) -> Path:
    """Write ``recipe`` atomically as JSON, or TOML when ``path`` ends in ``.toml``.

    ``calibration`` is written as stored; when the recipe came from a file in another folder,
    the path is rebased so that it still names the same data from the new file's folder.

    Example:
        >>> save_recipe(Recipe(mode="dynamic"), "recipe.json")  # doctest: +SKIP
        PosixPath('recipe.json')
    """
    p = output_file(path, "recipe")
    write_set({p: recipe_file_text(recipe, p)}, "recipe")
    return p


def recipe_file_text(recipe: Recipe, path: str | os.PathLike[str]) -> str:
    """The text :func:`save_recipe` writes to ``path`` (its calibration path rebased onto ``path``'s folder)."""
    p = Path(path)
    data = recipe.to_dict()
    calib = recipe.calibration_path()
    if calib is not None and recipe.base_dir is not None and not Path(recipe.calibration or "").is_absolute():
        data["calibration"] = os.path.relpath(calib, p.parent if str(p.parent) else ".")
    text = _to_toml(data, p) if p.suffix.lower() == ".toml" else json.dumps(data, indent=2) + "\n"
    return text


def _toml_string(text: str) -> str:
    """A TOML basic string. Not ``json.dumps``: its surrogate-pair escapes (``\\ud83d``) are invalid TOML."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any, obj: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v, obj) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(v, obj)}" for k, v in value.items()) + "}"
    raise DiagError("bad-recipe", obj, f"holds {value!r}, which TOML cannot write", "save the recipe as .json")


def _to_toml(data: dict[str, Any], path: Path) -> str:
    obj = f"recipe '{path}'"
    lines = [f"{k} = {_toml_value(v, obj)}" for k, v in data.items() if k != "extra_options"]
    extra = data.get("extra_options") or {}
    if extra:
        lines += ["", "[extra_options]"]
        lines += [f"{_toml_string(k)} = {_toml_value(v, obj)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"
