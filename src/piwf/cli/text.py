"""Text from workflows and clients, made safe to print on a terminal."""

from __future__ import annotations

from typing import Any

SHOWN = 200  # characters of a value or an error shown in a listing (--json has it all)


def shown(text: Any, limit: int = SHOWN) -> str:
    """Text from a workflow or a client, safe on a terminal: control and format characters
    escaped (no escape sequences, no line breaks), cut to ``limit`` with a mark."""
    text = str(text)
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return safe if len(safe) <= limit else safe[:limit] + "…"
