"""Task-metric plugins the tests load with ``--metric taskmetric_plugins:<factory>`` (tests/ on sys.path)."""

from __future__ import annotations

from typing import Any

import numpy as np


class RelativeError:
    """Worst per-sample relative L2 error ||y - x|| / ||x|| of every output (lower is better).

    Streaming (one max), mergeable (max of maxima) and serializable (state / from_state).
    """

    better = {"rel_err": "lower"}  # noqa: RUF012 (the protocol's declared class attribute)

    def __init__(self, worst: float = 0.0) -> None:
        self.worst = worst

    def update(self, fp32: dict[str, np.ndarray], int8: dict[str, np.ndarray], labels: Any) -> None:
        for name, x in fp32.items():
            x2 = x.reshape(len(x), -1).astype(np.float64)
            e = int8[name].reshape(len(x), -1).astype(np.float64) - x2
            rel = np.sqrt((e * e).sum(1)) / np.sqrt((x2 * x2).sum(1))
            self.worst = max(self.worst, float(rel.max()))

    def merge(self, other: RelativeError) -> RelativeError:
        self.worst = max(self.worst, other.worst)
        return self

    def finalize(self) -> dict[str, float]:
        return {"rel_err": self.worst}

    def state(self) -> dict[str, float]:
        return {"worst": self.worst}

    @classmethod
    def from_state(cls, state: dict[str, float]) -> RelativeError:
        return cls(float(state["worst"]))


def rel_error() -> RelativeError:
    return RelativeError()


class CorrectCount:
    """INT8 correct predictions of the first output against the labels (higher is better); no state()."""

    better = {"int8_correct": "higher"}  # noqa: RUF012

    def __init__(self) -> None:
        self.correct = 0

    def update(self, fp32: dict[str, np.ndarray], int8: dict[str, np.ndarray], labels: Any) -> None:
        first = next(iter(int8.values()))
        self.correct += int((first.argmax(axis=1) == labels).sum())

    def merge(self, other: CorrectCount) -> CorrectCount:
        self.correct += other.correct
        return self

    def finalize(self) -> dict[str, float]:
        return {"int8_correct": float(self.correct)}


def correct_count() -> CorrectCount:
    return CorrectCount()


def not_a_metric() -> int:
    return 42


class _BadBetter(RelativeError):
    better = {"rel_err": "smaller"}  # noqa: RUF012


def bad_better() -> _BadBetter:
    return _BadBetter()


def raises() -> RelativeError:
    raise RuntimeError("metric server unreachable")


class _UpdateFails(RelativeError):
    def update(self, fp32: dict[str, np.ndarray], int8: dict[str, np.ndarray], labels: Any) -> None:
        raise ValueError("expected boxes")


def update_fails() -> _UpdateFails:
    return _UpdateFails()


NOT_CALLABLE = 3
