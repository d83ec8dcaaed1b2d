"""Numbers as text: the one rule the exclusion and sweep outputs print metrics with.

NOTE: the other formatters stay apart because their rules differ: the report's tables and the lines
under the verdict use :func:`fmt_num` (3 significant digits, an en dash for none) and :func:`fmt_db`
(dB, one decimal, "∞"); ``diff`` prints 6 significant digits, the ``--tiers`` summary 4 significant digits.

A foundation module: it imports nothing from diag.
"""

from __future__ import annotations

from typing import Any


def fixed_number(v: float, decimals: int) -> str:
    """``decimals`` decimals below 10 (0.99995 with 5 stays 0.99995, never 1.0), 4 significant digits from 10 up.

    A metric near its bound (cosine 0.9999 against ``cosine>=0.9999``) must show the digit that
    decides it; a large one (max_abs 1234.5) needs no decimals.

    Example:
        >>> fixed_number(0.99995, 5), fixed_number(1234.5678, 4), fixed_number(float("nan"), 4)
        ('0.99995', '1235', 'nan')
    """
    return f"{v:.{decimals}f}" if abs(v) < 10 else f"{v:.4g}"


def table_cell(v: object, digits: int = 6) -> str:
    """One cell of a sweep table: "-" for none, text as is, floats by :func:`fixed_number`.

    Example:
        >>> table_cell(None), table_cell("n/a"), table_cell(0.9999512, 4), table_cell(3)
        ('-', 'n/a', '1.0000', '3')
    """
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return fixed_number(v, digits)
    return str(v)


def byte_size(n: int) -> str:
    """A file size for people: KB under 1 MiB, MB above (a 2 GB model is not "1979131.2 KB").

    Example:
        >>> byte_size(40857), byte_size(2026631 * 1024)
        ('39.9 KB', '1979.13 MB')
    """
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


#: What a missing number prints as.
NO_VALUE = "\u2013"  # an en dash


def fmt_db(v: Any) -> str:
    """An SQNR from diag.json: one decimal, "∞" for "inf", an en dash for none.

    Example:
        >>> fmt_db(12.345), fmt_db("inf"), fmt_db(None)
        ('12.3', '∞', '–')
    """
    if v in ("inf", None):
        return "\u221e" if v == "inf" else NO_VALUE
    if v in ("-inf", "nan"):
        return str(v)
    return f"{float(v):.1f}"


def fmt_num(v: Any, digits: int = 3) -> str:
    """A figure from diag.json with ``digits`` significant digits; text (``"nan"``) as it is.

    Example:
        >>> fmt_num(0.123456), fmt_num(0), fmt_num("nan")
        ('0.123', '0', 'nan')
    """
    if v is None:
        return NO_VALUE
    if isinstance(v, str):
        return v
    if v == 0:
        return "0"
    return f"{float(v):.{digits}g}"


def fmt_pct(v: Any) -> str:
    """A share as a percentage with two decimals.

    Example:
        >>> fmt_pct(0.9612)
        '96.12%'
    """
    return NO_VALUE if v is None or isinstance(v, str) else f"{100 * float(v):.2f}%"
