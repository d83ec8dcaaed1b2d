"""Untrusted JSON text: parsed without crashing, and its fields read without internal errors.

Every JSON file a user hands diag (``diag.json``, shard files, recipes, a sweep's resume file) may be
hostile: nested deeply enough to hit Python's recursion limit, holding an integer longer than Python
parses, or valid JSON whose fields are not what the code reading them needs. :func:`parse_json` turns
the first two into one-line errors before ``json.loads`` runs; :func:`fields_of` turns the third into
``bad-report`` naming the file. A foundation module: it imports only :mod:`diag.foundations.errors`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from diag.foundations.errors import DiagError

#: Deepest nesting a diag document has is ~8; anything far deeper is hostile.
MAX_DEPTH = 64


def bad_report(path: object, problem: str, hint: str = "pass the diag.json written by diag compare") -> DiagError:
    """The ``bad-report`` error naming a JSON document and what is wrong with it."""
    return DiagError("bad-report", f"report '{path}'", problem, hint)


def parse_json(text: str, path: object, *, bad: Callable[[object, str], DiagError] | None = None) -> Any:
    """``json.loads`` for untrusted text: deep nesting and giant integers are refused, never a crash.

    Example:
        >>> parse_json("[" * 100 + "]" * 100, "x.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: report 'x.json' | is nested deeper than 64 levels. Hint: ...
    """
    make = bad or bad_report
    depth = max_depth(text)
    if depth > MAX_DEPTH:
        raise make(path, f"is nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError as e:  # pragma: no cover - the depth scan above comes first
        raise make(path, f"is nested deeper than {MAX_DEPTH} levels") from e
    except ValueError as e:
        why = "has an integer too long to read" if "digits" in str(e) else f"is not readable JSON ({str(e)[:80]})"
        raise make(path, why) from e


def max_depth(text: str) -> int:
    """Deepest bracket nesting, strings skipped; linear and without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


@contextlib.contextmanager
def fields_of(path: object) -> Iterator[None]:
    """Run code that reads a validated document's fields; a value the schema let through but the code
    cannot use (a string where a count is needed deep in a shard's state) is ``bad-report`` naming the
    file, never an internal error."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        if isinstance(e, DiagError):
            raise
        raise bad_report(
            path, f"has a missing or malformed field ({type(e).__name__}: {str(e)[:80]})", "re-run diag compare"
        ) from e
