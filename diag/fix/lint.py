"""Recipe linter: what onnxruntime would silently ignore or reject in a recipe, before quantizing.

onnxruntime's quantizer never complains about an ``extra_options`` key it does not read, a node
name that matches no node, or an op type the model does not have: the model comes out quantized
with settings the user did not ask for, and the accuracy drop is blamed on quantization itself.
Popular guides recommend ``OpTypesToExclude`` and ``QuantizationPrecision``; neither exists.

NOTE: The keys onnxruntime reads are taken from the *installed* onnxruntime's source at run time
(``extra_options.get("…")``, ``extra_options["…"]``, ``"…" in extra_options`` in
``onnxruntime/quantization/*.py``), so a new onnxruntime release is linted by its own rules.
When the source is not shipped (a frozen install), :data:`FALLBACK_EXTRA_OPTIONS` (onnxruntime
1.32, tested against the scan) is used and the findings say so.

NOTE: Errors are settings onnxruntime ignores or refuses (the recipe does not do what it says);
warnings are legal settings that are probably not meant. ``diag lint`` exits 3 (a failed gate)
on any error and 0 with warnings only, so CI can run it before a long quantization job.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import onnx

from diag.core.load import float_model_from_path, iter_nodes
from diag.core.protos import default_opset
from diag.core.recipe import FP16_KEYS, Recipe, read_recipe_file
from diag.foundations.errors import DiagError

#: extra_options keys onnxruntime 1.32's quantizer reads (tests check this against the scan).
FALLBACK_EXTRA_OPTIONS = frozenset(
    {
        "ActivationRestrictedAsymmetric",
        "ActivationSymmetric",
        "AddQDQPairToWeight",
        "BlockSize",
        "CalibMaxIntermediateOutputs",
        "CalibMovingAverage",
        "CalibMovingAverageConstant",
        "CalibPercentile",
        "CalibStridedMinMax",
        "CalibTensorRangeSymmetric",
        "DedicatedQDQPair",
        "DefaultTensorType",
        "EnableSubgraph",
        "ForceQuantizeNoInputCheck",
        "MatMulConstBOnly",
        "MinimumRealRange",
        "OpTypesToExcludeOutputQuantization",
        "QDQDisableWeightAdjustForInt32Bias",
        "QDQKeepRemovableActivations",
        "QDQOpTypePerChannelSupportToAxis",
        "QuantizeBias",
        "SmoothQuant",
        "SmoothQuantAlpha",
        "SmoothQuantFolding",
        "TensorQuantOverrides",
        "UseQDQContribOps",
        "WeightSymmetric",
        "extra.Sigmoid.nnapi",
    }
)
#: calibrator keys (read in calibrate.py) -> the extra_options key quantize_static maps onto them.
FALLBACK_CALIBRATOR_KEYS = {
    "symmetric": "CalibTensorRangeSymmetric",
    "moving_average": "CalibMovingAverage",
    "averaging_constant": "CalibMovingAverageConstant",
    "max_intermediate_outputs": "CalibMaxIntermediateOutputs",
    "percentile": "CalibPercentile",
    "num_bins": "",
    "num_quantized_bins": "",
    "scenario": "",
    "per_channel": "",
}
#: keys popular guides invent, with what does the job instead.
INVENTED_KEYS = {
    "OpTypesToExclude": "keep op types in float with op_types_to_quantize = the quantizable types minus these",
    "QuantizationPrecision": "set weight_type / activation_type (QInt8, QUInt8, QInt16, QUInt16)",
}
#: extra_options that only mean something for quantize_static.
STATIC_ONLY_PREFIXES = ("Calib", "Activation", "SmoothQuant", "QDQ", "AddQDQPairToWeight", "DedicatedQDQPair")
RECIPE_KEYS = (
    "mode",
    "quant_format",
    "activation_type",
    "weight_type",
    "per_channel",
    "reduce_range",
    "op_types_to_quantize",
    "nodes_to_quantize",
    "nodes_to_exclude",
    "calibrate_method",
    "extra_options",
    "calibration",
    "calibration_samples",
    "preprocess",
    "use_external_data_format",
    # mode "weight_only": MatMulNBitsQuantizer's arguments (node_bits is diag's own).
    "bits",
    "block_size",
    "is_symmetric",
    "accuracy_level",
    "node_bits",
    "keep_io_types",
    "op_block_list",
    "node_block_list",
)
#: Keys diag reads itself; onnxruntime's functions take the others under the same names.
DIAG_ONLY_KEYS = ("calibration", "calibration_samples", "preprocess", "node_bits")
STATIC_KEYS = ("quant_format", "activation_type", "calibrate_method", "calibration", "calibration_samples")


def quantizable_op_types(kind: str) -> list[str]:
    """The op types the installed onnxruntime quantizes by default in this format.

    ``kind`` is ``dynamic`` (IntegerOpsRegistry) or a static format (the union of QDQRegistry and
    QLinearOpsRegistry: quantize_static's default ``op_types_to_quantize``).

    Example:
        >>> "MatMul" in quantizable_op_types("dynamic")
        True
    """
    from onnxruntime.quantization import registry

    if kind == "dynamic":
        return list(registry.IntegerOpsRegistry)
    return list(set(registry.QDQRegistry) | set(registry.QLinearOpsRegistry))


@dataclass(frozen=True)
class Finding:
    """One lint finding: severity, a stable code, where in the recipe, what is wrong, what to do.

    Example:
        >>> Finding("error", "unknown-extra-option", "extra_options.X", "is ignored", "drop it").line()
        'error[unknown-extra-option] extra_options.X: is ignored. Hint: drop it'
    """

    severity: str
    code: str
    where: str
    message: str
    hint: str = ""

    def line(self) -> str:
        """The finding as one line (what ``diag lint`` prints)."""
        text = f"{self.severity}[{self.code}] {self.where}: {self.message}"
        return text + (f". Hint: {self.hint}" if self.hint else "")


@dataclass(frozen=True)
class ExtraOptionKeys:
    """The ``extra_options`` keys an onnxruntime install reads, and where they came from.

    Attributes:
        quantizer: keys ``quantize_dynamic`` / ``quantize_static`` read.
        calibrator: keys the calibrator reads -> the quantize_static key mapped onto it ("" if none).
        version: the onnxruntime version.
        scanned: True when read from the installed source, False for the fallback list.
    """

    quantizer: frozenset[str]
    calibrator: dict[str, str]
    version: str
    scanned: bool


_READ_KEY = re.compile(r"""extra_options(?:\.get\(\s*|\[\s*)["']([\w.]+)["']""")
_IN_KEY = re.compile(r"""["']([\w.]+)["']\s+(?:not\s+)?in\s+[\w.]*extra_options\b""")
_IN_VAR = re.compile(r"""\b([A-Za-z_]\w*)\s+(?:not\s+)?in\s+[\w.]*extra_options\b""")
_CALIB_PAIR = re.compile(r"""\(\s*["'](\w+)["']\s*,\s*["'](\w+)["']\s*\)""")


def onnxruntime_extra_options(source_dir: str | os.PathLike[str] | None = None) -> ExtraOptionKeys:
    """The ``extra_options`` keys the installed onnxruntime really reads, from its source files.

    Args:
        source_dir: the ``onnxruntime/quantization`` folder (default: the installed one).

    Example:
        >>> "WeightSymmetric" in onnxruntime_extra_options().quantizer
        True
    """
    import onnxruntime

    if source_dir is None:
        source_dir = Path(onnxruntime.__file__).parent / "quantization"
    return _scan(str(source_dir), onnxruntime.__version__)


@lru_cache(maxsize=4)
def _scan(source_dir: str, version: str) -> ExtraOptionKeys:
    root = Path(source_dir)
    files = sorted([*root.glob("*.py"), *root.glob("operators/*.py")])
    quantizer: set[str] = set()
    calibrator: dict[str, str] = {}
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except OSError:
            continue
        keys = set(_READ_KEY.findall(text)) | set(_IN_KEY.findall(text))
        for var in set(_IN_VAR.findall(text)):  # nnapi_sigmoid_option = "extra.Sigmoid.nnapi"
            keys.update(re.findall(rf"""\b{re.escape(var)}\s*=\s*["']([\w.]+)["']""", text))
        if f.name == "calibrate.py":
            calibrator.update(dict.fromkeys(keys, ""))
        else:
            quantizer.update(keys)
    for f in files:  # ("CalibPercentile", "percentile"): quantize_static's name for a calibrator key
        if f.name != "quantize.py":
            continue
        for a, b in _CALIB_PAIR.findall(f.read_text(encoding="utf-8")):
            user, calib = (a, b) if a.startswith("Calib") else (b, a)
            if user.startswith("Calib"):
                quantizer.add(user)
                calibrator[calib] = user
    if not quantizer:
        return ExtraOptionKeys(FALLBACK_EXTRA_OPTIONS, dict(FALLBACK_CALIBRATOR_KEYS), version, False)
    return ExtraOptionKeys(frozenset(quantizer), calibrator, version, True)


def lint_recipe_file(
    recipe_path: str | os.PathLike[str], model_path: str | os.PathLike[str] | None = None
) -> list[Finding]:
    """Lint a recipe file (JSON/TOML), against the FP32 model when given.

    Unlike loading a recipe, linting does not stop at the first problem: every finding is listed.

    Example:
        >>> for f in lint_recipe_file("recipe.json", "fp32.onnx"):  # doctest: +SKIP
        ...     print(f.line())
        error[unknown-extra-option] extra_options.OpTypesToExclude: onnxruntime 1.32.0 ignores this key. Hint: ...
    """
    data = read_recipe_file(recipe_path)
    model = None
    if model_path is not None:
        model = float_model_from_path(model_path).proto
    return lint_recipe(data, model)


def lint_recipe(data: dict[str, Any], model: onnx.ModelProto | None = None) -> list[Finding]:
    """Lint a parsed recipe dict; ``model`` (an FP32 ``onnx.ModelProto``) enables name checks.

    Example:
        >>> [f.code for f in lint_recipe({"mode": "dynamic", "extra_options": {"OpTypesToExclude": ["Conv"]}})]
        ['unknown-extra-option']
    """
    findings: list[Finding] = []
    valid = _check_keys(data, findings)
    mode = valid.get("mode", "static")
    weight_type = str(valid.get("weight_type") or ("QInt8" if mode == "dynamic" else ""))
    _check_extra_options(data.get("extra_options"), mode, model, findings, weight_type)
    _check_contradictions(data, valid, model, findings)
    if model is not None:
        _check_names(valid, model, findings)
    order = {"error": 0, "warning": 1, "note": 2}
    return sorted(findings, key=lambda f: order[f.severity])


def summary_line(recipe_path: str | os.PathLike[str], findings: list[Finding]) -> str:
    """``recipe.json: 2 errors, 1 warning`` (or ``no problems found``).

    Example:
        >>> summary_line("r.json", [])
        'r.json: no problems found'
    """
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    lines = sum(f.code in ("measured", "no-effect") for f in findings)
    measured = f"; {_plural(lines, 'line')} measured on the model" if lines else ""
    if not errors and not warnings:
        return f"{Path(recipe_path).name}: no problems found{measured}"
    return f"{Path(recipe_path).name}: {_plural(errors, 'error')}, {_plural(warnings, 'warning')}{measured}"


# ---------------------------------------------------------------- checks


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _suggest(word: str, choices: list[str] | set[str] | frozenset[str]) -> str | None:
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    if close:
        return close[0]
    lower = {c.lower(): c for c in choices}
    return lower.get(word.lower())


def _check_keys(data: dict[str, Any], findings: list[Finding]) -> dict[str, Any]:
    """Unknown recipe keys and invalid values; returns the valid key/value pairs."""
    valid: dict[str, Any] = {}
    for key, value in data.items():
        if key not in RECIPE_KEYS:
            close = _suggest(key, set(RECIPE_KEYS))
            hint = f"did you mean '{close}'?" if close else f"recipe keys: {', '.join(RECIPE_KEYS)}"
            findings.append(Finding("error", "unknown-key", key, "is not a recipe key (nothing would read it)", hint))
            continue
        # a weight_only recipe's keys are checked in that mode (its arguments are MatMulNBitsQuantizer's)
        mode = {"mode": "weight_only"} if data.get("mode") == "weight_only" and key != "mode" else {}
        try:
            if key in FP16_KEYS:
                mode = {"mode": "fp16"}
            checked = Recipe.from_dict({**mode, key: value})
        except DiagError as e:
            findings.append(Finding("error", "bad-value", key, e.problem, e.hint))
            continue
        valid[key] = getattr(checked, key)
    return valid


def _check_extra_options(extra: Any, mode: str, model: Any, findings: list[Finding], weight_type: str = "") -> None:
    if not isinstance(extra, dict):
        return
    known = onnxruntime_extra_options()
    source = f"onnxruntime {known.version}" + ("" if known.scanned else " (diag's built-in list)")
    for key in extra:
        where = f"extra_options.{key}"
        if key == "MatMulConstBOnly" and mode == "dynamic" and extra[key] is False:
            findings.append(
                Finding(
                    "warning",
                    "act-act-matmuls",
                    where,
                    "False quantizes every activation x activation MatMul (a transformer's attention scores "
                    "and context), which quantize_dynamic leaves in float by default: a common cause of spread "
                    "error",
                    "remove it unless measured harmless (diag lint --model FP32 --inputs X measures it; diag "
                    "compare names it as the cause when keeping those MatMuls in float recovers the error)",
                )
            )
            continue
        if key in known.quantizer:
            # NOTE: quantize_dynamic reads ActivationSymmetric for what it quantizes with the activation
            # type that is not an activation: a Gather's table when weight_type is not QUInt8 (with
            # QInt8 weights a MiniLM's embedding scales change 0.0061 -> 0.0082). With QUInt8 weights the
            # model is byte-identical (REFERENCE.md; tests/test_lint.py measures both).
            reads_it = key == "ActivationSymmetric" and weight_type != "QUInt8"
            if mode == "dynamic" and key.startswith(STATIC_ONLY_PREFIXES) and not reads_it:
                findings.append(
                    Finding(
                        "warning",
                        "static-only-option",
                        where,
                        "only affects quantize_static but mode is 'dynamic' (activations are quantized at run time)",
                        "remove it, or use mode 'static'",
                    )
                )
            continue
        if key in INVENTED_KEYS:
            hint = INVENTED_KEYS[key]
            if key == "OpTypesToExclude" and isinstance(extra[key], list):
                hint = _op_types_hint(extra[key], mode, model) or hint
            findings.append(Finding("error", "unknown-extra-option", where, f"{source} ignores this key", hint))
        elif key in known.calibrator:
            mapped = known.calibrator[key]
            hint = f"write '{mapped}'" if mapped else "quantize_static has no extra_options key for it"
            findings.append(
                Finding(
                    "error",
                    "calibrator-option",
                    where,
                    f"is read by the calibrator only; quantize_static ignores '{key}' in extra_options",
                    hint,
                )
            )
        else:
            close = _suggest(key, known.quantizer)
            hint = f"did you mean '{close}'?" if close else "see quantize_static's docstring for the keys it reads"
            findings.append(Finding("error", "unknown-extra-option", where, f"{source} ignores this key", hint))


def _op_types_hint(excluded: list[Any], mode: str, model: Any) -> str | None:
    """The op_types_to_quantize list that really keeps ``excluded`` op types in float."""
    kinds = set(quantizable_op_types("dynamic" if mode == "dynamic" else "qdq"))
    if model is not None:
        kinds &= {n.op_type for n in all_nodes(model)}
    keep = sorted(kinds - {str(x) for x in excluded})
    if not keep:
        return None
    return f'write "op_types_to_quantize": {json.dumps(keep)}'


def _check_contradictions(data: dict[str, Any], valid: dict[str, Any], model: Any, findings: list[Finding]) -> None:
    """Settings valid one by one that onnxruntime cannot honour together (errors), or reads otherwise than meant."""
    mode = valid.get("mode", "static")
    fmt = valid.get("quant_format", "QDQ")
    _check_mode_keys(data, valid, mode, findings)
    _check_types(valid, mode, fmt, findings)
    _check_lists(valid, findings)
    if model is not None and mode == "static" and fmt == "QDQ" and valid.get("per_channel"):
        _check_opset(model, findings)


def _check_mode_keys(data: dict[str, Any], valid: dict[str, Any], mode: str, findings: list[Finding]) -> None:
    """Keys the mode's onnxruntime function does not take: it would never see them."""
    if mode == "weight_only":  # settings valid one by one that onnxruntime cannot honour together
        try:
            Recipe.from_dict(valid)
        except DiagError as e:
            key = e.obj.split("'")[1] if "'" in e.obj else "mode"
            findings.append(Finding("error", "contradiction", key, e.problem, e.hint))
    for key in data:
        if key != "mode" and key in RECIPE_KEYS and (key in FP16_KEYS) != (mode == "fp16"):
            applies = "convert_float_to_float16" if key in FP16_KEYS else "quantize_dynamic / quantize_static"
            findings.append(
                Finding(
                    "error",
                    "contradiction",
                    key,
                    f"only applies to {applies} but mode is '{mode}'",
                    f"remove '{key}'" + (' or set mode to "fp16"' if key in FP16_KEYS else ""),
                )
            )
    if mode == "dynamic":
        for key in STATIC_KEYS:
            if key in data:
                findings.append(
                    Finding(
                        "error",
                        "contradiction",
                        key,
                        "only applies to quantize_static but mode is 'dynamic'",
                        f"remove '{key}' or set mode to 'static'",
                    )
                )


def _check_types(valid: dict[str, Any], mode: str, fmt: str, findings: list[Finding]) -> None:
    """Quantization types onnxruntime refuses in this format or with this calibration (it raises mid-run)."""
    for key in ("activation_type", "weight_type"):
        if mode == "static" and fmt == "QOperator" and valid.get(key) in ("QInt16", "QUInt16"):
            findings.append(
                Finding(
                    "error",
                    "contradiction",
                    key,
                    f"{valid[key]} needs quant_format QDQ: QOperator kernels are 8-bit only",
                    'set "quant_format": "QDQ"',
                )
            )
    float8 = [k for k in ("activation_type", "weight_type") if valid.get(k) == "QFLOAT8E4M3FN"]
    if mode == "static" and float8 and valid.get("calibrate_method", "MinMax") != "Distribution":
        findings.append(
            Finding(
                "error",
                "contradiction",
                float8[0],
                "QFLOAT8E4M3FN needs calibrate_method Distribution: onnxruntime raises 'Only Distribution "
                "calibration method is supported for float quantization' otherwise",
                'set "calibrate_method": "Distribution"',
            )
        )


def _check_lists(valid: dict[str, Any], findings: list[Finding]) -> None:
    """Node and op-type lists onnxruntime reads otherwise than written (both lists, empty = every)."""
    include = valid.get("nodes_to_quantize") or []
    for name in dict.fromkeys(n for n in valid.get("nodes_to_exclude") or [] if n in include):
        findings.append(
            Finding(
                "error",
                "contradiction",
                f"nodes_to_exclude '{name}'",
                "is also in nodes_to_quantize (onnxruntime excludes it)",
                "list the node in one of the two",
            )
        )
    for key, means in (("op_types_to_quantize", "every op type"), ("nodes_to_quantize", "every node")):
        if valid.get(key) == []:
            findings.append(
                Finding(
                    "warning",
                    "empty-list",
                    key,
                    f"is empty, which onnxruntime reads as {means} (not none)",
                    f"remove '{key}', or list what to quantize",
                )
            )
    if "calibration_samples" in valid and "calibration" not in valid:
        findings.append(
            Finding(
                "warning", "unused-option", "calibration_samples", "is set but calibration is not", "add calibration"
            )
        )


def _check_opset(model: Any, findings: list[Finding]) -> None:
    """Per-channel QDQ on a model below opset 13: onnxruntime writes a model that does not load."""
    opset = default_opset(model)
    if opset < 13:
        findings.append(
            Finding(
                "warning",
                "old-opset",
                "per_channel",
                f"QDQ per-channel writes DequantizeLinear with 'axis', which opset {opset} forbids:"
                " quantize_static's INT8 model will not load",
                "diag quantize upgrades the opset to 13 first; with onnxruntime directly, run"
                " onnx.version_converter.convert_version(model, 13) before quantizing",
            )
        )


def all_nodes(model: Any) -> list[Any]:
    """Every node of ``model``, its subgraphs' included (what node names and op types are checked against)."""
    return iter_nodes(model.graph)


def module_to_onnx_prefix(name: str) -> str:
    """The node-name prefix the PyTorch exporter gives a module path (ModuleList indices stay dotted).

    Example:
        >>> module_to_onnx_prefix("encoder.layer.0.attention.self.query")
        '/encoder/layer.0/attention/self/query/'
    """
    parts: list[str] = []
    for seg in name.split("."):
        if seg.isdigit() and parts:
            parts[-1] += f".{seg}"
        else:
            parts.append(seg)
    return "/" + "/".join(parts) + "/"


def _check_names(valid: dict[str, Any], model: Any, findings: list[Finding]) -> None:
    nodes = all_nodes(model)
    names = [n.name for n in nodes if n.name]
    name_set = set(names)
    for key in ("nodes_to_exclude", "nodes_to_quantize", "node_block_list"):
        for name in dict.fromkeys(valid.get(key) or []):
            if name in name_set:
                continue
            where = f"{key} '{name}'"
            if "." in name and "/" not in name:
                prefix = module_to_onnx_prefix(name)
                hits = [n for n in names if n.startswith(prefix) or n.startswith(prefix[1:])]
                if hits:
                    shown = ", ".join(hits[:4]) + (f" (+{len(hits) - 4} more)" if len(hits) > 4 else "")
                    findings.append(
                        Finding(
                            "error",
                            "module-name",
                            where,
                            "is a PyTorch module name, not an ONNX node name (onnxruntime ignores it)",
                            f"the module's nodes: {shown}",
                        )
                    )
                    continue
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "list node names with: diag inspect --recipe, or Netron"
            findings.append(
                Finding(
                    "error", "unknown-node", where, "matches no node of the FP32 model (onnxruntime ignores it)", hint
                )
            )
    present = {n.op_type for n in nodes}
    mode = valid.get("mode", "static")
    quantizable = set(quantizable_op_types("dynamic" if mode == "dynamic" else "qdq"))
    for op in dict.fromkeys(valid.get("op_types_to_quantize") or []):
        if op not in quantizable:
            findings.append(
                Finding(
                    "warning",
                    "unquantizable-op-type",
                    f"op_types_to_quantize '{op}'",
                    f"onnxruntime has no {mode} quantizer for {op} (it stays float)",
                    "remove it",
                )
            )
        elif op not in present:
            near = _suggest(op, present)
            hint = f"did you mean '{near}'?" if near else f"the model's op types: {', '.join(sorted(present))}"
            findings.append(
                Finding(
                    "warning", "unknown-op-type", f"op_types_to_quantize '{op}'", "occurs in no node of the model", hint
                )
            )
