"""Recipe mode ``weight_only``: ``MatMulNBitsQuantizer`` calls, their Python, and the recipe a model came from.

The fix-side half of weight-only 4/8-bit quantization. Reading the graphs it writes (unpacking
``MatMulNBits`` and block-wise ``DequantizeLinear`` weights, block errors, ``accuracy_level``) is
core and lives in :mod:`diag.core.nbits`; this module runs onnxruntime's quantizer as a recipe says
(one call per bit width for ``node_bits``), writes the same calls as plain Python for
``reproduce.py`` and the `diag compare` fix, and infers the recipe back from a quantized graph.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.core.protos import default_opset
from diag.core.recipe import Recipe
from diag.fix.modelprep import upgrade_opset
from diag.foundations.errors import DiagError


def infer_weight_only(model: onnx.ModelProto) -> tuple[dict[str, Any], list[str]]:
    """The ``weight_only`` recipe (``MatMulNBitsQuantizer`` arguments) that made ``model``, with evidence.

    ``algorithm`` is never inferred: a k_quant, HQQ or GPTQ graph is indistinguishable from RTN (same
    MatMulNBits nodes, other weight values), so the recipe says RTN or another algorithm by omission.

    FP32 node names come from onnxruntime's naming (``<node>_Q<bits>``, ``<node>_DQ_Q4``); a
    float MatMul left in the graph is listed in ``nodes_to_exclude``; MatMulNBits nodes of
    another bit width than the majority become ``node_bits``.

    Example:
        >>> infer_weight_only(onnx.load("model.q4.onnx"))[0]  # doctest: +SKIP
        {'mode': 'weight_only', 'quant_format': 'QOperator', 'bits': 4, 'block_size': 32, ...}
    """
    evidence: list[str] = []
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    recipe: dict[str, Any] = {"mode": "weight_only"}
    gathers = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    if gathers and not nbits:
        nbits, attrs = gathers, [{"bits": 4, **a} for a in ({x.name: onnx.helper.get_attribute_value(x) for x in
                                                            n.attribute} for n in gathers)]  # fmt: skip
    if nbits:
        recipe["quant_format"] = "QOperator"
        bits = Counter(int(a.get("bits", 4)) for a in attrs)
        main_bits = bits.most_common(1)[0][0]
        blocks = Counter(int(a["block_size"]) for a in attrs)
        recipe["bits"] = main_bits
        recipe["block_size"] = blocks.most_common(1)[0][0]
        recipe["is_symmetric"] = all(len(n.input) < 4 or not n.input[3] for n in nbits)
        levels = {a["accuracy_level"] for a in attrs if "accuracy_level" in a}
        if levels:
            recipe["accuracy_level"] = int(sorted(levels)[0])
        others = {
            _fp_name(n.name, int(a.get("bits", 4))): int(a.get("bits", 4))
            for n, a in zip(nbits, attrs, strict=True)
            if int(a.get("bits", 4)) != main_bits
        }
        if others:
            recipe["node_bits"] = dict(sorted(others.items()))
        evidence.append(f"{len(nbits)} {nbits[0].op_type} node(s): bits {dict(bits)}, block_size {dict(blocks)}")
        if gathers:
            recipe["op_types_to_quantize"] = ["Gather"] if nbits is gathers else ["MatMul", "Gather"]
            evidence.append(f"{len(gathers)} GatherBlockQuantized node(s): Gather tables quantized too")
    else:
        recipe["quant_format"] = "QDQ"
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        sizes = Counter(a.i for n in dq for a in n.attribute if a.name == "block_size")
        recipe["bits"] = 4
        if sizes:
            recipe["block_size"] = sizes.most_common(1)[0][0]
        recipe["is_symmetric"] = all(len(n.input) < 3 or not n.input[2] for n in dq)
        evidence.append(f"{sum(sizes.values())} block-wise DequantizeLinear node(s): block_size {dict(sizes)}")
    # Only a MatMul whose B is a 2-D float initializer is one MatMulNBitsQuantizer would have
    # quantized ("MatMul doesn't have const weight. Skip"): attention's activation x activation
    # MatMuls are never quantized, so excluding them is advice that changes nothing.
    inits = {t.name: t for t in model.graph.initializer}
    kept = [
        n.name
        for n in model.graph.node
        if n.op_type == "MatMul" and n.name and not _quantized_matmul(n) and _float_weight(n, inits)
    ]
    if kept:
        recipe["nodes_to_exclude"] = kept
        evidence.append(f"{len(kept)} MatMul node(s) left in float: {', '.join(kept[:5])}")
    return recipe, evidence


def _float_weight(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """``node``'s B is a 2-D float initializer (what MatMulNBitsQuantizer quantizes; a B behind a
    block-wise DequantizeLinear is already quantized)."""
    b = inits.get(node.input[1]) if len(node.input) > 1 else None
    return b is not None and len(b.dims) == 2 and b.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _quantized_matmul(node: onnx.NodeProto) -> bool:
    return node.name.endswith("_Q4") or "_matmul_Q" in node.name


def _fp_name(name: str, bits: int) -> str:
    return name.removesuffix(f"_Q{bits}")


#: MatMulNBitsQuantizer algorithms whose per-node widths come from ``customized_weight_config`` only.
PER_NODE_CONFIG_ALGORITHMS = ("k_quant",)
#: Algorithms whose nodes at another width than the recipe's are quantized by RTN: HQQ at 8 bits
#: writes float zero points, which onnxruntime's CPU MatMulNBits refuses ("does not support 8-bit
#: weights with floating-point zero points"). (GPTQ takes no node_bits at all: its branch in
#: onnxruntime ignores nodes_to_exclude, so recipe validation refuses both.)
RTN_FOR_OTHER_WIDTHS = ("HQQ",)


def weight_only_calls(recipe: Recipe) -> list[dict[str, Any]]:
    """The ``MatMulNBitsQuantizer`` keyword arguments a weight-only recipe runs, in order.

    One call at ``recipe.bits`` that leaves out ``nodes_to_exclude`` and every ``node_bits`` node;
    then one call per other bit width over the nodes given that width (MatMulNBits nodes of the
    first pass are no longer MatMuls, so the second pass touches only what is still float).

    NOTE: ``MatMulNBitsQuantizer`` has no per-node bits with its default (RTN) config (its
    ``customized_weight_config`` is read by the neural-compressor algorithms only), and
    ``nodes_to_include`` adds to ``op_types_to_quantize`` rather than restricting it: excluding
    everything else is the only way to quantize named nodes at another width. k_quant and GPTQ
    are those neural-compressor algorithms: they ignore ``bits`` (every node is 4 bits unless its
    ``customized_weight_config`` entry says otherwise), so a second call at 8 bits quantized the
    node at 4 bits again. For them, one call carries the widths as ``customized_weight_config``.
    Under HQQ the calls at other widths run RTN (``"algorithm": "RTN"`` in the call; see
    :data:`RTN_FOR_OTHER_WIDTHS`).

    Example:
        >>> r = Recipe(mode="weight_only", bits=4, block_size=32, node_bits={"head": 8})
        >>> [(c["bits"], c["nodes_to_exclude"]) for c in weight_only_calls(r)]
        [(4, ['head']), (8, [])]
        >>> k = Recipe(mode="weight_only", bits=4, block_size=32, node_bits={"head": 8}, algorithm="k_quant")
        >>> [(c["bits"], c["nodes_to_exclude"], c["customized_weight_config"]) for c in weight_only_calls(k)]
        [(4, [], {'head': {'bits': 8}})]
    """
    excluded = list(recipe.nodes_to_exclude or [])
    node_bits = dict(recipe.node_bits or {})
    main = recipe.bits or 4
    common: dict[str, Any] = {
        "block_size": recipe.block_size or 128,
        "is_symmetric": bool(recipe.is_symmetric),
        "accuracy_level": recipe.accuracy_level,
        "quant_format": recipe.quant_format or "QOperator",
    }
    if recipe.op_types_to_quantize:
        common["op_types_to_quantize"] = tuple(recipe.op_types_to_quantize)
    others = {n: b for n, b in node_bits.items() if b != main}
    if recipe.algorithm in PER_NODE_CONFIG_ALGORITHMS and others:
        widths = {n: {"bits": b} for n, b in others.items()}
        return [{"bits": main, **common, "nodes_to_exclude": excluded, "customized_weight_config": widths}]
    calls = [{"bits": main, **common, "nodes_to_exclude": list(dict.fromkeys([*excluded, *others]))}]
    for bits in sorted(set(others.values())):
        call = {"bits": bits, **common, "nodes_to_exclude": list(excluded)}
        if recipe.algorithm in RTN_FOR_OTHER_WIDTHS:
            call["algorithm"] = "RTN"
        calls.append(call)
    return calls


def quantize_weight_only(recipe: Recipe, src: Path, dst: Path, external: bool, actions: list[str]) -> None:
    """Run ``MatMulNBitsQuantizer`` as the recipe says (see :func:`weight_only_calls`) from ``src`` to ``dst``.

    QDQ output needs opset 21 (int4 types): an older model is converted with
    ``onnx.version_converter`` first (onnxruntime would only rewrite the opset number).

    Example:
        >>> quantize_weight_only(Recipe(mode="weight_only"), "fp32.onnx", "q4.onnx", False, [])  # doctest: +SKIP
    """
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    algo = recipe.algorithm or "RTN"
    if algo in ("HQQ", "GPTQ") and importlib.util.find_spec("torch") is None:
        raise DiagError(
            "missing-extra",
            f"algorithm {algo}",
            "needs torch (onnxruntime's HQQ/GPTQ code imports it) and torch is not installed",
            'pip install torch, or use "algorithm": "RTN" or "k_quant"',
        )
    if recipe.quant_format == "QDQ":
        opset = default_opset(model)
        if 0 < opset < 21:
            model = upgrade_opset(model, 21)
            actions.append(
                f"upgraded opset {opset} -> 21 with onnx.version_converter: block-wise int4 DequantizeLinear needs it"
            )
    calls = weight_only_calls(recipe)
    for call in calls:
        kwargs = dict(call)
        kwargs.pop("customized_weight_config", None)  # the algo_config's, not the quantizer's
        if kwargs.pop("algorithm", algo) != "RTN":
            kwargs["algo_config"] = _algo_config(recipe, call)
        kwargs["quant_format"] = QuantFormat[kwargs["quant_format"]]
        quantizer = MatMulNBitsQuantizer(model, **kwargs)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # k_quant/GPTQ print a progress bar on stdout
                quantizer.process()
        except Exception as e:  # onnxruntime's quantizer on a setting it cannot do (GPTQ block > K)
            message = (str(e).splitlines() or ["no message"])[0][:200]
            raise DiagError(
                "quantize-failed",
                f"MatMulNBitsQuantizer (algorithm {call.get('algorithm', algo)}, bits {call['bits']})",
                f"raised {type(e).__name__}: {message}",
                "nothing was written; try another algorithm, or a block_size no larger than the MatMuls' input width",
            ) from e
        model = quantizer.model.model
    if algo != "RTN":
        actions.append(f"quantized with algorithm {algo} (MatMulNBitsQuantizer algo_config)")
    if len(calls) > 1:
        actions.append(
            "ran MatMulNBitsQuantizer "
            + " then ".join(f"bits={c['bits']} (nodes_to_exclude {len(c['nodes_to_exclude'])})" for c in calls)
        )
    if external:
        onnx.save(model, str(dst), save_as_external_data=True, location=f"{dst.name}.data")
    else:
        onnx.save(model, str(dst))


class NpzReader:
    """GPTQ's calibration reader: one sample (leading-axis row) of an ``.npz`` per ``get_next``.

    GPTQ deep-copies and iterates the reader (onnxruntime's ``inc_dataloader``), so it holds
    plain arrays, not a live feed source; the generated Python defines the same class.
    """

    def __init__(self, path: str, samples: int | None = None) -> None:
        with np.load(path) as data:
            self.arrays = {k: data[k] for k in data.files}
        n = min(len(a) for a in self.arrays.values())
        self.rows = [{k: a[i : i + 1] for k, a in self.arrays.items()} for i in range(min(n, samples or n))]
        self.pos = 0

    def get_next(self) -> dict[str, Any] | None:
        if self.pos >= len(self.rows):
            return None
        self.pos += 1
        return self.rows[self.pos - 1]

    def __iter__(self) -> Any:
        return iter(self.rows)


_NPZ_READER_SRC = [
    "class NpzReader:  # GPTQ calibration: one row of the .npz per sample",
    "    def __init__(self, path, samples=None):",
    "        import numpy as np",
    "        with np.load(path) as data:",
    "            arrays = {k: data[k] for k in data.files}",
    "        n = min(len(a) for a in arrays.values())",
    "        self.rows = [{k: a[i : i + 1] for k, a in arrays.items()} for i in range(min(n, samples or n))]",
    "        self.pos = 0",
    "",
    "    def get_next(self):",
    "        self.pos += 1",
    "        return self.rows[self.pos - 1] if self.pos <= len(self.rows) else None",
    "",
    "    def __iter__(self):",
    "        return iter(self.rows)",
    "",
]


def _algo_config(recipe: Recipe, call: dict[str, Any]) -> Any:
    """The ``algo_config`` object for HQQ/GPTQ (RTN is onnxruntime's default: no object)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    ops = call.get("op_types_to_quantize")
    config: Any
    if recipe.algorithm == "k_quant":
        config = mnq.KQuantWeightOnlyQuantConfig(op_types_to_quantize=ops)
    elif recipe.algorithm == "HQQ":
        return mnq.HQQWeightOnlyQuantConfig(block_size=call["block_size"], bits=call["bits"], op_types_to_quantize=ops)
    else:
        path = recipe.calibration_path()
        assert path is not None  # validated by the recipe
        reader = NpzReader(str(path), recipe.calibration_samples)
        config = mnq.GPTQWeightOnlyQuantConfig(
            calibration_data_reader=reader, block_size=call["block_size"], op_types_to_quantize=ops
        )
    if call.get("customized_weight_config"):
        # GPTQ's constructor has no such parameter; both read the attribute (WeightOnlyQuantConfig's).
        config.customized_weight_config = call["customized_weight_config"]
    return config


def _algo_config_src(recipe: Recipe, call: dict[str, Any]) -> str:
    ops = call.get("op_types_to_quantize")
    if recipe.algorithm == "k_quant":
        return f"algo_config=KQuantWeightOnlyQuantConfig(op_types_to_quantize={ops!r})"
    if recipe.algorithm == "HQQ":
        return (
            f"algo_config=HQQWeightOnlyQuantConfig(block_size={call['block_size']!r}, bits={call['bits']!r}, "
            f"op_types_to_quantize={ops!r})"
        )
    path = recipe.calibration_path()
    calib = os.path.abspath(str(path)) if path is not None else None
    return (
        f"algo_config=GPTQWeightOnlyQuantConfig(calibration_data_reader=NpzReader({calib!r}, "
        f"{recipe.calibration_samples!r}), block_size={call['block_size']!r}, op_types_to_quantize={ops!r})"
    )


def weight_only_snippet(
    recipe: dict[str, Any], fp32: str, model_out: str, header: str, prelude: list[str] | None = None
) -> str:
    """Python that rebuilds a weight-only model with plain ``MatMulNBitsQuantizer`` calls (no diag).

    ``recipe`` is a weight-only recipe in file form (``Recipe.to_dict()``); one call per bit width
    (see :func:`weight_only_calls`), in the order diag ran them. ``prelude``: source lines run on
    ``model`` before the quantizer (`diag exclude`'s replay of ``lift_constants``).

    Example:
        >>> print(weight_only_snippet({"mode": "weight_only", "bits": 4}, "m.onnx", "q.onnx", "# x"))  # doctest: +SKIP
    """
    r = Recipe.from_dict(recipe, "recipe")
    lines = [
        "# Rebuilds the model found by diag with plain onnx/onnxruntime calls "
        f"(MatMulNBitsQuantizer, algorithm {r.algorithm or 'RTN'}).",
        header,
        "import os",
        "",
        "import onnx",
        "from onnxruntime.quantization import QuantFormat",
        "from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer",
        "",
        f"FP32 = os.path.abspath({fp32!r})",
        f"OUT = os.path.abspath({model_out!r})",
        "",
        "model = onnx.load(FP32)",
    ]
    lines += prelude or []
    if r.quant_format == "QDQ":
        lines += [
            "if next(o.version for o in model.opset_import if o.domain in ('', 'ai.onnx')) < 21:",
            "    model = onnx.version_converter.convert_version(model, 21)  # int4 DequantizeLinear needs opset 21",
        ]
    lines += quantizer_calls(r)
    lines += ["onnx.save(model, OUT)", "print('wrote', OUT)"]
    return "\n".join(lines) + "\n"


def quantizer_calls(recipe: Recipe) -> list[str]:
    """Source lines that run the recipe's ``MatMulNBitsQuantizer`` calls on ``model`` (see :func:`weight_only_calls`).

    Example:
        >>> quantizer_calls(Recipe(mode="weight_only", block_size=32))[0]
        'quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False, quant_format=QuantFormat.QOperator, nodes_to_exclude=[])'
    """  # noqa: E501
    lines: list[str] = []
    algo = recipe.algorithm or "RTN"
    if algo != "RTN":
        config = {"k_quant": "KQuant", "HQQ": "HQQ", "GPTQ": "GPTQ"}[algo] + "WeightOnlyQuantConfig"
        lines.append(f"from onnxruntime.quantization.matmul_nbits_quantizer import {config}")
        if algo == "GPTQ":
            lines += _NPZ_READER_SRC
    for call in weight_only_calls(recipe):
        args = ", ".join(
            f"{k}=QuantFormat.{v}" if k == "quant_format" else f"{k}={v!r}"
            for k, v in call.items()
            if v is not None and k not in ("customized_weight_config", "algorithm")
        )
        if call.get("algorithm", algo) != "RTN":
            lines.append("algo_config = " + _algo_config_src(recipe, call).removeprefix("algo_config="))
            if call.get("customized_weight_config"):
                widths = call["customized_weight_config"]
                note = f"# per-node bits ({algo} reads only these)"
                lines.append(f"algo_config.customized_weight_config = {widths!r}  {note}")
            args += ", algo_config=algo_config"
        lines += [
            f"quantizer = MatMulNBitsQuantizer(model, {args})",
            "quantizer.process()",
            "model = quantizer.model.model",
        ]
    return lines


def weight_only_fix_snippet(
    settings: dict[str, Any], head: str, fp32_path: str, out_path: str, external: bool = False
) -> str:
    """The `diag compare` fix for a weight-only model: MatMulNBitsQuantizer calls with the new ``nodes_to_exclude``.

    ``external``: the result is saved with its weights in ``<out>.data`` beside it, as the FP32
    model was (over 2 GB, ``onnx.save`` cannot write it otherwise).

    Example:
        >>> print(weight_only_fix_snippet({"mode": "weight_only", "nodes_to_exclude": ["head"]}, "# x", "m.onnx",
        ...                               "m.fixed.onnx"))  # doctest: +ELLIPSIS
        # x
        import onnx
        ...
    """
    r = Recipe.from_dict(settings, "recipe")
    return "\n".join(
        [
            head,
            "import onnx",
            "from onnxruntime.quantization import QuantFormat",
            "from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer",
            "",
            f"model = onnx.load({fp32_path!r})",
            *quantizer_calls(r),
            f"onnx.save(model, {out_path!r}, save_as_external_data=True, location={Path(out_path).name + '.data'!r})"
            if external
            else f"onnx.save(model, {out_path!r})",
        ]
    )
