"""Recipe mode ``fp16``: ``convert_float_to_float16`` guarded, its recipe inferred back, its Python.

The fix-side half of FP16 support: :func:`convert_model` is `diag quantize` for ``mode = "fp16"``
(names checked, output verified in onnxruntime before it is moved into place), and the snippets
re-run the converter with plain onnxruntime calls for the `diag compare` fix and `diag exclude`'s
``reproduce.py``. Which nodes to block comes from the analysis, :mod:`diag.analysis.fp16health`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import onnx

from diag.core.load import detect_format, float_model_from_path, iter_nodes
from diag.core.precision import fp16_breakdown
from diag.core.recipe import Recipe
from diag.fix.modelprep import QuantizeReport, checked_out, load_error, publish
from diag.foundations.errors import DiagError
from diag.foundations.files import work_dir


class KeptInFloat(Protocol):
    """What :func:`reproduce_fp16` reads of a :class:`diag.fix.exclude.ExclusionResult` (exclude calls this module)."""

    @property
    def fp32(self) -> str: ...
    @property
    def target(self) -> object: ...
    @property
    def verdict(self) -> str: ...
    @property
    def nodes_to_exclude(self) -> list[str]: ...
    @property
    def recipe(self) -> dict[str, Any]: ...


def convert_model(
    fp32_path: str | os.PathLike[str], recipe: Recipe, out_path: str | os.PathLike[str]
) -> QuantizeReport:
    """`diag quantize` for ``mode = "fp16"``: ``convert_float_to_float16`` with the recipe's arguments.

    Guarded like the quantizer: names in ``node_block_list`` must exist (the converter ignores
    unknown ones silently), the output is verified to load in onnxruntime before it is renamed
    into place, and the input model is never modified.

    Example:
        >>> r = Recipe(mode="fp16", node_block_list=["attn"])  # doctest: +SKIP
        >>> convert_model("m.onnx", r, "m.fp16.onnx").format  # doctest: +SKIP
        'mixed'
    """
    start = time.perf_counter()
    loaded = float_model_from_path(fp32_path)
    out = checked_out(out_path, loaded.path)
    names = {n.name for n in iter_nodes(loaded.graph) if n.name}
    for name in recipe.node_block_list or []:
        if name not in names:
            raise DiagError(
                "bad-recipe",
                f"node_block_list entry '{name}'",
                "names no node of the FP32 model (convert_float_to_float16 would ignore it)",
                "use FP32 node names (diag inspect lists the model)",
            )
    if loaded.has_external_data:
        raise DiagError(
            "bad-recipe",
            f"FP32 model '{loaded.path}'",
            'has external data, which mode "fp16" does not convert yet',
            "call convert_float_to_float16 on the model path directly",
        )
    from onnxruntime.transformers.float16 import convert_float_to_float16

    actions: list[str] = []
    with work_dir(out.parent, "quantize") as stage:  # swept like every diag work folder
        staged = stage.resolve() / out.name
        try:
            model = convert_float_to_float16(
                onnx.load(str(loaded.path)),
                keep_io_types=bool(recipe.keep_io_types),
                op_block_list=recipe.op_block_list,
                node_block_list=recipe.node_block_list,
            )
        except Exception as e:
            raise DiagError(
                "quantize-failed",
                f"FP16 model for '{loaded.path}'",
                f"convert_float_to_float16 failed ({type(e).__name__}: {str(e).strip()[:200]})",
                "report the model; nothing was written",
            ) from e
        onnx.save(model, str(staged))
        error = load_error(staged)
        if error:
            raise DiagError(
                "quantize-failed",
                f"FP16 model for '{loaded.path}'",
                f"does not load in onnxruntime ({error})",
                "nothing was written; add the failing node's op type to op_block_list",
            )
        fmt = detect_format(model)
        blocked = fmt.precisions.get("fp32", [])
        if blocked:
            actions.append(f"kept {len(blocked)} node(s) in float32: {', '.join(blocked[:5])}")
        actions.append(f"verified: the FP16 model loads in onnxruntime (format {fmt.kind})")
        publish(staged, out)
    return QuantizeReport(out, actions, time.perf_counter() - start, fmt.kind, [], ["convert_float_to_float16"])


def infer_fp16_recipe(proto: onnx.ModelProto) -> tuple[dict[str, Any], list[str]]:
    """The ``mode = "fp16"`` recipe that made an FP16 model, and the evidence.

    ``keep_io_types`` from the graph's float inputs/outputs; ``node_block_list`` = the nodes still
    computing in float32, minus those onnxruntime's default ``op_block_list`` keeps anyway (the
    graph cannot tell a node block from an op block: it lists nodes, which re-converts alike).

    Example:
        >>> infer_fp16_recipe(onnx.load("m.fp16.onnx"))[0]  # doctest: +SKIP
        {'mode': 'fp16', 'keep_io_types': True, 'node_block_list': ['attn/Attention']}
    """
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

    g = proto.graph
    inits = {t.name for t in g.initializer}
    io = [v for v in list(g.input) + list(g.output) if v.name not in inits and v.type.HasField("tensor_type")]
    elem = {v.type.tensor_type.elem_type for v in io}
    keep = onnx.TensorProto.FLOAT in elem
    b = fp16_breakdown(proto)
    ops = {n.name: n.op_type for n in g.node}
    blocked = [n for n in (b.nodes.get("fp32", []) if b else []) if ops.get(n) not in DEFAULT_OP_BLOCK_LIST]
    evidence = [
        f"keep_io_types from the graph's {'float32' if keep else 'float16'} inputs/outputs",
        f"node_block_list: {len(blocked)} node(s) compute in float32",
    ]
    return {"mode": "fp16", "keep_io_types": keep, "node_block_list": blocked}, evidence


def fix_snippet_fp16(settings: dict[str, Any], nodes: list[str], fp32_path: str, fp16_path: str) -> str:
    """Python that re-converts with plain onnxruntime, adding ``nodes`` to ``node_block_list``.

    Example:
        >>> print(fix_snippet_fp16({"mode": "fp16", "keep_io_types": True}, ["attn"], "m.onnx", "m.fp16.onnx"))
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
        <BLANKLINE>
        model = convert_float_to_float16(
            onnx.load("m.onnx"),
            keep_io_types=True,
            node_block_list=["attn"],
        )
        onnx.save(model, "m.fp16.fixed.onnx")
    """
    out = str(Path(fp16_path).with_name(Path(fp16_path).name.removesuffix(".onnx") + ".fixed.onnx"))
    args = _converter_keywords(settings, nodes, json.dumps)
    return "\n".join(
        [
            "import onnx",
            "from onnxruntime.transformers.float16 import convert_float_to_float16",
            "",
            "model = convert_float_to_float16(",
            f"    onnx.load({json.dumps(fp32_path)}),",
            *args,
            ")",
            f"onnx.save(model, {json.dumps(out)})",
        ]
    )


def _converter_keywords(settings: dict[str, Any], nodes: list[str], literal: Callable[[Any], str]) -> list[str]:
    """The keyword lines of a generated ``convert_float_to_float16`` call: the recipe's arguments,
    with ``nodes`` added to its ``node_block_list``; lists written by ``literal`` (``json.dumps`` in the
    report's fix, ``repr`` in reproduce.py: their bytes are pinned by the golden reports and tests)."""
    blocked = list(dict.fromkeys([*(settings.get("node_block_list") or []), *nodes]))
    args = [f"    keep_io_types={bool(settings.get('keep_io_types'))},"]
    if settings.get("op_block_list") is not None:
        args.append(f"    op_block_list={literal(settings['op_block_list'])},")
    args.append(f"    node_block_list={literal(blocked)},")
    return args


def reproduce_fp16(result: KeptInFloat, model_out: str) -> str:
    """`diag exclude`'s reproduce.py for an ``fp16`` recipe: one converter call, no diag.

    ``result`` is a :class:`diag.fix.exclude.ExclusionResult`; its kept-in-float nodes become
    ``node_block_list``.

    Example:
        >>> print(reproduce_fp16(result, "m.reproduced.onnx"))  # doctest: +SKIP
        # Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.
        ...
    """
    args = _converter_keywords(result.recipe, result.nodes_to_exclude, repr)
    return "\n".join(
        [
            "# Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.",
            f"# target {result.target}: {result.verdict}; {len(result.nodes_to_exclude)} node(s) kept in float32.",
            "# Paths are as given to diag exclude: run this from the folder diag exclude ran in.",
            "import os",
            "",
            "import onnx",
            "from onnxruntime.transformers.float16 import convert_float_to_float16",
            "",
            f"FP32 = os.path.abspath({result.fp32!r})",
            f"OUT = os.path.abspath({model_out!r})",
            "model = convert_float_to_float16(",
            "    onnx.load(FP32),",
            *args,
            ")",
            "onnx.save(model, OUT)",
            "",
        ]
    )
