"""The one progress reporter: a tqdm bar on stderr, shown only on a terminal.

Every long-running step (compare's batches, calibration, effect checks, sensitivity, exclude's
trials, bench, Dask tasks) reports through :class:`Progress`, so all bars look alike and all of
them stay quiet where a bar would only be noise: when stderr is not a terminal (a log file, CI, a
pipe) and under ``--quiet`` (``enabled=False``). Status lines (:meth:`Progress.note`) are printed
in every case: they are the verbs' own output, not decoration.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

#: Seconds between two redraws of a bar (tqdm's ``mininterval``).
REDRAW_SECONDS = 0.1


class Progress:
    """``Progress(total, label).advance(n)``; silent when stderr is not a TTY or ``enabled`` is False.

    ``total`` may be None (a count without an end) and may be changed while the bar runs (an
    estimate that improves; the ETA follows it); ``unit`` may be changed too (the Dask bar puts
    its running and retried counts there).

    Example:
        >>> bar = Progress(3, "compare", enabled=False)
        >>> bar.advance(2)
        >>> bar.done
        2
    """

    def __init__(self, total: int | None, label: str, enabled: bool = True, unit: str = "samples") -> None:
        self.label = label
        self.unit = unit
        self.done = 0
        #: When counting began; the rate is the average since then (trials are too few for a moving one).
        self.start = time.perf_counter()
        self.enabled = enabled and sys.stderr.isatty()
        self._total = total
        # NOTE: the tqdm bar is made at the first advance, so a step that never advances (or is
        # disabled) draws nothing, and the two bars of one exclude search do not stack unused.
        self._bar: Any = None  # a tqdm subclass (_Bar)
        self._closed = False

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        self._total = value
        if self._bar is not None:
            self._bar.total = value
            self._bar.bar_format = _format(value)
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done; drawn at once the first time and at the end, else at most every 0.1 s."""
        self.done += n
        if not self.enabled or self._closed:
            return
        first = self._bar is None
        bar = self._bar if self._bar is not None else self._start()
        bar.update(n)
        if first or self.done == self._total:
            bar.refresh()

    def note(self, line: str) -> None:
        """Print ``line`` on stderr above the bar (which is drawn again below it); printed even when quiet."""
        if self._bar is not None:
            self._bar.write(line.rstrip("\n"), file=sys.stderr)
            return
        sys.stderr.write(line.rstrip("\n") + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        """Close with the total set to what was done (an estimated total ends at 100 %)."""
        if self._bar is not None:
            self.total = self.done
        self.close()

    def close(self) -> None:
        """Leave the bar's last state on its line; nothing is drawn after this."""
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _start(self) -> Any:
        columns, rows = _terminal_size()
        self._bar = _Bar(
            self,
            total=self._total,
            desc=self.label,
            file=sys.stderr,
            bar_format=_format(self._total),
            mininterval=REDRAW_SECONDS,
            ncols=columns,
            nrows=rows,
            leave=True,
        )
        return self._bar

    def fields(self) -> dict[str, str]:
        """The parts of the line tqdm does not know: the unit as given, the rate and the ETA, as words."""
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self._total - self.done) / rate if self._total and rate > 0 else 0.0
        return {"what": self.unit, "speed": _rate(rate), "left": _duration(max(eta, 0.0))}


def _format(total: int | None) -> str:
    """tqdm's ``bar_format``: a 30-character bar when the total is known, a count when not."""
    if total:
        return "{desc} [{bar:30}] {n}/{total} {what}, {speed}, eta {left}"
    return "{desc} {n} {what}, {speed}"


def _terminal_size() -> tuple[int, int]:
    """stderr's columns and rows; 120 x 24 where it reports none (a fresh pseudo-terminal says 0 x 0)."""
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stream)
        columns, rows = 0, 0
    return columns or 120, rows or 24


class _Bar(tqdm):  # type: ignore[misc]  # tqdm ships no type hints
    """tqdm, with the fields of :meth:`Progress.fields` available to ``bar_format``."""

    def __init__(self, owner: Progress, **kwargs: Any) -> None:
        self._owner = owner  # before tqdm's __init__, which draws
        super().__init__(**kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, **self._owner.fields()}


def _rate(per_second: float) -> str:
    """``12.0/s``, or ``7.5 s each`` when slower than one per second (trials of a search)."""
    if per_second >= 1 or per_second <= 0:
        return f"{per_second:.1f}/s"
    return f"{1 / per_second:.1f} s each"


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
