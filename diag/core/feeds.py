"""Input iterators: a stacked ``.npz``, a folder of feed files, seeded random data, or a reader.

Every source yields :class:`Batch` objects one at a time and is validated against the model's
inputs (names, dtypes, ranks, fixed dims, finite values) before anything runs. Files are loaded
with ``allow_pickle=False``: an ``.npy`` holding Python objects is refused, never executed.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from diag.core.lazy_npz import LazyRows, lazy_npy, lazy_npz
from diag.foundations.errors import DiagError
from diag.foundations.files import input_file, input_path

DEFAULT_INT_RANGE = (0, 100)
#: Refuse a random/loaded batch larger than this many bytes up front (per input).
MAX_BATCH_BYTES = 8 * 2**30
#: Refuse more random samples than this up front: error statistics settle within a few hundred
#: samples, and a mistyped --samples 100000000000 would otherwise run for days.
MAX_RANDOM_SAMPLES = 10**6


@dataclass(frozen=True)
class InputSpec:
    """One model input: name, numpy dtype and dims (int, or a symbolic name / None)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]

    def describe(self) -> str:
        dims = ",".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.dtype}[{dims}]"


@dataclass
class Batch:
    """One run's feed dict and how many samples it holds."""

    index: int
    feeds: dict[str, np.ndarray]
    size: int


@dataclass
class FeedSource:
    """A validated, restartable stream of batches plus a description for the report."""

    description: str
    batches: Iterable[Batch]
    total_samples: int | None
    specs: list[InputSpec] = field(default_factory=list)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (graph inputs that are not initializers)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype(np.float32)
        dims: list[int | str | None] = []
        if tt.HasField("shape"):
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(int(d.dim_value))
                elif d.HasField("dim_value"):
                    dims.append(None)  # exporters such as paddle2onnx write -1 for "any"
                elif d.HasField("dim_param") and d.dim_param not in ("?", "-1", "unk__"):
                    dims.append(d.dim_param)
                else:
                    dims.append(None)
        specs.append(InputSpec(vi.name, dtype, tuple(dims)))
    return specs


def validate_feed(feed: dict[str, np.ndarray], specs: list[InputSpec], where: str) -> None:
    """Check one feed dict against the model's inputs; raise ``bad-inputs`` on the first problem."""
    names = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in feed]
    extra = [k for k in feed if k not in names]
    if missing:
        raise DiagError(
            "bad-inputs",
            f"{where}",
            f"has no array for model input '{missing[0]}'"
            f" (model inputs: {', '.join(sorted(names))}; given: {', '.join(sorted(feed)) or 'none'})",
            "name each array after the model input it feeds",
        )
    if extra:
        raise DiagError(
            "bad-inputs",
            f"{where}",
            f"has array '{extra[0]}', which is not a model input (model inputs: {', '.join(sorted(names))})",
            "rename or drop the extra array",
        )
    symbols: dict[str, tuple[int, str]] = {}
    for s in specs:
        a = feed[s.name]
        obj = f"input '{s.name}' in {where}"
        if not isinstance(a, np.ndarray):
            raise DiagError("bad-inputs", obj, f"is a {type(a).__name__}, not a numpy array", "yield numpy arrays")
        if a.dtype != s.dtype:
            raise DiagError(
                "bad-inputs",
                obj,
                f"has dtype {a.dtype}, model wants {s.dtype}",
                f"cast it with .astype(np.{s.dtype.name})",
            )
        if s.dims and a.ndim != len(s.dims):
            raise DiagError(
                "bad-inputs",
                obj,
                f"has shape {a.shape} (rank {a.ndim}), model wants {s.describe()} (rank {len(s.dims)})",
                "reshape the array",
            )
        for axis, (have, want) in enumerate(zip(a.shape, s.dims, strict=False)):
            if isinstance(want, int) and have != want:
                raise DiagError(
                    "bad-inputs",
                    obj,
                    f"has shape {a.shape}, model wants {s.describe()} (axis {axis} must be {want})",
                    "resize or pad the data",
                )
            if isinstance(want, str):
                if want in symbols and symbols[want][0] != have:
                    other = symbols[want][1]
                    raise DiagError(
                        "bad-inputs",
                        obj,
                        f"has {want}={have} but input '{other}' has {want}={symbols[want][0]}",
                        "give all inputs the same batch size",
                    )
                symbols[want] = (have, s.name)
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            bad = int(a.size - np.isfinite(a).sum())
            raise DiagError(
                "bad-inputs",
                obj,
                f"contains {bad} NaN/Inf value(s)",
                "clean the data; diag compares finite inputs only",
            )


def load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of a small ``.npz`` (one feed dict, labels) in memory; sizes checked first."""
    input_file(path, "inputs", "pass a .npz written by np.savez")
    return {k: (v[:] if isinstance(v, LazyRows) else v) for k, v in lazy_npz(path).items()}


def load_npy(path: Path, lazy: bool = False) -> Any:
    """A ``.npy`` array; with ``lazy`` its rows are read only when a batch uses them (:mod:`diag.core.lazy_npz`)."""
    input_file(path, "inputs", "pass a .npy written by np.save")
    arr = lazy_npy(path)
    return arr[:] if isinstance(arr, LazyRows) and not lazy else arr


def _batchable(specs: list[InputSpec]) -> bool:
    """True when every input's first dim is symbolic, so rows can be stacked into batches."""
    return all(s.dims and not isinstance(s.dims[0], int) for s in specs)


def feeds_from_npz(path: Path, specs: list[InputSpec], samples: int | None, batch: int, skip: int = 0) -> FeedSource:
    """Stacked arrays from an ``.npz``, first axis = samples (see :func:`feeds_from_arrays`)."""
    # NOTE: lazily: only the rows of the batch being run are ever in memory, whatever the file holds.
    input_file(path, "inputs", "pass a .npz written by np.savez")
    return feeds_from_arrays(lazy_npz(path), specs, samples, batch, f"inputs '{path}'", skip)


def feeds_from_arrays(
    arrays: dict[str, np.ndarray], specs: list[InputSpec], samples: int | None, batch: int, where: str, skip: int = 0
) -> FeedSource:
    """Stacked arrays, first axis = samples; rows are grouped ``batch`` at a time when allowed.

    ``skip`` leaves out the first rows (held-out splits, shards).
    """
    if not arrays:
        raise DiagError("bad-inputs", where, "contains no arrays", "save one array per model input with np.savez")
    counts = {k: (v.shape[0] if v.ndim else 0) for k, v in arrays.items()}
    if len(set(counts.values())) > 1:
        desc = ", ".join(f"{k}: {n}" for k, n in counts.items())
        raise DiagError(
            "bad-inputs",
            where,
            f"arrays have different sample counts ({desc})",
            "stack every input along the first axis with the same number of rows",
        )
    total = next(iter(counts.values()))
    if total - skip <= 0 or (samples is not None and samples <= 0):
        raise DiagError("bad-inputs", where, "holds zero samples", "provide at least one row per input")
    spec_by_name = {s.name: s for s in specs}
    # Arrays with one more axis than the model input hold one sample per row (no batching).
    per_row = {
        k: (k in spec_by_name and spec_by_name[k].dims and v.ndim == len(spec_by_name[k].dims) + 1)
        for k, v in arrays.items()
    }
    step = batch if (_batchable(specs) and not any(per_row.values())) else 1
    n = total - skip if samples is None else min(samples, total - skip)

    def gen() -> Iterator[Batch]:
        for b, start in enumerate(range(skip, skip + n, step)):
            stop = min(start + step, skip + n)
            feed = {k: np.asarray(v[start] if per_row[k] else v[start:stop]) for k, v in arrays.items()}
            rows = f"row {start}" if stop - start == 1 else f"rows {start}..{stop - 1}"
            validate_feed(feed, specs, f"{where} {rows} (of {total})")
            yield Batch(b, feed, stop - start)

    next(iter(gen()))  # validates the first batch now, before any model runs
    label = where.removeprefix("inputs ").strip("'")
    return FeedSource(f"{Path(label).name} ({n} samples, batch {step})", Restartable(gen), n, specs)


def feeds_from_folder(path: Path, specs: list[InputSpec], samples: int | None) -> FeedSource:
    """Each ``.npz`` in the folder is one complete feed dict (``.npy`` for single-input models)."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
    if samples is not None:
        files = files[:samples]
    for p in files:  # a FIFO or folder named x.npz must fail now, not block or crash mid-run
        input_file(p, "inputs", "every .npz in an inputs folder must be a regular file")
    if not files:
        raise DiagError(
            "bad-inputs",
            f"inputs folder '{path}'",
            "contains no .npz or .npy files",
            "write one feed dict per .npz (np.savez(path, **feeds))",
        )
    if any(p.suffix == ".npy" for p in files) and len(specs) != 1:
        raise DiagError(
            "bad-inputs",
            f"inputs folder '{path}'",
            f"has .npy files but the model has {len(specs)} inputs",
            "use one .npz per feed dict for multi-input models",
        )

    def gen() -> Iterator[Batch]:
        for i, p in enumerate(files):
            feed = load_npz(p) if p.suffix == ".npz" else {specs[0].name: load_npy(p)}
            validate_feed(feed, specs, f"inputs '{p.name}'")
            yield Batch(i, feed, _batch_size(feed, specs))

    return FeedSource(f"folder {path.name} ({len(files)} feed files)", Restartable(gen), len(files), specs)


def _batch_size(feed: dict[str, np.ndarray], specs: list[InputSpec]) -> int:
    for s in specs:
        a = feed[s.name]
        if a.ndim and s.dims and not isinstance(s.dims[0], int):
            return int(a.shape[0])
    return 1


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """Parse ``--shape name=1,3,224,224`` flags."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        m = re.fullmatch(r"([^=]+)=(\d+(?:[,x]\d+)*)", item.strip())
        if not m:
            raise DiagError(
                "bad-option", f"--shape {item!r}", "is not name=d0,d1,...", "write e.g. --shape image=1,3,224,224"
            )
        shapes[m.group(1)] = tuple(int(d) for d in re.split("[,x]", m.group(2)))
    return shapes


def random_feeds(
    specs: list[InputSpec],
    samples: int,
    batch: int,
    seed: int,
    shapes: dict[str, tuple[int, ...]],
    int_range: tuple[int, int] = DEFAULT_INT_RANGE,
    skip: int = 0,
) -> FeedSource:
    """Seeded random inputs: normal floats, uniform integers in ``int_range``, random booleans.

    Symbolic dims come from ``shapes`` (full shapes per input); a symbolic first dim otherwise
    takes the batch size. Each batch draws from its own seed so shards reproduce one run.
    """
    if samples <= 0:
        raise DiagError("bad-option", "--samples", "must be at least 1", "pass --samples 8")
    concrete = _concrete_dims(specs, shapes)
    step = batch if _batchable(specs) else 1
    _check_random_size(specs, concrete, samples, step)

    def gen() -> Iterator[Batch]:
        for b, start in enumerate(range(skip, skip + samples, step)):
            size = min(step, skip + samples - start)
            rng = np.random.default_rng([seed, start])
            yield Batch(b, _random_feed(rng, specs, concrete, size, int_range), size)

    return FeedSource(f"random (seed {seed}, {samples} samples)", Restartable(gen), samples, specs)


def _concrete_dims(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """Every input's dims with ``--shape`` applied; ``-1`` marks a symbolic batch axis.

    Raises ``bad-option`` for a ``--shape`` of no input or of the wrong rank, ``bad-inputs`` for a
    symbolic dim other than the first that no ``--shape`` fixes.
    """
    unknown = [k for k in shapes if k not in {s.name for s in specs}]
    if unknown:
        raise DiagError(
            "bad-option",
            f"--shape {unknown[0]}",
            "names no model input",
            f"model inputs: {', '.join(s.name for s in specs)}",
        )
    concrete: dict[str, list[int]] = {}
    for s in specs:
        if s.name in shapes:
            dims = list(shapes[s.name])
            if len(dims) != len(s.dims):
                raise DiagError(
                    "bad-option",
                    f"--shape {s.name}",
                    f"has rank {len(dims)}, model wants {s.describe()}",
                    "give one number per axis",
                )
        else:
            dims = []
            for axis, d in enumerate(s.dims):
                if isinstance(d, int):
                    dims.append(d)
                elif axis == 0:
                    dims.append(-1)  # the batch axis
                else:
                    raise DiagError(
                        "bad-inputs",
                        f"input '{s.name}'",
                        f"has symbolic dim {d!r} (shape {s.describe()})",
                        f"pass --shape {s.name}=" + ",".join("1" if i == 0 else "N" for i in range(len(s.dims))),
                    )
        concrete[s.name] = dims
    return concrete


def _check_random_size(specs: list[InputSpec], concrete: dict[str, list[int]], samples: int, step: int) -> None:
    """``too-large`` before anything is drawn: too many samples, or one batch over ``MAX_BATCH_BYTES``."""
    if samples > MAX_RANDOM_SAMPLES:
        per_sample = sum(math.prod(1 if d == -1 else d for d in concrete[s.name]) * s.dtype.itemsize for s in specs)
        raise DiagError(
            "too-large",
            f"--samples {samples}",
            f"would draw {samples * per_sample / 2**30:,.1f} GiB of random inputs in {-(-samples // step):,} runs "
            f"of each model (limit {MAX_RANDOM_SAMPLES:,} samples)",
            "error statistics settle within a few hundred samples: use e.g. --samples 256",
        )
    for s in specs:
        elems = math.prod(max(d, step) if d == -1 else d for d in concrete[s.name])
        if elems * s.dtype.itemsize > MAX_BATCH_BYTES:
            raise DiagError(
                "too-large",
                f"input '{s.name}'",
                f"one batch would need {elems * s.dtype.itemsize / 2**30:.1f} GiB",
                "use smaller --shape or --batch",
            )


def _random_feed(
    rng: np.random.Generator,
    specs: list[InputSpec],
    concrete: dict[str, list[int]],
    size: int,
    int_range: tuple[int, int],
) -> dict[str, np.ndarray]:
    """One batch of ``size`` samples drawn from ``rng``, inputs in model order (the order fixes the draws)."""
    lo, hi = int_range
    feed: dict[str, np.ndarray] = {}
    for s in specs:
        dims = [size if d == -1 else d for d in concrete[s.name]]
        if s.dtype.kind == "f":
            feed[s.name] = rng.standard_normal(dims).astype(s.dtype)
        elif s.dtype.kind in "iu":
            feed[s.name] = rng.integers(lo, hi, size=dims).astype(s.dtype)
        elif s.dtype.kind == "b":
            feed[s.name] = rng.integers(0, 2, size=dims).astype(bool)
        else:
            raise DiagError(
                "bad-inputs",
                f"input '{s.name}'",
                f"has dtype {s.dtype}, which random inputs cannot produce",
                "pass --inputs with real data",
            )
    return feed


def object_from_spec(spec: str, obj: str, slug: str, what: str, example: str) -> Any:
    """What ``package.module:name`` names (``--reader``, ``--metric``); a ``slug`` error when it cannot be had.

    Example:
        >>> object_from_spec("math:sqrt", "--metric 'math:sqrt'", "bad-metric", "function", "e.g. m:f")(4.0)
        2.0
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise DiagError(slug, obj, f"is not 'package.module:{what}'", example)
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except Exception as e:
        raise DiagError(
            slug,
            obj,
            f"cannot be imported ({type(e).__name__}: {e})",
            "make the module importable (PYTHONPATH) and check the name",
        ) from e


def feeds_from_reader(spec: str, specs: list[InputSpec], samples: int | None) -> FeedSource:
    """``package.module:factory`` returning an iterable of feed dicts or a CalibrationDataReader.

    The factory is called again for every pass over the data, so it must be re-iterable.
    """
    obj = f"--reader {spec!r}"
    factory = object_from_spec(spec, obj, "bad-reader", "factory", "e.g. --reader mydata.calib:make_reader")

    def gen() -> Iterator[Batch]:
        try:
            made = factory()
        except Exception as e:
            raise DiagError(
                "bad-reader",
                obj,
                f"raised {type(e).__name__}: {e}",
                "fix the factory; it must return an iterable of feed dicts",
            ) from e
        if hasattr(made, "get_next"):
            items: Iterator[object] = iter(made.get_next, None)
        else:
            try:
                items = iter(made)
            except TypeError as e:
                raise DiagError(
                    "bad-reader",
                    obj,
                    f"returned a {type(made).__name__}, not an iterable",
                    "return a list/generator of dicts or a CalibrationDataReader",
                ) from e
        count = 0
        while samples is None or count < samples:
            try:
                item = next(items)
            except StopIteration:
                break
            except Exception as e:
                raise DiagError(
                    "bad-reader", obj, f"raised {type(e).__name__} while iterating: {e}", "fix the reader"
                ) from e
            if not isinstance(item, dict):
                raise DiagError(
                    "bad-reader", obj, f"yielded a {type(item).__name__}, not a dict", "yield {input_name: numpy array}"
                )
            validate_feed(item, specs, f"reader item {count}")
            yield Batch(count, item, _batch_size(item, specs))
            count += 1
        if count == 0:
            raise DiagError("bad-reader", obj, "yielded zero samples", "check the reader's data")

    return FeedSource(f"reader {spec}", Restartable(gen), samples, specs)


class Restartable:
    """Wrap a generator function so every ``iter()`` starts a fresh pass."""

    def __init__(self, gen: object) -> None:
        self._gen = gen

    def __iter__(self) -> Iterator[Batch]:
        return self._gen()  # type: ignore[operator, no-any-return]


def feed_source(model: onnx.ModelProto, spec: FeedSpec) -> FeedSource:
    """Pick the source from the CLI-style arguments (exactly one of inputs/random/reader).

    Example:
        >>> feed_source(model, FeedSpec(random=True, samples=4, batch=2)).samples  # doctest: +SKIP
        4
    """
    inputs, reader, samples, batch = spec.inputs, spec.reader, spec.samples, spec.batch
    specs = input_specs(model)
    chosen = [x for x in (inputs, reader) if x] + (["random"] if spec.random else [])
    if len(chosen) != 1:
        raise DiagError(
            "bad-option",
            "inputs",
            "need exactly one of --inputs, --random, --reader",
            "e.g. --inputs data.npz, or --random --samples 8",
        )
    if batch < 1:
        raise DiagError("bad-option", "--batch", "must be at least 1", "pass --batch 1")
    if samples is not None and samples < 1:
        raise DiagError("bad-option", "--samples", "must be at least 1", "pass --samples 8")
    if inputs:
        p = input_path(inputs, "inputs", "pass a .npz, a .npy or a folder of .npz files")
        if p.is_dir():
            return feeds_from_folder(p, specs, samples)
        if p.suffix == ".npy":
            if len(specs) != 1:
                raise DiagError(
                    "bad-inputs",
                    f"inputs '{p}'",
                    f"is one array but the model has {len(specs)} inputs",
                    "use a .npz with one array per input",
                )
            return feeds_from_arrays({specs[0].name: load_npy(p, lazy=True)}, specs, samples, batch, f"inputs '{p}'")
        return feeds_from_npz(p, specs, samples, batch)
    if reader:
        return feeds_from_reader(reader, specs, samples)
    return random_feeds(specs, samples or 8, batch, spec.seed, spec.shapes or {}, spec.int_range)


@dataclass
class FeedSpec:
    """Where inputs come from, as given on the command line; resolved against a model later."""

    inputs: str | None = None
    random: bool = False
    reader: str | None = None
    samples: int | None = None
    batch: int = 1
    seed: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    int_range: tuple[int, int] = DEFAULT_INT_RANGE

    def source(self, model: onnx.ModelProto) -> FeedSource:
        return feed_source(model, self)


def load_labels(path: str) -> np.ndarray:
    """Class indices, one per sample in input order (``.npy``, or ``.npz`` with one array)."""
    p = input_file(path, "labels", "pass a .npy of class indices")
    if p.suffix == ".npz":
        arrays = load_npz(p)
        if len(arrays) != 1:
            raise DiagError("bad-inputs", f"labels '{p}'", f"holds {len(arrays)} arrays", "save exactly one array")
        labels = next(iter(arrays.values()))
    else:
        labels = load_npy(p)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DiagError(
            "bad-inputs",
            f"labels '{p}'",
            f"has shape {labels.shape} and dtype {labels.dtype}",
            "save a 1-D integer array of class indices, one per sample",
        )
    return labels
