"""The host protocol against an in-process host with real workers and real SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from piwf.client import AsyncClient, make_request
from piwf.host.state import HostState
from piwf.paths import StatePaths
from piwf.wire import MAX_LINE, encode_line


def start_payload(project: Path, workflow: str = "greet", **extra: object) -> dict:
    return {"workflow": workflow, "projectPath": str(project), **extra}


async def test_run_start_and_wait_completes(client: AsyncClient, project: Path) -> None:
    started = await client.call("run.start", payload=start_payload(project))
    assert started.outcome == "accepted", started.error
    run_id = started.receipt["runId"]
    done = await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done.receipt["status"] == "completed" and done.receipt["atRest"]
    assert done.receipt["output"] == {"text": "HELLO\n"}


async def test_client_chosen_run_id_is_kept(client: AsyncClient, project: Path) -> None:
    started = await client.call("run.start", run_id="mine-1", payload=start_payload(project))
    assert started.receipt["runId"] == "mine-1"
    taken = await client.call("run.start", run_id="mine-1", payload=start_payload(project))
    assert taken.outcome == "rejected" and "already taken" in taken.error


async def test_repeated_request_id_is_adopted_with_the_stored_receipt(client: AsyncClient, project: Path) -> None:
    request = make_request("run.start", client_id="c1", payload=start_payload(project), request_id="req-1")
    first = await client.send(request)
    again = await client.send(request)
    assert (first.outcome, again.outcome) == ("accepted", "adopted")
    assert again.receipt == first.receipt
    listed = await client.call("run.list")
    assert [r["runId"] for r in listed.receipt] == [first.receipt["runId"]]


async def test_retry_under_a_new_request_id_with_the_same_key_is_adopted(client: AsyncClient, project: Path) -> None:
    body = {"client_id": "c1", "payload": start_payload(project), "idempotency_key": "k"}
    first = await client.send(make_request("run.start", request_id="a", **body))
    retry = await client.send(make_request("run.start", request_id="b", **body))
    assert retry.outcome == "adopted" and retry.receipt == first.receipt and retry.requestId == "b"


async def test_a_retry_whose_workflow_has_gone_is_answered_from_the_log(client: AsyncClient, project: Path) -> None:
    # A write is prepared before the unit of work that looks its request up: a retry whose
    # prepare no longer passes is still answered from what was recorded, not refused.
    request = make_request("run.start", client_id="c1", payload=start_payload(project), request_id="req-1")
    first = await client.send(request)
    for source in (project / ".piwf" / "workflows").glob("greet*"):
        source.unlink()
    again = await client.send(request)
    assert (first.outcome, again.outcome, again.receipt) == ("accepted", "adopted", first.receipt)
    reused = await client.send(make_request("run.start", client_id="c1", request_id="req-1",
                                            payload=start_payload(project, "ghost")))
    assert reused.outcome == "conflict"
    new = await client.send(make_request("run.start", client_id="c1", request_id="req-2",
                                         payload=start_payload(project)))
    assert new.outcome == "rejected" and "no workflow 'greet'" in new.error


async def test_reused_ids_with_another_body_are_conflicts(client: AsyncClient, project: Path) -> None:
    await client.send(make_request("run.start", client_id="c1", request_id="a", idempotency_key="k",
                                   payload=start_payload(project)))
    same_id = await client.send(make_request("run.start", client_id="c1", request_id="a", idempotency_key="k",
                                             payload=start_payload(project, input={"x": 1})))
    same_key = await client.send(make_request("run.start", client_id="c1", request_id="b", idempotency_key="k",
                                              payload=start_payload(project, input={"x": 1})))
    assert (same_id.outcome, same_key.outcome) == ("conflict", "conflict")
    assert len((await client.call("run.list")).receipt) == 1


async def test_unknown_workflow_is_rejected_and_queues_nothing(client: AsyncClient, project: Path) -> None:
    response = await client.call("run.start", payload=start_payload(project, "ghost"))
    assert response.outcome == "rejected" and "no workflow 'ghost'" in response.error
    assert "\n" not in response.error
    assert (await client.call("run.list")).receipt == []


async def test_bad_run_start_payloads_are_rejected(client: AsyncClient, project: Path) -> None:
    cases = [
        ({"projectPath": str(project)}, "missing required field `workflow` - at `$.payload`"),
        ({"workflow": "greet", "projectPath": "relative/path"}, "absolute path"),
        ({"workflow": "greet", "projectPath": str(project / "nowhere")}, "not a directory"),
        ({**start_payload(project), "colour": "blue"}, "unknown field `colour` - at `$.payload`"),
        ({**start_payload(project), "definitionDigest": "sha256:0"}, "changed"),
    ]
    for payload, message in cases:
        response = await client.call("run.start", payload=payload)
        assert response.outcome == "rejected" and message in response.error, (payload, response)
    assert (await client.call("run.list")).receipt == []


async def test_malformed_lines_get_clear_refusals_and_the_host_keeps_serving(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    async with AsyncClient(paths) as bystander:
        async with AsyncClient(paths) as bad:
            reply = json.loads(await bad.send_line(b"this is not json\n"))
            assert reply["outcome"] == "rejected" and "not valid JSON" in reply["error"]
        async with AsyncClient(paths) as bad:
            unknown = await bad.call("run.explode")
            assert unknown.outcome == "rejected" and "unknown operation 'run.explode'" in unknown.error
            missing = json.loads(await bad.send_line(b'{"requestId": "x1", "schema": "piwf.host-request.v1"}\n'))
            assert missing["requestId"] == "x1" and "missing required field" in missing["error"]
            no_run = await bad.call("run.status")
            assert no_run.outcome == "rejected" and "missing required field `runId`" in no_run.error
            unknown_run = await bad.call("run.status", run_id="ghost")
            assert unknown_run.outcome == "notFound"
            still = await bad.call("host.status")  # the connection survived every refusal above
            assert still.outcome == "accepted"
        async with AsyncClient(paths) as bad:
            reply = json.loads(await bad.send_line(b"x" * (MAX_LINE + 10) + b"\n"))
            assert reply["outcome"] == "rejected" and "exceeds" in reply["error"]
        status = await bystander.call("host.status")
        assert status.outcome == "accepted" and status.receipt["lifecycleContradictions"] == 0


async def test_a_client_streaming_without_newline_is_cut_off_at_the_limit(
    host: HostState, paths: StatePaths
) -> None:
    stream = await trio.open_unix_socket(str(paths.socket))
    sent, cut_off = 0, False
    async with stream:
        with trio.fail_after(20):
            try:
                while sent <= MAX_LINE * 8:
                    await stream.send_all(b"y" * 65536)
                    sent += 65536
                # Everything was sent: the host must have closed the connection on us.
                cut_off = b"exceeds" in await stream.receive_some(65536)
            except trio.BrokenResourceError:
                cut_off = True  # the host closed while we were still streaming
    assert cut_off and sent <= MAX_LINE * 8
    async with AsyncClient(paths) as other:
        assert (await other.call("host.status")).outcome == "accepted"


async def test_host_status_reports_counts(client: AsyncClient) -> None:
    status = (await client.call("host.status")).receipt
    assert status["state"] == "running" and status["socketAvailable"]
    for key in ("queuedRuns", "runningRuns", "parkedRuns", "expiredClaims", "lifecycleContradictions", "epoch"):
        assert key in status


async def test_read_only_operations_are_not_logged(client: AsyncClient, host: HostState) -> None:
    for _ in range(3):
        await client.send(make_request("host.status", client_id="c", request_id="same"))
    assert host.store.db.scalar("SELECT COUNT(*) FROM host_commands") == 0


async def test_a_failing_node_fails_the_run_with_its_error(client: AsyncClient, project: Path) -> None:
    run_id = (await client.call("run.start", payload=start_payload(project, "boom"))).receipt["runId"]
    run = (await client.call("run.wait", run_id=run_id)).receipt
    assert run["status"] == "failed" and run["queueStatus"] == "failed"
    assert run["error"]["type"] == "ValueError"
    assert run["error"]["message"] == "node explode: the fuse was lit"
    assert "raise ValueError" in run["error"]["traceback"]


async def test_protocol_lines_are_answered_in_order(client: AsyncClient) -> None:
    requests = [make_request("run.status", client_id="c", run_id=f"r{i}") for i in range(5)]
    await client._stream.send_all(b"".join(encode_line(r) for r in requests))
    replies = [json.loads(await client.read_line()) for _ in requests]
    assert [r["requestId"] for r in replies] == [r.requestId for r in requests]


async def test_a_stale_expected_revision_is_a_conflict_and_changes_nothing(client: AsyncClient, project: Path) -> None:
    run_id = (await client.call("run.start", payload=start_payload(project, "sleepy"))).receipt["runId"]
    current = (await client.call("run.status", run_id=run_id)).receipt["revision"]
    stale = await client.call("run.cancel", run_id=run_id, expected_revision=current + 5)
    # the worker may move the run on meanwhile: the conflict names the stale revision, not always ``current``
    assert stale.outcome == "conflict" and f"not {current + 5}" in stale.error
    assert (await client.call("run.status", run_id=run_id)).receipt["status"] != "cancelled"
    assert (await client.call("run.cancel", run_id=run_id)).outcome == "accepted"


async def test_one_active_run_per_origin_session(client: AsyncClient, project: Path) -> None:
    first = await client.call("run.start", payload=start_payload(project, "sleepy", originSessionId="s1"))
    second = await client.call("run.start", payload=start_payload(project, "greet", originSessionId="s1"))
    assert second.outcome == "rejected" and "already has an active run" in second.error
    other = await client.call("run.start", payload=start_payload(project, "greet", originSessionId="s2"))
    assert other.outcome == "accepted"
    await client.call("run.cancel", run_id=first.receipt["runId"])
    again = await client.call("run.start", payload=start_payload(project, "greet", originSessionId="s1"))
    assert again.outcome == "accepted"


async def test_run_wait_returns_at_its_timeout_when_the_run_is_busy(client: AsyncClient, project: Path) -> None:
    run_id = (await client.call("run.start", payload=start_payload(project, "sleepy"))).receipt["runId"]
    busy = await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 50})
    assert busy.outcome == "accepted" and not busy.receipt["atRest"]
    await client.call("run.cancel", run_id=run_id)
    assert (await client.call("run.wait", run_id=run_id)).receipt["atRest"]
