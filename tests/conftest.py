"""Shared fixtures: ground-truth models built in code and quantized by real onnxruntime, once."""

from __future__ import annotations

import copy
import doctest
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from _pytest.doctest import DoctestItem

import diag
from diag.analysis.compare import CompareOptions, CompareResult, compare_models
from diag.core.feeds import FeedSpec
from diag.fixtures import models, quantize

FORMATS = ("dynamic", "qdq", "qoperator")
# The checkout these tests belong to: the diag they test must be its diag/, not an installed copy.
ROOT = Path(__file__).resolve().parent.parent


def installed_outside(diag_file: str | None, root: Path) -> bool:
    """True when ``diag_file`` (``diag.__file__``) is not inside the checkout ``root``.

    A path compare, not a prefix compare: ``/src/diag-old/diag`` is outside ``/src/diag``.
    """
    return diag_file is None or not Path(diag_file).resolve().is_relative_to(root.resolve())


def pytest_configure(config: pytest.Config) -> None:
    """Stop before collecting when ``diag`` is an installed copy: the tests would pass or fail on it.

    ``pip install ".[test]"`` copies diag into site-packages; the ``pytest`` script then imports that
    copy, and an edit in the working tree changes nothing the tests see.
    """
    if installed_outside(diag.__file__, ROOT):
        where = Path(diag.__file__).resolve().parent if diag.__file__ else "a namespace package"
        raise pytest.UsageError(
            f"the tests import diag from {where}, not from this checkout ({ROOT}). "
            'Hint: pip install -e ".[test]" in the checkout'
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the docstring examples that run nothing (every line ``# doctest: +SKIP``: they need
    a model file or a whole run), so "skipped" counts only tests that could have run and did not."""

    def runs_nothing(item: pytest.Item) -> bool:
        test = item.dtest if isinstance(item, DoctestItem) else None
        return test is not None and all(e.options.get(doctest.SKIP) for e in test.examples)

    idle = [item for item in items if runs_nothing(item)]
    if idle:
        items[:] = [item for item in items if not runs_nothing(item)]
        config.hook.pytest_deselected(items=idle)


class Built:
    """Paths of one fixture's FP32 model, its INT8 versions and its inputs."""

    def __init__(self, folder: Path, fx: models.Fixture) -> None:
        self.fixture = fx
        self.fp32 = folder / f"{fx.name}.fp32.onnx"
        onnx.save(fx.model, self.fp32)
        self.calib = fx.make_inputs(32, 11)
        self.inputs = fx.make_inputs(32, 12)
        self.inputs_path = folder / f"{fx.name}.inputs.npz"
        np.savez(self.inputs_path, **self.inputs)
        self.int8: dict[str, Path] = {}
        for fmt in FORMATS:
            path = folder / f"{fx.name}.{fmt}.onnx"
            quantize.quantize(self.fp32, path, fmt, self.calib)
            self.int8[fmt] = path
        self._compared: dict[tuple[str, int], CompareResult] = {}

    def compared(self, fmt: str, samples: int = 32) -> CompareResult:
        """``compare_models`` of the FP32 model and its ``fmt`` INT8 model on the first ``samples``
        inputs (batch 8, default options): run once per session, and every caller gets its own deep
        copy, so no test sees what another did to its result."""
        if (fmt, samples) not in self._compared:
            spec = FeedSpec(inputs=str(self.inputs_path), samples=samples, batch=8)
            options = CompareOptions(progress=False)
            self._compared[fmt, samples] = compare_models(self.fp32, self.int8[fmt], spec, options)
        return copy.deepcopy(self._compared[fmt, samples])


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """``built("convnet")`` -> the fixture's files, quantized in all formats (cached per session)."""
    cache: dict[str, Built] = {}
    root = tmp_path_factory.mktemp("fixtures")

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = Built(root, models.build(name))
        return cache[name]

    return get
