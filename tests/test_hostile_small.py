"""The smaller hostile inputs of issue 14 (item 12): ids that are not printable, storage
I/O errors, the reply schema, run.events paging, a host.sock that is not a socket, and
run.wait answering before the worker's end is recorded."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio

from piwf.client import AsyncClient, make_request
from piwf.errors import ExitCode, StorageUnavailable
from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths
from piwf.status import WorkerStatus
from piwf.store.sql import queue
from piwf.store.sqlite import Database
from piwf.wire import HOST_RESPONSE, encode_line

from .conftest import config, piwf, wait_for, write_workflow


def start_payload(project: Path, workflow: str = "greet", **extra: Any) -> dict[str, Any]:
    return {"workflow": workflow, "projectPath": str(project), **extra}


# --- (a) ids are printable ---------------------------------------------------------------------

UNPRINTABLE = ["\x1b[2J\x1b[31mred", "bell\x07", "two\nlines", "tab\tbed", "\u202eevil", "nbsp\xa0", "del\x7f"]


@pytest.mark.parametrize("value", UNPRINTABLE)
async def test_ids_that_are_not_printable_are_refused(client: AsyncClient, project: Path, value: str) -> None:
    requests = {
        "runId": make_request("run.start", client_id="c", run_id=value, payload=start_payload(project)),
        "clientId": make_request("run.start", client_id=value, payload=start_payload(project)),
        "idempotencyKey": make_request("run.start", client_id="c", idempotency_key=value,
                                       payload=start_payload(project)),
        "requestId": make_request("host.status", client_id="c", request_id=value),
        "payload.originSessionId": make_request("run.start", client_id="c",
                                                payload=start_payload(project, originSessionId=value)),
    }
    for field, request in requests.items():
        refused = await client.send(request)
        assert refused.outcome == "rejected", (field, refused)
        assert refused.error is not None and refused.error.startswith(f"{field} must be printable text")
        assert refused.error.isprintable(), refused.error  # the reason names the character escaped
    assert (await client.call("run.list")).receipt == []


async def test_printable_ids_of_any_script_are_accepted(client: AsyncClient, project: Path) -> None:
    started = await client.call("run.start", run_id="läuft 1 · 実行", payload=start_payload(project))
    assert started.outcome == "accepted" and started.receipt["runId"] == "läuft 1 · 実行"


async def test_the_cli_refuses_a_run_id_with_a_terminal_escape_in_one_printable_line(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    done = await piwf(paths, "run", "start", "greet", "--run-id", "\x1b]0;owned\x07x", "--project", str(project),
                      check=False)
    assert done.returncode == ExitCode.ERROR
    assert b"\x1b" not in done.stderr and done.stderr.decode().count("\n") == 1
    assert "runId must be printable text" in done.stderr.decode()


# --- (b) storage I/O errors are unavailable ----------------------------------------------------


class FlakyVFS(apsw.VFS):
    """The default VFS for new connections while registered: passes everything to the
    real one, except that writes fail with SQLITE_IOERR while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = False
        super().__init__("piwf-flaky", base="unix", makedefault=True)

    def xOpen(self, name: Any, flags: list[int]) -> apsw.VFSFile:  # apsw's name
        return FlakyFile(self, name, flags)


class FlakyFile(apsw.VFSFile):
    def __init__(self, vfs: FlakyVFS, name: Any, flags: list[int]) -> None:
        self.vfs = vfs
        super().__init__("unix", name, flags)

    def xWrite(self, data: bytes, offset: int) -> None:  # apsw's name
        if self.vfs.failing:
            raise apsw.IOError("injected write failure")
        super().xWrite(data, offset)


@pytest.fixture
def flaky_vfs() -> Iterator[FlakyVFS]:
    vfs = FlakyVFS()
    yield vfs
    vfs.failing = False
    apsw.set_default_vfs("unix")  # left registered: a connection may still be closing on it


def test_a_real_sqlite_io_error_is_storage_unavailable(flaky_vfs: FlakyVFS, tmp_path: Path) -> None:
    db = Database.open(tmp_path / "io.db")
    try:
        flaky_vfs.failing = True
        with pytest.raises(StorageUnavailable, match=r"storage error on .*injected write failure") as caught, \
                db.write():
            db.put_blob(os.urandom(200_000), 0)
        assert caught.value.outcome == "unavailable" and isinstance(caught.value.__cause__, apsw.IOError)
        flaky_vfs.failing = False
        with db.write():  # the connection is usable again once the storage is
            db.put_blob(b"after", 0)
    finally:
        db.close()


async def test_a_storage_io_error_answers_unavailable_and_a_retry_succeeds(
    flaky_vfs: FlakyVFS, paths: StatePaths, nursery: trio.Nursery, project: Path
) -> None:
    host = await nursery.start(Host(config(paths)).serve)
    request = make_request("run.start", client_id="c", payload=start_payload(project))
    async with AsyncClient(paths) as client:
        flaky_vfs.failing = True
        refused = await client.send(request)
        assert refused.outcome == "unavailable", refused
        assert refused.error is not None and "storage error" in refused.error
        assert (await client.call("host.status")).outcome == "accepted"  # reads still work
        flaky_vfs.failing = False
        accepted = await client.send(request)  # the same request, retried
        assert accepted.outcome == "accepted", accepted
        done = await client.call("run.wait", run_id=accepted.receipt["runId"], payload={"timeoutMs": 20_000})
        assert done.receipt["status"] == "completed"
    host.stop_requested.set()


# --- (c) every reply carries its schema --------------------------------------------------------


async def test_every_reply_carries_the_response_schema(client: AsyncClient, project: Path) -> None:
    start = encode_line(make_request("run.start", client_id="c", request_id="r1", payload=start_payload(project)))
    lines = [start, start, encode_line(make_request("run.status", client_id="c", run_id="ghost")),
             encode_line(make_request("run.cancel", client_id="c", run_id="ghost")),
             b'{"requestId": "bad", "schema": "piwf.host-request.v1"}\n']
    replies = [json.loads(await client.send_line(line)) for line in lines]
    assert [r["outcome"] for r in replies] == ["accepted", "adopted", "notFound", "notFound", "rejected"]
    assert all(r["schema"] == HOST_RESPONSE for r in replies), replies
    async with AsyncClient(client.paths) as other:
        unreadable = json.loads(await other.send_line(b"not json\n"))
    assert unreadable["schema"] == HOST_RESPONSE and unreadable["outcome"] == "rejected"


# --- (d) run.events is paged -------------------------------------------------------------------


async def test_run_events_are_paged_and_the_cli_fetches_every_page(
    client: AsyncClient, host: HostState, paths: StatePaths, project: Path
) -> None:
    run_id = (await client.call("run.start", payload=start_payload(project))).receipt["runId"]
    await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    with host.store.db.write():  # a long trace: more than one page of 1,000
        for n in range(2500):
            queue.add_event(host.store.db, run_id, "paused", {"reason": f"filler {n}"}, host.now())
    pages, after = [], 0
    while after is not None:
        page = (await client.call("run.events", run_id=run_id, payload={"after": after})).receipt
        assert len(page["events"]) <= 1000
        pages.append(page)
        after = page["nextAfter"]
    events = [e for page in pages for e in page["events"]]
    assert len(pages) == 3 and len(events) > 2500 and events[-1]["reason"] == "filler 2499"
    assert [p["nextAfter"] for p in pages[:-1]] == [pages[0]["events"][-1]["eventId"],
                                                   pages[1]["events"][-1]["eventId"]]
    ids = [e["eventId"] for e in events]
    assert ids == sorted(set(ids))
    small = (await client.call("run.events", run_id=run_id, payload={"limit": 2})).receipt
    assert small["events"] == events[:2] and small["nextAfter"] == ids[1]
    shown = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
    assert shown == events


async def test_a_run_events_limit_out_of_range_is_refused(client: AsyncClient, project: Path) -> None:
    for limit in (0, 1001):
        refused = await client.call("run.events", run_id="r", payload={"limit": limit})
        assert refused.outcome == "rejected" and "$.payload.limit" in refused.error


# --- (e) a host.sock that is not a socket ------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "file"])
async def test_serve_refuses_a_host_sock_that_is_not_a_socket_in_one_line(paths: StatePaths, kind: str) -> None:
    paths.ensure()
    if kind == "directory":
        paths.socket.mkdir()
    else:
        paths.socket.write_text("mine")
    with trio.fail_after(30):
        done = await piwf(paths, "serve", check=False)
    stderr = done.stderr.decode()
    assert done.returncode == ExitCode.STATE_DIR, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert f"{paths.socket} is {'a directory' if kind == 'directory' else 'not a socket'}" in stderr
    assert not paths.db.exists()  # refused before anything was written
    assert paths.socket.is_dir() if kind == "directory" else paths.socket.read_text() == "mine"


# --- (f) run.wait waits for the worker's end to be recorded ------------------------------------


@pytest.fixture
async def lingering_host(paths: StatePaths, project: Path, nursery: trio.Nursery) -> AsyncIterator[HostState]:
    """A host whose workers hang once their run has ended (after the second answer they
    read: `worker.ready`, then the one node's final `attempt.accept`)."""
    write_workflow(project, "single", """
        from piwf import Workflow, compute
        workflow = Workflow(name="single", start_at="one", nodes={"one": compute(lambda ctx: {"one": 1})})
    """)
    host = await nursery.start(Host(config(paths, worker_env={"PIWF_FAULT": "worker.answer.received:sleep:2"})).serve)
    yield host
    host.stop_requested.set()


async def test_run_wait_answers_only_once_the_workers_end_is_recorded_and_a_lingering_worker_is_stopped(
    lingering_host: HostState, paths: StatePaths, project: Path
) -> None:
    async with AsyncClient(paths) as client:
        run_id = (await client.call("run.start", payload=start_payload(project, "single"))).receipt["runId"]
        await wait_for(lambda: _status_of(client, run_id, "completed"))
        early = (await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 300})).receipt
        assert early["status"] == "completed" and early["workers"][0]["status"] == WorkerStatus.RUNNING
        assert not early["atRest"]  # its worker is still there: not at rest yet
        waiting = trio.Event()
        answer: list[dict[str, Any]] = []

        async def wait() -> None:
            async with AsyncClient(paths) as waiter:
                waiting.set()
                answer.append((await waiter.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})).receipt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await waiting.wait()  # the host stops the lingering worker after the kill grace
        done = answer[0]
        assert done["atRest"] and done["status"] == "completed"
        [worker] = done["workers"]
        # Told its part was done, it did not end: stopped, and counted as misbehaving.
        assert (worker["status"], worker["signal"]) == (WorkerStatus.CRASHED, signal.SIGTERM), worker


async def _status_of(client: AsyncClient, run_id: str, status: str) -> bool:
    return (await client.call("run.status", run_id=run_id)).receipt["status"] == status

