"""onnxruntime sessions for FP32, INT8 and cut models, run one batch at a time.

Heavy import: onnxruntime is imported inside the functions so ``diag --help`` stays instant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.errors import DiagError


def session_from_model(
    model: onnx.ModelProto,
    role: str,
    opt_level: str = "disabled",
    threads: int | None = None,
    external_data_dir: Path | None = None,
) -> Any:
    """An ``InferenceSession`` on the CPU for ``model``.

    ``opt_level="disabled"`` (exact mode) keeps every tensor onnxruntime would otherwise fuse
    away. ``external_data_dir`` lets a model whose weights stay in external files be loaded from
    memory without copying the weights.
    """
    import onnxruntime as ort

    levels = {
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[opt_level]
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if external_data_dir is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_data_dir))
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise DiagError(
            "invalid-model",
            role,
            f"fails to load in onnxruntime: {_first_line(e)}",
            "check the model runs with onnxruntime.InferenceSession; custom ops need their library",
        ) from e


def run_batch(session: Any, feeds: dict[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
    """Run one batch; returns every output by name. Failures name the node onnxruntime reported."""
    names = [o.name for o in session.get_outputs()]
    try:
        values = session.run(names, feeds)
    except Exception as e:
        node = re.search(r"[Nn]ode(?: \(|:\s*)?'?([^'\s)]+)", str(e))
        where = f" at node '{node.group(1)}'" if node else ""
        raise DiagError(
            "runtime-failure",
            role,
            f"onnxruntime failed{where}: {_first_line(e)}",
            "check the inputs' shapes and values; run with --debug for the full error",
        ) from e
    return dict(zip(names, values, strict=True))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]
