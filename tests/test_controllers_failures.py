"""Controllers when things go wrong: back-off, TemporaryError, PermanentError, a flood of
reconcile requests during a slow reconcile, a host SIGKILLed mid-reconcile."""

from __future__ import annotations

import itertools
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from piwf.client import AsyncClient
from piwf.host.controller_state import ControllerState
from piwf.paths import StatePaths

from .conftest import HostProcess, wait_for
from .test_controllers import ctl, get, write_controller

# spec.mode: "raise" (a bug), "temporary" (TemporaryError(delay=2)), "permanent", anything else settles.
FLAKY = """
    from piwf import Controller, PermanentError, Result, TemporaryError

    def reconcile(ctx):
        mode = ctx.resource.spec.get("mode")
        if mode == "raise":
            raise ValueError("the widget is broken")
        if mode == "temporary":
            raise TemporaryError("not yet", delay=2)
        if mode == "permanent":
            raise PermanentError("this spec can never work")
        return Result.settled(status={"mode": mode}, conditions=[{"type": "Ready", "status": "True"}])

    controller = Controller(name="flaky", reconcile=reconcile)
"""

# Appends "start"/"end" lines to trace.txt; blocks until the file 'gate' exists. Its one
# effect appends to ledger.txt, before it blocks.
SLOW = """
    import os, time
    from pathlib import Path
    from piwf import Controller, Result

    def reconcile(ctx):
        with open("trace.txt", "a") as f:
            f.write(f"start {os.getpid()}\\n")
        def charge():
            with open("ledger.txt", "a") as f:
                f.write(f"{ctx.resource.key}\\n")
                f.flush()
                os.fsync(f.fileno())
            return {"charged": True}
        ctx.effects.ensure("charge", charge)
        while not Path("gate").exists():
            time.sleep(0.02)
        with open("trace.txt", "a") as f:
            f.write(f"end {os.getpid()}\\n")
        return Result.settled(conditions=[{"type": "Ready", "status": "True"}])

    controller = Controller(name="slow", reconcile=reconcile)
"""


def event_types(resource: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in resource["events"] if e["type"] == kind]


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["at"].replace("Z", "+00:00")).timestamp()


def test_backoff_grows_and_is_capped_with_jitter() -> None:
    state = ControllerState()
    delays = [state.backoff_ms(n) for n in range(10)]
    for n, delay in enumerate(delays):
        base = min(60_000, 1000 * 2 ** min(n, 6))
        assert base * 0.9 <= delay <= base
    assert all(b > a for a, b in itertools.pairwise(delays[:6]))
    assert max(delays) <= 60_000


async def test_a_raising_reconcile_backs_off_with_growing_delays(host: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "flaky", FLAKY)
    await ctl(paths, "apply", project, "flaky", "w", spec={"mode": "raise"})

    async def failed_three_times() -> dict[str, Any] | None:
        got = await get(paths, project, "flaky", "w")
        return got if got and got["consecutiveErrors"] >= 3 and not got["reconciling"] else None

    got = await wait_for(failed_three_times, timeout=30)
    delays = [e["detail"]["delayMs"] for e in event_types(got, "reconcile_failed")]
    assert 900 <= delays[0] <= 1000 and 1800 <= delays[1] <= 2000 and 3600 <= delays[2] <= 4000
    assert "the widget is broken" in got["lastError"] and got["availableAt"] is not None
    # fixed: the next pass settles and the count resets
    await ctl(paths, "apply", project, "flaky", "w", spec={"mode": "ok"})
    fixed = await wait_for(lambda: _settled(paths, project, "w", generation=2))
    assert fixed["consecutiveErrors"] == 0 and fixed["lastError"] is None


async def _settled(paths: StatePaths, project: Path, key: str, generation: int = 1) -> dict[str, Any] | None:
    got = await get(paths, project, "flaky", key)
    ok = got and got["ready"] == "True" and got["status"]["observedGeneration"] == generation
    return got if ok and not got["reconciling"] else None


async def test_a_temporary_error_retries_after_its_delay(host: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "flaky", FLAKY)
    await ctl(paths, "apply", project, "flaky", "t", spec={"mode": "temporary"})

    async def retried() -> dict[str, Any] | None:
        got = await get(paths, project, "flaky", "t")
        return got if got and len(event_types(got, "reconcile_failed")) >= 2 else None

    got = await wait_for(retried, timeout=30)
    failures = event_types(got, "reconcile_failed")
    starts = event_types(got, "reconcile_started")
    assert [f["detail"]["delayMs"] for f in failures[:2]] == [2000, 2000]
    assert at(starts[1]) - at(failures[0]) >= 1.9


async def test_a_permanent_error_stops_retrying_until_the_spec_changes(host: Any, paths: StatePaths,
                                                                      project: Path) -> None:
    write_controller(project, "flaky", FLAKY)
    await ctl(paths, "apply", project, "flaky", "p", spec={"mode": "permanent"})

    async def held() -> dict[str, Any] | None:
        got = await get(paths, project, "flaky", "p")
        return got if got and got["hold"] == "permanent" and not got["reconciling"] else None

    got = await wait_for(held)
    assert got["ready"] == "False" and got["availableAt"] is None
    [ready] = got["status"]["conditions"]
    assert ready["reason"] == "PermanentError" and "can never work" in ready["message"]
    async with AsyncClient(paths) as client:
        assert (await client.call("host.status")).receipt["heldControllers"] == 1
    same = await ctl(paths, "apply", project, "flaky", "p", spec={"mode": "permanent"})
    assert not same["changed"]
    assert len(event_types(await get(paths, project, "flaky", "p"), "reconcile_started")) == 1
    await ctl(paths, "apply", project, "flaky", "p", spec={"mode": "ok"})
    fixed = await wait_for(lambda: _settled(paths, project, "p", generation=2))
    assert fixed["hold"] is None and len(event_types(fixed, "reconcile_started")) == 2


async def test_a_thousand_reconcile_requests_during_a_slow_reconcile_cause_one_more(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "slow", SLOW)
    await ctl(paths, "apply", project, "slow", "s", spec={})
    trace = project / "trace.txt"
    await wait_for(lambda: trace.exists() and trace.read_text().count("start") == 1)
    body = {"projectPath": str(project), "controller": "slow", "key": "s"}
    async with AsyncClient(paths) as client:
        for _ in range(1000):
            assert (await client.call("controller.reconcile", payload=body)).outcome == "accepted"
    (project / "gate").touch()

    async def done() -> bool:
        got = await get(paths, project, "slow", "s")
        return bool(got and not got["reconciling"] and got["availableAt"] is None
                    and trace.read_text().count("end") == trace.read_text().count("start"))

    await wait_for(done)
    lines = trace.read_text().split()[::2]
    assert lines == ["start", "end", "start", "end"]  # one more, never two at once
    assert (project / "ledger.txt").read_text().splitlines() == ["s"]  # the same spec: its effect once


@pytest.mark.parametrize("worker_start", ["fork", "spawn"])
async def test_host_sigkill_mid_reconcile_reconciles_again_without_repeating_the_effect(
        host_process: Any, paths: StatePaths, project: Path, worker_start: str) -> None:
    write_controller(project, "slow", SLOW)
    first: HostProcess = await host_process("--worker-start", worker_start).start()
    await ctl(paths, "apply", project, "slow", "k", spec={"n": 1})
    ledger = project / "ledger.txt"

    async def effect_settled() -> bool:  # applied and recorded: SIGKILL mid-apply is the ambiguity test's case
        got = await get(paths, project, "slow", "k")
        return bool(got and event_types(got, "effect_applied"))

    await wait_for(effect_settled)
    assert ledger.read_text() == "k\n"
    first.signal(signal.SIGKILL)
    await first.wait()
    second: HostProcess = await host_process("--worker-start", worker_start).start()
    trace = project / "trace.txt"
    await wait_for(lambda: trace.read_text().count("start") == 2)
    first_worker = int(trace.read_text().split()[1])
    assert ended(first_worker)  # no two passes of one resource at once
    (project / "gate").touch()

    async def converged() -> dict[str, Any] | None:
        got = await get(paths, project, "slow", "k")
        return got if got and got["ready"] == "True" and not got["reconciling"] else None

    got = await wait_for(converged)
    assert trace.read_text().split()[::2] == ["start", "start", "end"]  # the second pass ran alone
    assert ledger.read_text() == "k\n"  # applied before the kill, not again
    assert got["consecutiveErrors"] == 0
    second.signal(signal.SIGTERM)
    assert await second.wait() == 0


# The first pass dies inside apply() (after the world changed, before it was settled); its
# effect has no observe(), so nobody can tell: the resource is held for an operator.
DIES_MID_APPLY = """
    import os
    from pathlib import Path
    from piwf import Controller, Result

    def reconcile(ctx):
        def apply():
            with open("ledger.txt", "a") as f:
                f.write("applied\\n")
            if not Path("died").exists():
                Path("died").touch()
                os._exit(9)
            return {"n": 1}
        result = ctx.effects.ensure("once", apply)
        return Result.settled(status=result, conditions=[{"type": "Ready", "status": "True", "reason": "Done"}])

    controller = Controller(name="fragile", reconcile=reconcile)
"""

SLEEPER = """
    import time
    from piwf import Controller, Result

    def reconcile(ctx):
        time.sleep(30)
        return Result.settled()

    controller = Controller(name="sleeper", reconcile=reconcile, timeout=0.5)
"""


async def test_an_effect_cut_short_holds_the_resource_until_an_operator_resolves_it(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "fragile", DIES_MID_APPLY)
    await ctl(paths, "apply", project, "fragile", "f", spec={})

    async def held() -> dict[str, Any] | None:
        got = await get(paths, project, "fragile", "f")
        return got if got and got["hold"] == "effect" and not got["reconciling"] else None

    got = await wait_for(held, timeout=30)
    [ready] = got["status"]["conditions"]
    assert (ready["status"], ready["reason"]) == ("False", "EffectAmbiguous")
    assert (project / "ledger.txt").read_text() == "applied\n"
    async with AsyncClient(paths) as client:
        assert (await client.call("host.status")).receipt["ambiguousControllerEffects"] == 1
    receipt = await ctl(paths, "resolve", project, "fragile", "f", effectKey="once", applied=True, result={"n": 1})
    assert receipt["ambiguous"] == []
    async with AsyncClient(paths) as client:
        assert (await client.call("host.status")).receipt["ambiguousControllerEffects"] == 0

    async def done() -> dict[str, Any] | None:
        got = await get(paths, project, "fragile", "f")
        return got if got and got["ready"] == "True" and not got["reconciling"] else None

    fixed = await wait_for(done)
    assert fixed["status"]["controllerStatus"] == {"n": 1} and fixed["hold"] is None
    assert (project / "ledger.txt").read_text() == "applied\n"  # never applied again


async def test_a_reconcile_over_its_timeout_is_stopped_and_backs_off(host: Any, paths: StatePaths,
                                                                     project: Path) -> None:
    write_controller(project, "sleeper", SLEEPER)
    await ctl(paths, "apply", project, "sleeper", "z", spec={})

    async def timed_out() -> dict[str, Any] | None:
        got = await get(paths, project, "sleeper", "z")
        return got if got and got["consecutiveErrors"] >= 1 and not got["reconciling"] else None

    got = await wait_for(timed_out)
    assert got["lastError"].startswith("reconcileTimeout: reconcile did not finish within its timeout of 0.5 s")
    assert got["availableAt"] is not None


async def test_a_host_stop_requeues_the_reconcile_at_once(host_process: Any, paths: StatePaths,
                                                          project: Path) -> None:
    write_controller(project, "slow", SLOW)
    first: HostProcess = await host_process().start()
    await ctl(paths, "apply", project, "slow", "h", spec={})
    trace = project / "trace.txt"
    await wait_for(lambda: trace.exists() and "start" in trace.read_text())
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    from piwf.store.sqlite import Database
    from piwf.store.sql.controllers import get_resource

    db = Database.open_readonly(paths.db)
    try:
        got = get_resource(db, str(project), "slow", "h", 0)
    finally:
        db.close()
    assert got.consecutiveErrors == 1 and got.availableAt is not None and not got.reconciling
    assert got.lastError == "interrupted: the host stopped during the reconcile"


async def test_max_controller_workers_bounds_reconciles_at_once(paths: StatePaths, project: Path,
                                                                nursery: Any) -> None:
    from piwf.host.host import Host

    from .conftest import config

    state = await nursery.start(Host(config(paths, max_controller_workers=1)).serve)
    try:
        write_controller(project, "slow", SLOW)
        for key in ("a", "b", "c"):
            await ctl(paths, "apply", project, "slow", key, spec={})
        trace = project / "trace.txt"
        await wait_for(lambda: trace.exists() and "start" in trace.read_text())
        async with AsyncClient(paths) as client:
            status = (await client.call("host.status")).receipt
        assert status["activeControllerWorkers"] == 1 and status["pendingControllers"] == 2
        (project / "gate").touch()

        async def all_done() -> bool:
            text = trace.read_text()
            return text.count("end") == 3 and state.controllers.active == {}

        await wait_for(all_done)
        assert trace.read_text().split()[::2] == ["start", "end"] * 3  # one at a time
    finally:
        state.stop_requested.set()


async def test_a_lost_claim_stops_exactly_that_reconcile(paths: StatePaths, project: Path, nursery: Any) -> None:
    import psutil

    from piwf.host.host import Host
    from piwf.store.sqlite import Database

    from .conftest import config

    state = await nursery.start(Host(config(paths, controller_lease_ms=600)).serve)
    try:
        write_controller(project, "slow", SLOW)
        for key in ("lost", "kept"):
            await ctl(paths, "apply", project, "slow", key, spec={})
        trace = project / "trace.txt"
        await wait_for(lambda: trace.exists() and trace.read_text().count("start") == 2)
        pids = [int(pid) for pid in trace.read_text().split()[1::2]]
        lost = (await get(paths, project, "slow", "lost"))["uid"]
        other = Database.open(paths.db)  # another host took the claim
        try:
            other.execute("UPDATE controller_queue SET claim_token = 'another-host' WHERE uid = ?", (lost,))
        finally:
            other.close()
        await wait_for(lambda: lost not in state.controllers.active)
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert len(alive) == 1  # the other reconcile goes on
        kept = await get(paths, project, "slow", "kept")
        assert kept["reconciling"]
        got = await get(paths, project, "slow", "lost")
        assert got["consecutiveErrors"] == 0 and got["lastError"] is None  # nothing recorded for a lost claim
    finally:
        state.stop_requested.set()


EXITS = """
    import os
    from piwf import Controller

    def reconcile(ctx):
        os._exit(3)  # ends without reporting: the host records the failure

    controller = Controller(name="exits", reconcile=reconcile)
"""


async def test_a_reconcile_end_the_store_refused_is_retried_not_dropped(
        paths: StatePaths, project: Path, nursery: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from piwf.errors import StorageFull
    from piwf.host.host import Host
    from piwf.store.sql.aggregates import ControllerQueueAggregate

    from .conftest import config

    real = ControllerQueueAggregate.record_failure
    errors: list[str] = []

    async def refused_once(self: ControllerQueueAggregate, *args: Any, **kwargs: Any) -> int | None:
        errors.append(kwargs["error"])
        if len(errors) == 1:
            raise StorageFull("disk full (in this test)")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(ControllerQueueAggregate, "record_failure", refused_once)
    state = await nursery.start(Host(config(paths)).serve)
    try:
        write_controller(project, "exits", EXITS)
        await ctl(paths, "apply", project, "exits", "x", spec={})

        async def failed() -> dict[str, Any] | None:
            got = await get(paths, project, "exits", "x")
            return got if got and got["consecutiveErrors"] >= 1 else None

        # Long before the claim's lease (120 s) could expire: the host retried what the store
        # refused, as it does for a run's worker; it did not leave the claim to run out.
        got = await wait_for(failed)
        assert len(errors) >= 2 and errors[0] == errors[1]
        assert "the reconcile worker ended without a result (exit 3" in errors[0]
        assert got["lastError"].startswith("the reconcile worker ended without a result")
        assert len(event_types(got, "reconcile_failed")) == got["consecutiveErrors"]
    finally:
        state.stop_requested.set()


REUSES_A_KEY = """
    from piwf import Controller, Result

    def reconcile(ctx):
        made = ctx.effects.ensure("sync", lambda: {"made": 1}, kind="create", request={"n": 1})
        again = ctx.resource.spec.get("again")
        if again:  # the same key for another action: another kind, or another request
            ctx.effects.ensure("sync", lambda: {"other": 1}, kind=again["kind"], request=again["request"])
        return Result.settled(status=made)

    controller = Controller(name="reuser", reconcile=reconcile)
"""


@pytest.mark.parametrize("again, message", [
    ({"kind": "delete", "request": {"n": 1}}, "reserved for kind 'create', not 'delete'"),
    ({"kind": "create", "request": {"n": 2}}, "reserved for another request"),
])
async def test_a_key_reused_for_another_action_fails_the_pass_as_a_conflict(
        host: Any, paths: StatePaths, project: Path, again: dict[str, Any], message: str) -> None:
    """Seed: a reconcile's effect is its key, kind and request fingerprint; the key reused
    for another action is a conflict, never the first action's stored result."""
    write_controller(project, "reuser", REUSES_A_KEY)
    await ctl(paths, "apply", project, "reuser", "same", spec={"again": {"kind": "create", "request": {"n": 1}}})
    await ctl(paths, "apply", project, "reuser", "other", spec={"again": again})

    async def settled(key: str) -> dict[str, Any] | None:
        got = await get(paths, project, "reuser", key)
        return got if got and got["ready"] is None and got["status"]["controllerStatus"] == {"made": 1} else None

    async def failed(key: str) -> dict[str, Any] | None:
        got = await get(paths, project, "reuser", key)
        return got if got and got["consecutiveErrors"] >= 1 else None

    same = await wait_for(lambda: settled("same"))  # the same action again: its stored result
    assert same["consecutiveErrors"] == 0
    refused = await wait_for(lambda: failed("other"))
    assert message in refused["lastError"] and "conflicts" in refused["lastError"]
    assert refused["status"]["controllerStatus"] != {"made": 1}  # nothing settled with the stale result
