"""The one generator of fix code: Python that re-quantizes with onnxruntime's own calls, no diag.

Two texts come out of it, for two readers:

- :func:`fix_snippet`, the "suggested fix" of a `diag compare` report: the INT8 model's
  recipe (given or inferred) with more nodes kept in float, for the user to paste;
- :func:`reproduce_snippet`, `diag exclude`'s ``reproduce.py``: a script that replays every step
  diag took before onnxruntime's quantizer and rebuilds the verified mixed-precision model.

Both are built from the same pieces (the enum of each recipe key, one keyword line, one call)
so that a recipe key is spelled one way in every text diag writes. Their bytes are pinned by the
golden reports and by the tests that run ``reproduce.py``: change a line here and they fail.

FP16 and weight-only recipes call other converters; their text lives next to the code that
reads those models (:mod:`diag.core.fp16`, :mod:`diag.core.nbits`) and is dispatched to from here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

from diag.core.load import WEIGHT_INPUTS
from diag.fix.fp16convert import KeptInFloat, fix_snippet_fp16, reproduce_fp16
from diag.fix.infer import SNIPPET_KEYS
from diag.fix.modelprep import (
    STEP_EXTERNAL_DATA,
    STEP_LIFT_CONSTANTS,
    STEP_PREPROCESS,
    STEP_PREPROCESS_SKIP_SYMBOLIC,
    STEP_UPGRADE_AFTER_LOAD_ERROR,
    STEP_UPGRADE_OPSET,
)
from diag.fix.weightonly import weight_only_fix_snippet, weight_only_snippet
from diag.foundations.ortfacts import FORMATS

#: onnxruntime's enum class of each recipe key whose value is a member name (``"QInt8"``).
ENUMS = {
    "quant_format": "QuantFormat",
    "activation_type": "QuantType",
    "weight_type": "QuantType",
    "calibrate_method": "CalibrationMethod",
}

#: Keys only ``quantize_static`` takes: a dynamic fix must not pass them.
_STATIC_ONLY = ("quant_format", "activation_type", "calibrate_method")


def lift_constants_snippet(mode: str) -> list[str]:
    """reproduce.py's replay of ``quantize``'s Constant lifting: the Constant nodes the quantizer reads
    as weights become initializers (:func:`diag.core.load.constant_weights`, by the same rule).

    ``mode``: the recipe's (``static``: every float Constant a quantized op reads; otherwise the
    weight inputs of the ops quantize_dynamic quantizes).

    Example:
        >>> any("IntegerOpsRegistry" in line for line in lift_constants_snippet("dynamic"))
        True
    """
    static = mode == "static"
    registries = (
        "set(registry.QDQRegistry) | set(registry.QLinearOpsRegistry)" if static else "set(registry.IntegerOpsRegistry)"
    )
    pick = (
        [
            "        wanted.update(t for t in node.input if t in consts",
            "                      and consts[t].attribute[0].t.data_type == onnx.TensorProto.FLOAT)",
        ]
        if static
        else [
            f"        weight_inputs = {dict(WEIGHT_INPUTS)!r}.get(node.op_type, ())",
            "        wanted.update(node.input[i] for i in weight_inputs",
            "                      if i < len(node.input) and node.input[i] in consts)",
        ]
    )
    return [
        "# The Constant nodes the quantizer reads as weights -> initializers (it only quantizes initializers).",
        "from onnxruntime.quantization import registry",
        "",
        f"quantized = {registries}",
        "consts = {n.output[0]: n for n in model.graph.node if n.op_type == 'Constant' and n.output",
        "          and len(n.attribute) == 1 and n.attribute[0].name == 'value'}",
        "wanted = set()",
        "for node in model.graph.node:",
        "    if node.op_type in quantized:",
        *pick,
        "kept = []",
        "for node in model.graph.node:",
        '    if node.op_type == "Constant" and node.output and node.output[0] in wanted:',
        "        t = onnx.TensorProto()",
        "        t.CopyFrom(node.attribute[0].t)",
        "        t.name = node.output[0]",
        "        model.graph.initializer.append(t)",
        "    else:",
        "        kept.append(node)",
        "del model.graph.node[:]",
        "model.graph.node.extend(kept)",
    ]


class Reproducible(KeptInFloat, Protocol):
    """What reproduce.py needs of a search's result (:class:`diag.fix.exclude.ExclusionResult`, a tier plan):
    what an fp16 reproduce.py needs, and the steps diag took before onnxruntime's quantizer."""

    @property
    def steps(self) -> list[str]: ...


# ---------------------------------------------------------------- shared pieces


def _keyword(key: str, source: str) -> str:
    """One keyword argument line of a generated call (four spaces, trailing comma)."""
    return f"    {key}={source},"


def _enum_keyword(key: str, member: object) -> str:
    """``key=QuantType.QInt8,``: onnxruntime compares enum members, a string would be ignored."""
    return _keyword(key, f"{ENUMS[key]}.{member}")


def _call(fn: str, positional: list[str], keywords: list[str]) -> list[str]:
    """A generated call, one argument per line, as ruff would format it."""
    return [f"{fn}(", *(f"    {p}," for p in positional), *keywords, ")"]


def _quantize_fn(static: bool) -> str:
    return "quantize_static" if static else "quantize_dynamic"


# ---------------------------------------------------------------- the report's suggested fix


def fix_snippet(
    fmt: str,
    nodes: list[str],
    recipe: dict[str, Any] | None = None,
    fp32_path: str = "fp32.onnx",
    int8_path: str = "int8.onnx",
    external: bool = False,
) -> str:
    """Python that re-quantizes with plain onnxruntime, keeping ``nodes`` in float.

    ``external``: the FP32 model keeps its weights in external data (LLM exports, anything over
    2 GB), so the fixed model is written the same way (protobuf cannot hold it in one file).

    With ``recipe`` (``diag.json["recommendation"]["recipe"]``: the ``--recipe`` given, or the
    settings :func:`diag.fix.infer.fix_recipe` inferred from the INT8 model) every setting the INT8
    model was made with is passed on, and the nodes it already kept in float stay excluded: the
    fix changes the exclusions only. A comment says where the settings came from and what could
    not be inferred. Without it (diag.json files written before the recipe was recorded) only the
    format is known.

    Example:
        >>> r = {"source": "inferred", "settings": {"mode": "dynamic", "weight_type": "QUInt8"}, "unknown": {}}
        >>> print(fix_snippet("dynamic", ["fc1"], r, "m.onnx", "m.int8.onnx"))
        # Settings inferred by diag from the INT8 model (diag inspect INT8 --recipe).
        from onnxruntime.quantization import QuantType, quantize_dynamic
        <BLANKLINE>
        quantize_dynamic(
            "m.onnx",
            "m.int8.fixed.onnx",
            weight_type=QuantType.QUInt8,
            nodes_to_exclude=["fc1"],
        )
    """
    if not nodes:
        return ""
    if recipe is None:
        return _plain_fix_snippet(fmt, nodes)
    if recipe.get("settings") is None:
        why = recipe.get("why") or "unknown reason"
        return (
            f"# The INT8 model's settings could not be inferred ({why}): onnxruntime's defaults below may\n"
            "# differ from the settings that made it; pass the recipe with --recipe to get them.\n"
            + _plain_fix_snippet(fmt, nodes)
        )
    settings = dict(recipe["settings"])
    if settings.get("mode") == "fp16":
        return fix_snippet_fp16(settings, nodes, fp32_path, int8_path)
    static = settings.get("mode") == "static"
    settings["nodes_to_exclude"] = list(dict.fromkeys([*settings.get("nodes_to_exclude", []), *nodes]))
    args, used = _fix_keywords(settings, static)
    lines = _fix_comments(recipe, settings, fp32_path, static)
    out = str(Path(int8_path).with_name(Path(int8_path).name.removesuffix(".onnx") + ".fixed.onnx"))
    if settings.get("mode") == "weight_only":
        return weight_only_fix_snippet(settings, lines[0], fp32_path, out, external)
    fn = _quantize_fn(static)
    if external:
        args.append(_keyword("use_external_data_format", "True"))
    lines.append(f"from onnxruntime.quantization import {', '.join(sorted(used | {fn}))}")
    positional = [json.dumps(fp32_path), json.dumps(out), *(["calibration_reader"] if static else [])]
    lines += ["", *_call(fn, positional, args)]
    return "\n".join(lines)


def _fix_keywords(settings: dict[str, Any], static: bool) -> tuple[list[str], set[str]]:
    """The keyword lines of the fix call, in onnxruntime's argument order, and the enums they use.

    Only the keys the settings hold are passed (the rest are onnxruntime's defaults either way);
    a dynamic fix drops the static-only keys, an empty ``extra_options`` is left out.
    """
    args: list[str] = []
    used: set[str] = set()
    for key in SNIPPET_KEYS:
        if key not in settings or settings[key] is None:
            continue
        if not static and key in _STATIC_ONLY:
            continue
        value = settings[key]
        if key in ENUMS:
            used.add(ENUMS[key])
            args.append(_enum_keyword(key, value))
        elif key == "extra_options" and not value:
            continue
        else:
            args.append(_keyword(key, _py_literal(value)))
    return args, used


def _fix_comments(recipe: dict[str, Any], settings: dict[str, Any], fp32_path: str, static: bool) -> list[str]:
    """The comment lines above the fix: where the settings came from and what the user must supply."""
    unknown = [k for k in (recipe.get("unknown") or {}) if k != "calibration"]
    if recipe.get("source") == "given":
        head = "# Settings as given with --recipe"
    else:
        head = "# Settings inferred by diag from the INT8 model (diag inspect INT8 --recipe)"
    lines = [head + (f"; not inferable: {', '.join(unknown)}." if unknown else ".")]
    if settings.get("preprocess"):
        lines.append(f"# The recipe runs quant_pre_process first: pass its output instead of {fp32_path!r}.")
    if static:
        lines.append(
            "# calibration_reader is yours: a CalibrationDataReader over representative inputs (not in the model)."
        )
    return lines


def _py_literal(value: Any) -> str:
    """Python source for a JSON value (True/False/None, not true/false/null)."""
    return repr(value) if not isinstance(value, (str, list, dict)) else _py_json(value)


def _py_json(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_py_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_json(str(k))}: {_py_json(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _plain_fix_snippet(fmt: str, nodes: list[str]) -> str:
    """The snippet for a diag.json without a recorded recipe: the format is all that is known."""
    listed = ", ".join(json.dumps(n) for n in nodes)
    facts = FORMATS.get(fmt)
    if facts is not None and facts.weight_only:
        settings = {"mode": "weight_only", "quant_format": facts.quant_format, "nodes_to_exclude": list(nodes)}
        return weight_only_fix_snippet(
            settings, "# onnxruntime's defaults (bits 4, block_size 128)", "fp32.onnx", "int8.onnx"
        )
    if fmt == "dynamic":
        return (
            "from onnxruntime.quantization import quantize_dynamic\n"
            f'quantize_dynamic("fp32.onnx", "int8.onnx", nodes_to_exclude=[{listed}])'
        )
    qf = (facts and facts.quant_format) or "QDQ"  # QDQ when the format does not say (a mixed model)
    return (
        "from onnxruntime.quantization import QuantFormat, quantize_static\n"
        f'quantize_static("fp32.onnx", "int8.onnx", calibration_reader,\n'
        f"                quant_format=QuantFormat.{qf}, nodes_to_exclude=[{listed}])"
    )


# ---------------------------------------------------------------- diag exclude's reproduce.py


def reproduce_snippet(
    result: Reproducible,
    model_out: str,
    calibration: str | None = None,
    calibration_samples: int | None = None,
    batch: int = 1,
) -> str:
    """Python that rebuilds the verified mixed-precision model with plain onnx/onnxruntime calls (no diag).

    It replays every step diag took before onnxruntime's quantizer (``result.steps``: Constant
    nodes lifted to initializers, opset upgrade for per-channel QDQ, ``quant_pre_process`` with
    or without symbolic shapes), then quantizes with the final recipe: the same calls in the same
    order, so it writes the same model. ``model_out`` must not be the verified model's own path
    (``diag exclude`` passes ``<stem>.reproduced.onnx``). ``calibration`` is the ``.npz`` a static
    recipe calibrates on (its first ``calibration_samples`` rows, ``batch`` rows per call).

    Example:
        >>> print(reproduce_snippet(result, "m.reproduced.onnx"))  # doctest: +SKIP
        # Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.
        ...
    """
    r = result.recipe
    if r.get("mode") == "weight_only":
        header = f"# target {result.target}: {result.verdict}; {len(result.nodes_to_exclude)} node(s) kept in float."
        lift = lift_constants_snippet("weight_only") if STEP_LIFT_CONSTANTS in result.steps else []
        return weight_only_snippet(r, result.fp32, model_out, header, lift)
    if r.get("mode") == "fp16":
        return reproduce_fp16(result, model_out)
    static = r.get("mode") == "static"
    steps = list(result.steps)
    if r.get("preprocess") and not any(x.startswith(STEP_PREPROCESS) for x in steps):
        steps.append(STEP_PREPROCESS)
    external = STEP_EXTERNAL_DATA in steps
    lines = _reproduce_preamble(result, steps, static, model_out)
    if static:
        lines += [f"CALIBRATION = os.path.abspath({calibration or 'CALIBRATION.npz'!r})", *_READER_CLASS]
    lines += ["", "", "model = onnx.load(FP32)", *_model_steps(steps, str(r.get("mode") or "static"))]
    lines += _file_steps(steps, external)
    reader = [f"Reader(CALIBRATION, {calibration_samples!r}, {batch!r})"] if static else []
    keywords = _reproduce_keywords(r, result.nodes_to_exclude, static, external)
    lines += [
        *_call(_quantize_fn(static), ["src", "OUT", *reader], keywords),
        "os.chdir(os.path.dirname(OUT))",
        "shutil.rmtree(work, ignore_errors=True)",
        "print('wrote', OUT)",
    ]
    return "\n".join(lines) + "\n"


def _reproduce_preamble(result: Reproducible, steps: list[str], static: bool, model_out: str) -> list[str]:
    """The header comments (what was found, what is replayed), the imports, and the two paths.

    The paths are made absolute before the script changes folder: quant_pre_process may leave
    temporary files in the current folder, so the script works in a temporary one.
    """
    names = ["QuantType", _quantize_fn(static)]
    if static:
        names = ["CalibrationDataReader", "CalibrationMethod", "QuantFormat", *names]
    lines = [
        "# Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.",
        f"# target {result.target}: {result.verdict}; {len(result.nodes_to_exclude)} node(s) kept in float.",
        f"# Replays diag's steps before quantizing: {', '.join(steps) or 'none'}.",
        "# Paths are as given to diag exclude: run this from the folder diag exclude ran in.",
        "import os",
        "import shutil",
        "import tempfile",
        "",
        *(["import numpy as np"] if static else []),
        "import onnx",
        f"from onnxruntime.quantization import {', '.join(names)}",
    ]
    if any(x.startswith(STEP_PREPROCESS) for x in steps):
        lines.append("from onnxruntime.quantization.shape_inference import quant_pre_process")
    return [*lines, "", f"FP32 = os.path.abspath({result.fp32!r})", f"OUT = os.path.abspath({model_out!r})"]


#: reproduce.py's calibration reader: the rows diag calibrated on, in the batches diag fed them.
_READER_CLASS = [
    "",
    "",
    "class Reader(CalibrationDataReader):",
    '    """The first `count` rows of a stacked .npz, `batch` rows per get_next (as diag fed them)."""',
    "",
    "    def __init__(self, path, count, batch):",
    "        with np.load(path) as z:",
    "            arrays = {k: z[k] for k in z.files}",
    "        n = len(next(iter(arrays.values()))) if count is None else count",
    "        rows = range(0, n, batch)",
    "        self.feeds = iter([{k: v[i : min(i + batch, n)] for k, v in arrays.items()} for i in rows])",
    "",
    "    def get_next(self):",
    "        return next(self.feeds, None)",
]


def _model_steps(steps: list[str], mode: str) -> list[str]:
    """The steps diag applied to the loaded FP32 model in memory (before it is saved for the quantizer)."""
    lines: list[str] = []
    for step in steps:
        if step == STEP_LIFT_CONSTANTS:
            lines += lift_constants_snippet(mode)
        elif step == STEP_UPGRADE_OPSET:
            lines += [
                "# per-channel QDQ writes DequantizeLinear(axis=...), which opset < 13 forbids.",
                "model = onnx.version_converter.convert_version(model, 13)",
            ]
    return lines


def _file_steps(steps: list[str], external: bool) -> list[str]:
    """Save the model in a temporary folder, then the steps diag ran on files (quant_pre_process, opset upgrade)."""
    save = ", save_as_external_data=True, location='model.onnx.data'" if external else ""
    lines = [
        "work = tempfile.mkdtemp()",
        "src = os.path.join(work, 'model.onnx')",
        f"onnx.save_model(model, src{save})",
        "del model",
        "os.chdir(work)  # quant_pre_process may leave temp files in the current folder",
    ]
    for step in steps:
        if step in (STEP_PREPROCESS, STEP_PREPROCESS_SKIP_SYMBOLIC):
            skip = ", skip_symbolic_shape=True" if step == STEP_PREPROCESS_SKIP_SYMBOLIC else ""
            ext = ", save_as_external_data=True, all_tensors_to_one_file=True" if external else ""
            lines += [
                f"quant_pre_process(src, os.path.join(work, 'pre.onnx'){skip}{ext})",
                "src = os.path.join(work, 'pre.onnx')",
            ]
        elif step == STEP_UPGRADE_AFTER_LOAD_ERROR:
            lines += [
                "# diag's first INT8 model did not load (DequantizeLinear axis on opset < 13): upgraded, as here.",
                "upgraded = onnx.version_converter.convert_version(onnx.load(src), 13)",
                "onnx.save_model(upgraded, os.path.join(work, 'up.onnx'))",
                "src = os.path.join(work, 'up.onnx')",
            ]
    return lines


def _reproduce_keywords(r: dict[str, Any], nodes: list[str], static: bool, external: bool) -> list[str]:
    """Every keyword of the final recipe, spelled out (reproduce.py must not lean on defaults)."""
    args: list[str] = []
    if static:
        args += [
            _enum_keyword("quant_format", r["quant_format"]),
            _enum_keyword("activation_type", r["activation_type"]),
        ]
    args.append(_enum_keyword("weight_type", r["weight_type"]))
    for key in ("per_channel", "reduce_range"):
        args.append(_keyword(key, repr(bool(r.get(key)))))
    for key in ("op_types_to_quantize", "nodes_to_quantize"):
        if r.get(key) is not None:
            args.append(_keyword(key, repr(r[key])))
    args.append(_keyword("nodes_to_exclude", repr(nodes)))
    if static:
        args.append(_enum_keyword("calibrate_method", r["calibrate_method"]))
    if r.get("extra_options"):
        args.append(_keyword("extra_options", _extra_options_source(r["extra_options"])))
    if external:
        args.append(_keyword("use_external_data_format", "True"))
    return args


def _extra_options_source(extra: dict[str, Any]) -> str:
    """``extra_options`` as Python source, TensorQuantOverrides values as onnxruntime wants them.

    A recipe file holds ``"quant_type": "QInt16"`` as a string; onnxruntime compares it with
    ``QuantType`` members and silently ignores a string (see :func:`diag.core.recipe.resolve_quant_types`).

    Example:
        >>> _extra_options_source({"TensorQuantOverrides": {"h": [{"quant_type": "QInt16"}]}})
        "{'TensorQuantOverrides': {'h': [{'quant_type': QuantType.QInt16}]}}"
    """
    text = repr(extra)
    text = re.sub(r"'quant_type': '(\w+)'", r"'quant_type': QuantType.\1", text)
    return re.sub(r"'(rmin|rmax|scale)': ([-+0-9.eE]+)", r"'\1': np.float32(\2)", text)


def splice_snippet(
    fp32: str,
    int8: str,
    nodes: list[str],
    model_out: str,
    header: str,
    requantize_call: str | None = None,
    bits: dict[str, int] | None = None,
) -> str:
    """reproduce.py of a surgical fix: the user's INT8 model with ``nodes`` spliced in float, by diag.

    A surgical fix is not a quantizer call: the float regions are cut into the model the user
    ships (:func:`diag.fix.exclude.splice_to_file`), so the script needs diag. ``requantize_call``
    (the fix in the producer's own vocabulary) is shown as a comment only: re-quantizing makes a
    different model unless the recipe round-trips, and that model was not the one verified.
    ``bits``: weight-only nodes re-blocked at a wider width (a tier plan), passed on as ``bits=``.

    Example:
        >>> print(splice_snippet("m.fp32.onnx", "m.int8.onnx", ["fc1"], "m.reproduced.onnx", "# met").splitlines()[-2])
        diag.splice_to_file(FP32, INT8, NODES, OUT)
    """
    lines = [
        header,
        "# Every other node and initializer of your INT8 model is kept as it is: no quantizer runs.",
        "import os",
        "",
        "import diag",
        "",
        f"FP32 = os.path.abspath({fp32!r})",
        f"INT8 = os.path.abspath({int8!r})",
        f"OUT = os.path.abspath({model_out!r})",
        f"NODES = {json.dumps(list(nodes), ensure_ascii=False)}",
    ]
    if requantize_call:
        lines += [
            "",
            "# The same list in your quantizer's own terms; re-quantizing builds another model, verified only",
            "# when the recipe rebuilds yours exactly (diag exclude --int8 ... --requantize proves that first):",
            *[f"#   {x}".rstrip() for x in requantize_call.splitlines()],
        ]
    call = "diag.splice_to_file(FP32, INT8, NODES, OUT)"
    if bits:
        widths = json.dumps(bits, ensure_ascii=False)
        lines.append(f"BITS = {widths}  # re-blocked from the FP32 weight at these widths")
        call = "diag.splice_to_file(FP32, INT8, NODES, OUT, bits=BITS)"
    lines += ["", call, "print('wrote', OUT)"]
    return "\n".join(lines) + "\n"


def encodings_snippet(encodings: str, removed: list[str], out: str, header: str, aimet_call: str) -> str:
    """reproduce.py of an AIMET fix: the user's encodings file without ``removed``, in plain Python.

    The fix of an AIMET export is a file, not a model: the encodings the float nodes' quantizers
    own are taken out (:meth:`diag.core.encodings.AimetExport.without`), in any version's layout,
    everything else kept as written. ``aimet_call`` (the same nodes' quantizers disabled in AIMET,
    before computing encodings again) is shown as a comment: that is another calibration.

    Example:
        >>> print(encodings_snippet("m.encodings", ["t"], "m.reproduced.encodings", "# met", "").splitlines()[-1])
        print("wrote", OUT)
    """
    lines = [
        header,
        "# Every other encoding, and every other key of the file, is kept as written: no quantizer runs.",
        "import json",
        "import os",
        "",
        f"ENCODINGS = os.path.abspath({encodings!r})",
        f"OUT = os.path.abspath({out!r})",
        f"REMOVE = set({json.dumps(list(removed), ensure_ascii=False)})",
    ]
    if aimet_call:
        lines += [
            "",
            "# The same nodes in float in AIMET itself (a new QuantizationSimModel, calibrated again: another",
            "# model than the one verified):",
            *[f"#   {x}".rstrip() for x in aimet_call.splitlines()],
        ]
    lines += [
        "",
        'with open(ENCODINGS, encoding="utf-8") as f:',
        "    doc = json.load(f)",
        'for key in ("activation_encodings", "param_encodings", "encodings"):  # 0.6.1 / 1.0.0 / 2.0.0',
        "    section = doc.get(key)",
        "    if isinstance(section, dict):",
        "        doc[key] = {k: v for k, v in section.items() if k not in REMOVE}",
        "    elif isinstance(section, list):",
        '        doc[key] = [e for e in section if not (isinstance(e, dict) and e.get("name") in REMOVE)]',
        'with open(OUT, "w", encoding="utf-8") as f:',
        "    json.dump(doc, f, indent=2, ensure_ascii=False)",
        '    f.write("\\n")',
        'print("wrote", OUT)',
    ]
    return "\n".join(lines) + "\n"
