"""mkdocs hook: the manual's lists that have one source elsewhere, rendered from it at build time.

- The verbs are listed once by hand, in README.md's table (``diag.cli.commands.VERBS`` is the code's list;
  ``tests/test_readme.py`` checks the two agree). The manual's "Verbs" section in ``mkdocs.yml``
  names only its index page; this hook appends one page per verb in the table's order (the order
  ``tests/test_readme.py`` runs their examples in) and renders the table on ``docs/verbs/index.md``,
  so a new verb is a README row and its page, never a nav entry or a second list to keep in step.
- The metrics' names (``diag.json`` key, target, objective, gate) and the gates of ``diag check``
  are rows of ``diag.foundations.metricnames.METRICS``; a page asks for them with a marker line
  (:data:`MARKERS`), so a new metric is a row there and its definition in ``docs/metrics.md``.

Registered in ``mkdocs.yml`` (``hooks:``); it imports no mkdocs and only diag's foundation table, so
the tests import it as they import diag.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from diag.foundations.metricnames import METRICS, gates

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The nav section the verb pages are appended to, and the page that lists them.
SECTION = "Verbs"
INDEX = "verbs/index.md"
#: A row of README.md's verb table: ``| [`diag VERB ...`](docs/verbs/VERB.md) | what it does |``.
ROW = re.compile(r"^\| \[`diag (?P<verb>[a-z]+)[^`]*`\]\(docs/verbs/(?P<page>[a-z]+)\.md\) \| .+ \|$", re.M)


def verb_rows(readme: str) -> list[tuple[str, str]]:
    """(verb, table row) for every row of the README's verb table, in its order.

    Example:
        >>> verb_rows("| [`diag lint RECIPE`](docs/verbs/lint.md) | what onnxruntime ignores |")
        [('lint', '| [`diag lint RECIPE`](docs/verbs/lint.md) | what onnxruntime ignores |')]
    """
    rows = []
    for m in ROW.finditer(readme):
        assert m["verb"] == m["page"], f"diag {m['verb']} links the page of {m['page']}"
        rows.append((m["verb"], m[0]))
    return rows


def verb_pages(readme: str) -> list[dict[str, str]]:
    """The nav entries of the verb pages: ``{"diag VERB": "verbs/VERB.md"}``, in the table's order.

    Example:
        >>> verb_pages("| [`diag lint RECIPE`](docs/verbs/lint.md) | what onnxruntime ignores |")
        [{'diag lint': 'verbs/lint.md'}]
    """
    return [{f"diag {verb}": f"verbs/{verb}.md"} for verb, _ in verb_rows(readme)]


def verbs_table(readme: str) -> str:
    """The README's verb table with its links made relative to ``docs/verbs/``.

    Example:
        >>> verbs_table("| [`diag lint RECIPE`](docs/verbs/lint.md) | what onnxruntime ignores |")
        '| verb | what it does |\\n|---|---|\\n| [`diag lint RECIPE`](lint.md) | what onnxruntime ignores |\\n'
    """
    rows = [row.replace("](docs/verbs/", "](") for _, row in verb_rows(readme)]
    return "\n".join(["| verb | what it does |", "|---|---|", *rows]) + "\n"


def metric_names_table() -> str:
    """Every metric's names in each vocabulary and which way is better, one row per metric.

    Example:
        >>> metric_names_table().splitlines()[3].split(" | ")[:5]
        ['| `cosine_min`', '`cosine>=V`', '`cosine`', '`--min-cosine C`', 'higher']
    """
    rows = [
        "| `diag.json` key | `--target` | `sweep --objective` | `diag check` | better | held out, it is |",
        "|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        op = ">=" if m.higher_is_better else "<="
        cells = [
            f"`{m.key}`" if m.key else "-",
            f"`{m.target}{op}V`" if m.target else "-",
            f"`{m.objective}`" if m.objective else "-",
            f"`--{m.gate} {m.check.metavar}`" if m.gate and m.check else "-",
            "higher" if m.higher_is_better else "lower",
            (m.how or m.what or "-").replace("|", "\\|"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def gate_rows() -> str:
    """The metric gates of ``diag check``: one table row each, ``| `--FLAG METAVAR` | its help |``.

    Example:
        >>> gate_rows().splitlines()[0]
        "| `--min-sqnr DB` | fail when an output's SQNR is below DB |"
    """
    return "\n".join(f"| `--{flag} {gate.metavar}` | {gate.help} |" for flag, (_, _, gate) in gates().items())


#: A line of a docs page that the hook replaces with a list rendered from its one source.
MARKERS = {
    "<!-- diag: metric names -->": metric_names_table,
    "<!-- diag: check gates -->": gate_rows,
}


def on_config(config: Any, **kwargs: Any) -> Any:
    """Append the verb pages to the nav's "Verbs" section (mkdocs calls this before it reads docs/)."""
    pages = verb_pages(README.read_text(encoding="utf-8"))
    for section in config["nav"]:
        if isinstance(section, dict) and SECTION in section:
            section[SECTION] = [*section[SECTION], *pages]
    return config


def render(markdown: str, uri: str) -> str:
    """A page's markdown with its marker lines replaced, and the verb table after the verbs' index.

    Example:
        >>> render("<!-- diag: check gates -->", "verbs/check.md").splitlines()[1]
        "| `--min-cosine C` | fail when an output's min per-sample cosine < C |"
    """
    lines = [MARKERS[line.strip()]() if line.strip() in MARKERS else line for line in markdown.split("\n")]
    markdown = "\n".join(lines)
    if uri == INDEX:
        markdown = markdown.rstrip("\n") + "\n\n" + verbs_table(README.read_text(encoding="utf-8"))
    return markdown


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Render the page's lists (:func:`render`)."""
    return render(markdown, page.file.src_uri)
