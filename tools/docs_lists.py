"""mkdocs hook: the manual's verb pages and its list of verbs, read from README.md's verb table.

The verbs are listed once by hand, in README.md's table (``diag.cli.VERBS`` is the code's list;
``tests/test_readme.py`` checks the two agree). The manual's "Verbs" section in ``mkdocs.yml`` names
only its index page; this hook appends one page per verb in the table's order (the order
``tests/test_readme.py`` runs their examples in) and renders the table on ``docs/verbs/index.md``,
so a new verb is a README row and its page, never a nav entry or a second list to keep in step.

Registered in ``mkdocs.yml`` (``hooks:``); stdlib only, so the tests import it without mkdocs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def on_config(config: Any, **kwargs: Any) -> Any:
    """Append the verb pages to the nav's "Verbs" section (mkdocs calls this before it reads docs/)."""
    pages = verb_pages(README.read_text(encoding="utf-8"))
    for section in config["nav"]:
        if isinstance(section, dict) and SECTION in section:
            section[SECTION] = [*section[SECTION], *pages]
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Render the README's verb table at the end of ``docs/verbs/index.md``."""
    if page.file.src_uri != INDEX:
        return markdown
    return markdown.rstrip("\n") + "\n\n" + verbs_table(README.read_text(encoding="utf-8"))
