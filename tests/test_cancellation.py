"""What a stop records, not only what it stops: every cancellation path of the core.

Each test names the path: a run cancelled, a claim lost, the host's scope cancelled by its
parent, a drain whose cleanup cannot finish, a start cancelled half-way, a host out of
descriptors, and signals that must never reach a reaped worker's recycled pid.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf import processes
from piwf.client import AsyncClient
from piwf.host.run_lane import RunLane
from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths
from piwf.store.sqlite import Database

from .conftest import HostProcess, config, pg_store_url, wait_for
from .test_launcher import templates
from .test_lifecycle import _running_worker, call, run_status, start


def _worker_rows(paths: StatePaths, run_id: str) -> list[tuple[Any, ...]]:
    db = Database.open_readonly(paths.db)
    try:
        return db.execute("SELECT status, exit_code, signal, diagnostic FROM run_workers WHERE run_id = ?",
                          (run_id,)).fetchall()
    finally:
        db.close()


async def _ended_worker(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    worker = (await run_status(paths, run_id))["workers"][-1]
    return worker if worker["status"] not in ("starting", "running") else None


async def test_a_cancelled_runs_worker_is_recorded_with_its_exit(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    await nursery.start(Host(config(paths)).serve)
    run_id = await start(paths, project, "sleepy")
    await wait_for(lambda: _running_worker(paths, run_id))
    await call(paths, "run.cancel", run_id=run_id)
    worker = await wait_for(lambda: _ended_worker(paths, run_id))
    assert worker["status"] == "cancelled"
    assert worker["signal"] == signal.SIGTERM and worker["exitCode"] is None, worker


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> str | None:
    """The in-process host's store: the state directory's SQLite, or a fresh PostgreSQL schema."""
    return None if request.param == "sqlite" else pg_store_url(request.getfixturevalue("postgres"))


async def test_a_cancel_between_a_claims_commit_and_the_host_taking_it_up_takes_effect(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, store_url: str | None,
) -> None:
    """run.cancel lands after the claim committed and before the dispatcher registers the
    run as active (on PostgreSQL the claim's commit returns from a thread: other tasks run
    in between): it is accepted, and the run's worker is stopped before it starts."""
    answers: list[Any] = []
    claim = RunLane.claim

    async def claim_then_cancel(self: RunLane, room: int) -> list[Any]:
        claimed = await claim(self, room)
        for active in claimed:  # committed, not yet in host.active: the window
            async with AsyncClient(paths) as client:
                answers.append(await client.call("run.cancel", run_id=active.claim.run_id))
        return claimed

    monkeypatch.setattr(RunLane, "claim", claim_then_cancel)
    await nursery.start(Host(config(paths, store_url=store_url)).serve)
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: answers)
    assert answers[0].outcome == "accepted", answers[0]
    worker = await wait_for(lambda: _ended_worker(paths, run_id))
    assert worker["status"] == "cancelled" and worker["pid"] is None, worker  # stopped before it started
    run = await run_status(paths, run_id)
    assert (run["status"], run["queueStatus"]) == ("cancelled", "cancelled")
    assert not (project / "once.log").exists()  # its first node never ran


async def test_a_host_cancelled_by_its_parent_records_its_workers_as_stopped_not_crashed(
    paths: StatePaths, project: Path
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(Host(config(paths)).serve)
        run_id = await start(paths, project, "sleepy")
        await wait_for(lambda: _running_worker(paths, run_id))
        nursery.cancel_scope.cancel()  # the normal trio way to stop a task: no stop request
    [(status, exit_code, sig, _)] = _worker_rows(paths, run_id)
    assert status == "stopped" and (exit_code, sig) == (None, signal.SIGTERM)
    db = Database.open_readonly(paths.db)
    try:
        assert db.one("SELECT status, hold FROM run_queue WHERE run_id = ?", (run_id,)) == ("parked", None)
    finally:
        db.close()


async def test_a_drain_ends_by_its_deadline_even_when_a_worker_cannot_be_reaped(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    """The fork server (which reaps workers) is frozen: the drain gives up at its deadline,
    records what it could, and the host exits."""
    host = await host_process("--drain-timeout", "2").start()
    run_id = await start(paths, project, "sleepy")
    running = await wait_for(lambda: _running_worker(paths, run_id))
    template = _parent_of(running["workers"][0]["pid"])
    os.kill(template, signal.SIGSTOP)
    try:
        host.signal(signal.SIGTERM)
        with trio.fail_after(8):  # 2 s of drain, then the template is killed; before: over 15 s
            assert await host.proc.wait() == 0
    finally:
        with pytest.raises(ProcessLookupError):  # the host killed it on its way out
            os.kill(template, signal.SIGCONT)
    [(status, exit_code, sig, diagnostic)] = _worker_rows(paths, run_id)
    assert status == "stopped" and (exit_code, sig) == (None, None)
    assert "not reaped before the cleanup deadline" in diagnostic


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_runs_cancelled_while_their_workers_start_leak_no_descriptors(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    host: HostState = await nursery.start(Host(config(paths, max_workers=10)).serve)
    [template] = await wait_for(lambda: templates(os.getpid()))  # its start is not awaited by the host's
    os.kill(template, signal.SIGSTOP)  # every start now waits for the fork server's reply
    try:
        async with AsyncClient(paths) as client:
            before = _open_fds()
            run_ids = [await start(paths, project, "greet") for _ in range(10)]
            await wait_for(lambda: len(host.active) == 10)
            for run_id in run_ids:
                assert (await client.call("run.cancel", run_id=run_id)).outcome == "accepted"
            await wait_for(lambda: not host.active)
            assert _open_fds() - before < 4, "pipes of cancelled starts were left open"  # before: +40
    finally:
        os.kill(template, signal.SIGCONT)
    host.stop_requested.set()


async def test_a_host_out_of_descriptors_keeps_serving_and_answers_when_they_free_up(
    host_process: Callable[..., HostProcess], paths: StatePaths
) -> None:
    host = host_process()
    # The same host under a 64-descriptor limit; 80 idle clients exhaust it.
    host_args = ["-c", "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
                       "sys.argv = ['piwf', *sys.argv[1:]]; runpy.run_module('piwf', run_name='__main__')"]
    await _start_wrapped(host, host_args)
    clients = []
    try:
        for _ in range(80):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(paths.socket))
            clients.append(sock)
        await wait_for(lambda: "cannot accept connections" in host.log.read_text())
        assert host.proc is not None and host.proc.returncode is None
    finally:
        for sock in clients:
            sock.close()
    with trio.fail_after(20):
        assert (await call(paths, "host.status"))["state"] == "running"


async def _start_wrapped(host: HostProcess, python_args: list[str]) -> None:
    with open(host.log, "ab") as log:
        host.proc = await trio.lowlevel.open_process(
            [sys.executable, *python_args, "serve", "--state-dir", str(host.paths.root)],
            stdout=log, stderr=log, start_new_session=True, env=host.env,
        )
    await wait_for(host.answers, timeout=20)


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_a_worker_group_is_never_signalled_after_its_leader_was_reaped(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A reaped leader's pid may name another process at any moment: every group signal the
    host sends must find the leader still there (alive, or a zombie not yet reaped)."""
    sent: list[tuple[int, int, bool]] = []
    killpg = os.killpg

    def recording_killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig, os.path.exists(f"/proc/{pgid}")))
        killpg(pgid, sig)

    monkeypatch.setattr(processes.os, "killpg", recording_killpg)
    host = await nursery.start(Host(config(paths, worker_start=mode)).serve)
    done = await start(paths, project, "greet")
    assert (await call(paths, "run.wait", run_id=done))["status"] == "completed"
    cancelled = await start(paths, project, "sleepy")
    await wait_for(lambda: _running_worker(paths, cancelled))
    await call(paths, "run.cancel", run_id=cancelled)
    await wait_for(lambda: not host.active)
    assert sent, "the host signalled no worker group"
    assert all(leader_present for _, _, leader_present in sent), sent
    host.stop_requested.set()
