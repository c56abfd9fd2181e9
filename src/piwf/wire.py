"""Messages and NDJSON framing shared by host, worker and client: the bottom layer.

The framing itself (line limits, ``LineBuffer``, ``check_nesting``, ``Outcome``) is
``piwf.framing``, standard library only, re-exported here; this module adds the msgspec
Structs and codecs. It imports nothing of piwf but ``piwf.framing`` and the error
hierarchy (``piwf.errors``, which imports nothing at all). Reading a request line into
its operation's Struct is the protocol's (``piwf.protocol.read_request``).
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

import msgspec

from piwf.errors import ProtocolError
from piwf.framing import (  # re-exported: the framing is part of the wire format
    HOST_REQUEST, HOST_RESPONSE, MAX_ID_BYTES, MAX_LINE, MAX_NESTING, OUTCOMES, LineBuffer, Outcome, check_nesting,
)

T = TypeVar("T")

__all__ = ["HOST_REQUEST", "HOST_RESPONSE", "MAX_ID_BYTES", "MAX_LINE", "MAX_NESTING", "OUTCOMES", "HostRequest",
           "HostResponse", "LineBuffer", "Outcome", "canonical_json", "check_id", "check_nesting", "decode_as",
           "decode_json", "decode_with", "encode_line", "encode_reply", "readable_request_id", "request_fingerprint",
           "sha256_hex"]

_encoder = msgspec.json.Encoder(order="sorted")
_reply_encoder = msgspec.json.Encoder()  # fields in their Struct's order, dicts' keys as they are
_json_decoder = msgspec.json.Decoder()


class HostRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Any request, its payload untyped: what clients build, and how the host reads a
    request whose operation it does not know."""

    schema: str
    requestId: str
    clientId: str
    idempotencyKey: str
    operation: str
    runId: str | None = None
    expectedRevision: int | None = None
    payload: dict[str, Any] = {}


class HostResponse(msgspec.Struct, omit_defaults=True):
    requestId: str
    outcome: Outcome
    # A factory, not a plain default: omit_defaults leaves out fields equal to a plain
    # default, and every reply must say its schema (tests/test_hostile_small.py checks it).
    schema: str = msgspec.field(default_factory=lambda: HOST_RESPONSE)
    revision: int | None = None
    receipt: Any = None
    error: str | None = None


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no spaces. Used for hashes and fingerprints."""
    return _encoder.encode(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_line(message: Any) -> bytes:
    return _encoder.encode(message) + b"\n"


def encode_reply(response: HostResponse) -> bytes:
    """A host reply's line. Its keys are not sorted (docs/protocol.md): nothing hashes or
    compares a reply's bytes, and sorting them was half of encoding a ``run.status`` reply."""
    return _reply_encoder.encode(response) + b"\n"


def decode_json(line: bytes) -> Any:
    check_nesting(line)
    try:
        return _json_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"line is not valid JSON: {exc}") from exc


def request_fingerprint(request: msgspec.Struct) -> bytes:
    """Everything but ``requestId``: a retry under a new id with the same body matches.
    A typed request's payload has its defaults filled in, so leaving out a field and
    sending its default are the same body."""
    return hashlib.sha256(canonical_json(msgspec.structs.replace(request, requestId=""))).digest()


def check_id(value: str, field: str) -> None:
    """Ids are printed by the CLI and written to logs: printable characters only
    (``str.isprintable``: no control characters, so no terminal escapes; no format
    characters such as bidirectional overrides; no separators but the ASCII space)."""
    if not value or len(value.encode()) > MAX_ID_BYTES:
        raise ProtocolError(f"{field} must be non-empty text of at most {MAX_ID_BYTES} bytes")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ProtocolError(f"{field} must be printable text: it contains {bad!a}")


def readable_request_id(obj: Any) -> str | None:
    """The request id of a decoded frame, if one can be read at all."""
    if isinstance(obj, dict):
        value = obj.get("requestId")
        if isinstance(value, str) and 0 < len(value.encode()) <= MAX_ID_BYTES:
            return value  # echoed as JSON, where a control character is escaped
    return None


def decode_as(line: bytes, kind: type[T], what: str) -> T:
    """Decode one line into ``kind``; a ProtocolError naming ``what`` otherwise."""
    return decode_with(msgspec.json.Decoder(kind), line, what)


def decode_with(decoder: msgspec.json.Decoder[T], line: bytes, what: str) -> T:
    """Decode one line with a decoder built once, nesting bounded; a ProtocolError naming
    ``what`` otherwise."""
    check_nesting(line)
    try:
        return decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"unreadable {what}: {exc}") from exc
