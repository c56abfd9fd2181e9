"""Text from a workflow or a client, made safe for a terminal: what every human view of
the CLI prints goes through ``terminal_text`` (``common._print``, the follower, ``watch``),
so no view, old or new, can hand a terminal an escape sequence a workflow wrote.

Line breaks are kept (views are lines; a traceback is several); every other character
that is not printable — C0 and C1 controls (ESC, BEL, CR, CSI), DEL, and Unicode format
characters such as right-to-left overrides — is shown as its Python escape (``\\x1b``),
so a person sees what was sent. ``--json`` output needs none of this: JSON escapes
control characters itself.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this module is on the CLI's path
if TYPE_CHECKING:
    from typing import Any

SHOWN = 200  # characters of a value or an error shown in a listing (--json has it all)

# Every character but the line break and printable ASCII: what may need escaping, found
# with one regex scan. Compiled on first use (re caches it): most text needs none, and
# compiling it costs a one-shot command a tenth of its start.
_UNSAFE = "[^\n" + "".join(re.escape(chr(c)) for c in range(0x20, 0x7F)) + "]"


def terminal_text(text: str) -> str:
    """``text`` with every non-printable character but ``\\n`` escaped."""
    if text.isprintable() or all(line.isprintable() for line in text.split("\n")):
        return text  # one pass in C per line when nothing needs escaping
    return re.sub(_UNSAFE, _escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return char if char.isprintable() else char.encode("unicode_escape").decode("ascii")


def shown(text: Any, limit: int = SHOWN) -> str:
    """Text from a workflow or a client for one line of a listing: ``terminal_text`` with
    line breaks escaped too, cut to ``limit`` with a mark."""
    safe = terminal_text(str(text)).replace("\n", "\\n")
    return safe if len(safe) <= limit else safe[:limit] + "…"
