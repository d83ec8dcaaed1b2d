"""What a verb prints: its lines, and whether it failed its gate.

Every library call behind a CLI verb returns one :class:`Summary`; ``diag.cli.commands`` makes the lines
printable (names from model files must not drive the terminal), prints them and turns ``failed``
into exit code 3. A foundation module: it imports nothing from diag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Summary(Generic[R]):
    """What a verb prints (one line each, untrusted names still in them: the CLI makes them
    printable) and whether it failed its gate (the CLI's exit code 3); for a library caller, also
    what the verb computed and the files it wrote.

    NOTE: one return value, not a tuple the CLI unpacks: every verb's call returns this, so the
    CLI's code for a verb is parse, one call, print (issue 28). ``result`` and ``files`` are for
    library callers; the CLI prints ``lines`` only.

    Example:
        >>> Summary(["PASS cosine 0.9999 >= 0.999"]).failed
        False
    """

    lines: list[str] = field(default_factory=list)
    failed: bool = False
    #: What the verb computed (a ``CompareResult``, an ``ExclusionResult``, ...), None when it
    #: computes nothing a caller needs beyond the lines.
    result: R | None = None
    #: The files the verb wrote, by the names its lines give them.
    files: dict[str, Path] = field(default_factory=dict)
