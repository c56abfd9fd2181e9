"""A database damaged inside is refused at start after an unclean stop, before anything
is written (issue 14, item 10)."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import apsw
import pytest
import trio

from piwf.errors import CorruptStateError
from piwf.paths import StatePaths
from piwf.store.sql import queue, runs
from piwf.store.sqlite import Database
from piwf.store.sqlite.hosts import open_state
from piwf.store.sqlite.schema import SCHEMA_VERSION

from .conftest import HostProcess, piwf

DAMAGE = b"\xde\xad\xbe\xef" * 64  # 256 bytes over a b-tree page's header and first cells


def seed_ended_runs(path: Path, count: int = 300) -> None:
    """Runs that have ended, with their events: a database of many pages, nothing left to do."""
    db = Database.open(path)
    for i in range(count):
        run_id, token = f"r{i:04}", f"t{i}"
        runs.create_run(db, run_id=run_id, workflow="greet", project_path="/nowhere", source=b"s", digest="d",
                        input={"i": i, "pad": "x" * 200}, origin_session_id=None, now=i)
        queue.claim_run(db, run_id, runner_id="seed", token=token, lease_ms=1000, now=i, epoch=0)
        queue.complete_run(db, run_id, token, {"ok": i}, i)
    db.close()


def pages_in_wal(path: Path) -> set[int]:
    """Page numbers the write-ahead log holds a copy of (those copies hide the file's own)."""
    wal = Path(f"{path}-wal")
    data = wal.read_bytes() if wal.exists() else b""
    if len(data) < 32:
        return set()
    page_size, offset, pages = int.from_bytes(data[8:12], "big"), 32, set()
    while offset + 24 + page_size <= len(data):
        pages.add(int.from_bytes(data[offset:offset + 4], "big"))
        offset += 24 + page_size
    return pages


def damage_a_page(path: Path, table: str) -> int:
    """Overwrite the start of a leaf page of ``table`` from the middle of its pages, one
    that is not page 1 and has no newer copy in the WAL. Returns the page number."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchall()[0][0]
        leaves = [p for (p,) in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY pageno", (table,))]
    finally:
        conn.close()
    candidates = [p for p in leaves if p != 1 and p not in pages_in_wal(path)]
    assert len(candidates) > 2, (leaves, pages_in_wal(path))
    page = candidates[len(candidates) // 2]
    with open(path, "r+b") as handle:
        handle.seek((page - 1) * page_size)
        handle.write(DAMAGE)
    return page


def fingerprint(path: Path) -> dict[str, str]:
    """Hashes of the database and its WAL (the -shm is an index SQLite rebuilds on open)."""
    files = [path, Path(f"{path}-wal")]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.exists()}


async def test_a_damaged_page_after_an_unclean_stop_is_refused_and_nothing_is_written(
    host_process: Callable[..., HostProcess], paths: StatePaths
) -> None:
    paths.ensure()
    seed_ended_runs(paths.db)
    killed = await host_process().start()
    killed.signal(signal.SIGKILL)  # the lease row still names it
    await killed.wait()
    damage_a_page(paths.db, "run_events")
    before = fingerprint(paths.db)

    with trio.fail_after(15):  # before the fix the host served on (and was killed here)
        serve = await piwf(paths, "serve", check=False)
    assert serve.returncode == 3, serve.stderr.decode()
    lines = serve.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and "quick_check" in lines[0], lines
    assert fingerprint(paths.db) == before
    # status reads the lease and the counts, not every page: it cannot tell (by design, see
    # operations.md), and it must not write either.
    assert (await piwf(paths, "status", check=False)).returncode == 0
    assert fingerprint(paths.db) == before


def test_a_clean_database_after_an_unclean_stop_opens(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    seed_ended_runs(path, count=20)
    db = Database.open(path)
    db.execute("UPDATE host_lease SET host_id = 'gone', pid = 1, expires_at = 0")
    db.close()
    open_state(path, durability="full").close()


def test_a_damaged_database_of_an_older_layout_is_refused_before_its_migration(tmp_path: Path) -> None:
    """The check comes before the migration, which would write."""
    path = tmp_path / "state.db"
    seed_ended_runs(path)
    db = Database.open(path)
    db.execute("UPDATE host_lease SET host_id = 'gone', pid = 1, expires_at = 0")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    db.close()
    damage_a_page(path, "run_events")
    before = fingerprint(path)
    with pytest.raises(CorruptStateError, match="damaged"):
        open_state(path, durability="full")
    assert fingerprint(path) == before
    assert os.path.getsize(path) > 0
