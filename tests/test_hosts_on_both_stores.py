"""The flows that matter most, end to end with real `piwf serve` processes, on both stores:
a run's lifecycle through the CLI, a SIGKILLed host taken over, effects across a kill and
a retry answered from the command log (``store_args``: SQLite, then PostgreSQL)."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piwf.client import AsyncClient, make_request
from piwf.paths import StatePaths

from .conftest import HostProcess, pg_store_url, piwf, wait_for
from .test_effects import charges, shop, start_pay, wait_at_rest  # noqa: F401 (shop: a fixture)
from .test_lifecycle import call, group_members, run_status, start, step_states


async def test_a_run_starts_finishes_and_shows_through_the_cli(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, store_args: tuple[str, ...],
) -> None:
    await host_process(*store_args).start()
    started = await piwf(paths, "run", "start", "greet", "--project", str(project), "--wait", "--json")
    run_id = json.loads(started.stdout)["runId"]
    shown = json.loads((await piwf(paths, "run", "show", run_id, "--json")).stdout)
    assert shown["status"] == "completed" and shown["queueStatus"] == "done"
    assert shown["output"] == {"text": "HELLO\n"}
    events = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
    assert [e["type"] for e in events][:2] == ["created", "claimed"]
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["lifecycleContradictions"] == 0 and status["completedRuns"] == 1
    assert status.get("store") == (store_args[1] if store_args else None)


async def test_a_sigkilled_host_is_taken_over_without_redoing_accepted_steps(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, store_args: tuple[str, ...],
) -> None:
    first = await host_process(*store_args).start()
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())  # 'once' accepted, 'wait' running
    worker_pid = (await run_status(paths, run_id))["workers"][0]["pid"]
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    await wait_for(lambda: not group_members(worker_pid))
    (project / "gate").touch()
    await host_process(*store_args).start()  # takes over at once: the flock proves the first gone
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed"
    assert (project / "once.log").read_text().splitlines() == [run_id]  # ran exactly once
    assert step_states(done) == [("once", "accepted"), ("wait", "interrupted"), ("wait", "accepted"),
                                 ("done", "accepted")]


async def test_an_effect_applied_when_its_host_was_killed_is_observed_not_applied_again(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any],  # noqa: F811
    store_args: tuple[str, ...],
) -> None:
    first = await host_process(*store_args, env={"PIWF_FAULT": "worker.effect.applied:sleep"}).start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "observe": True})
    await wait_for(lambda: charges(shop) == 1)
    first.signal(signal.SIGKILL)
    await first.wait()
    await host_process(*store_args).start()
    run = await wait_at_rest(paths, run_id)
    assert run["status"] == "completed", run
    assert charges(shop) == 1 and run["output"]["receipt"]["observed"] is True


async def test_a_request_whose_host_died_after_commit_is_adopted_on_retry(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any],  # noqa: F811
    store_args: tuple[str, ...],
) -> None:
    first = await host_process(*store_args, env={"PIWF_FAULT": "host.command.committed:exit"}).start()
    payload = {"workflow": "pay", "projectPath": str(project), "input": {"ledger": shop["ledger"]}}
    request = make_request("run.start", client_id="shop", idempotency_key="order-1", payload=payload)
    async with AsyncClient(paths) as client:
        with contextlib.suppress(Exception):
            await client.send(request)
    assert await first.wait() == 86
    await host_process(*store_args).start()
    async with AsyncClient(paths) as client:
        retry = await client.send(request)
    assert retry.outcome == "adopted", retry
    assert (await wait_at_rest(paths, retry.receipt["runId"]))["status"] == "completed"
    assert charges(shop) == 1 and len(await call(paths, "run.list")) == 1


async def test_two_hosts_on_one_postgresql_store_share_the_runs_and_run_each_once(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    url = pg_store_url(postgres)
    other = StatePaths.resolve(tmp_path / "state-b")
    await host_process("--store", url, "--max-workers", "2").start()
    second = HostProcess(other, tmp_path / "host-b.log", "--store", url, "--max-workers", "2")
    await second.start()
    try:
        run_ids = [await start(paths, project, "gated") for _ in range(4)]  # all through the first host
        # each host runs two: the second learns of the runs from the first's notification (or its poll)
        await wait_for(lambda: (project / "wait.log").exists()
                       and len((project / "wait.log").read_text().splitlines()) == 4)
        (project / "gate").touch()
        for run_id in run_ids:
            done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
            assert done["status"] == "completed"
        assert sorted((project / "once.log").read_text().splitlines()) == sorted(run_ids)  # each ran once
        epochs = set()
        for run_id in run_ids:
            events = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
            epochs |= {e["epoch"] for e in events if e["type"] == "claimed"}
        assert len(epochs) == 2  # both hosts claimed runs
        b_status = json.loads((await piwf(other, "status", "--json")).stdout)
        assert b_status["completedRuns"] == 4 and b_status["state"] == "running"  # one store, seen from both
    finally:
        second.signal(signal.SIGTERM)
        await second.wait()


async def test_three_hosts_spread_the_work_each_up_to_its_max_workers(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    """Six runs that wait at a gate, all started through one host of three, each host
    allowed two at once: the work can only be held by spreading it over all three."""
    url = pg_store_url(postgres)
    await host_process("--store", url, "--max-workers", "2").start()
    others = [HostProcess(StatePaths.resolve(tmp_path / f"state-{name}"), tmp_path / f"host-{name}.log",
                          "--store", url, "--max-workers", "2") for name in ("b", "c")]
    for other in others:
        await other.start()
    try:
        run_ids = [await start(paths, project, "gated") for _ in range(6)]
        await wait_for(lambda: (project / "wait.log").exists()
                       and len((project / "wait.log").read_text().splitlines()) == 6)  # all six at the gate
        status = json.loads((await piwf(paths, "status", "--json")).stdout)
        assert sorted(h["activeRuns"] for h in status["hosts"]) == [2, 2, 2]
        (project / "gate").touch()
        for run_id in run_ids:
            done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
            assert done["status"] == "completed"
        assert sorted((project / "once.log").read_text().splitlines()) == sorted(run_ids)  # each ran once
    finally:
        for other in others:
            other.signal(signal.SIGTERM)
            await other.wait()
