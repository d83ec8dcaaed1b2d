"""The accumulator protocol: how every streaming statistic of diag is updated, merged, finished and saved.

A comparison never keeps a tensor: each batch is reduced into accumulators (running sums, maxima,
counts, histogram bins) and dropped. Sharded runs (``diag compare --shard k/n``, the Dask
cluster) write those accumulators into JSON shard files and add them up later, so every
accumulator answers the same five questions:

* ``update(...)`` once per batch (its arguments are the accumulator's own: a tensor pair, an
  output pair, a dict of model outputs and labels, one FP32 tensor);
* ``merge(other) -> self``: add another shard's accumulator, in place. Merging two halves of the
  batches equals one run over all of them (histograms and counts exactly, sums to float tolerance);
* ``finalize() -> result``: the figures, computed once at the end;
* ``to_state() -> dict``: plain JSON (numbers, strings, lists, dicts; inf / NaN as the strings of
  :mod:`diag.foundations.jsonnum`, floats with their exact repr so a number read back is bit for bit the
  number written);
* ``from_state(state) -> instance`` (a classmethod): the inverse; a malformed state raises
  ``KeyError``, ``TypeError`` or ``ValueError`` (the shard reader turns those into ``bad-report``).

``tests/test_accumulators.py`` checks both laws (merge of halves == one run, from_state(to_state(x))
== x through ``json.dumps``) for every accumulator, field by field.

A core module: it imports only :mod:`diag.foundations.jsonnum` (foundations).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from diag.foundations.jsonnum import json_number, number_from_json

R_co = TypeVar("R_co", covariant=True)
A = TypeVar("A", bound="Accumulator[Any]")

#: The JSON form of an accumulator's state.
State = dict[str, Any]


@runtime_checkable
class Accumulator(Protocol[R_co]):
    """A streaming, mergeable, serializable statistic (see the module docstring).

    NOTE: a ``typing.Protocol``, not an ABC: accumulators are checked by their shape, so a
    ``--metric`` plugin's adapter, a dataclass (:class:`diag.core.fp16.Fp16Range`) and a slotted class
    all conform without inheriting from diag, and mypy checks each of them where it is used as
    one. ``update`` is not part of it: its arguments differ per accumulator (a tensor pair, a dict
    of model outputs and labels, ...), so a protocol method could only be ``update(*args: Any)``,
    which would check nothing.

    Example:
        >>> from diag.core.metrics import ErrorAccumulator
        >>> isinstance(ErrorAccumulator(), Accumulator)
        True
    """

    def merge(self, other: Any) -> Any:
        """Add ``other`` (the same kind of accumulator, another shard) into self; returns self."""
        ...

    def finalize(self) -> R_co:
        """The figures this accumulator stands for."""
        ...

    def to_state(self) -> State:
        """Plain JSON: everything :meth:`from_state` needs to rebuild an equal accumulator."""
        ...

    @classmethod
    def from_state(cls, state: State) -> Any:
        """Rebuild from :meth:`to_state`'s output; ``KeyError`` / ``TypeError`` / ``ValueError`` if malformed."""
        ...


def float_to_state(x: float) -> float | str:
    """A float for state JSON: finite values exact (bit-for-bit round trip), others "inf" / "-inf" / "nan".

    Example:
        >>> float_to_state(0.1), float_to_state(float("-inf"))
        (0.1, '-inf')
    """
    out = json_number(float(x), digits=None)
    assert isinstance(out, (float, str))  # a float is never None nor int here
    return out


def float_from_state(v: Any) -> float:
    """The inverse of :func:`float_to_state`; anything else is ``ValueError``.

    Example:
        >>> float_from_state("inf"), float_from_state(2)
        (inf, 2.0)
    """
    return number_from_json(v, strict=True)


def int_from_state(v: Any) -> int:
    """A count read back (``int()``: a malformed value is ``ValueError`` / ``TypeError``)."""
    return int(v)


def array_to_state(a: np.ndarray | None) -> list[float | str] | None:
    """A float array (per-channel statistics) as a JSON list, exact; None stays None."""
    return None if a is None else [float_to_state(x) for x in a.tolist()]


def array_from_state(v: Iterable[Any] | None) -> np.ndarray | None:
    """The inverse of :func:`array_to_state`, as float64."""
    return None if v is None else np.array([float_from_state(x) for x in v], dtype=np.float64)


def states_of(accumulators: dict[str, Any]) -> dict[str, State]:
    """``{name: acc.to_state()}`` of a dict of accumulators."""
    return {k: a.to_state() for k, a in accumulators.items()}


def from_states(kind: type[A], states: dict[str, Any]) -> dict[str, A]:
    """``{name: kind.from_state(state)}``: the inverse of :func:`states_of`."""
    return {str(k): kind.from_state(v) for k, v in states.items()}
