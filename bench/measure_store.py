"""The store: a raw apsw claim loop (the limit) and piwf's fenced claim path, same schema."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from piwf.store.sql import queue, runs
from piwf.store.sqlite import Database

LEASE_MS = 30_000


def fresh_store(path: Path, durability: str, n: int) -> Database:
    """piwf's schema, indexes and pragmas, with ``n`` queued runs."""
    db = Database.open(path, durability=durability)
    with db.write():
        for i in range(n):
            runs.create_run(db, run_id=f"r{i:07d}", workflow="noop", project_path="/p", source=b"s",
                            digest="d", input={}, origin_session_id=None, now=i)
    return db


def raw_claims(path: Path, durability: str, n: int) -> dict[str, Any]:
    """The limit: the claim as bare SQL (select the oldest claimable run, take it), one
    transaction per claim, on the same tables, index and durability."""
    db = fresh_store(path, durability, n)
    conn = db.conn
    began = time.perf_counter()
    for i in range(n):
        conn.execute("BEGIN IMMEDIATE")
        (run_id,) = conn.execute(
            "SELECT run_id FROM run_queue INDEXED BY run_queue_ready WHERE status IN ('queued', 'parked') "
            "AND hold IS NULL ORDER BY created_at, run_id LIMIT 1").fetchone()
        conn.execute("UPDATE run_queue SET status = 'starting', claim_token = ?, claim_expires_at = ?, "
                     "generation = generation + 1 WHERE run_id = ?", (f"t{i}", i + LEASE_MS, run_id))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - began
    db.close()
    return {"per_s": n / elapsed, "n": n}


def store_claims(path: Path, durability: str, n: int) -> dict[str, Any]:
    """piwf's claim alone (claim_next_run: oldest ready run, fenced token, generation, event),
    one transaction per claim: the same work as the limit's loop, through the store."""
    db = fresh_store(path, durability, n)
    began = time.perf_counter()
    for i in range(n):
        assert queue.claim_next_run(db, runner_id="bench", token=f"t{i}", lease_ms=LEASE_MS, now=i + 1,
                                    epoch=1) is not None
    elapsed = time.perf_counter() - began
    db.close()
    return {"per_s": n / elapsed, "n": n}


def _one_run(db: Database, i: int) -> None:
    now = i + 1
    claim = queue.claim_next_run(db, runner_id="bench", token=f"t{i}", lease_ms=LEASE_MS, now=now, epoch=1)
    assert claim is not None
    queue.mark_running(db, claim.run_id, claim.token, now)
    queue.complete_run(db, claim.run_id, claim.token, {}, now)


def store_path(path: Path, durability: str, n: int, batch: int = 1) -> dict[str, Any]:
    """piwf's store: claim → mark running → complete, each fenced by the claim token.
    With ``batch`` 1 every transition is its own transaction (three per run); otherwise
    ``batch`` runs share one."""
    db = fresh_store(path, durability, n)
    began = time.perf_counter()
    done = 0
    while done < n:
        group = min(batch, n - done)
        with db.write() if batch > 1 else contextlib.nullcontext():
            for _ in range(group):
                _one_run(db, done)
                done += 1
    elapsed = time.perf_counter() - began
    assert db.scalar("SELECT count(*) FROM run_queue WHERE status = 'done'") == n
    db.close()
    return {"per_s": n / elapsed, "n": n, "batch": batch}
