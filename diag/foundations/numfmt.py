"""Numbers as text: the one rule the exclusion and sweep outputs print metrics with.

NOTE: the other formatters stay apart because their rules differ: the report's tables use
``view.fmt_num`` (3 significant digits, an en dash for none) and ``view.fmt_db`` (dB, one decimal,
"∞"); ``diff`` prints 6 significant digits, the ``--tiers`` summary 4 significant digits.

A foundation module: it imports nothing from diag.
"""

from __future__ import annotations


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
