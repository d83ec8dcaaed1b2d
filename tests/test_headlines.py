"""Headlines say what to run: the exclusion search is printed as the exact command (issue 25, 6b)."""

from __future__ import annotations

from pathlib import Path

from diag.compare import EXCLUDE_WORDS, exclude_command, with_exclude_command
from diag.feeds import FeedSpec


def test_exclusion_search_is_printed_as_the_command_with_the_users_paths():
    sentence = f"no single root cause: ... or {EXCLUDE_WORDS}"
    out = with_exclude_command(sentence, Path("models/m.onnx"), Path("m int8.onnx"), FeedSpec(inputs="data/x.npz"))
    assert out.endswith(
        "an exclusion search: diag exclude models/m.onnx --int8 'm int8.onnx' --inputs data/x.npz --target cosine>=0.99"
    )
    assert EXCLUDE_WORDS not in out


def test_random_inputs_are_carried_into_the_exclude_command():
    assert "--random" in exclude_command(Path("a.onnx"), Path("b.onnx"), FeedSpec(random=True))
