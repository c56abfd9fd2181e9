"""Protocol parsing and framing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from piwf.client import make_request
from piwf.errors import ProtocolError
from piwf.protocol import read_request
from piwf.wire import LineBuffer, canonical_json, decode_json, readable_request_id, request_fingerprint

GOOD = {"schema": "piwf.host-request.v1", "requestId": "r1", "clientId": "c", "idempotencyKey": "k",
        "operation": "run.list", "payload": {}}


def parse_request(body: object) -> object:
    return read_request(canonical_json(body))


def test_a_good_request_parses() -> None:
    request = parse_request(GOOD)
    assert (request.requestId, request.operation, request.runId) == ("r1", "run.list", None)


@pytest.mark.parametrize(("change", "message"), [
    ({"schema": "other"}, "unknown schema"),
    ({"requestId": ""}, "requestId must be non-empty"),
    ({"clientId": "x" * 257}, "clientId must be non-empty"),
    ({"expectedRevision": "3"}, "Expected `int | null`"),
    ({"surprise": 1}, "unknown field"),
])
def test_bad_requests_are_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_request({**GOOD, **change})


def test_a_missing_field_is_named() -> None:
    body = dict(GOOD)
    del body["operation"]
    with pytest.raises(ProtocolError, match="missing required field `operation`"):
        parse_request(body)


def test_a_refused_request_carries_its_id_when_one_can_be_read() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_request({**GOOD, "surprise": 1})
    assert caught.value.request_id == "r1"
    with pytest.raises(ProtocolError) as caught:
        parse_request({**GOOD, "requestId": "x" * 300})
    assert caught.value.request_id is None
    with pytest.raises(ProtocolError) as caught:
        read_request(b"{not json")
    assert caught.value.request_id is None


def test_request_id_is_readable_from_a_bad_frame() -> None:
    assert readable_request_id({"requestId": "abc", "junk": True}) == "abc"
    assert readable_request_id([1, 2]) is None
    assert readable_request_id({"requestId": 7}) is None


def test_non_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode_json(b"{nope")


def test_fingerprint_ignores_only_the_request_id() -> None:
    a = make_request("run.pause", client_id="c", run_id="r", request_id="1", idempotency_key="k")
    b = make_request("run.pause", client_id="c", run_id="r", request_id="2", idempotency_key="k")
    c = make_request("run.pause", client_id="c", run_id="s", request_id="1", idempotency_key="k")
    assert request_fingerprint(a) == request_fingerprint(b) != request_fingerprint(c)


def test_line_buffer_splits_and_enforces_the_limit_while_reading() -> None:
    buffer = LineBuffer(limit=10)
    assert buffer.feed(b"ab\ncd") == [b"ab"]
    assert buffer.feed(b"e\n") == [b"cde"]
    with pytest.raises(ProtocolError, match="exceeds"):
        buffer.feed(b"x" * 11)  # no newline yet: cut off before the line completes


@given(st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b), max_size=20), st.integers(1, 50))
def test_line_buffer_returns_exactly_the_lines_fed_in_any_chunking(lines: list[bytes], size: int) -> None:
    data = b"".join(line + b"\n" for line in lines)
    buffer = LineBuffer(limit=100)
    out: list[bytes] = []
    for start in range(0, len(data), size):
        out.extend(buffer.feed(data[start:start + size]))
    assert out == lines and buffer.pending == 0
