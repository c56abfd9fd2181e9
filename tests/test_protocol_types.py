"""The typed host protocol: requests refused by their Structs with the field named, receipts
whose JSON is the documented one, and docs/protocol.md generated from the same Structs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgspec
import pytest

from piwf.client import AsyncClient, make_request
from piwf.host.operations import READS, WRITES
from piwf.protocol import OPERATIONS, REQUEST_TYPES, RunEvent, StartRun
from piwf.protocol.doc import DOC_BEGIN, DOC_END, reference, with_reference
from piwf.protocol import read_request
from piwf.wire import HOST_REQUEST, canonical_json, request_fingerprint

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_DOC = ROOT / "docs" / "protocol.md"


async def test_a_wrong_typed_run_start_field_is_refused_with_its_path(client: AsyncClient, project: Path) -> None:
    response = await client.call("run.start", payload={"workflow": 5, "projectPath": str(project)})
    assert response.outcome == "rejected"
    assert response.error == "bad request: Expected `str`, got `int` - at `$.payload.workflow`"
    assert (await client.call("run.list")).receipt == []


@pytest.mark.parametrize(("operation", "fields", "error"), [
    ("run.list", {"payload": {"limit": "ten"}}, "Expected `int`, got `str` - at `$.payload.limit`"),
    ("run.list", {"payload": {"limit": 0}}, "Expected `int` >= 1 - at `$.payload.limit`"),
    ("run.list", {"payload": {"status": ["running"]}}, "Expected `str | null`, got `array` - at `$.payload.status`"),
    ("run.events", {"runId": "r", "payload": {"after": -1}}, "Expected `int` >= 0 - at `$.payload.after`"),
    ("run.wait", {"runId": "r", "payload": {"timeoutMs": True}},
     "Expected `int`, got `bool` - at `$.payload.timeoutMs`"),
    ("run.wait", {"runId": "r", "payload": {"timeoutMs": 600_001}},
     "Expected `int` <= 600000 - at `$.payload.timeoutMs`"),
    ("effect.resolve", {"runId": "r", "payload": {"key": "k", "applied": "yes"}},
     "Expected `bool`, got `str` - at `$.payload.applied`"),
    ("effect.resolve", {"runId": "r", "payload": {"key": "", "applied": True}},
     "Expected `str` of length >= 1 - at `$.payload.key`"),
    ("run.status", {"runId": 7}, "Expected `str`, got `int` - at `$.runId`"),
    ("run.pause", {"runId": "r", "payload": {"now": True}}, "Object contains unknown field `now` - at `$.payload`"),
    ("run.cancel", {"runId": "r", "expectedRevision": "3"},
     "Expected `int | null`, got `str` - at `$.expectedRevision`"),
])
async def test_wrong_typed_fields_are_refused_with_their_path(
    client: AsyncClient, operation: str, fields: dict, error: str
) -> None:
    line = _request_line(operation, **fields)
    reply = msgspec.json.decode(await client.send_line(line))
    assert reply["outcome"] == "rejected" and reply["error"] == f"bad request: {error}"
    assert reply["requestId"] == "req-1"
    assert (await client.call("host.status")).outcome == "accepted"  # the connection stays open


async def test_the_unknown_operation_error_lists_every_operation(client: AsyncClient) -> None:
    response = await client.call("run.explode", run_id="r")
    assert response.outcome == "rejected" and response.requestId
    known = response.error.split("; known: ")[1]
    assert known.split(", ") == sorted(OPERATIONS)


def test_every_operation_has_one_handler_of_its_kind() -> None:
    assert set(READS) | set(WRITES) == set(REQUEST_TYPES) and not set(READS) & set(WRITES)
    assert set(READS) == {kind for kind in REQUEST_TYPES if kind.is_read}


def test_a_typed_requests_fingerprint_ignores_the_request_id_and_fills_in_defaults() -> None:
    def parse(request_id: str, payload: dict) -> StartRun:
        request = read_request(_request_line("run.start", requestId=request_id, payload=payload))
        assert isinstance(request, StartRun)
        return request

    sparse = parse("a", {"workflow": "w", "projectPath": "/p"})
    explicit = parse("b", {"workflow": "w", "projectPath": "/p", "input": {}, "originSessionId": None})
    other = parse("a", {"workflow": "w", "projectPath": "/p", "input": {"x": 1}})
    assert request_fingerprint(sparse) == request_fingerprint(explicit) != request_fingerprint(other)


async def test_receipts_carry_the_documented_fields(client: AsyncClient, project: Path) -> None:
    started = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
    run_id = started.receipt["runId"]
    done = await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert set(done.receipt) == SUMMARY | DETAIL | {"atRest"}
    assert set((await client.call("run.status", run_id=run_id)).receipt) == SUMMARY | DETAIL
    assert set((await client.call("run.list")).receipt[0]) == SUMMARY
    assert set(done.receipt["steps"][0]) == {"seq", "node", "status", "generation", "exit", "startedAt", "finishedAt",
                                             "settingsChange"}
    assert set(done.receipt["workers"][0]) == {"workerEpoch", "generation", "pid", "status", "exitCode", "signal",
                                               "diagnostic", "stopped"}
    page = (await client.call("run.events", run_id=run_id)).receipt
    assert set(page) == {"events", "nextAfter"} and page["nextAfter"] is None
    events = page["events"]
    assert events[0] == {"eventId": events[0]["eventId"], "at": events[0]["at"], "type": "created",
                         "workflow": "greet"}  # an event carries its own fields and no others


SUMMARY = {"runId", "workflow", "status", "queueStatus", "paused", "hold", "statusDetail", "revision",
           "originSessionId", "generation", "createdAt", "updatedAt", "finishedAt", "queue"}
DETAIL = {"projectPath", "definitionDigest", "input", "output", "error", "steps", "workers", "effects", "waitingFor",
          "updates", "placement"}


def test_every_event_field_written_is_a_run_event_field() -> None:
    """run.events builds a RunEvent from each stored event: a field it does not declare
    would make the run's trace unreadable."""
    written = set()
    for path in (ROOT / "src" / "piwf").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "add_event" and len(node.args) >= 4:
                written |= _literal_keys(node.args[3], path)
    assert written and written <= set(RunEvent.__struct_fields__), written - set(RunEvent.__struct_fields__)


def _literal_keys(node: ast.expr, path: Path) -> set[str]:
    if isinstance(node, ast.IfExp):
        return _literal_keys(node.body, path) | _literal_keys(node.orelse, path)
    assert isinstance(node, ast.Dict), f"{path}:{node.lineno}: an event's fields must be a dict literal"
    keys = {key.value for key in node.keys if isinstance(key, ast.Constant)}
    assert len(keys) == len(node.keys), f"{path}:{node.lineno}: an event's keys must be literal text"
    return keys


def test_the_protocol_reference_is_generated_from_the_structs() -> None:
    text = PROTOCOL_DOC.read_text()
    assert DOC_BEGIN in text and DOC_END in text
    assert with_reference(text) == text, "stale: run python -m piwf.protocol.doc --write docs/protocol.md"
    generated = reference()
    for operation in OPERATIONS:
        assert f"#### `{operation}` (" in generated


def test_every_operation_has_a_hand_written_section() -> None:
    prose = PROTOCOL_DOC.read_text().split(DOC_BEGIN)[0]
    sections = set(re.findall(r"^### `([\w.]+)`", prose, re.MULTILINE))
    assert sections == set(OPERATIONS)


def _request_line(operation: str, **fields: object) -> bytes:
    body = msgspec.structs.asdict(make_request(operation, client_id="c", request_id="req-1"))
    return canonical_json({**body, **fields, "schema": HOST_REQUEST}) + b"\n"


def test_a_payload_naming_one_resource_sends_its_address_first() -> None:
    from piwf.protocol.resources import (
        ApplyResourcePayload, DeleteResourcePayload, ResolveResourceEffectPayload, ResourcePayload,
    )
    address = {"projectPath": "/p", "controller": "c", "key": "k"}
    assert msgspec.json.encode(ResourcePayload(**address)) == b'{"projectPath":"/p","controller":"c","key":"k"}'
    assert msgspec.json.encode(ApplyResourcePayload(**address, spec={"a": 1}, expectedResourceVersion=2)) == (
        b'{"projectPath":"/p","controller":"c","key":"k","spec":{"a":1},"expectedResourceVersion":2}')
    assert msgspec.json.encode(DeleteResourcePayload(**address, force=True)) == (
        b'{"projectPath":"/p","controller":"c","key":"k","force":true}')
    assert msgspec.json.encode(ResolveResourceEffectPayload(**address, effectKey="e", applied=True, result=1)) == (
        b'{"projectPath":"/p","controller":"c","key":"k","effectKey":"e","applied":true,"result":1}')
