"""What this diag is and where it runs: its version, the versions and machine a report records,
and the folder its templates were installed in.

Foundations: imports no other diag module but :mod:`diag.foundations.errors`, so every layer may ask
(``diag.__init__`` re-exports :data:`__version__`; a report records :func:`environment`).
"""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from diag.foundations.errors import DiagError

__version__ = "0.1.0"


def environment() -> dict[str, str]:
    """Versions and date recorded in every report (scrubbed in golden tests).

    Example:
        >>> sorted(environment())  # doctest: +SKIP
        ['date', 'diag', 'numpy', 'onnx', 'onnxruntime', 'platform', 'python']
    """
    # NOTE: imported here, not at module top: ``diag --version`` and ``diag --help`` read
    # __version__ from this module and must not pay for numpy, onnx and onnxruntime.
    import numpy as np
    import onnx
    import onnxruntime as ort

    return {
        "diag": __version__,
        "onnx": str(onnx.__version__),
        "onnxruntime": str(ort.__version__),
        "numpy": str(np.__version__),
        "python": sys.version.split()[0],
        "platform": platform.platform(terse=True),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def printable(text: object) -> str:
    """Printable text only: names from model files must not drive the terminal.

    Example:
        >>> printable("conv\x1b[2J")
        'conv?[2J'
    """
    return "".join(ch if ch.isprintable() else "?" for ch in str(text))


def package_dir() -> Path:
    """The folder of the installed ``diag`` package (the templates are next to it or inside it)."""
    return Path(__file__).resolve().parents[1]


def templates_dir() -> Path:
    """Where the jinja2 templates live: in the installed package, or the source checkout.

    Raises:
        DiagError: ``missing-templates`` when neither holds them (a broken install).
    """
    here = package_dir()
    for candidate in (here / "reports_templates", here.parent / "reports_templates"):
        if (candidate / "report.html.j2").is_file():
            return candidate
    raise DiagError(
        "missing-templates",
        f"templates folder near '{here}'",
        "report templates are not installed",
        "reinstall diag (pip install --force-reinstall diag)",
    )
