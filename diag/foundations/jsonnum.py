"""Numbers in diag's JSON files: the one encoder for inf / NaN, and its decoder.

JSON has no inf or NaN (``json.dumps`` would write the non-standard ``Infinity`` / ``NaN``), so every
file diag writes (diag.json, shard state, sweep.json, exclusion.json, tiers.json, diff output) spells
them as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, and every reader parses them back here.

NOTE: two parameters keep the files that exist byte for byte what they were, on purpose:

* ``digits``: diag.json rounds its figures to 6 significant digits (diffable, small); shard state,
  sweep, exclusion, tiers and diff files keep Python's shortest round-trip repr (``digits=None``), so
  a number read back is bit for bit the number written.
* ``nan``: exclusion.json writes NaN as ``null`` (``nan=None``, "no figure"); every other file writes
  the string ``"nan"``.

A foundation module: it imports nothing from diag.
"""

from __future__ import annotations

import math
from typing import Any

#: How the non-finite floats are spelled in diag's JSON files.
NONFINITE = ("inf", "-inf", "nan")


def json_number(x: float | None, *, digits: int | None = 6, nan: str | None = "nan") -> float | int | str | None:
    """A number for JSON, which has no inf/nan: those become the strings "inf", "-inf" (and ``nan``).

    Args:
        x: a float (numpy scalars too), an int (returned as is) or None (returned as is).
        digits: significant digits kept for finite floats; None keeps the exact value.
        nan: what NaN becomes: ``"nan"``, or None where a file writes NaN as ``null``.

    Example:
        >>> json_number(float("inf")), json_number(0.1234567891), json_number(0.1234567891, digits=None)
        ('inf', 0.123457, 0.1234567891)
        >>> json_number(float("nan")), json_number(float("nan"), nan=None)
        ('nan', None)
    """
    if x is None or isinstance(x, int):
        return x
    if math.isnan(x):
        return nan
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x) if digits is None else float(f"{x:.{digits}g}")


def json_numbers(tree: Any, *, digits: int | None = 6, nan: str | None = "nan") -> Any:
    """A copy of nested dicts / lists with every float passed through :func:`json_number`.

    Other values (strings, ints, bools, None) are kept as they are; ``digits`` and ``nan`` as there.

    Example:
        >>> json_numbers({"a": [1, float("-inf"), 0.1234567891], "b": "x"}, digits=None)
        {'a': [1, '-inf', 0.1234567891], 'b': 'x'}
    """
    if isinstance(tree, float):
        return json_number(tree, digits=digits, nan=nan)
    if isinstance(tree, dict):
        return {k: json_numbers(v, digits=digits, nan=nan) for k, v in tree.items()}
    if isinstance(tree, list):
        return [json_numbers(v, digits=digits, nan=nan) for v in tree]
    return tree


def number_from_json(v: Any, *, strict: bool = False) -> float:
    """The inverse of :func:`json_number`.

    Args:
        v: a JSON value.
        strict: for reading state back (shard files): anything but a number or one of
            :data:`NONFINITE` raises ``ValueError``. Otherwise (plots, tables) None and any other
            string become NaN.

    Example:
        >>> number_from_json("-inf"), number_from_json(2), number_from_json(None)
        (-inf, 2.0, nan)
    """
    if strict:
        if isinstance(v, str) and v in NONFINITE:
            return float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise ValueError(f"{str(v)[:40]!r} is not a number, 'inf', '-inf' or 'nan'")
    if v is None:
        return math.nan
    if isinstance(v, str):
        return math.inf if v == "inf" else -math.inf if v == "-inf" else math.nan
    return float(v)
