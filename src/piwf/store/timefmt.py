"""Timestamps in receipts: ISO 8601 UTC with milliseconds."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
