"""What the PostgreSQL store sends for a call: the statements (each a round trip to the
server) of the calls a run makes most, and when a unit of work begins its transaction.
The statements are counted on a real server, as they leave PgDatabase._run (execute, one
and scalar all send through it)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

from piwf.clock import ManualClock
from piwf.store.api import open_store
from piwf.store.postgres.backend import PgStore
from piwf.errors import StoreError
from piwf.store.postgres.db import PgDatabase, Session
from piwf.client import make_request

from .conftest import pg_store_url


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The statements the store sends, in order (observed, not replaced); a transaction's
    BEGIN before its first statement (sent with it: PgDatabase.begin); COMMIT and
    ROLLBACK, sent by PgDatabase.finish itself, are not among them."""
    statements: list[str] = []
    run = PgDatabase._run

    def counted(self: PgDatabase, sql: str, params: Any) -> Any:
        if self._begin is not None:
            statements.append(self._begin.decode())
        statements.append(" ".join(sql.split())[:60])
        return run(self, sql, params)

    monkeypatch.setattr(PgDatabase, "_run", counted)
    yield statements


@pytest.fixture
async def store(postgres: Any, tmp_path: Path) -> Any:
    opened = open_store(tmp_path, url=pg_store_url(postgres, f"calls_{secrets.token_hex(4)}"), listen=False)
    yield opened
    await opened.close()


async def create(store: Any, run_id: str, clock: ManualClock) -> None:
    await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input={},
                                origin_session_id=None, now=clock.now_ms())


async def test_a_runs_summary_is_one_statement(store: Any, sent: list[str]) -> None:
    clock = ManualClock()
    await create(store, "r1", clock)
    sent.clear()
    summary = await store.runs.run_summary("r1")
    assert (summary.runId, summary.status, summary.queueStatus) == ("r1", "queued", "queued")
    assert len(sent) == 1, sent  # one join: no snapshot's BEGIN and COMMIT around two reads


async def test_a_claim_reads_its_candidates_in_one_statement(store: Any, sent: list[str]) -> None:
    clock = ManualClock()
    await create(store, "r1", clock)
    sent.clear()
    nothing = await store.supervision.claim_runs(room=1, exclude=frozenset({"r1"}), runner_id="h", lease_ms=30_000,
                                                 now=clock.now_ms(), epoch=1)
    assert nothing == []
    assert len(sent) == 2 and sent[0] == "BEGIN" and sent[1].startswith("WITH v AS"), sent  # then COMMIT
    sent.clear()
    ((claim, _worker),) = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id="h",
                                                             lease_ms=30_000, now=clock.now_ms(), epoch=1)
    assert claim.run_id == "r1"
    assert sum(statement.startswith("WITH v AS") for statement in sent) == 1, sent


async def test_the_command_logs_lookup_outside_a_unit_of_work_sends_no_lock(store: Any, sent: list[str]) -> None:
    request = make_request("run.cancel", client_id="c", run_id="r1", request_id="q1")
    sent.clear()
    assert await store.commands.lookup(request, b"f") is None
    assert len(sent) == 1 and sent[0].startswith("SELECT request_id"), sent  # an xact lock would end at once
    sent.clear()
    async with store.transaction() as tx:
        assert await tx.commands.lookup(request, b"f") is None
    assert [s.split("(")[0] for s in sent[:3]] == ["BEGIN", *["SELECT pg_advisory_xact_lock"] * 2]


async def test_a_unit_of_work_begins_in_its_first_call_and_one_without_calls_sends_nothing(
        store: PgStore, sent: list[str]) -> None:
    requests = store.pool.get_stats().get("requests_num", 0)
    sent.clear()
    async with store.transaction():
        pass
    assert sent == [] and store.pool.get_stats().get("requests_num", 0) == requests  # no connection taken
    clock = ManualClock()
    with pytest.raises(RuntimeError, match="undone"):
        async with store.transaction() as tx:
            await create(tx, "r1", clock)
            unit = store.current.get()
            assert unit is not None and unit.db is not None
            assert unit.db.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            raise RuntimeError("undone")
    assert sent[0] == "BEGIN"
    with pytest.raises(Exception, match="not found"):
        await store.runs.run_summary("r1")  # the first call's write was inside the rolled-back transaction


async def test_a_transactions_begin_goes_with_its_first_statement_in_one_round_trip(
        store: PgStore, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    await create(store, "r1", clock)
    alone: list[bytes] = []
    pipelined: list[tuple[bytes | None, bool]] = []  # (its BEGIN, whether it prepared the statement)
    simple, pipeline = Session._simple, Session._pipelined

    def counted_simple(self: Session, statement: bytes) -> None:
        alone.append(statement)
        simple(self, statement)

    def counted_pipeline(self: Session, begin: bytes | None, prepare: Any, *args: Any) -> Any:
        pipelined.append((begin, prepare is not None))
        return pipeline(self, begin, prepare, *args)

    monkeypatch.setattr(Session, "_simple", counted_simple)
    monkeypatch.setattr(Session, "_pipelined", counted_pipeline)
    for _ in range(3):
        async with store.transaction() as tx:
            assert (await tx.runs.run_summary("r1")).status == "queued"
            unit = store.current.get()
            assert unit is not None and unit.db is not None
            assert unit.db.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    # each BEGIN went with the statement; a statement's first use on a connection prepared it on the way
    assert alone == [] and [begin for begin, _ in pipelined] == [b"BEGIN"] * 3, (alone, pipelined)
    assert sum(prepared for _, prepared in pipelined) <= 1, pipelined
    # A first statement that fails in its pipeline: the transaction is rolled back, the connection goes on.

    def failing() -> list[Any]:
        db = store.connection()
        try:
            outcomes = []
            for divisor in (1, 0, 2):  # the first prepares the statement; the second fails
                try:
                    with db.write():
                        outcomes.append(db.scalar("SELECT 6 / ?", (divisor,)))
                except StoreError as exc:
                    outcomes.append(type(exc).__name__)
                assert db.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            return outcomes
        finally:
            store.give_back(db)

    before = len(pipelined)
    assert await trio.to_thread.run_sync(failing) == [6, "StoreError", 3]
    assert pipelined[before:] == [(b"BEGIN", True), (b"BEGIN", False), (b"BEGIN", False)], pipelined
    assert alone == []


async def test_a_first_statement_refused_before_it_is_sent_leaves_its_transaction_to_begin(
        store: PgStore) -> None:
    """A value psycopg cannot send (a NUL in text) fails in the client, before the
    transaction's pipelined BEGIN went: what the unit writes after it is still inside the
    transaction, and goes with its rollback."""
    clock = ManualClock()
    await create(store, "r1", clock)

    def unit() -> list[Any]:
        db = store.connection()
        try:
            try:
                with db.write():
                    with pytest.raises(StoreError):
                        db.execute("SELECT ?::text", ("a\x00b",))
                    db.execute("UPDATE runs SET workflow = ? WHERE run_id = ?", ("changed", "r1"))
                    assert db.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
                    raise RuntimeError("roll it back")
            except RuntimeError:
                pass
            return [row[0] for row in db.execute("SELECT workflow FROM runs WHERE run_id = ?", ("r1",))]
        finally:
            store.give_back(db)

    assert await trio.to_thread.run_sync(unit) == ["w"]


async def test_a_call_cancelled_while_it_waits_in_its_thread_finishes_then_the_caller_is_cancelled(
        store: PgStore, postgres: Any, nursery: trio.Nursery) -> None:
    clock = ManualClock()
    holder = psycopg.connect(postgres.url(), autocommit=True)
    try:
        holding = PgDatabase(holder, "test", store.url.schema)
        holding.begin()
        holding.lock_key("run", "r1")  # create_run waits for it
        scope = trio.CancelScope()
        finished, returned = trio.Event(), trio.Event()

        async def caller() -> None:
            with scope:
                await create(store, "r1", clock)
                returned.set()
                await trio.lowlevel.checkpoint()  # the caller's next checkpoint: the cancellation
            finished.set()

        nursery.start_soon(caller)
        with trio.fail_after(30):
            while not holder.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                     "AND NOT granted").fetchone()[0]:
                await trio.sleep(0.01)  # until the call waits for the lock, in its thread
        scope.cancel()
        await trio.sleep(0.05)
        assert not finished.is_set()  # cancelled, it still waits: the call has started
        holding.finish(commit=True)
        with trio.fail_after(30):
            await finished.wait()
    finally:
        holder.close()
    assert returned.is_set() and scope.cancelled_caught  # the cancellation came once the call had returned
    assert (await store.runs.run_summary("r1")).status == "queued"  # and what it wrote is committed
