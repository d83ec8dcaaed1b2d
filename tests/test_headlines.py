"""Headlines say what to run: the exclusion search is printed as the exact command (issue 25, 6b)."""

from __future__ import annotations

from pathlib import Path

from diag.analysis.compare import exclude_search
from diag.analysis.headline import Headline, NextSearch, SpreadRemedies
from diag.analysis.remedies import SEARCH_REMEDY
from diag.core.feeds import FeedSpec


def exclude_command(fp32: Path, int8: Path, spec: FeedSpec) -> str:
    return str(exclude_search(fp32, int8, spec))


def test_exclusion_search_is_printed_as_the_command_with_the_users_paths():
    headline = Headline("spread", "no single root cause: ...", spread=SpreadRemedies("dynamic"))
    assert headline.text().endswith(f"or {SEARCH_REMEDY}")
    search = exclude_search(Path("models/m.onnx"), Path("m int8.onnx"), FeedSpec(inputs="data/x.npz"))
    headline.search = NextSearch(search)
    out = headline.text()
    assert out.endswith(
        "an exclusion search: diag exclude models/m.onnx --int8 'm int8.onnx' --inputs data/x.npz "
        "--target 'cosine>=0.99'"
    )
    assert SEARCH_REMEDY not in out
    headline.search.held_here = True  # diag exclude's own diagnosis: the command's work folder is gone
    assert headline.text().endswith(", or the exclusion search this report holds"), headline.text()


def test_random_inputs_are_carried_into_the_exclude_command():
    assert "--random" in exclude_command(Path("a.onnx"), Path("b.onnx"), FeedSpec(random=True))


def test_the_batch_is_carried_into_the_exclude_command():
    """Dynamic quantization scales each batch as a whole: a search run at another batch size starts
    from another baseline than the compare that printed it."""
    assert exclude_command(Path("a.onnx"), Path("b.onnx"), FeedSpec(inputs="x.npz", batch=8)).endswith(
        "--inputs x.npz --batch 8 --target 'cosine>=0.99'"
    )
    assert "--batch" not in exclude_command(Path("a.onnx"), Path("b.onnx"), FeedSpec(inputs="x.npz"))


def test_the_printed_commands_run_as_printed_in_a_shell(built, tmp_path):
    """Copied into a shell, the advice runs: the recipe comes from the INT8 model (--int8) and the target's
    ``>=`` is quoted (unquoted, the shell would redirect and diag would refuse the target)."""
    import shutil
    import subprocess
    import sys

    b = built("convnet")
    command = exclude_command(b.fp32, b.int8["dynamic"], FeedSpec(inputs=str(b.inputs_path)))
    bindir = Path(sys.executable).parent
    assert shutil.which("diag", path=str(bindir)), "the diag console script sits next to this python"
    env = {"PATH": f"{bindir}:/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 3), out.stderr  # 3: the target was not reached; never a usage error
    assert "error[" not in out.stderr
    assert not (tmp_path / "=0.99").exists()
    assert out.stdout.startswith(f"recipe: read back from the INT8 model {b.int8['dynamic']} "), out.stdout
    assert "exclusion.json" in out.stdout


def test_the_suggested_search_aims_at_a_band_the_model_has_not_reached(tmp_path, capsys):
    """Issue 45: the demo suggested ``cosine>=0.99`` to a model already at 0.9965, and the search it
    printed answered "nothing to exclude". The suggestion aims at the loosest cosine band the worst
    output misses, so running it always searches."""
    import json
    import shlex

    from diag.analysis.compare import SUGGESTED_COSINES
    from diag.cli import commands as cli

    assert cli.main(["demo", "--no-fix", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "demo" / "diag.json").read_text())
    worst = min(o["cosine_min"] for o in doc["verdict"]["outputs"])
    command = doc["recommendation"]["verify_command"]
    target = float(command.rsplit(">=", 1)[1].rstrip("'"))
    assert target == next(t for t in SUGGESTED_COSINES if worst < t) and worst < target, (worst, command)
    code = cli.main([*shlex.split(command)[1:], "--bench-runs", "0", "--quiet", "--out", str(tmp_path / "ex")])
    printed = capsys.readouterr().out
    assert code in (0, 3), printed
    assert "already met" not in printed and "nothing to exclude" not in printed, printed
