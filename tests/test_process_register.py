"""``process.register`` follows the seed's rules: the host kills a registered process's
group when its worker ends, so only a live direct child of the worker that leads its own
group, registered to no other worker, may be registered (seed 000)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from piwf.paths import StatePaths

from .conftest import wait_for, write_workflow
from .test_interactions import start, wait_run
from .test_lifecycle import call

REGISTERS = """
    import os, signal, subprocess, sys
    from piwf import Workflow, compute, processes
    from piwf.errors import HostRefused
    from piwf.protocol.worker import ProcessRegister, ProcessRegisterPayload

    def target(kind, pid):
        if kind == "foreign":
            return pid, []
        if kind == "zero":
            return 0, []
        if kind == "worker":
            return os.getpid(), []
        if kind == "not-leader":
            child = subprocess.Popen(["sleep", "300"])
            return child.pid, [child.pid]
        assert kind == "grandchild"
        child = subprocess.Popen([sys.executable, "-c", "import subprocess; p = subprocess.Popen(['sleep', '300'], "
                                  "start_new_session=True); print(p.pid, flush=True); p.wait()"],
                                 stdout=subprocess.PIPE, start_new_session=True)
        grandchild = int(child.stdout.readline())
        return grandchild, [grandchild, child.pid]

    def register(ctx):
        pid, mine = target(ctx.input["kind"], ctx.input.get("pid"))
        try:
            ctx.journal.channel.request(ProcessRegister, ProcessRegisterPayload(
                pid=pid, identity=processes.identity(pid) or "none", node="register"))
            outcome = {"registered": pid}
        except HostRefused as exc:
            outcome = {"refused": str(exc)}
        for own in mine:
            os.kill(own, signal.SIGKILL)
        return outcome

    workflow = Workflow(name="registers", start_at="register", nodes={"register": compute(register)})
"""


async def _ended(paths: StatePaths, run_id: str) -> bool:
    """Its worker's end is recorded: the groups it registered were reaped before that."""
    workers = (await call(paths, "run.status", run_id=run_id))["workers"]
    return bool(workers) and all(w["status"] not in ("starting", "running") for w in workers)


async def test_a_process_of_the_user_that_is_not_the_workers_is_refused_and_left_alone(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "registers", REGISTERS)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)  # the user's: a group leader
    try:
        run_id = await start(paths, project, "registers", input={"kind": "foreign", "pid": bystander.pid})
        done = await wait_run(paths, run_id)
        await wait_for(lambda: _ended(paths, run_id))
        assert done["output"] == {"refused": f"host refused process.register: process {bystander.pid} is not a "
                                             "child of the worker (pid " + str(done["workers"][0]["pid"]) + ")"}
        assert bystander.poll() is None  # today's main kills its group when the worker ends
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize(("kind", "said"), [
    ("zero", "process pid must be positive, not 0"),
    ("worker", "is not a child of the worker"),
    ("not-leader", "does not lead its own process group"),
    ("grandchild", "is not a child of the worker"),
])
async def test_what_the_worker_did_not_start_as_a_group_of_its_own_is_refused(
        host: Any, paths: StatePaths, project: Path, kind: str, said: str) -> None:
    write_workflow(project, "registers", REGISTERS)
    done = await wait_run(paths, await start(paths, project, "registers", input={"kind": kind}))
    assert done["status"] == "completed", done.get("error")
    assert said in done["output"]["refused"]


async def test_a_shell_node_still_registers_its_own_group(host: Any, paths: StatePaths, project: Path) -> None:
    """A refused registration would end the worker (its node cannot start its program)."""
    done = await wait_run(paths, await start(paths, project, "greet"))
    assert done["status"] == "completed" and done["output"] == {"text": "HELLO\n"}
    assert [w["status"] for w in done["workers"]] == ["exited"]


def test_the_host_reads_parent_and_group_from_proc() -> None:
    from piwf import processes

    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert processes.parent_and_group(child.pid) == (os.getpid(), child.pid)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert processes.parent_and_group(child.pid) is None
