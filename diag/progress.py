"""A dependency-free progress bar on stderr, shown only on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(total, label).advance(n)``; silent when stderr is not a TTY or disabled."""

    def __init__(self, total: int | None, label: str, enabled: bool = True, unit: str = "samples") -> None:
        self.total = total
        self.label = label
        self.unit = unit
        self.done = 0
        self.start = time.perf_counter()
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.1 and self.done != self.total):
            return
        self._last = now
        self._draw(now)

    def note(self, line: str) -> None:
        """Print ``line`` on stderr above the bar (which is drawn again below it)."""
        if self.enabled:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(line.rstrip("\n") + "\n")
        if self.enabled and self.done:
            self._draw(time.perf_counter())
        sys.stderr.flush()

    def _draw(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = f"{self.label} [{bar:<30}] {self.done}/{self.total} {self.unit}, {_rate(rate)}, eta {_duration(eta)}"
        else:
            line = f"{self.label} {self.done} {self.unit}, {_rate(rate)}"
        sys.stderr.write("\r" + line[:120])
        sys.stderr.flush()

    def finish(self) -> None:
        """Close with the total set to what was done (an estimated total ends at 100 %)."""
        if self.enabled and self.done:
            self.total = self.done
            self._draw(time.perf_counter())
        self.close()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()


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
