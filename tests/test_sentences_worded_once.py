"""A sentence is worded once, from typed values, and never edited or read back (issue 42 item 6).

The headline used to be a finished sentence that later stages edited with ``str.replace`` (the
spread remedies, the exclusion-search words) and that the terminal and the report read back by
substring ("no single root cause", "rounding-level"): each edit did nothing, silently, once the
words it looked for changed. Now the headline is :class:`diag.analysis.headline.Headline`: later
stages set its typed slots and read its ``kind``. These tests scan diag/ so the pattern cannot
come back unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from diag.analysis.headline import ExcludeCommand, Headline, NextSearch, SpreadRemedies

DIAG = Path(__file__).resolve().parent.parent / "diag"
#: Names that hold diag's own prose: a ``.replace`` on them edits a sentence, an ``in`` test on them
#: parses one. (Reading other tools' text, /proc/cpuinfo or a log line, is parsing input, not prose.)
PROSE = {"sentence", "sentences", "cause", "cause_sentence", "headline", "lines", "message", "note", "summary"}


def _name(node: ast.AST) -> str:
    """The last name of an expression: ``result.cause_sentence`` -> cause_sentence, ``doc["cause"]`` -> cause,
    ``lines[0]`` -> lines."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
        return _name(node.value)
    return ""


def _offences() -> list[str]:
    out = []
    for path in sorted(DIAG.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(DIAG.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = _name(node.func.value)
                if node.func.attr in ("replace", "rsplit", "split", "partition", "rpartition") and receiver in PROSE:
                    out.append(f"{where}:{node.lineno}: {receiver}.{node.func.attr}(...)")
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                left = node.left
                if isinstance(left, ast.Constant) and isinstance(left.value, str) and " " in left.value:
                    for right in node.comparators:
                        if _name(right) in PROSE:
                            out.append(f"{where}:{node.lineno}: {left.value!r} in {_name(right)}")
    return out


def test_no_sentence_in_diag_is_edited_or_parsed_back() -> None:
    assert _offences() == []


def test_the_scan_finds_the_patterns_it_forbids(tmp_path, monkeypatch) -> None:
    """The scan can fail: the three patterns the headline refactor removed are each found."""
    bad = tmp_path / "diag"
    bad.mkdir()
    (bad / "m.py").write_text(
        "def f(result, doc, command):\n"
        "    result.cause_sentence = result.cause_sentence.replace('a', 'b')\n"
        "    role = 'x' if 'no single root cause' in doc['cause'] else 'y'\n"
        "    lines[0] = lines[0].replace('default RTN', 'k')\n"
    )
    monkeypatch.setattr(__import__(__name__), "DIAG", bad)
    found = _offences()
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "'no single root cause' in cause",
        "cause_sentence.replace(...)",
        "lines.replace(...)",
    ], found


@pytest.mark.parametrize("held_here", [False, True])
def test_every_later_stage_sets_a_slot_and_the_sentence_follows(held_here: bool) -> None:
    """The spread headline's remedies and next search are typed slots: the format's list, then the
    recipe's, then the measured remedies; the search as words, the command, or this report's own."""
    h = Headline(
        "spread", "no single root cause: error accumulates over 4 quantized nodes", spread=SpreadRemedies("qdq")
    )
    assert h.text().endswith("16-bit activations (QDQ), or an exclusion search (diag exclude)")
    assert h.spread is not None
    h.spread.settings, h.spread.recipe_known = (
        {"mode": "static", "per_channel": True, "activation_type": "QUInt16"},
        True,
    )
    assert h.text().endswith("What fits spread error: an exclusion search (diag exclude)"), h.text()
    h.search = NextSearch(ExcludeCommand("m.onnx", "q.onnx", "--inputs x.npz", "cosine>=0.999"), held_here=held_here)
    expected = (
        "the exclusion search this report holds"
        if held_here
        else "an exclusion search: diag exclude m.onnx --int8 q.onnx --inputs x.npz --target 'cosine>=0.999'"
    )
    assert h.text().endswith(f"What fits spread error: {expected}"), h.text()
    assert h.to_dict()["search"]["held_here"] is held_here and h.to_dict()["kind"] == "spread"


def test_names_in_the_headline_copy_from_summary_md_and_the_report_as_the_models_own(tmp_path, capsys) -> None:
    """Issue 46: summary.md escaped ``_`` in node names (``self\\_attn/v\\_proj``), so a name copied
    or searched in the raw Markdown did not match the model. The headline's names are code spans
    (``<code>`` in report.html) and its prose is escaped, from the same typed parts."""
    import json

    import numpy as np
    import onnx

    from diag.cli import commands as cli
    from diag.fixtures import models
    from diag.fixtures.quantize import quantize

    fx = models.build("convnet")
    renamed = {"conv2": "block_1/conv_2*down_proj", "relu2": "block_1/act_2"}
    for node in fx.model.graph.node:
        node.name = renamed.get(node.name, node.name)
    fp, q, x = tmp_path / "m.fp32.onnx", tmp_path / "m.int8.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    quantize(fp, q, "dynamic")
    np.savez(x, **fx.make_inputs(16, 12))
    out = tmp_path / "out"
    assert cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--quiet", "--out", str(out)]) in (
        0,
        3,
    )
    capsys.readouterr()
    doc = json.loads((out / "diag.json").read_text())
    headline = doc["verdict"]["headline"]
    assert headline["kind"] == "single-cause" and headline["node"].startswith("block_1/conv_2*down_proj"), headline
    named = [p["text"] for p in headline["parts"] if p["name"]]
    assert "block_1/conv_2*down_proj" in named, named
    summary = (out / "summary.md").read_text()
    assert "`block_1/conv_2*down_proj`" in summary, summary[:600]
    assert "conv\\_2" not in summary.splitlines()[2] and "down\\_proj" not in summary.splitlines()[2]
    html = (out / "report.html").read_text()
    assert "<code>block_1/conv_2*down_proj</code>" in html
    # The plain sentence (terminal, diag.json) is the same words without the markup.
    assert doc["verdict"]["cause"] == "".join(p["text"] for p in headline["parts"])


def test_a_merge_re_aims_the_shards_command_from_its_parts_and_ignores_a_malformed_one() -> None:
    """The shards' exclude command is kept in parts (no ``rsplit(' --target ')`` of a sentence); a
    shard file is untrusted, so parts that are not three strings give no command, not a crash."""
    from diag.analysis.merge import _shard_command

    parts = {"fp32": "m.onnx", "int8": "q q.onnx", "feeds": "--inputs x.npz --batch 8", "target": "cosine>=0.99"}
    doc = {"verdict": {"headline": {"search": {"command": parts, "held_here": False}}}}
    assert str(_shard_command(doc, "cosine>=0.999")) == (
        "diag exclude m.onnx --int8 'q q.onnx' --inputs x.npz --batch 8 --target 'cosine>=0.999'"
    )
    for bad in ({"fp32": 1, "int8": "q", "feeds": ""}, ["m.onnx"], "diag exclude; rm -rf /", None):
        assert _shard_command({"verdict": {"headline": {"search": {"command": bad}}}}, "cosine>=0.99") is None
    assert _shard_command({}, "cosine>=0.99") is None
