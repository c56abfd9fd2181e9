"""Control through any host (issue 21): a cancel, a pause and a resume, an answered ask,
a settings change and a watch, each sent to a host that does not own the run, on one
PostgreSQL store. Every host polls once in hours and renews its claims once in hours, so
only a wake-up (store/postgres/wakeups.py) can explain the owner acting: without it each
test fails by its own timeout. Real in-process hosts with real worker processes, each with
its own state directory; ``front`` takes requests and runs nothing (``max_workers=0``), so
the run is always the other host's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf import processes
from piwf.client import AsyncClient
from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import config, pg_store_url, wait_for, write_workflow
from .test_controllers import ctl, get, mirror, ready, write_controller  # noqa: F401 (mirror: a fixture)
from .test_interactions import open_request, start
from .test_lifecycle import _shell_group, call, group_members, run_status, step_states
from .test_settings import SLOW, TUNED, change, submit
from .test_watch import CRUNCH

HOURS = 3 * 3600.0  # the poll, and (at least) the claims' renewal period: never, within a test


@pytest.fixture
def store_url(postgres: Any) -> str:
    return pg_store_url(postgres)


async def serve(nursery: trio.Nursery, tmp_path: Path, name: str, store_url: str, **options: Any) -> StatePaths:
    paths = StatePaths.resolve(tmp_path / name)
    state: HostState = await nursery.start(Host(config(
        paths, store_url=store_url, poll_s=HOURS, run_lease_ms=int(HOURS * 3000), **options)).serve)
    assert state.config.poll_s == HOURS
    return paths


async def two_hosts(nursery: trio.Nursery, tmp_path: Path, store_url: str) -> tuple[StatePaths, StatePaths]:
    """(front, owner): the front runs nothing, so every run is the owner's."""
    front = await serve(nursery, tmp_path, "front", store_url, max_workers=0)
    owner = await serve(nursery, tmp_path, "owner", store_url)
    return front, owner


async def _worker_of(paths: StatePaths, run_id: str) -> int | None:
    run = await run_status(paths, run_id)
    live = run["queueStatus"] == "running" and run["workers"] and run["workers"][-1]["pid"]
    return run["workers"][-1]["pid"] if live else None


async def test_a_cancel_through_another_host_stops_the_owners_worker_and_its_processes(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, owner = await two_hosts(nursery, tmp_path, store_url)
    run_id = await start(front, project, "sleepy")
    worker_pid = await wait_for(lambda: _worker_of(front, run_id))
    shell_pid = await wait_for(lambda: _shell_group(worker_pid))
    # sh and its two sleeps, in their own group: the worker is in its node and says nothing more
    await wait_for(lambda: len(group_members(shell_pid)) >= 3)
    receipt = await call(front, "run.cancel", run_id=run_id)
    assert receipt["status"] == "cancelled"
    with trio.fail_after(15):  # the owner hears of it and stops the worker, its shell and its sleeps
        await wait_for(lambda: not group_members(worker_pid) and not group_members(shell_pid))

    async def recorded() -> bool:
        return (await run_status(front, run_id))["workers"][-1]["status"] == "cancelled"
    await wait_for(recorded, timeout=15)
    run = await run_status(owner, run_id)
    assert (run["status"], run["queueStatus"]) == ("cancelled", "cancelled")
    assert (await call(owner, "host.status"))["activeWorkers"] == 0


async def test_a_poll_only_owner_hears_of_a_cancel_through_another_host_at_its_next_poll(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    """An owner without LISTEN (``--poll-only``) gets no CLAIMS wake-up: its renewer checks
    its claims at every poll (1 s here; its renewals alone would come in hours)."""
    front = await serve(nursery, tmp_path, "front", store_url, max_workers=0)
    paths = StatePaths.resolve(tmp_path / "owner")
    await nursery.start(Host(config(paths, store_url=store_url, store_listen=False, poll_s=1.0,
                                    run_lease_ms=int(HOURS * 6000))).serve)
    run_id = await start(front, project, "sleepy")
    worker_pid = await wait_for(lambda: _worker_of(front, run_id), timeout=20)
    receipt = await call(front, "run.cancel", run_id=run_id)
    assert receipt["status"] == "cancelled"
    with trio.fail_after(15):
        await wait_for(lambda: not group_members(worker_pid))


async def test_pause_and_resume_through_another_host(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, _ = await two_hosts(nursery, tmp_path, store_url)
    run_id = await start(front, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())  # in its second node, on the owner
    await call(front, "run.pause", run_id=run_id)
    (project / "gate").touch()  # 'wait' finishes; 'done' must not start

    async def parked() -> dict[str, Any] | None:
        run = await run_status(front, run_id)
        return run if run["queueStatus"] == "parked" else None
    run = await wait_for(parked, timeout=15)
    assert (run["paused"], run["status"]) == (True, "running")
    assert step_states(run) == [("once", "accepted"), ("wait", "accepted")]
    assert run["workers"][-1]["status"] == "exited"  # stopped cleanly at the boundary
    await call(front, "run.resume", run_id=run_id)
    with trio.fail_after(15):  # the owner claims it again on the wake-up
        done = await call(front, "run.wait", run_id=run_id, payload={"timeoutMs": 15_000})
    assert done["status"] == "completed" and not done["paused"], done
    assert (project / "once.log").read_text().split() == [run_id]


async def test_a_settings_change_and_an_answer_through_another_host_reach_the_owners_worker(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, _ = await two_hosts(nursery, tmp_path, store_url)
    write_workflow(project, "tuned", TUNED)
    run_id = await start(front, project, "tuned")
    await open_request(front, run_id)  # it waits for its ask
    assert (await change(front, run_id, {"budget": 5})).outcome == "accepted"
    await submit(front, run_id, "go")  # validated by the owner's worker: the run goes on there
    with trio.fail_after(15):
        done = await call(front, "run.wait", run_id=run_id, payload={"timeoutMs": 15_000})
    assert done["status"] == "completed", done
    assert done["output"] == {"budget": 5, "model": "small", "max": 10}


async def test_a_settings_change_through_another_host_reaches_the_running_worker_at_its_next_node(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, _ = await two_hosts(nursery, tmp_path, store_url)
    write_workflow(project, "slow", SLOW)
    run_id = await start(front, project, "slow")
    await wait_for(lambda: (project / "started").exists())
    assert (await change(front, run_id, {"budget": 5})).outcome == "accepted"
    (project / "release").write_text("go")
    with trio.fail_after(15):
        done = await call(front, "run.wait", run_id=run_id, payload={"timeoutMs": 15_000})
    assert done["output"] == {"budget": 5}
    assert [(s["node"], s["settingsChange"]) for s in done["steps"]] == [("slow", 0), ("next", 1)]


async def test_a_watch_through_another_host_sees_the_owners_events_in_order(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, owner = await two_hosts(nursery, tmp_path, store_url)
    cursor = (await call(front, "run.watch"))["cursor"]
    run_ids = [await start(front, project, "greet") for _ in range(3)]
    seen: list[tuple[str, str, int]] = []
    with trio.fail_after(20):
        while {(r, "worker.finished") for r in run_ids} - {(r, t) for r, t, _ in seen}:
            page = await call(front, "run.watch", payload={"after": cursor, "timeoutMs": 15_000})
            assert page["cursor"] >= cursor
            cursor = page["cursor"]
            seen += [(e["runId"], e["event"]["type"], e["event"]["eventId"]) for e in page["events"]]
    ids = [event_id for _, _, event_id in seen]
    assert ids == sorted(set(ids))  # in order, none twice
    for run_id in run_ids:  # every one of each run's events, as the owner's own read has them
        mine = [(t, i) for r, t, i in seen if r == run_id]
        events = (await call(owner, "run.events", run_id=run_id))["events"]
        assert [(e["type"], e["eventId"]) for e in events][:len(mine)] == mine
        assert mine[0][0] == "created" and "completed" in [t for t, _ in mine]


NOTIFYING = """
    import time
    from pathlib import Path
    from piwf import Workflow, compute

    def work(ctx):
        ctx.notify("halfway")
        while not Path(ctx.project_path, "gate").exists():
            time.sleep(0.02)
        return "done"

    workflow = Workflow(name="notifying", start_at="work", nodes={"work": compute(work)})
"""


async def agent(paths: StatePaths, operation: str, **kwargs: Any) -> Any:
    """A call by one client (delivery claims are held by the client that took them)."""
    async with AsyncClient(paths, client_id="agent-client") as client:
        response = await client.call(operation, **kwargs)
    assert response.outcome == "accepted", response
    return response.receipt


async def test_notifications_follow_ups_and_turns_through_another_host(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, _ = await two_hosts(nursery, tmp_path, store_url)
    write_workflow(project, "notifying", NOTIFYING)
    run_id = await start(front, project, "notifying", originSessionId="agent-1")

    async def claimed_notification() -> dict[str, Any] | None:
        claim = await agent(front, "notification.claim", payload={"sessionId": "agent-1"})
        return claim if claim["notification"] is not None else None
    claim = await wait_for(claimed_notification, timeout=15)  # sent by the owner's worker
    assert claim["notification"]["content"] == "halfway"
    await agent(front, "notification.deliver", payload={"notificationId": claim["notification"]["notificationId"],
                                                       "claimId": claim["claimId"]})
    await call(front, "followup.queue", run_id=run_id, payload={"requestKey": "k1", "prompt": "then ship it"})
    (project / "gate").touch()

    async def claimed_turn() -> dict[str, Any] | None:
        claim = await agent(front, "turn.claim", payload={"sessionId": "agent-1"})
        return claim if claim["turn"] is not None else None
    turn = await wait_for(claimed_turn, timeout=15)  # the owner ended the run: its turn
    assert turn["turn"]["runId"] == run_id and turn["turn"]["cause"] == "completed"
    assert [f["prompt"] for f in turn["turn"]["followUps"]] == ["then ship it"]
    resolved = await agent(front, "turn.resolve", payload={"turnId": turn["turn"]["turnId"],
                                                          "claimId": turn["claimId"], "resolution": "presented"})
    assert resolved["followUpsDelivered"] == 1


async def test_a_resource_deleted_through_another_host_is_finalized_by_the_one_that_reconciles(
        nursery: trio.Nursery, tmp_path: Path, mirror: Path, store_url: str) -> None:  # noqa: F811
    front = await serve(nursery, tmp_path, "front", store_url, max_controller_workers=0)
    await serve(nursery, tmp_path, "owner", store_url)
    await ctl(front, "apply", mirror, "mirror", "a", spec={"text": "hi"})

    async def reconciled() -> bool:
        return ready(await get(front, mirror, "mirror", "a"))
    await wait_for(reconciled, timeout=15)
    assert (mirror / "out" / "a.txt").read_text() == "hi"
    await ctl(front, "reconcile", mirror, "mirror", "a")
    await ctl(front, "delete", mirror, "mirror", "a")

    async def gone() -> bool:
        return await get(front, mirror, "mirror", "a") is None
    await wait_for(gone, timeout=15)  # its finalizer ran on the other host
    assert not (mirror / "out" / "a.txt").exists()


STUCK = """
    import os
    import time
    from pathlib import Path

    from piwf import Controller, Result

    def reconcile(ctx):
        Path("stuck.pid").write_text(str(os.getpid()))
        while True:  # until it is stopped
            time.sleep(0.02)

    controller = Controller(name="stuck", reconcile=reconcile, initial_status={})
"""


async def test_a_force_delete_through_another_host_stops_the_reconcile_running_for_it(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    write_controller(project, "stuck", STUCK)
    front = await serve(nursery, tmp_path, "front", store_url, max_controller_workers=0)
    # its claims renewed once in hours: only the wake-up can make it look again
    await serve(nursery, tmp_path, "owner", store_url, controller_lease_ms=int(HOURS * 4000))
    await ctl(front, "apply", project, "stuck", "a", spec={})
    pid = int(await wait_for(lambda: (project / "stuck.pid").exists() and (project / "stuck.pid").read_text()))
    identity = processes.identity(pid)
    assert processes.alive(pid, identity)
    await ctl(front, "delete", project, "stuck", "a", force=True)
    assert await get(front, project, "stuck", "a") is None
    await wait_for(lambda: not processes.alive(pid, identity), timeout=15)


async def test_a_force_delete_stops_the_reconcile_running_for_it_at_once_on_one_host(
        host: Any, paths: StatePaths, project: Path) -> None:
    """SQLite, one host: its claims' renewal is 30 s away, so only the check the delete
    asks for stops the pass within the test's time."""
    write_controller(project, "stuck", STUCK)
    await ctl(paths, "apply", project, "stuck", "a", spec={})
    pid = int(await wait_for(lambda: (project / "stuck.pid").exists() and (project / "stuck.pid").read_text()))
    identity = processes.identity(pid)
    await ctl(paths, "delete", project, "stuck", "a", force=True)
    await wait_for(lambda: not processes.alive(pid, identity), timeout=15)


async def test_piwf_watch_through_another_host_follows_the_owners_run(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front, _ = await two_hosts(nursery, tmp_path, store_url)
    watch = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "watch", "--state-dir", str(front.root)], stdout=subprocess.PIPE)
    assert watch.stdout is not None
    seen = b""

    async def until(*wanted: bytes) -> None:  # the views printed so far (into a pipe: each in whole)
        nonlocal seen
        with trio.fail_after(20):
            while not all(w in seen.rsplit(b"cursor", 1)[-1] for w in wanted):
                seen += await watch.stdout.receive_some(65536)  # type: ignore[union-attr]

    try:
        write_workflow(project, "crunch", CRUNCH)
        run_id = await start(front, project, "crunch")
        await until(run_id.encode(), b"crunch", b'"done": 7')  # the owner's worker published it
        (project / "gate").write_text("open")
        await until(run_id.encode(), b"completed")
    finally:
        watch.kill()
        await watch.wait()
