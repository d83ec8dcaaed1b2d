"""Plain onnxruntime helpers for tests that must reproduce diag's figures without diag's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader


class Rows(CalibrationDataReader):
    """Plain onnxruntime calibration reader: one row at a time from stacked arrays."""

    def __init__(self, arrays: dict[str, np.ndarray], count: int) -> None:
        self.rows = iter([{k: v[i : i + 1] for k, v in arrays.items()} for i in range(count)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.rows, None)


def min_cosine(fp32: Path, model: Path, arrays: dict[str, np.ndarray], first: int, batch: int) -> float:
    """Min per-sample cosine over every output, samples ``first..`` run ``batch`` at a time."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a = ort.InferenceSession(str(fp32), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    n = len(next(iter(arrays.values())))
    worst = 1.0
    for i in range(first, n, batch):
        feed = {k: v[i : i + batch] for k, v in arrays.items()}
        for x, y in zip(a.run(None, feed), b.run(None, feed), strict=True):
            x, y = x.astype(np.float64).reshape(len(x), -1), y.astype(np.float64).reshape(len(y), -1)
            worst = min(worst, float(((x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))).min()))
    return worst
