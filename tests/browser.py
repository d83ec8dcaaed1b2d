"""Finding the headless Chromium the browser tests drive (Debian's package, installed by tools/test-setup.sh)."""

from __future__ import annotations

import shutil

import pytest


def chromium() -> str:
    """Path of the chromium binary; fails the test (never skips) when it is missing."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "Debian's chromium is required for the browser test: run tools/test-setup.sh (it installs it), "
            "or apt-get install chromium"
        )
    return path
