"""The done-when points of the end-to-end issue, with real `piwf serve` processes."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from piwf.client import AsyncClient
from piwf.errors import StoreError
from piwf.paths import StatePaths
from piwf.store.sqlite import Database
from piwf.store.sql.runs import LIFECYCLE_CONTRADICTIONS

from .conftest import HostProcess, piwf, wait_for, write_workflow


@pytest.fixture(autouse=True)
async def no_lifecycle_contradictions_throughout(
    paths: StatePaths, request: pytest.FixtureRequest
) -> AsyncIterator[None]:
    """Sample the database every few milliseconds, across host kills and restarts."""
    samples: list[int] = []

    async def sample() -> None:
        db = None
        while True:
            try:
                db = db or Database.open_readonly(paths.db)
                samples.append(db.scalar(LIFECYCLE_CONTRADICTIONS))
            except (StoreError, OSError):
                pass  # not created yet, or deliberately corrupt
            await trio.sleep(0.005)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        yield
        nursery.cancel_scope.cancel()
    assert samples or request.node.get_closest_marker("unreadable_db"), "the database was never sampled"
    assert not any(samples), f"lifecycle contradictions seen: {max(samples)}"


async def call(paths: StatePaths, operation: str, **kwargs: Any) -> Any:
    async with AsyncClient(paths) as client:
        response = await client.call(operation, **kwargs)
    assert response.outcome in ("accepted", "adopted"), response
    return response.receipt


async def run_status(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return await call(paths, "run.status", run_id=run_id)


async def start(paths: StatePaths, project: Path, workflow: str) -> str:
    receipt = await call(paths, "run.start", payload={"workflow": workflow, "projectPath": str(project)})
    return receipt["runId"]


async def contradictions(paths: StatePaths) -> int:
    return (await call(paths, "host.status"))["lifecycleContradictions"]


def step_states(run: dict[str, Any]) -> list[tuple[str, str]]:
    return [(s["node"], s["status"]) for s in run["steps"]]


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


async def gated_run_in_its_second_node(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> tuple[HostProcess, str, int]:
    """A host with a 'gated' run whose 'once' node is accepted and whose 'wait' node runs."""
    host = await host_process().start()
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())
    worker_pid = (await run_status(paths, run_id))["workers"][0]["pid"]
    return host, run_id, worker_pid


async def test_run_start_wait_and_show_through_the_cli(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    await host_process().start()
    started = await piwf(paths, "run", "start", "greet", "--project", str(project), "--wait", "--json")
    run_id = json.loads(started.stdout)["runId"]
    shown = json.loads((await piwf(paths, "run", "show", run_id, "--json")).stdout)
    assert shown["status"] == "completed" and shown["queueStatus"] == "done"
    assert shown["output"] == {"text": "HELLO\n"}
    for key in ("runId", "workflow", "paused", "error", "createdAt", "finishedAt"):
        assert key in shown
    events = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
    types = [e["type"] for e in events]
    assert types[:2] == ["created", "claimed"] and "completed" in types
    assert types.count("attempt.accepted") == 2
    failed = await piwf(paths, "run", "start", "boom", "--project", str(project), "--wait", check=False)
    assert failed.returncode == 20 and b"the fuse was lit" in failed.stdout
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["lifecycleContradictions"] == 0 and status["completedRuns"] == 1


SLOW_LOAD = """
import os, time
from pathlib import Path
from piwf import Workflow, compute

if "PIWF_WORKER_FDS" in os.environ:  # in its worker (not when the host inspects it): a slow load
    Path("loading.tmp").write_text(str(os.getpid()))
    os.replace("loading.tmp", "loading.pid")
    while not Path("gate").exists():
        time.sleep(0.01)

workflow = Workflow(name="slowload", start_at="n", nodes={"n": compute(lambda ctx: {"loaded": True})})
"""


async def test_a_host_killed_while_its_worker_loads_leaves_no_worker_running(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    """A worker's pid is recorded with its ``worker.ready``: one whose host is killed while
    it loads its workflow is not in the record for the next host to kill. Its watcher
    thread, up before the workflow loads, kills its process group as its host's end of the
    pipe closes; the next host runs the run again."""
    write_workflow(project, "slowload", SLOW_LOAD)
    first = await host_process().start()
    run_id = await start(paths, project, "slowload")
    await wait_for(lambda: (project / "loading.pid").exists())
    worker_pid = int((project / "loading.pid").read_text())
    [worker] = (await run_status(paths, run_id))["workers"]
    assert (worker["status"], worker["pid"]) == ("starting", None)  # loading: no pid recorded yet
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    await wait_for(lambda: not group_members(worker_pid))  # gone by itself, in the middle of its load
    (project / "gate").touch()
    await host_process().start()
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed" and done["output"] == {"loaded": True}
    assert sorted(w["status"] for w in done["workers"]) == ["exited", "orphaned"]
    assert [w["pid"] for w in done["workers"] if w["status"] == "orphaned"] == [None]
    assert await contradictions(paths) == 0


async def test_sigkilled_host_resumes_without_redoing_accepted_steps(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    first = await host_process().start()
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())  # 'once' accepted, 'wait' running
    run = await run_status(paths, run_id)
    assert step_states(run) == [("once", "accepted"), ("wait", "running")]
    worker_pid = run["workers"][0]["pid"]
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    # The orphaned worker notices its host is gone and takes its process group with it.
    await wait_for(lambda: not group_members(worker_pid))
    (project / "gate").touch()
    await host_process().start()
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed"
    assert (project / "once.log").read_text().splitlines() == [run_id]  # ran exactly once
    assert (project / "wait.log").read_text().splitlines() == ["started", "started"]  # interrupted, ran again
    assert step_states(done) == [("once", "accepted"), ("wait", "interrupted"), ("wait", "accepted"),
                                 ("done", "accepted")]
    assert done["output"]["once"] == {"counted": True}
    assert await contradictions(paths) == 0


async def test_a_changed_workflow_parks_the_run_until_resumed_on_the_new_source(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    first, run_id, worker_pid = await gated_run_in_its_second_node(host_process, paths, project)
    first.signal(signal.SIGKILL)
    await first.wait()
    await wait_for(lambda: not group_members(worker_pid))
    source = project / ".piwf" / "workflows" / "gated.py"
    changed = source.read_text().replace('lambda ctx: {"input"', 'lambda ctx: {"v2": True, "input"')
    source.write_text(changed)
    (project / "gate").touch()
    await host_process().start()
    held = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert (held["status"], held["queueStatus"], held["hold"]) == ("running", "parked", "source")
    assert held["statusDetail"].startswith("no live host can load its workflow: host-")
    assert "workflow source changed" in held["statusDetail"]
    assert await contradictions(paths) == 0
    await piwf(paths, "run", "resume", run_id)
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed" and done["output"]["v2"] is True
    assert (project / "once.log").read_text().splitlines() == [run_id]


async def test_pause_parks_at_the_next_boundary_and_resume_finishes(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    _, run_id, _ = await gated_run_in_its_second_node(host_process, paths, project)
    await call(paths, "run.pause", run_id=run_id)
    assert await contradictions(paths) == 0
    (project / "gate").touch()  # 'wait' finishes; 'done' must not start
    await wait_for(lambda: _no_active_workers(paths))
    parked = await run_status(paths, run_id)
    assert (parked["queueStatus"], parked["paused"], parked["status"]) == ("parked", True, "running")
    assert step_states(parked) == [("once", "accepted"), ("wait", "accepted")]
    assert parked["workers"][-1]["status"] == "exited"  # stopped cleanly at the boundary
    # It stays parked: another run wakes the dispatcher and completes, and it is not claimed.
    other = await start(paths, project, "greet")
    assert (await call(paths, "run.wait", run_id=other))["status"] == "completed"
    assert (await run_status(paths, run_id))["queueStatus"] == "parked"
    assert len((await run_status(paths, run_id))["workers"]) == 1
    assert await contradictions(paths) == 0
    await piwf(paths, "run", "resume", run_id)
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed" and not done["paused"]
    assert step_states(done)[-1] == ("done", "accepted")


async def _no_active_workers(paths: StatePaths) -> bool:
    return (await call(paths, "host.status"))["activeWorkers"] == 0


async def test_cancel_ends_the_run_and_kills_its_worker_group(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    await host_process().start()
    run_id = await start(paths, project, "sleepy")
    running = await wait_for(lambda: _running_worker(paths, run_id))
    worker_pid = running["workers"][0]["pid"]
    shell_pid = await wait_for(lambda: _shell_group(worker_pid))
    await wait_for(lambda: len(group_members(shell_pid)) >= 3)  # sh and its two sleeps, in their own group
    cancelled = await piwf(paths, "run", "cancel", run_id, "--json")
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    await wait_for(lambda: not group_members(worker_pid) and not group_members(shell_pid))
    run = await run_status(paths, run_id)
    assert (run["status"], run["queueStatus"]) == ("cancelled", "cancelled")
    await wait_for(lambda: _worker_outcome(paths, run_id, "cancelled"))
    assert await contradictions(paths) == 0
    again = await piwf(paths, "run", "cancel", run_id, check=False)
    assert again.returncode == 1 and b"cannot be cancelled" in again.stderr


def _shell_group(worker_pid: int) -> int | None:
    """The process group a worker started for its shell node."""
    for child in psutil.Process(worker_pid).children():
        if os.getpgid(child.pid) == child.pid:
            return child.pid
    return None


async def _running_worker(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["queueStatus"] == "running" and run["workers"] and run["workers"][0]["pid"] else None


async def _worker_outcome(paths: StatePaths, run_id: str, outcome: str) -> bool:
    return (await run_status(paths, run_id))["workers"][-1]["status"] == outcome


async def test_second_host_refuses_to_start_while_the_first_keeps_serving(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    first = await host_process().start()
    second = await piwf(paths, "serve", check=False)
    assert second.returncode != 0
    assert b"already serving" in second.stderr and len(second.stderr.strip().splitlines()) == 1
    assert await first.answers()
    run_id = await start(paths, project, "greet")
    assert (await call(paths, "run.wait", run_id=run_id))["status"] == "completed"


async def test_sigterm_drains_and_the_next_host_finishes_the_runs(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    first, run_id, worker_pid = await gated_run_in_its_second_node(host_process, paths, project)
    host_pid = first.proc.pid
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    assert not paths.socket.exists()
    assert not group_members(worker_pid)
    assert not [p for p in psutil.process_iter() if _parent_is(p, host_pid)]
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["state"] == "stopped" and status["parkedRuns"] == 1
    assert status["lifecycleContradictions"] == 0
    (project / "gate").touch()
    await host_process().start()
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed"
    assert (project / "once.log").read_text().splitlines() == [run_id]
    assert done["workers"][0]["status"] == "stopped"  # stopped by the drain, not crashed
    assert done["workers"][0]["signal"] is not None or done["workers"][0]["exitCode"] is not None


def _parent_is(proc: psutil.Process, pid: int) -> bool:
    try:
        return proc.ppid() == pid
    except psutil.NoSuchProcess:
        return False


async def test_piwf_stop_drains_the_host(
    host_process: Callable[..., HostProcess], paths: StatePaths
) -> None:
    first = await host_process().start()
    stopped = await piwf(paths, "stop", "--json")
    assert json.loads(stopped.stdout) == {"stopped": True, "takenOverBy": None}
    assert await first.wait() == 0
    again = await piwf(paths, "stop")
    assert b"no host was running" in again.stdout
    with trio.fail_after(1):
        assert not paths.socket.exists()


@pytest.mark.unreadable_db
async def test_a_corrupt_database_is_refused_at_start_and_left_as_it_was(paths: StatePaths) -> None:
    paths.ensure()
    paths.db.write_bytes(b"definitely not sqlite" * 50)
    before = paths.db.read_bytes()
    serve = await piwf(paths, "serve", check=False)
    assert serve.returncode == 3
    assert b"is not a SQLite database" in serve.stderr and len(serve.stderr.strip().splitlines()) == 1
    status = await piwf(paths, "status", check=False)
    assert status.returncode == 3
    assert paths.db.read_bytes() == before
    assert not paths.socket.exists()
