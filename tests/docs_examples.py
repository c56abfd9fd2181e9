"""The docs' console examples, read from the pages and matched against what the commands print.

The convention (docs/contributing.md says it for writers): every ```console block of
README.md and docs/*.md is run, a page at a time, against a real host, in a project
directory of the page's own; ``$ `` lines are commands, the lines after one are what it
prints (stdout and stderr together). Ids and times are masked; a doc id stands for the id
printed where it first appears, and later commands use that id. ``...`` on a line of its
own stands for any lines, ``…`` inside a line for any text. HTML comments just before a
block direct the run (``<!-- example: ... -->``): ``file PATH`` writes the next block to
PATH in the project, ``skip REASON`` leaves the next console block out, and ``setup``
(a multi-line comment) runs its shell lines in the project before the next console block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# An id: a lowercase prefix and 8+ hex digits (run-…, req-…, sub-…, res-…, settings-…), or a
# bare 16+ hex digit id (a worker's).
ID = re.compile(r"(?<![\w-])(?:[a-z][a-z0-9]*-[0-9a-f]{8,}|[0-9a-f]{16,})(?![\w-])")
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)"
PROJECT = "/home/me/project"  # the project directory, as the pages show it
FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*example:\s*(\w+)\s*(.*?)\s*(-->)?\s*$")


class ExampleError(Exception):
    """A page's example is malformed, or what a command printed does not match it."""


@dataclass
class Command:
    line: int  # where in the page
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int
    setup: list[str]
    commands: list[Command]


@dataclass
class Page:
    path: Path
    files: dict[str, str]  # project path -> content (``example: file``)
    blocks: list[Block]
    skipped: list[tuple[int, str]]  # (line, reason)


def read_page(path: Path) -> Page:
    """The console blocks of one page, with the files and setup its directives name."""
    page = Page(path, {}, [], [])
    lines = path.read_text().splitlines()
    pending: dict[str, str] = {}
    setup: list[str] = []
    i = 0
    while i < len(lines):
        directive = DIRECTIVE.match(lines[i])
        fence = FENCE.match(lines[i])
        if directive:
            i = _directive(lines, i, directive, pending, setup)
        elif fence:
            body, end = _fenced(lines, i)
            _take(page, fence.group(1) or "text", i + 1, body, pending, setup)
            pending, setup = {}, ([] if fence.group(1) == "console" else setup)
            i = end
        elif lines[i].strip():
            pending = {}  # a directive applies to the block right after it
        i += 1
    return page


def _directive(lines: list[str], i: int, match: re.Match[str], pending: dict[str, str], setup: list[str]) -> int:
    kind, rest, closed = match.group(1), match.group(2), match.group(3)
    if kind == "setup":
        if closed:
            raise ExampleError(f"line {i + 1}: `example: setup` is a comment of several lines")
        i += 1
        while not lines[i].strip().startswith("-->"):
            if lines[i].strip():
                setup.append(lines[i])
            i += 1
        return i
    if not closed:
        raise ExampleError(f"line {i + 1}: `example: {kind}` is one line, ending in -->")
    if kind not in ("file", "skip") or not rest:
        raise ExampleError(f"line {i + 1}: unknown example directive {match.group(0)!r}")
    pending[kind] = rest
    return i


def _fenced(lines: list[str], start: int) -> tuple[list[str], int]:
    for end in range(start + 1, len(lines)):
        if lines[end].rstrip() == "```":
            return lines[start + 1:end], end
    raise ExampleError(f"line {start + 1}: code block never closed")


def _take(page: Page, language: str, line: int, body: list[str], pending: dict[str, str],
          setup: list[str]) -> None:
    if "file" in pending:
        page.files[pending["file"]] = "\n".join(body) + "\n"
    if language != "console":
        if any(text.startswith("$ ") for text in body):
            raise ExampleError(f"{page.path.name}:{line}: `$ ` prompts belong in a ```console block "
                               "(run by the test), not in ```" + language)
        return
    if "skip" in pending:
        page.skipped.append((line, pending["skip"]))
        return
    commands: list[Command] = []
    for offset, text in enumerate(body, start=line + 1):
        if text.startswith("$ "):
            commands.append(Command(offset, text[2:]))
        elif not commands:
            raise ExampleError(f"{page.path.name}:{offset}: a console block starts with `$ `")
        else:
            commands[-1].expected.append(text.rstrip())
    page.blocks.append(Block(line, list(setup), commands))


@dataclass
class Ids:
    """Doc ids bound to the ids the host made, as a page's commands print them."""

    bound: dict[str, str] = field(default_factory=dict)

    def substitute(self, command: str) -> str:
        return ID.sub(lambda m: self.bound.get(m.group(0), m.group(0)), command)

    def match(self, expected: list[str], actual: list[str]) -> None:
        """Bind ids as ``actual`` matches ``expected``; raise ExampleError when it does not."""
        found = _match(expected, [_pattern(line, self.bound) for line in expected], 0, actual, 0, {})
        if found is None:
            raise ExampleError("expected:\n" + "\n".join(expected) + "\ngot:\n" + "\n".join(actual))
        for doc_id, real in found.items():
            if real in self.bound.values() and self.bound.get(doc_id) != real:
                raise ExampleError(f"{real} is shown as two ids of the page ({doc_id} too)")
            self.bound[doc_id] = real


def _pattern(line: str, bound: dict[str, str]) -> tuple[re.Pattern[str], list[str]]:
    """A regex for one expected line, and the doc ids (not yet bound) its groups capture."""
    parts: list[str] = []
    captured: list[str] = []
    for token in re.split(rf"({ID.pattern}|{TIME}|…)", line):
        if not token:
            continue
        if token == "…":
            parts.append(".*?")
        elif re.fullmatch(TIME, token):
            parts.append(TIME)
        elif ID.fullmatch(token):
            if token in bound:
                parts.append(re.escape(bound[token]))
            else:
                prefix = token.rsplit("-", 1)[0] + "-" if "-" in token else ""
                parts.append(f"({re.escape(prefix)}[0-9a-f]+)")
                captured.append(token)
        else:
            parts.append(re.escape(token))
    return re.compile("".join(parts)), captured


def _match(expected: list[str], patterns: list[tuple[re.Pattern[str], list[str]]], i: int,
           actual: list[str], j: int, binding: dict[str, str]) -> dict[str, str] | None:
    """Match from expected line ``i`` and actual line ``j`` on; ``...`` takes any lines."""
    if i == len(expected):
        return binding if j == len(actual) else None
    if expected[i] == "...":
        for k in range(j, len(actual) + 1):
            found = _match(expected, patterns, i + 1, actual, k, binding)
            if found is not None:
                return found
        return None
    if j == len(actual):
        return None
    pattern, captured = patterns[i]
    got = pattern.fullmatch(actual[j])
    if got is None:
        return None
    new = dict(binding)
    for doc_id, real in zip(captured, got.groups(), strict=True):
        if new.setdefault(doc_id, real) != real:
            return None
    return _match(expected, patterns, i + 1, actual, j + 1, new)


def pages(root: Path) -> list[Path]:
    """The pages whose console examples are run: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
