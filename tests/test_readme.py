"""The README's and the manual's (docs/) examples run, and print what the pages say they print
(timings scrubbed); the README stays a front door and every page is in the site's nav."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path
from types import ModuleType

import pytest
from diag_forks import DiagForks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _docs_lists() -> ModuleType:
    """tools/docs_lists.py, mkdocs.yml's hook: the lists it renders (verb pages, metric names) have one source."""
    spec = importlib.util.spec_from_file_location("docs_lists", ROOT / "tools" / "docs_lists.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav() -> list[Path]:
    """The pages of the site's nav, in its order (the order a reader meets them): mkdocs.yml's, with
    the verb pages its hook appends after the verbs' index page."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:\n") :]
    names = re.findall(r"^\s*- (?:[^\n]*: )?(\S+\.md)$", nav, flags=re.M)
    hook = _docs_lists()
    at = names.index(hook.INDEX) + 1
    verbs = [page for entry in hook.verb_pages(README.read_text()) for page in entry.values()]
    return [DOCS / name for name in [*names[:at], *verbs, *names[at:]]]


def _pages() -> list[Path]:
    """README.md, then every docs page in nav order: an example may use what an earlier one wrote."""
    return [README, *_nav()]


#: An example command: ``$ diag VERB ...`` or ``$ NAME=VALUE ... diag VERB ...`` (``PYTHONPATH=.`` for plugins).
COMMAND = re.compile(r"^\$ ((?:[A-Z_]+=\S* )*diag .*)$")


def _examples() -> list[tuple[str, list[str]]]:
    examples: list[tuple[str, list[str]]] = []
    for page in _pages():
        current: tuple[str, list[str]] | None = None
        for line in page.read_text().splitlines():
            command = COMMAND.match(line)
            if command:
                current = (command.group(1), [])
                examples.append(current)
            elif current is not None and line and not line.startswith("```"):
                current[1].append(line)
            else:
                current = None
    return examples


def _python_files() -> dict[str, str]:
    """The pages' python blocks that open with ``# NAME.py``: files their examples import."""
    files: dict[str, str] = {}
    for page in _pages():
        for name, body in re.findall(r"^```python\n# (\w+\.py)\n(.*?)^```$", page.read_text(), flags=re.S | re.M):
            assert files.get(name, f"# {name}\n{body}") == f"# {name}\n{body}", f"two different {name} in the pages"
            files[name] = f"# {name}\n{body}"
    return files


def _split(cmd: str) -> tuple[dict[str, str], list[str]]:
    """``PYTHONPATH=. diag compare ...`` -> ({"PYTHONPATH": "."}, ["diag", "compare", ...])."""
    argv = shlex.split(cmd)
    env = {}
    while "=" in argv[0]:
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return env, argv


#: What onnxruntime's integer kernels decide at optimization level "all" (the effects check runs
#: there: what a deployed session computes). Those kernels differ between CPUs (u8s8 pairs saturate
#: in int16 on AVX2 without VNNI, are exact with VNNI), so these parts of a README line are compared
#: as "something was measured here", while names, verdict words and structure stay exact.
#: ``test_kernel_dependent_lines_are_exactly_the_scrubbed_ones`` proves the list complete for the
#: QDQ demo by running it with the effects check at two kernel paths.
KERNEL_DEPENDENT = (
    # "effect on logits of keeping one node in float: a 16%, b 9% (8 samples)": which nodes, how much
    (
        re.compile(r"^(\s*effect on \S+ of keeping one node in float: ).*( \(\d+ samples), optimization level \w+\)$"),
        r"\1<measured>\2, optimization level <level>)",
    ),
    # the level the effects ran at ("all" as shipped; the test below also runs them in exact mode)
    (re.compile(r"at optimization level \w+"), "at optimization level <level>"),
    # "keeping it alone in float recovers only 11% of the error of logits"
    (re.compile(r"recovers (only |at most )?\d+%"), r"recovers \1<measured>%"),
    # the demo's best verified fix (a node list or an op-type change) is met as deployed (level
    # "all", onnxruntime's fused integer kernels), so which nodes it takes depends on the CPU;
    # the baseline and the target stay exact
    (
        re.compile(r"^(verified fix: ).*(: held-out cosine [\d.]+ -> )[\d.]+( \(.*\))$"),
        r"\1<measured>\2<measured>\3",
    ),
    # diag exclude's answer as onnxruntime runs it at the deploy level: "-> 0.9993 (level all: 0.9993)"
    (re.compile(r"\(level (basic|extended|all): -?[\d.]+\)"), r"(level \1: <measured>)"),
    # diag diff's output rows: the outputs are graded as deployed (level "all"), where a QDQ model's
    # fused integer kernels run (u8s8 pairs saturate on AVX2 without VNNI): b's figure and the delta
    # ("  sqnr_db   22.3347 -> 17.1934   -5.141  worse"); a's, the row's name and its verdict word stay exact
    (
        re.compile(r"^(  (?:sqnr_db|cosine_min|cosine_mean|max_abs|top1_agreement)\s+\S+ -> )\S+(\s+)\S+(\s+\w+)$"),
        r"\1<measured>\2<measured>\3",
    ),
    # a remedy's measured effect: "(measured: removes 96% of the error of logits)"
    (re.compile(r"\((measured(?:, does not help)?): [^()]*\)$"), r"(\1: <measured>)"),
    # the spread sentence's "(biggest contributors: a (12%), b (5%))"
    (re.compile(r"\(biggest contributors: .*?%\)\)"), "(biggest contributors: <measured>)"),
)


def _scrub(line: str) -> str:
    line = re.sub(r"in \d+(\.\d+)? s$", "in <t> s", line.rstrip())
    for pattern, replacement in KERNEL_DEPENDENT:
        line = pattern.sub(replacement, line)
    return line


def _scrub_numbers(line: str) -> str:
    """diag bench and diag sweep print timings: compare their layout, names and units, not their numbers."""
    return " ".join(re.sub(r"\d+(\.\d+)?", "#", line).split())


@pytest.mark.slow
@pytest.mark.kernel_path
def test_readme_examples_run_and_print_what_the_readme_shows(tmp_path):
    """Every example of README.md and docs/, in reading order; a command shown on two pages (the demo:
    README and its verb page) runs once and both pages must show its output."""
    examples = _examples()
    from diag.cli.commands import VERBS

    verbs = [_split(cmd)[1][1] for cmd, _ in examples]
    assert verbs[0] == "demo", "the first example builds the files the others use"
    assert set(verbs) == set(VERBS), "every CLI verb has an example with its real output"
    for name, text in _python_files().items():
        (tmp_path / name).write_text(text)
    printed: dict[str, list[str]] = {}
    (tmp_path / "forks").mkdir()
    with DiagForks(tmp_path / "forks") as diag:  # each command its own `python -m diag` process
        for cmd, expected in examples:
            env, argv = _split(cmd)
            if cmd not in printed:
                if "PYTHONPATH" in env:
                    env["PYTHONPATH"] = str(tmp_path / env["PYTHONPATH"])
                out = diag.run(argv[1:], cwd=tmp_path, env={**os.environ, **env})
                assert out.returncode == 0, (cmd, out.stderr)
                printed[cmd] = out.stdout.splitlines()
            scrub = _scrub_numbers if argv[1] in ("bench", "sweep") else _scrub
            got = [scrub(x) for x in printed[cmd]]
            assert got == [scrub(x) for x in expected], cmd


def test_readme_runs_its_plugin_examples_with_the_files_it_shows():
    """The CTC decoder plugin is run, not only shown: its command is collected and its file written."""
    commands = [cmd for cmd, _ in _examples()]
    assert any(cmd.startswith("PYTHONPATH=. diag compare") and "ctc_metrics:text_agreement" in cmd for cmd in commands)
    assert "def greedy_texts" in _python_files()["ctc_metrics.py"]
    assert _split("PYTHONPATH=. diag demo --out d") == ({"PYTHONPATH": "."}, ["diag", "demo", "--out", "d"])


def test_readme_starts_with_install_and_test_commands_that_ci_runs():
    text = README.read_text()
    head = text[: text.index("## What the demo prints")]
    assert "pip install . && diag demo --out demo" in head
    line = next(x for x in head.splitlines() if x.startswith("tools/"))
    command = line.split("#", 1)[0].strip()
    assert command == "tools/test-setup.sh && pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.strip().endswith("\n" + command), "CI runs the README's test command, exactly, last"
    script = (ROOT / "tools" / "test-setup.sh").read_text()
    # A fresh machine has Python, pip and gcc only: the command installs what the tests need itself.
    assert 'pip install -q -e ".[test]"' in script and "apt-get install -y -q chromium" in script
    assert 'pip install -e ".[docs]"' in ci and "mkdocs build --strict" in ci, "CI builds the manual, strictly"


def test_readme_is_a_front_door_that_links_every_verb_page_and_resolves_its_links():
    from diag.cli.commands import VERBS

    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md is a front door; the manual is docs/"
    assert "\n$ diag demo --out demo\n" in text, "the README shows the demo's real output"
    for verb in VERBS:
        assert (DOCS / "verbs" / f"{verb}.md").is_file(), f"diag {verb} has no page"
        assert f"](docs/verbs/{verb}.md)" in text, f"the README's verb table does not link diag {verb}"
    for page in (README, ROOT / "CONTRIBUTING.md", ROOT / "ARCHITECTURE.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_verb_table_is_the_registry_and_the_manual_lists_it():
    """The verb pages in the site's nav and the list on docs/verbs/index.md are the README table's rows
    (tools/docs_lists.py): a row the hook cannot read, or a verb without a row, fails here."""
    from diag.cli.commands import VERBS

    hook, readme = _docs_lists(), README.read_text()
    rows = hook.verb_rows(readme)
    assert sorted(verb for verb, _ in rows) == sorted(VERBS), (
        "README.md's verb table and diag.cli.commands.VERBS differ"
    )
    assert len(rows) == len(re.findall(r"^\| \[`diag ", readme, flags=re.M)), "a verb row the hook cannot read"
    assert [DOCS / "verbs" / f"{verb}.md" for verb, _ in rows] == [p for p in _nav() if p.parent.name == "verbs"][1:]
    table = hook.verbs_table(readme)
    for verb in VERBS:
        assert f"](../{verb}.md)" not in table and f"]({verb}.md)" in table, f"the verbs index does not link {verb}"
    assert "](docs/" not in table, "a README link left unresolved on docs/verbs/index.md"


def test_the_manuals_metric_names_and_gates_are_rendered_from_the_metric_table():
    """docs/metrics.md's table of names and docs/verbs/check.md's gates are diag.foundations.metricnames' rows
    (tools/docs_lists.py); a page that lost its marker, or a row the rendering leaves out, fails."""
    from diag.foundations.metricnames import METRICS, gates

    hook = _docs_lists()
    names = hook.render((DOCS / "metrics.md").read_text(), "metrics.md")
    for m in METRICS:
        for name in (m.key, m.objective, m.gate):
            assert name is None or f"`{name}" in names or f"`--{name}" in names, f"{name} is not in docs/metrics.md"
    check = hook.render((DOCS / "verbs" / "check.md").read_text(), "verbs/check.md")
    for flag, (_, _, gate) in gates().items():
        assert f"| `--{flag} {gate.metavar}` | {gate.help} |" in check, f"--{flag} is not in docs/verbs/check.md"
    for page in DOCS.rglob("*.md"):
        for marker in re.findall(r"<!-- diag: [^>]* -->", page.read_text()):
            assert marker in hook.MARKERS, f"{page.name}: {marker} renders nothing"


def test_every_docs_page_is_in_the_nav_once():
    """mkdocs build --strict (CI) checks the links and anchors; the example order needs the nav complete."""
    nav = _nav()
    assert len(nav) == len(set(nav)), "a page is in mkdocs.yml's nav twice"
    assert sorted(nav) == sorted(DOCS.rglob("*.md")), "docs/ pages and mkdocs.yml's nav differ"


def _anchors(page: Path) -> dict[str, str]:
    """Heading anchor (as mkdocs' toc makes it) -> the paragraph under the heading."""
    anchors = {}
    for heading, body in re.findall(r"^#+ ([^\n]*)\n\n(.*?)(?=\n#|\Z)", page.read_text(), flags=re.S | re.M):
        anchor = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors[re.sub(r"[\s]+", "-", anchor)] = " ".join(body.split())
    return anchors


def test_every_error_slug_has_its_own_anchor_in_docs_errors_with_its_meaning():
    """`diag: error[bad-inputs]` links to docs/errors.md#bad-inputs: every slug the code raises and
    every slug of errors.SLUGS has a heading there, saying what errors.SLUGS says it means."""
    from diag.foundations.errors import SLUGS

    anchors = _anchors(DOCS / "errors.md")
    raised = set()
    for source in (ROOT / "diag").rglob("*.py"):
        text = source.read_text()
        raised |= set(re.findall(r"DiagError\(\s*\"([a-z0-9-]+)\"", text))  # the slug on the next line too
        raised |= set(re.findall(r"slug=\"([a-z0-9-]+)\"", text))  # files._stat(..., missing_slug="bad-out")
    assert {"bad-option", "bad-recipe", "bad-out", "missing-file"} <= raised, "the scan finds no raise any more"
    assert sorted(raised - set(anchors)) == [], "slugs raised in diag/ without a heading in docs/errors.md"
    for slug, meaning in SLUGS.items():
        assert slug in anchors, f"{slug} has no heading in docs/errors.md"
        assert anchors[slug].replace("`", "") == meaning, slug
    assert sorted(a for a in anchors if a not in SLUGS) == ["errors-and-exit-codes", "exit-codes", "slugs"]


@pytest.mark.slow
def test_kernel_dependent_lines_are_exactly_the_scrubbed_ones(tmp_path, monkeypatch, capsys):
    """Run the README's QDQ demo with the effects check on onnxruntime's fused integer kernels (as
    shipped) and on float DequantizeLinear (exact mode): every line that changes with the kernel path
    must be one the scrubber blurs, so no README line compares a CPU-dependent number exactly; and
    some line must change, or this test proves nothing."""
    from diag.analysis import effects
    from diag.cli import commands as cli

    printed = {}
    for level in ("all", "disabled"):
        monkeypatch.setattr(effects, "EFFECT_OPT_LEVEL", level)
        (tmp_path / level).mkdir()
        monkeypatch.chdir(tmp_path / level)
        assert cli.main(["demo", "--format", "qdq", "--out", "demo-qdq", "--quiet"]) == 0
        printed[level] = capsys.readouterr().out.splitlines()
    assert len(printed["all"]) == len(printed["disabled"])
    changed = [(a, b) for a, b in zip(printed["all"], printed["disabled"], strict=True) if a != b]
    raw = [(a, b) for a, b in changed if not re.search(r"in \d+(\.\d+)? s$", a)]
    assert raw, "the kernel path changed no line: the effects check no longer runs on integer kernels"
    for a, b in raw:
        assert _scrub(a) == _scrub(b), f"CPU-dependent part compared exactly:\n  {a}\n  {b}"


def test_the_scrubber_blurs_measurements_not_names():
    head_of = "  effect on logits of keeping one node in float: "
    line = head_of + "classifier/MatMul 16%, x/Add 9% (8 samples, optimization level all)"
    assert _scrub(line) == head_of + "<measured> (8 samples, optimization level <level>)"
    head = "verdict: ACCEPTABLE - likely root cause (by local error): a/MatMul (100% of the local error"
    assert _scrub(head + "; recovers only 0% of") == head + "; recovers only <measured>% of"
    assert _scrub(head.replace("a/MatMul", "b/MatMul")) != _scrub(head)
    assert _scrub("  output logits: acceptable (max abs error 0.256)") != _scrub(
        "  output logits: acceptable (max abs error 0.257)"
    )
