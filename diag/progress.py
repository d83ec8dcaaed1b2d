"""A dependency-free progress bar on stderr, shown only on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(total, label).advance(n)``; silent when stderr is not a TTY or disabled."""

    def __init__(self, total: int | None, label: str, enabled: bool = True) -> None:
        self.total = total
        self.label = label
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
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = f"{self.label} [{bar:<30}] {self.done}/{self.total} samples, {rate:.1f}/s, eta {eta:.0f}s"
        else:
            line = f"{self.label} {self.done} samples, {rate:.1f}/s"
        sys.stderr.write("\r" + line[:120])
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()
