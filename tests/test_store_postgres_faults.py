"""Faults of a PostgreSQL server, with a real server: a connection lost during COMMIT (the
outcome unknown, the retry answered from the command log), the time limits that keep a
host from holding a lock forever, and a server restarted under a running host."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import trio

from piwf.clock import ManualClock
from piwf.client import AsyncClient, make_request
from piwf.errors import StorageUnavailable
from piwf.paths import StatePaths
from piwf.store.api import open_store
from piwf.store.postgres.backend import Limits
from piwf.store.postgres.db import Session
from piwf.wire import HostResponse, Outcome, request_fingerprint

from .conftest import HostProcess, pg_store_url, wait_for
from .postgres_server import CuttingProxy, Server
from .test_lifecycle import call


def server_socket(postgres: Any) -> Path:
    query = parse_qs(urlsplit(postgres.url()).query)
    return Path(query["host"][0]) / f".s.PGSQL.{query.get('port', ['5432'])[0]}"


async def opened(url: str, tmp_path: Path, name: str, **options: Any) -> Any:
    return await trio.to_thread.run_sync(
        lambda: open_store(tmp_path, url=url, directory=name, pool_size=2, listen=False, **options))


@pytest.fixture
async def store_pair(postgres: Any, tmp_path: Path) -> AsyncIterator[tuple[str, list[Any]]]:
    """A schema's URL, and the stores a test opened on it (closed at the end)."""
    stores: list[Any] = []
    yield pg_store_url(postgres), stores
    for store in stores:
        await store.close()


async def new_run(store: Any, clock: ManualClock, run_id: str) -> None:
    await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d",
                                input={}, origin_session_id=None, now=clock.now_ms())


async def test_a_commit_whose_answer_was_lost_is_unavailable_and_its_retry_adopted(
    postgres: Any, tmp_path: Path, store_pair: tuple[str, list[Any]],
) -> None:
    url, stores = store_pair
    proxy = CuttingProxy(server_socket(postgres), tmp_path)
    through = url.replace(postgres.url(), proxy.url()) if url.startswith(postgres.url()) else url
    store = await opened(through, tmp_path, "host")
    stores.append(store)
    clock = ManualClock()
    request = make_request("run.pause", client_id="c", run_id="r1", request_id="q1")
    fingerprint = request_fingerprint(request)
    answer = HostResponse(requestId="q1", outcome=Outcome.ACCEPTED, receipt={"runId": "r1"})
    proxy.armed.set()
    with pytest.raises(StorageUnavailable, match="lost during COMMIT: the change may or may not have been made"):
        async with store.transaction() as tx:
            assert await tx.commands.lookup(request, fingerprint) is None
            await new_run(tx, clock, "r1")
            await tx.commands.record(request, fingerprint, answer, 1, clock.now_ms())
    assert proxy.cuts == 1
    # The retry: the command log says it committed; it is answered from it, not carried out again.
    retried = await store.commands.lookup(request, fingerprint)
    assert retried is not None and retried.outcome == Outcome.ADOPTED and retried.receipt == {"runId": "r1"}
    assert [r.runId for r in await store.runs.list_runs()] == ["r1"]
    proxy.close()


async def test_a_connection_lost_after_a_pipelined_begin_and_statement_is_unavailable_not_a_hang(
    postgres: Any, tmp_path: Path, store_pair: tuple[str, list[Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transaction's BEGIN goes with its first statement (pipelined); the connection lost
    before their answers: StorageUnavailable (nothing was committed), not a wait for ever."""
    pipelined: list[tuple[bytes | None, bool]] = []  # (its BEGIN, whether it prepared the statement)
    pipeline = Session._pipelined

    def counted(self: Session, begin: bytes | None, prepare: Any, *args: Any) -> Any:
        pipelined.append((begin, prepare is not None))
        return pipeline(self, begin, prepare, *args)

    monkeypatch.setattr(Session, "_pipelined", counted)
    url, stores = store_pair
    proxy = CuttingProxy(server_socket(postgres), tmp_path)
    through = url.replace(postgres.url(), proxy.url()) if url.startswith(postgres.url()) else url
    store = await opened(through, tmp_path, "host")
    stores.append(store)

    def echo(db: Any, text: str) -> Any:
        with db.write():
            return db.scalar("SELECT ?::text", (text,))

    opening = len(pipelined)  # the store's own first statements, each prepared on the way
    assert await store.call(echo, "first") == "first"  # prepared now (its text holds no COMMIT)
    proxy.armed.set()  # the proxy cuts at the word in the statement's parameters (its Bind message)
    with trio.fail_after(30), pytest.raises(StorageUnavailable, match="unavailable"):
        await store.call(echo, "COMMIT")
    assert proxy.cuts == 1 and pipelined[opening:] == [(b"BEGIN", True), (b"BEGIN", False)], pipelined
    assert await store.call(echo, "again") == "again"  # on another connection of the pool
    proxy.close()


async def test_a_lock_held_past_the_lock_timeout_refuses_the_waiter_and_changes_nothing(
    tmp_path: Path, store_pair: tuple[str, list[Any]],
) -> None:
    url, stores = store_pair
    clock = ManualClock()
    a = await opened(url, tmp_path, "a")
    b = await opened(url, tmp_path, "b", limits=Limits(lock_ms=200))
    stores += [a, b]
    await new_run(a, clock, "r1")
    async with a.transaction() as tx:
        await tx.runs.check_revision("r1", 1)  # holds the run's row
        with pytest.raises(StorageUnavailable, match="lock timeout"):
            await b.runs.pause_run("r1", clock.now_ms())
    assert not (await a.runs.run_summary("r1")).paused


async def test_an_idle_open_transaction_is_ended_by_the_server_and_its_locks_freed(
    tmp_path: Path, store_pair: tuple[str, list[Any]],
) -> None:
    url, stores = store_pair
    clock = ManualClock()
    a = await opened(url, tmp_path, "a", limits=Limits(idle_in_transaction_ms=300))
    b = await opened(url, tmp_path, "b")
    stores += [a, b]
    await new_run(a, clock, "r1")
    with pytest.raises(StorageUnavailable):
        async with a.transaction() as tx:
            await tx.runs.check_revision("r1", 1)  # holds the run's row, then A stalls
            with trio.fail_after(10):  # B waits for the row until the server ends A's transaction
                await b.runs.pause_run("r1", clock.now_ms())
            await tx.runs.revision("r1")  # A's connection is gone: its unit of work fails
    assert (await b.runs.run_summary("r1")).paused


async def test_a_host_answers_unavailable_while_its_server_is_down_and_carries_on_after(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path,
) -> None:
    if not isinstance(postgres, Server):
        pytest.skip("restarts the server: needs the tests' own (not PIWF_TEST_STORE)")
    host = await host_process("--store", pg_store_url(postgres)).start()
    first = await call(paths, "run.start", payload={"workflow": "greet", "projectPath": str(project)})
    gated = await call(paths, "run.start", payload={"workflow": "gated", "projectPath": str(project)})
    await wait_for(lambda: (project / "wait.log").exists())  # its worker is in the middle of a node
    await trio.to_thread.run_sync(postgres.stop)
    try:
        async with AsyncClient(paths) as client:
            response = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
        assert response.outcome == "unavailable", response
    finally:
        await trio.to_thread.run_sync(postgres.start)

    async def started() -> bool:  # the pool's broken connections are replaced as they are used
        async with AsyncClient(paths) as client:
            again = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
        return again.outcome == "accepted"

    await wait_for(started, timeout=30, interval=0.2)
    done = await call(paths, "run.wait", run_id=first["runId"], payload={"timeoutMs": 20_000})
    assert done["status"] == "completed"
    (project / "gate").touch()  # the run that was running across the restart goes on
    done = await call(paths, "run.wait", run_id=gated["runId"], payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    assert (project / "once.log").read_text().splitlines() == [gated["runId"]]  # its accepted step not redone
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0
