"""NDJSON framing with the standard library alone: line limits, the line splitter, the
nesting bound, the envelope's schema names and outcome words.

``piwf.wire`` (the msgspec Structs of every message) builds on it and re-exports it;
``piwf.client``'s blocking client uses it directly, so a one-shot command (``piwf
status``, ``piwf run show``) loads no msgspec. It imports nothing of piwf but
``piwf.errors``.
"""

from __future__ import annotations

import enum
import re

from piwf.errors import ProtocolError

MAX_LINE = 1024 * 1024
MAX_ID_BYTES = 256
MAX_NESTING = 100  # JSON deeper than this is refused wherever a frame is decoded

HOST_REQUEST = "piwf.host-request.v1"
HOST_RESPONSE = "piwf.host-response.v1"


class Outcome(enum.StrEnum):
    """How the host answered a request (docs/protocol.md, "Outcomes")."""

    ACCEPTED = "accepted"
    ADOPTED = "adopted"
    REJECTED = "rejected"
    CONFLICT = "conflict"
    NOT_FOUND = "notFound"
    CLAIM_LOST = "claimLost"
    UNAVAILABLE = "unavailable"


OUTCOMES = tuple(outcome.value for outcome in Outcome)

_STRING = rb'"(?:[^"\\]|\\.)*"'  # compiled on first use (re caches it): nearly no frame needs it
_BRACKETS = bytes.maketrans(b"", b"")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def check_nesting(data: bytes, limit: int = MAX_NESTING) -> None:
    """Refuse JSON nested deeper than ``limit`` before any decoder recurses into it.

    A frame with fewer opening brackets than the limit cannot be too deep, which is nearly
    every frame, and costs two ``count`` calls; others are measured with strings removed.
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    depth = 0
    for bracket in re.sub(_STRING, b"", data).translate(_BRACKETS, _NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        if depth > limit:
            raise ProtocolError(f"JSON nested deeper than {limit} levels")


class LineBuffer:
    """Splits a byte stream into lines, refusing any line longer than ``limit``.

    The limit is enforced while reading: a peer streaming bytes without a newline is cut
    off once it passes the limit, not after it has filled memory.
    """

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        lines: list[bytes] = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            if len(line) > self.limit:
                raise ProtocolError(f"line exceeds the {self.limit}-byte limit")
            lines.append(line)
        if len(self._buffer) > self.limit:
            raise ProtocolError(f"line exceeds the {self.limit}-byte limit")
        return lines

    @property
    def pending(self) -> int:
        return len(self._buffer)
