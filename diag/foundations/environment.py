"""What this diag is and where it runs: its version, the versions and machine a report records,
and the folder its templates were installed in.

Foundations: imports no other diag module but :mod:`diag.foundations.errors`, so every layer may ask
(``diag.__init__`` re-exports :data:`__version__`; a report records :func:`environment`).
"""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

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


#: Environment variable holding the custom-op libraries every onnxruntime session registers
#: (``os.pathsep``-separated; ``--custom-op-library`` sets it, so worker processes inherit it).
CUSTOM_OPS_ENV = "DIAG_CUSTOM_OP_LIBRARIES"


def use_custom_op_libraries(paths: list[str]) -> None:
    """Register ``paths`` for every session this process (and its children) creates.

    Raises ``missing-file`` for a path that is not a file, before any model is read.
    """
    checked = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise DiagError(
                "missing-file",
                f"--custom-op-library {p}",
                "is not a file",
                "pass the shared library (.so / .dll / .dylib) that implements the model's custom ops",
            )
        checked.append(str(path.resolve()))
    os.environ[CUSTOM_OPS_ENV] = os.pathsep.join(checked)


def custom_op_libraries() -> list[str]:
    """The custom-op libraries sessions register (:data:`CUSTOM_OPS_ENV`), in order."""
    return [p for p in os.environ.get(CUSTOM_OPS_ENV, "").split(os.pathsep) if p]


def session_options() -> Any:
    """A new ``onnxruntime.SessionOptions`` with the custom-op libraries registered (the one place
    every session of diag starts from, so ``--custom-op-library`` reaches each of them)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    for library in custom_op_libraries():
        try:
            so.register_custom_ops_library(library)
        except Exception as e:  # onnxruntime cannot load it (wrong platform, missing symbols)
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DiagError(
                "bad-option",
                f"--custom-op-library {library}",
                f"cannot be registered by onnxruntime ({why})",
                "pass a custom-op library built for this onnxruntime and platform",
            ) from e
    return so


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
