"""Batches of arrays kept on disk from one stage of a run to a later one, never in memory.

The effect check (:mod:`diag.analysis.effects`) measures every candidate against the FP32
model's outputs on the first few samples. The main pass has computed exactly those outputs (the
same batches, through the same exact-mode session), so it keeps them here instead of the check
loading the FP32 model once more and running it again: on the 500M int4 decoder that was a 2 GB
session and 8 runs, ~10 s of a 64-sample compare.

NOTE: on disk, not in memory: they are taken in the first batches and held until the analysis,
through the whole main pass, where the run's memory peaks (a decoder's logits are 16 MB a sample,
131 MB for the default 8). Read back as memory maps, so they cost memory only while the check
reads them. The folder is removed by :meth:`SpilledBatches.close`, or when the object is
collected, or at exit. It is made in Python's temp folder (``TMPDIR``): where ``/tmp`` is a tmpfs,
the files live in RAM after all (outside the process's RSS), so point ``TMPDIR`` at a disk there.

The held-out evaluator of the fixing verbs (:class:`diag.fix.evaluate.HeldOutEvaluator`) keeps its
FP32 outputs here too when they are large, so that no FP32 session stays alive through a search's
re-quantizations; it reads them back one batch at a time (:meth:`SpilledBatches.batch`).

Example:
    >>> kept = SpilledBatches(2)
    >>> kept.add({"logits": np.ones((1, 3), np.float32)}, 1)
    >>> kept.add({"logits": np.zeros((1, 3), np.float32)}, 1)
    >>> kept.full, len(kept.batches() or []), float(kept.batches()[0]["logits"].sum())
    (True, 2, 3.0)
    >>> kept.close()
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np


class SpilledBatches:
    """The first ``samples`` samples' arrays, one ``.npy`` file per array, in a temporary folder."""

    def __init__(self, samples: int) -> None:
        self.wanted = samples
        self.taken = 0
        #: False once an array could not be kept (an object array, a full disk): :meth:`batches` is None.
        self.usable = True
        self._names: list[list[str]] = []
        self._folder: Path | None = None
        self._cleanup: Callable[[], object] | None = None

    @property
    def full(self) -> bool:
        """Whether no more batches are wanted (enough samples kept, or keeping failed)."""
        return self.taken >= self.wanted or not self.usable

    def add(self, arrays: dict[str, np.ndarray], size: int) -> None:
        """Keep one batch of ``size`` samples (nothing once :attr:`full`)."""
        if self.full:
            return
        try:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="diag-kept-"))
                # silent, unlike TemporaryDirectory's own finalizer (a ResourceWarning per run)
                self._cleanup = weakref.finalize(self, shutil.rmtree, self._folder, True)
            index = len(self._names)
            for i, value in enumerate(arrays.values()):
                # file names are ours: model output names can be any string
                np.save(self._folder / f"{index}-{i}.npy", np.asarray(value), allow_pickle=False)
        except (OSError, ValueError):
            self.usable = False
            return
        self._names.append(list(arrays))
        self.taken += size

    def batches(self) -> list[dict[str, np.ndarray]] | None:
        """Every kept batch, its arrays read-only memory maps; None when keeping failed or nothing was kept."""
        if not self.usable or self._folder is None:
            return None
        folder = self._folder
        return [
            {name: np.load(folder / f"{b}-{i}.npy", mmap_mode="r") for i, name in enumerate(names)}
            for b, names in enumerate(self._names)
        ]

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """Kept batch ``index`` alone, as :meth:`batches` gives it (one batch's files open at a time)."""
        if not self.usable or self._folder is None:
            raise ValueError("no batches kept")
        folder = self._folder
        return {name: np.load(folder / f"{index}-{i}.npy", mmap_mode="r") for i, name in enumerate(self._names[index])}

    def close(self) -> None:
        """Remove the folder now (maps still open keep their data until they are dropped)."""
        if self._cleanup is not None:
            self._cleanup()
        self._folder = None
        self.usable = False
