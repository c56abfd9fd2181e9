"""Rules every backend applies the same way, and that the host may check before it writes."""

from __future__ import annotations

from typing import Any

from piwf.errors import Rejected
from piwf.protocol.resources import MAX_KEY_BYTES, MAX_SPEC_BYTES
from piwf.wire import canonical_json, sha256_hex

RETENTION_MS = 7 * 24 * 3600 * 1000  # logged commands, and what was delivered for ended runs
STEPS_PAGE_BYTES = 8 * 1024 * 1024  # accepted outputs sent to a worker in one answer, at most
# Blobs (content-addressed, shared): storing one that exists refreshes its created_at once it
# is older than BLOB_TOUCH_MS; retention deletes an unused blob only once it is older than
# BLOB_GRACE_MS (more than the touch interval), so a blob being stored again is never deleted.
BLOB_TOUCH_MS = 10 * 60 * 1000
BLOB_GRACE_MS = 3 * BLOB_TOUCH_MS


def input_hash(value: Any) -> str:
    """A run input's hash, as a worker's launch arguments carry it."""
    return "sha256:" + sha256_hex(canonical_json(value))


def stored_input_hash(inline: str | None, digest: str | None) -> str:
    """``input_hash`` of a run input as stored (``Blobs.put_json``: its canonical JSON
    inline, or the hash of that JSON kept as a blob), without reading or decoding it."""
    if inline is not None:
        return "sha256:" + sha256_hex(inline.encode())
    return input_hash(None) if digest is None else "sha256:" + digest


def check_json_size(value: Any, what: str) -> bytes:
    """A controller resource's spec or status as canonical JSON; Rejected over 1 MiB."""
    data = canonical_json(value)
    if len(data) > MAX_SPEC_BYTES:
        raise Rejected(f"{what} is {len(data)} bytes as JSON, over the {MAX_SPEC_BYTES}-byte limit")
    return data


def check_key(key: str) -> None:
    """Keys are printed by the CLI and used by controllers as names: non-empty printable
    text (``str.isprintable``: no newlines, control or format characters). Rejected otherwise."""
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise Rejected(f"key must be non-empty text of at most {MAX_KEY_BYTES} bytes")
    if not key.isprintable():
        bad = next(c for c in key if not c.isprintable())
        raise Rejected(f"key must be printable text: it contains {bad!a}")
