"""Descendants die with their run: shell process groups are registered and reaped.

Also the zombie worker: a worker stopped while its claim moved on has every write refused.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import trio

from piwf.engine.definition import shell
from piwf.engine.executor import Context, run_shell
from piwf.paths import StatePaths
from piwf.store.sql import queue, runs
from piwf.store.sqlite import Database

from .conftest import HostProcess, config, wait_for, write_workflow
from .test_engine import RecordingJournal
from .test_lifecycle import _running_worker, _shell_group, call, group_members, run_status, start


async def test_a_timed_out_shell_node_takes_its_whole_group_with_it(tmp_path: Path) -> None:
    journal = RecordingJournal()
    pids: list[int] = []
    journal.process_started = lambda node, pid: pids.append(pid)  # type: ignore[method-assign]
    ctx = Context("r", "n", "a", None, {}, str(tmp_path), journal)
    node = shell(["sh", "-c", "sleep 300 & sleep 300"], timeout=0.5)
    try:
        run_shell(node, ctx)
    except TimeoutError as exc:
        assert "timed out after 0.5 s" in str(exc)
    else:
        raise AssertionError("the node should have timed out")
    assert pids
    await wait_for(lambda: not group_members(pids[0]))  # SIGKILLed; gone once the kernel gets to it


async def test_a_shell_node_leaves_nothing_behind_in_its_group(tmp_path: Path) -> None:
    journal = RecordingJournal()
    pids: list[int] = []
    journal.process_started = lambda node, pid: pids.append(pid)  # type: ignore[method-assign]
    ctx = Context("r", "n", "a", None, {}, str(tmp_path), journal)
    output = run_shell(shell(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo started"]), ctx)
    assert output["stdout"] == "started\n"
    await wait_for(lambda: not group_members(pids[0]))


def test_a_missing_program_is_a_clear_node_error(tmp_path: Path) -> None:
    ctx = Context("r", "n", "a", None, {}, str(tmp_path), RecordingJournal())
    try:
        run_shell(shell(["no-such-program-piwf"]), ctx)
    except OSError as exc:
        assert str(exc) == "cannot run no-such-program-piwf: not found or not executable"
    else:
        raise AssertionError("expected OSError")


async def test_a_killed_worker_takes_its_shell_group_with_it(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    await host_process().start()
    run_id = await start(paths, project, "sleepy")
    worker_pid, shell_pid = await _worker_and_shell(paths, run_id)
    os.kill(worker_pid, signal.SIGKILL)
    await wait_for(lambda: not group_members(shell_pid))
    run = await wait_for(lambda: _has_second_worker(paths, run_id))
    assert run["workers"][0]["status"] == "crashed"


async def test_the_next_host_reaps_shell_groups_left_by_a_killed_host_and_worker(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    first = await host_process().start()
    run_id = await start(paths, project, "sleepy")
    worker_pid, shell_pid = await _worker_and_shell(paths, run_id)
    # Freeze the host so it cannot reap, kill the worker so it cannot either, then kill the host.
    first.signal(signal.SIGSTOP)
    os.kill(worker_pid, signal.SIGKILL)
    first.signal(signal.SIGKILL)
    await first.wait()
    assert len(group_members(shell_pid)) >= 3  # orphaned: sh and its two sleeps
    await host_process().start()
    await wait_for(lambda: not group_members(shell_pid))
    run = await wait_for(lambda: _has_second_worker(paths, run_id))
    assert run["workers"][0]["status"] == "orphaned"


async def _worker_and_shell(paths: StatePaths, run_id: str) -> tuple[int, int]:
    running = await wait_for(lambda: _running_worker(paths, run_id))
    worker_pid = running["workers"][0]["pid"]
    shell_pid = await wait_for(lambda: _shell_group(worker_pid))
    await wait_for(lambda: len(group_members(shell_pid)) >= 3)
    return worker_pid, shell_pid


async def _has_second_worker(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if len(run["workers"]) >= 2 else None


WAITER = """
    import time
    from pathlib import Path
    from piwf import Workflow, compute

    def wait_for_go(ctx):
        go = Path(ctx.input["go"])
        while not go.exists():
            time.sleep(0.01)
        return {"went": True}

    workflow = Workflow(name="waiter", start_at="wait", nodes={"wait": compute(wait_for_go)})
"""


async def test_a_zombie_worker_has_every_write_refused(
    paths: StatePaths, project: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A worker frozen (SIGSTOP) while its claim passed to another owner wakes up to
    ``claimLost``: its accepted output is refused, it exits, and nothing it did is kept."""
    from piwf.host.host import Host

    write_workflow(project, "waiter", WAITER)
    go = tmp_path / "go"
    # Renewal every 200 s: only the worker's own write can discover the lost claim.
    host = await nursery.start(Host(config(paths, run_lease_ms=600_000)).serve)
    receipt = await call(paths, "run.start", payload={"workflow": "waiter", "projectPath": str(project),
                                                      "input": {"go": str(go)}})
    run_id = receipt["runId"]
    running = await wait_for(lambda: _running_worker(paths, run_id))
    await wait_for(lambda: _attempt_started(paths, run_id))
    worker = psutil.Process(running["workers"][0]["pid"])
    worker.suspend()
    thief = Database.open(paths.db)
    try:  # what another owner does once the frozen worker's claim has expired
        thief.execute("UPDATE run_queue SET claim_expires_at = 0 WHERE run_id = ?", (run_id,))
        stolen = queue.claim_run(thief, run_id, runner_id="thief", token="thief-token", lease_ms=600_000,
                                 now=host.now(), epoch=host.epoch)
        assert stolen is not None
        go.touch()
        worker.resume()
        record = await wait_for(lambda: _finished_worker(paths, run_id))
        # Only the refusal of its write can say claimLost here (renewal is 200 s away). The
        # worker got that answer and ended on its own: no signal was needed.
        assert record["status"] == "claimLost"
        assert (record["exitCode"], record["signal"]) == (0, None), record
        await wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE)
        assert runs.accepted_steps(thief, run_id) == ([], False)
        assert thief.one("SELECT claim_token, generation FROM run_queue WHERE run_id = ?", (run_id,)) == (
            "thief-token", stolen.generation)
        assert [s.status for s in runs.get_run(thief, run_id).steps] == ["interrupted"]
    finally:
        thief.close()
        host.stop_requested.set()


async def _attempt_started(paths: StatePaths, run_id: str) -> bool:
    return bool((await run_status(paths, run_id))["steps"])


async def _finished_worker(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    worker = (await run_status(paths, run_id))["workers"][0]
    return worker if worker["status"] not in ("starting", "running") else None


async def test_a_host_that_lost_its_lease_stops_without_touching_the_runs_it_no_longer_owns(
    paths: StatePaths, project: Path
) -> None:
    from piwf.host.host import Host
    from piwf.store.sqlite.hosts import acquire_lease

    host_config = config(paths, host_lease_ms=300)  # the heartbeat looks every 100 ms
    async with trio.open_nursery() as nursery:
        host = await nursery.start(Host(host_config).serve)
        run_id = await start(paths, project, "sleepy")
        running = await wait_for(lambda: _running_worker(paths, run_id))
        worker_pid = running["workers"][0]["pid"]
        shell_pid = await wait_for(lambda: _shell_group(worker_pid))
        usurper = Database.open(paths.db)
        try:  # another host proved this one dead (wrongly) and took the state with its run
            lease = acquire_lease(usurper, host_id="usurper", pid=1, identity="u", lease_ms=600_000,
                                  now=host.now(), owner_dead=True)
            queue.expire_claims_before(usurper, lease.epoch, host.now())
            taken = queue.claim_run(usurper, run_id, runner_id="usurper", token="usurper-token",
                                    lease_ms=600_000, now=host.now(), epoch=lease.epoch)
            assert taken is not None
        finally:
            usurper.close()
        with trio.fail_after(20):
            await host.stop_requested.wait()  # the host stops itself
    after = Database.open(paths.db)
    try:
        row = after.one("SELECT status, claim_token, runner_id, generation FROM run_queue WHERE run_id = ?",
                        (run_id,))
        assert row == ("starting", "usurper-token", "usurper", taken.generation)  # untouched
        assert after.scalar("SELECT host_id FROM host_lease") == "usurper"
    finally:
        after.close()
    await wait_for(lambda: not group_members(worker_pid) and not group_members(shell_pid))
