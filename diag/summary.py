"""What a verb prints: its lines, and whether it failed its gate.

Every library call behind a CLI verb returns one :class:`Summary`; ``diag.cli`` makes the lines
printable (names from model files must not drive the terminal), prints them and turns ``failed``
into exit code 3. A foundation module: it imports nothing from diag.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Summary:
    """What a verb prints (one line each, untrusted names still in them: the CLI makes them
    printable) and whether it failed its gate (the CLI's exit code 3).

    Example:
        >>> Summary(["PASS cosine 0.9999 >= 0.999"]).failed
        False
    """

    lines: list[str] = field(default_factory=list)
    failed: bool = False
