"""Fault points: declared, reachable, and acting as specified."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import pytest
import trio

from piwf import faults
from piwf.paths import StatePaths

from .conftest import HostProcess, config, piwf, wait_for, write_workflow
from .test_controllers import write_controller
from .test_lifecycle import call

SRC = Path(__file__).parent.parent / "src" / "piwf"

EVERYTHING = """
    from piwf import Workflow, compute, decision, shell

    workflow = Workflow(
        name="everything",
        start_at="approve",
        nodes={
            "approve": decision("Go?", choices={"go": "Go"}, deadline=0.05, default="go"),
            "hello": shell(["echo", "hello"]),
            "send": compute(lambda ctx: ctx.effect("send", lambda: {"sent": True})),
        },
        edges=[("approve", "hello"), ("hello", "send")],
    )
"""


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    faults.configure({})


@pytest.mark.parametrize(("spec", "message"), [
    ("nowhere:exit", "unknown fault point 'nowhere'"),
    ("host.reply.sent:explode", "action must be one of exit, raise, sleep, not 'explode'"),
    ("host.reply.sent:exit:0", "count must be a positive integer, not '0'"),
    ("host.reply.sent:exit:x", "count must be a positive integer, not 'x'"),
    ("host.reply.sent", "must be point:action[:nth]"),
])
def test_a_bad_fault_spec_is_refused(spec: str, message: str) -> None:
    with pytest.raises(faults.BadFaultSpec, match=re.escape(message)):
        faults.configure({"PIWF_FAULT": spec})


async def test_serve_refuses_a_bad_fault_spec_before_touching_the_state_dir(paths: StatePaths) -> None:
    done = await trio.run_process(
        [sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root)],
        env={**os.environ, "PIWF_FAULT": "nowhere:exit"}, capture_stderr=True, check=False)
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and "unknown fault point" in done.stderr.decode()
    assert not paths.root.exists()


def test_every_point_used_in_the_source_is_declared_and_every_declared_point_is_used() -> None:
    used = set()
    for path in SRC.rglob("*.py"):
        used |= set(re.findall(r'faults\.point\("([^"]+)"\)', path.read_text()))
    assert used == set(faults.POINTS)


SETTLE = """
from piwf import Controller, Result

controller = Controller(name="settle", reconcile=lambda ctx: Result.settled())
"""


async def test_every_declared_point_is_reached(paths: StatePaths, project: Path, tmp_path: Path,
                                               nursery: trio.Nursery) -> None:
    from piwf.host.host import Host

    trace = tmp_path / "trace"
    write_workflow(project, "everything", EVERYTHING)
    faults.configure({"PIWF_FAULT_TRACE": str(trace)})
    # A 300 ms host lease: the heartbeat renews every 100 ms.
    host_config = config(paths, host_lease_ms=300, worker_env={"PIWF_FAULT_TRACE": str(trace)})
    host = await nursery.start(Host(host_config).serve)
    receipt = await call(paths, "run.start", payload={"workflow": "everything", "projectPath": str(project)})
    async def completed() -> bool:  # run.wait answers while it waits for its decision too
        done = await call(paths, "run.wait", run_id=receipt["runId"], payload={"timeoutMs": 20_000})
        assert done["status"] in ("waiting", "running", "completed"), done
        return done["status"] == "completed"

    await wait_for(completed)
    write_controller(project, "settle", SETTLE)  # and a controller's reconcile
    await call(paths, "controller.apply", payload={"projectPath": str(project), "controller": "settle", "key": "k",
                                                   "spec": {}})

    def reached() -> set[str]:
        return set(trace.read_text().split()) if trace.exists() else set()

    await wait_for(lambda: {"host.lease.renewed", "host.worker.recorded", "host.reconcile.recorded"} <= reached())
    host.stop_requested.set()
    assert reached() == set(faults.POINTS), f"never reached: {sorted(set(faults.POINTS) - reached())}"


async def test_a_raise_at_a_worker_commit_costs_one_worker_not_the_run(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    await host_process(env={"PIWF_FAULT": "host.worker.committed:raise:2"}).start()
    run_id = (await call(paths, "run.start", payload={"workflow": "greet", "projectPath": str(project)}))["runId"]
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    assert done["workers"][0]["status"] == "crashed"
    log = (await piwf(paths, "status")).stdout  # the host is still serving
    assert b"running" in log


ONE_NODE = """
from piwf import Workflow, compute

workflow = Workflow(name="one", start_at="n", nodes={"n": compute(lambda ctx: {"ok": True})})
"""


async def test_a_worker_that_exits_otherwise_after_its_run_ended_has_its_record_amended(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    """A worker's end is recorded with the message that ended its run, exit code 0
    presumed; one that then exits otherwise (here with 86, after reading that answer: its
    second) has its record amended, and its trace says so."""
    write_workflow(project, "one", ONE_NODE)
    await host_process(env={"PIWF_FAULT": "worker.answer.received:exit:2"}).start()
    run_id = (await call(paths, "run.start", payload={"workflow": "one", "projectPath": str(project)}))["runId"]
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done

    async def amended() -> Any:
        run = await call(paths, "run.status", run_id=run_id)
        return run if run["workers"][0]["exitCode"] == 86 else None

    run = await wait_for(amended)
    assert [(w["status"], w["signal"]) for w in run["workers"]] == [("exited", None)]
    events = (await call(paths, "run.events", run_id=run_id))["events"]
    assert [e["type"] for e in events][-3:] == ["completed", "worker.finished", "worker.amended"]
    assert (events[-2]["exitCode"], events[-1]["exitCode"]) == (0, 86)


async def test_a_worker_that_exits_as_told_after_its_run_ended_is_recorded_once(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    write_workflow(project, "one", ONE_NODE)
    await host_process().start()
    run_id = (await call(paths, "run.start", payload={"workflow": "one", "projectPath": str(project)}))["runId"]
    await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    # its worker's supervision over (its exit seen, nothing left to record)
    await wait_for(lambda: _no_active_workers(paths))
    run = await call(paths, "run.status", run_id=run_id)
    assert [(w["status"], w["exitCode"], w["signal"]) for w in run["workers"]] == [("exited", 0, None)]
    events = (await call(paths, "run.events", run_id=run_id))["events"]
    assert [e["type"] for e in events][-2:] == ["completed", "worker.finished"]


async def _no_active_workers(paths: StatePaths) -> bool:
    return bool((await call(paths, "host.status"))["activeWorkers"] == 0)
