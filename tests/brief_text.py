"""The lines under the verdict read back from each rendering: the terminal's output, summary.md and
report.html, as (depth, plain text) pairs, so a test can assert that all three say the same
(issue 42 item 6: one wording, :mod:`diag.report.brief`, three renderings)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

#: A Markdown code span as :func:`diag.report.view.md_code` writes it: `x`, or `` x`y `` around backticks.
_CODE = re.compile(r"(`+)(.+?)\1")


def terminal_brief(stdout: str) -> list[tuple[int, str]]:
    """The lines `diag compare` printed between the verdict (and its fix) and the files it wrote."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("verdict: ")) + 1
    if start < len(lines) and lines[start].startswith("  fix: "):
        start += 1
    out = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        body = line[2:]
        depth = (len(body) - len(body.lstrip(" "))) // 2
        out.append((depth, body.strip(" ")))
    return out


def _plain_markdown(text: str) -> str:
    """A Markdown line as text: code spans unwrapped, backslash escapes undone outside them."""
    out, last = [], 0
    for m in _CODE.finditer(text):
        out.append(re.sub(r"\\(.)", r"\1", text[last : m.start()]))
        body = m.group(2)
        out.append(body[1:-1] if len(m.group(1)) > 1 else body)
        last = m.end()
    out.append(re.sub(r"\\(.)", r"\1", text[last:]))
    return "".join(out)


def summary_brief(markdown: str) -> list[tuple[int, str]]:
    """The bullet list summary.md puts under its headline (the first list of the file)."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("- ")), len(lines))
    out = []
    for line in lines[start:]:
        if not line.strip():
            continue
        m = re.match(r"( *)- (.*)$", line)
        if m is None:
            break
        out.append((len(m.group(1)) // 2, _plain_markdown(m.group(2))))
    return out


class _BriefParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.inside, self.in_item, self.items = False, False, []  # type: ignore[var-annotated]

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        a = dict(attrs)
        if tag == "details" and a.get("id") == "brief":
            self.inside = True
        elif self.inside and tag == "li":
            self.in_item = True
            self.items.append([1 if a.get("class") == "detail" else 0, ""])

    def handle_endtag(self, tag):  # type: ignore[no-untyped-def]
        if tag == "details":
            self.inside = False
        elif tag == "li":
            self.in_item = False

    def handle_data(self, data):  # type: ignore[no-untyped-def]
        if self.inside and self.in_item:
            self.items[-1][1] += data


def report_brief(html: str) -> list[tuple[int, str]]:
    """The items of report.html's ``#brief`` list."""
    parser = _BriefParser()
    parser.feed(html)
    return [(depth, text) for depth, text in parser.items]
