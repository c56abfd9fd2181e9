"""Group commit at `full` durability: nothing is answered before its commit is durable."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from piwf import faults
from piwf.client import AsyncClient
from piwf.errors import HostUnavailable
from piwf.faults import FAULT_EXIT_STATUS
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import HostProcess, config, wait_for
from .test_lifecycle import call


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    faults.configure({})


async def _connectable(paths: StatePaths) -> bool:
    try:
        async with AsyncClient(paths):
            return True
    except (HostUnavailable, OSError):
        return False


@pytest.mark.parametrize("point", ["host.group.syncing", "host.group.synced"])
async def test_a_host_dying_before_or_after_the_fsync_has_answered_nothing_of_its_group(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, point: str
) -> None:
    dying = host_process(env={"PIWF_FAULT": f"{point}:exit"})
    with open(dying.log, "ab") as log:  # not HostProcess.start: its host.status would reach the point first
        dying.proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root)], stdout=log, stderr=log,
            start_new_session=True, env=dying.env)
    await wait_for(lambda: _connectable(paths))
    start = {"workflow": "greet", "projectPath": str(project)}
    async with AsyncClient(paths, client_id="tester") as client:
        with pytest.raises(HostUnavailable, match="closed the connection"):  # no answer, at all
            await client.call("run.start", payload=start, request_id="start-1")
    assert await dying.wait() == FAULT_EXIT_STATUS

    # The commit itself was made (a process exit loses nothing the kernel holds), so the
    # retry is answered from the command log; the run then goes on as any other.
    await host_process().start()
    async with AsyncClient(paths, client_id="tester") as client:
        retried = await client.call("run.start", payload=start, request_id="start-1")
    assert retried.outcome == "adopted", retried
    done = await call(paths, "run.wait", run_id=retried.receipt["runId"], payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done


def _trace_between(trace: list[str], first: str, then: str) -> list[list[str]]:
    """The points reached between each ``first`` and the next ``then``."""
    spans, opened = [], None
    for name in trace:
        if name == first:
            opened = []
        elif name == then and opened is not None:
            spans.append(opened)
            opened = None
        elif opened is not None:
            opened.append(name)
    return spans


async def test_every_worker_answer_waits_for_an_fsync_after_its_commit(
    paths: StatePaths, project: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    trace = tmp_path / "trace"
    faults.configure({"PIWF_FAULT_TRACE": str(trace)})
    host = await nursery.start(Host(config(paths, durability="full")).serve)
    run_id = (await call(paths, "run.start", payload={"workflow": "greet", "projectPath": str(project)}))["runId"]
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    host.stop_requested.set()
    spans = _trace_between(trace.read_text().split(), "host.worker.committed", "host.worker.answered")
    assert len(spans) >= 3  # ready, then an attempt start and an accept per node (two nodes)
    for span in spans:  # every one of these messages wrote something: an fsync began and ended in between
        assert "host.group.syncing" in span and "host.group.synced" in span[span.index("host.group.syncing"):], span
    assert host.store.fsyncs >= 1


async def test_at_normal_durability_nothing_waits_for_an_fsync(
    paths: StatePaths, project: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    trace = tmp_path / "trace"
    faults.configure({"PIWF_FAULT_TRACE": str(trace)})
    host = await nursery.start(Host(config(paths, durability="normal")).serve)
    run_id = (await call(paths, "run.start", payload={"workflow": "greet", "projectPath": str(project)}))["runId"]
    assert (await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000}))["status"] == "completed"
    host.stop_requested.set()
    reached = set(trace.read_text().split())
    assert "host.worker.answered" in reached
    assert not {"host.group.syncing", "host.group.synced"} & reached



def test_the_wal_is_synced_through_one_descriptor_kept_until_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piwf.store.sqlite import Database

    db = Database.open(tmp_path / "state.db", durability="full")
    db.defer_sync()
    with db.write():
        db.execute("INSERT INTO blobs (hash, content, created_at) VALUES ('a', x'00', 0)")
    wal = Path(f"{tmp_path / 'state.db'}-wal")
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    db.sync_wal()
    opened_once = wal.stat().st_ino
    wal.rename(tmp_path / "moved-wal")  # the path now names nothing: the kept descriptor still names SQLite's WAL
    with db.write():
        db.execute("INSERT INTO blobs (hash, content, created_at) VALUES ('b', x'00', 0)")
    db.sync_wal()
    assert synced == [opened_once, opened_once]
    kept = db._wal_fd
    assert kept is not None
    (tmp_path / "moved-wal").rename(wal)
    db.close()
    with contextlib.suppress(FileNotFoundError):  # closed, or since reused for another file
        assert os.readlink(f"/proc/self/fd/{kept}") != str(wal)


async def test_commits_made_during_an_fsync_share_the_next_one_and_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from piwf.store.sqlite import Database
    from piwf.store.sqlite.group import GroupCommit

    db = Database.open(tmp_path / "state.db", durability="full")
    group = GroupCommit(db)
    in_sync = threading.Semaphore(0)  # released as each fsync begins
    releases = [threading.Event(), threading.Event()]  # each fsync is held until its own is set
    synced: list[int] = []
    real_sync = Database.sync_wal

    def held_sync(self: Database) -> None:
        in_sync.release()
        releases[len(synced)].wait()
        real_sync(self)
        synced.append(self.written())

    monkeypatch.setattr(Database, "sync_wal", held_sync)
    answered: list[str] = []

    def commit(name: str) -> None:
        with db.write():
            db.execute("INSERT INTO blobs (hash, content, created_at) VALUES (?, x'00', 0)", (name,))

    async def answer(name: str) -> None:
        commit(name)
        await group.durable()
        answered.append(name)

    async def settle() -> None:  # the loop idle, every thread but a held fsync done
        await trio.testing.wait_all_tasks_blocked()
        await trio.to_thread.run_sync(lambda: None)
        await trio.testing.wait_all_tasks_blocked()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(group.serve)
            nursery.start_soon(answer, "a")
            await trio.to_thread.run_sync(in_sync.acquire)  # the first fsync is under way, covering "a" only
            nursery.start_soon(answer, "b")
            nursery.start_soon(answer, "c")
            await settle()
            assert answered == []  # "a" waits for its fsync, "b" and "c" for the one after it
            releases[0].set()
            await trio.to_thread.run_sync(in_sync.acquire)  # the second fsync has begun, held
            while not answered:
                await settle()
            assert answered == ["a"], answered  # "a" did not wait for the fsync of "b" and "c"
            releases[1].set()
            while len(answered) < 3:
                await settle()
            nursery.cancel_scope.cancel()
    assert sorted(answered[1:]) == ["b", "c"], answered
    assert (group.fsyncs, len(synced)) == (2, 2), (group.fsyncs, synced)  # "b" and "c" shared the second fsync
    monkeypatch.undo()  # closing syncs the WAL once more, unheld
    db.close()
