"""Run supervision with an in-process host: crashes, back-off, held runs, claim renewal."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from piwf.client import AsyncClient
from piwf.clock import ManualClock, TrioClock
from piwf.host.host import Host, _heartbeat
from piwf.host.lane import renew_claims
from piwf.host import run_lane
from piwf.host.run_lane import RunLane
from piwf.host.state import ActiveRun, Conclusion, HostState
from piwf.paths import StatePaths
from piwf.protocol.worker import Ready
from piwf.status import StopReason
from piwf.store.sql import queue, runs
from piwf.store.sqlite import SqliteStore, Database
from piwf.store.sqlite.hosts import acquire_lease, read_lease

from .conftest import config, wait_for, write_workflow

CRASHER = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def crash(ctx):
        marker = Path(ctx.project_path) / "crashes.log"
        with open(marker, "a") as f:
            f.write("x\\n")
        if len(marker.read_text().splitlines()) <= int(ctx.input.get("crashes", 0)):
            os._exit(9)
        return {"survived": True}

    workflow = Workflow(name="crasher", start_at="crash", nodes={"crash": compute(crash)})
"""


async def test_a_crashed_worker_parks_its_run_for_another_try(paths: StatePaths, project: Path,
                                                              nursery: trio.Nursery) -> None:
    write_workflow(project, "crasher", CRASHER)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01)).serve)
    async with AsyncClient(paths) as client:
        started = await client.call("run.start", payload={"workflow": "crasher", "projectPath": str(project),
                                                          "input": {"crashes": 2}})
        run_id = started.receipt["runId"]
        run = (await client.call("run.wait", run_id=run_id)).receipt
        assert run["status"] == "completed" and run["output"] == {"survived": True}
        run = await wait_for(lambda: _all_workers_finished(client, run_id))
    assert [w["status"] for w in run["workers"]] == ["crashed", "crashed", "exited"]
    assert run["workers"][0]["exitCode"] == 9
    assert [s["status"] for s in run["steps"]] == ["interrupted", "interrupted", "accepted"]


async def _all_workers_finished(client: AsyncClient, run_id: str) -> dict | None:
    run = (await client.call("run.status", run_id=run_id)).receipt
    return run if all(w["status"] not in ("starting", "running") for w in run["workers"]) else None


async def test_a_run_that_keeps_crashing_is_held_with_the_reason(paths: StatePaths, project: Path,
                                                                nursery: trio.Nursery) -> None:
    write_workflow(project, "crasher", CRASHER)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=3)).serve)
    async with AsyncClient(paths) as client:
        started = await client.call("run.start", payload={"workflow": "crasher", "projectPath": str(project),
                                                          "input": {"crashes": 99}})
        run_id = started.receipt["runId"]
        held = (await client.call("run.wait", run_id=run_id)).receipt
        assert (held["queueStatus"], held["hold"]) == ("parked", "crashed")
        assert held["statusDetail"].startswith("worker crashed 3 times in a row")
        assert len(held["workers"]) == 3
        status = (await client.call("host.status")).receipt
        assert status["lifecycleContradictions"] == 0


async def test_a_crashed_run_is_not_claimed_by_a_new_host_before_its_back_off_ends(
        paths: StatePaths, project: Path) -> None:
    """The back-off is kept with the run, so a host started after the crash (a restart,
    or another host) honours it as the host that saw the crash would have."""
    write_workflow(project, "crasher", CRASHER)
    clock = ManualClock(TrioClock().now_ms())  # the hosts' clock: it moves when the test says
    async with trio.open_nursery() as nursery:  # the first host sees one crash, then stops
        await nursery.start(Host(config(paths, crash_backoff_s=5), clock=clock).serve)
        async with AsyncClient(paths) as client:
            run_id = (await client.call("run.start", payload={"workflow": "crasher", "projectPath": str(project),
                                                              "input": {"crashes": 1}})).receipt["runId"]
            await wait_for(lambda: _crashed_once(client, run_id))
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:  # a new host, the same moment: nothing of the first in memory
        await nursery.start(Host(config(paths, crash_backoff_s=5, poll_s=0.05), clock=clock).serve)
        async with AsyncClient(paths) as client:
            for moved in (0, 4_999):  # at once, and one millisecond before the back-off ends
                clock.advance(moved)
                # A younger run is claimed and done: the dispatcher passed the crashed (older) run over.
                greet = (await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
                         ).receipt["runId"]
                assert (await client.call("run.wait", run_id=greet)).receipt["status"] == "completed"
                run = (await client.call("run.status", run_id=run_id)).receipt
                assert run["queueStatus"] == "parked" and len(run["workers"]) == 1
            clock.advance(1)  # the back-off is over: claimed at the next poll
            done = (await client.call("run.wait", run_id=run_id)).receipt
        nursery.cancel_scope.cancel()
    assert done["status"] == "completed" and [w["status"] for w in done["workers"]] == ["crashed", "exited"]


async def _crashed_once(client: AsyncClient, run_id: str) -> bool:
    workers = (await client.call("run.status", run_id=run_id)).receipt["workers"]
    return [w["status"] for w in workers] == ["crashed"]


async def test_an_unloadable_workflow_holds_the_run(paths: StatePaths, project: Path, client: AsyncClient) -> None:
    started = await client.call("run.start", payload={"workflow": "gated", "projectPath": str(project)})
    run_id = started.receipt["runId"]
    await wait_for(lambda: (project / "wait.log").exists())
    await client.call("run.pause", run_id=run_id)
    (project / "gate").touch()
    source = project / ".piwf" / "workflows" / "gated.py"
    good = source.read_text()
    held = (await client.call("run.wait", run_id=run_id)).receipt
    assert held["hold"] == "paused"
    source.write_text("raise SystemExit('broken on purpose')\n")
    assert (await client.call("run.resume", run_id=run_id)).outcome == "accepted"
    held = (await client.call("run.wait", run_id=run_id)).receipt
    assert held["hold"] == "source" and "broken on purpose" in held["statusDetail"]
    refused = await client.call("run.resume", run_id=run_id)
    assert refused.outcome == "rejected" and "broken on purpose" in refused.error
    assert (await client.call("run.status", run_id=run_id)).receipt["hold"] == "source"  # nothing changed
    source.write_text(good)
    assert (await client.call("run.resume", run_id=run_id)).outcome == "accepted"
    done = (await client.call("run.wait", run_id=run_id)).receipt
    assert done["status"] == "completed"


async def test_claim_renewal_keeps_every_active_claim_live_across_many_leases(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host, active = _claimed_run(tmp_path)
    second = _claim_another(host, "r2")
    with trio.CancelScope() as scope:
        active.scope = second.scope = scope
        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew_claims, RunLane(host))
            await trio.sleep(host.config.run_lease_ms / 1000 * 20)
            for run in (active, second):
                # the fence: ClaimLost unless the claim is still live
                queue.fenced_revision(host.store.db, run.claim.run_id, run.claim.token, host.now())
            nursery.cancel_scope.cancel()
    assert not active.scope.cancel_called and not second.scope.cancel_called


async def test_a_lost_claim_cancels_that_run_scope_only(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    host, active = _claimed_run(tmp_path)
    other = _claim_another(host, "r2")
    # Another epoch takes the first run over: its claim is expired and claimed anew.
    db = host.store.db
    db.execute("UPDATE run_queue SET claim_expires_at = ? WHERE run_id = 'r'", (host.now(),))
    assert queue.claim_run(db, active.claim.run_id, runner_id="other", token="theirs", lease_ms=30_000,
                           now=host.now(), epoch=host.epoch + 1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew_claims, RunLane(host))
            with active.scope:
                try:
                    await trio.sleep_forever()
                except* trio.Cancelled as cancelled:
                    reasons = [exc.reason for exc in cancelled.exceptions]
                    raise
            nursery.cancel_scope.cancel()
    assert active.scope.cancelled_caught and reasons == [StopReason.CLAIM_LOST]
    assert not other.scope.cancel_called


async def test_a_run_that_released_its_claim_itself_is_not_stopped_as_claim_lost(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Between its worker's last message (which completed the run) and the worker's exit,
    the claim is gone because the worker gave it back, not because it was lost."""
    host, active = _claimed_run(tmp_path)
    queue.complete_run(host.store.db, active.claim.run_id, active.claim.token, {"done": True}, host.now())
    active.conclusion = Conclusion.DONE
    with trio.CancelScope() as scope:
        active.scope = scope
        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew_claims, RunLane(host))
            await trio.sleep(host.config.run_lease_ms / 1000 * 3)
            nursery.cancel_scope.cancel()
    assert active.stop_reason is None and not scope.cancelled_caught


async def test_a_worker_that_never_reports_ready_is_stopped_as_timed_out(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    hang = {"PIWF_FAULT": "worker.started:sleep"}  # every worker hangs before it says ready
    host = await nursery.start(Host(config(paths, worker_startup_s=0.3, worker_env=hang)).serve)
    async with AsyncClient(paths) as client:
        run_id = (await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
                  ).receipt["runId"]
        workers = await wait_for(lambda: _finished_workers(client, run_id))
    # Stopped like any worker: SIGTERM first, which ends the sleeping worker.
    assert workers[0]["status"] == "timedOut" and workers[0]["signal"] == signal.SIGTERM
    host.stop_requested.set()


async def test_a_ready_sent_in_time_is_not_cut_off_by_the_hosts_own_handling(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The startup timeout is the worker's to keep: a ready read in time whose handling
    (a slow store unit, say) outlasts the deadline still counts."""
    real = run_lane.handle
    startup_s = 2.0

    async def slow(host: HostState, active: ActiveRun, message: object) -> object:
        if isinstance(message, Ready):
            await trio.sleep(startup_s + 0.1)  # past the startup deadline, whenever the ready came
        return await real(host, active, message)

    monkeypatch.setattr(run_lane, "handle", slow)
    host = await nursery.start(Host(config(paths, worker_startup_s=startup_s)).serve)
    async with AsyncClient(paths) as client:
        run_id = (await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
                  ).receipt["runId"]
        workers = await wait_for(lambda: _finished_workers(client, run_id))
        assert (await client.call("run.status", run_id=run_id)).receipt["status"] == "completed"
    assert workers[0]["status"] == "exited", workers
    host.stop_requested.set()


CLOSER = """
    import os, time
    from piwf import Workflow, compute

    def close(ctx):
        os.closerange(3, 256)  # its pipes to the host too: the host reads their end
        time.sleep(300)
        return {}

    workflow = Workflow(name="closer", start_at="close", nodes={"close": compute(close)})
"""


async def test_a_worker_that_closes_its_pipes_after_ready_is_stopped_after_the_kill_grace(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    write_workflow(project, "closer", CLOSER)
    host = await nursery.start(Host(config(paths, kill_grace_s=0.5)).serve)
    async with AsyncClient(paths) as client:
        run_id = (await client.call("run.start", payload={"workflow": "closer", "projectPath": str(project)})
                  ).receipt["runId"]
        workers = await wait_for(lambda: _finished_workers(client, run_id))
    assert workers[0]["status"] == "crashed" and workers[0]["signal"] == signal.SIGTERM, workers
    assert "without ending" in (workers[0].get("diagnostic") or workers[0].get("note") or ""), workers
    host.stop_requested.set()


async def _finished_workers(client: AsyncClient, run_id: str) -> list | None:
    workers = (await client.call("run.status", run_id=run_id)).receipt["workers"]
    return workers if workers and workers[0]["status"] not in ("starting", "running") else None


def _claim_another(host: HostState, run_id: str) -> ActiveRun:
    runs.create_run(host.store.db, run_id=run_id, workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=host.now())
    claim = queue.claim_run(host.store.db, run_id, runner_id=host.host_id, token=f"mine-{run_id}", lease_ms=3000,
                            now=host.now(), epoch=host.epoch)
    assert claim is not None
    run = ActiveRun(claim, worker_id=f"w-{run_id}")
    host.active[run_id] = run
    return run


def _claimed_run(tmp_path: Path) -> tuple[HostState, ActiveRun]:
    paths = StatePaths.resolve(tmp_path / "state")
    paths.ensure()
    db = Database.open(paths.db)
    host = HostState(config(paths, run_lease_ms=3000, host_lease_ms=3000), SqliteStore(db), TrioClock())
    host.lease = acquire_lease(db, host_id=host.host_id, pid=1, identity="x", lease_ms=3000, now=host.now())
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=host.now())
    claim = queue.claim_next_run(db, runner_id=host.host_id, token="mine", lease_ms=3000, now=host.now(),
                                 epoch=host.epoch)
    assert claim is not None
    active = ActiveRun(claim, worker_id="w1")
    host.active[claim.run_id] = active
    return host, active


async def test_a_run_whose_worker_cannot_start_is_held_and_the_host_stays_up(
    paths: StatePaths, tmp_path: Path, nursery: trio.Nursery
) -> None:
    paths.ensure()
    db = Database.open(paths.db)
    runs.create_run(db, run_id="lost", workflow="greet", project_path=str(tmp_path / "deleted-project"),
                    source=b"", digest="d", input={}, origin_session_id=None, now=TrioClock().now_ms())
    db.close()
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=2)).serve)
    async with AsyncClient(paths) as client:
        held = (await client.call("run.wait", run_id="lost")).receipt
        assert (held["hold"], held["queueStatus"]) == ("crashed", "parked")
        assert "cannot start worker" in held["statusDetail"]
        assert (await client.call("host.status")).receipt["lifecycleContradictions"] == 0


async def test_heartbeat_renews_the_host_lease_and_stops_the_host_when_it_is_lost(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host, _ = _claimed_run(tmp_path)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_heartbeat, host)
            await trio.sleep(30)  # ten leases
            assert read_lease(host.store.db).live(host.now()) and not host.stop_requested.is_set()
            # Another host takes the state directory (it proved this one dead).
            acquire_lease(host.store.db, host_id="usurper", pid=2, identity="y", lease_ms=3000, now=host.now(),
                          owner_dead=True)
            await host.stop_requested.wait()
            nursery.cancel_scope.cancel()
    assert read_lease(host.store.db).host_id == "usurper"


async def test_dispatch_is_bounded_and_event_driven(paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    # With a ten-minute backstop poll, only events (start, capacity freed) can wake the dispatcher.
    host = await nursery.start(Host(config(paths, max_workers=2, poll_s=600)).serve)
    async with AsyncClient(paths) as client:
        payload = {"workflow": "sleepy", "projectPath": str(project)}
        started = [(await client.call("run.start", payload=payload)).receipt["runId"] for _ in range(3)]
        await wait_for(lambda: len(host.active) == 2)
        statuses = [(await client.call("run.status", run_id=r)).receipt["queueStatus"] for r in started]
        assert statuses.count("queued") == 1
        assert (await client.call("host.status")).receipt["activeWorkers"] == 2
        await client.call("run.cancel", run_id=started[0])
        await wait_for(lambda: started[2] in host.active)  # capacity freed: claimed at once
        for run_id in started[1:]:
            await client.call("run.cancel", run_id=run_id)


async def test_a_bug_while_supervising_one_run_parks_it_and_the_host_serves_on(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piwf.host import run_lane

    def broken(*args: object) -> None:
        raise ValueError("a bug in the message pump")

    monkeypatch.setattr(run_lane, "handle", broken)
    await nursery.start(Host(config(paths, crash_backoff_s=60)).serve)
    async with AsyncClient(paths) as client:
        run_id = (await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
                  ).receipt["runId"]
        workers = await wait_for(lambda: _finished_workers(client, run_id))
        assert workers[0]["status"] == "crashed"
        assert "supervision failed: ValueError('a bug in the message pump')" in workers[0]["diagnostic"]
        run = (await client.call("run.status", run_id=run_id)).receipt
        assert run["queueStatus"] == "parked"
        assert (await client.call("host.status")).outcome == "accepted"
