"""The progress reporter: a bar on a terminal only, never under --quiet; status lines always.

Each case runs a small script in a child process whose stderr is a real pipe or a real
pseudo-terminal, so what is tested is what a user sees, not a monkeypatched ``isatty``.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from diag.foundations.progress import Progress

    bar = Progress(4, "compare", enabled=sys.argv[1] == "on")
    bar.advance(2)
    bar.note("status: half way")
    bar.advance(2)
    bar.finish()
    """
)


def _run_on_pipe(enabled: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, enabled], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == ""
    return done.stderr


def _run_on_terminal(enabled: str) -> str:
    """stderr of the script when it is a pseudo-terminal (stdout stays a pipe)."""
    leader, follower = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, enabled], stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL
        )
    finally:
        os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert child.wait(timeout=60) == 0
    return b"".join(chunks).decode("utf-8", "replace")


def test_no_bar_when_stderr_is_not_a_terminal():
    assert _run_on_pipe("on") == "status: half way\n"


@pytest.mark.skipif(not hasattr(pty, "openpty"), reason="needs a pseudo-terminal")
def test_bar_is_drawn_on_a_terminal_with_count_and_eta():
    err = _run_on_terminal("on")
    assert "compare [" in err
    assert "2/4 samples" in err
    assert "4/4 samples" in err and "eta 0s" in err
    assert "status: half way" in err
    assert "\r" in err, "the bar redraws its own line"


@pytest.mark.skipif(not hasattr(pty, "openpty"), reason="needs a pseudo-terminal")
def test_quiet_prints_only_the_status_lines_even_on_a_terminal():
    err = _run_on_terminal("off")
    assert err.replace("\r\n", "\n") == "status: half way\n"
