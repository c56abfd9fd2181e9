"""Worker start-up: forked from the preloaded template, or spawned; same isolation either way."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from piwf.paths import StatePaths

from .conftest import HostProcess, wait_for, write_workflow
from .test_lifecycle import call

WHOAMI = """
    import os
    from piwf import Workflow, compute

    def whoami(ctx):
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                "cwd": os.getcwd(), "marker": os.environ.get("PIWF_TEST_MARKER"), "fds": fds,
                "template": os.environ.get("PIWF_FORKSERVER_FD")}

    workflow = Workflow(name="whoami", start_at="who", nodes={"who": compute(whoami)})
"""


async def run_whoami(paths: StatePaths, project: Path) -> dict:
    receipt = await call(paths, "run.start", payload={"workflow": "whoami", "projectPath": str(project)})
    done = await call(paths, "run.wait", run_id=receipt["runId"], payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    return done["output"]


def templates(host_pid: int) -> list[int]:
    """The host's fork server, if it has one (a worker just ended may be a zombie child)."""
    found = []
    for child in psutil.Process(host_pid).children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_each_run_gets_a_fresh_process_in_its_own_process_group(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, mode: str
) -> None:
    write_workflow(project, "whoami", WHOAMI)
    host = await host_process("--worker-start", mode, env={"PIWF_TEST_MARKER": mode}).start()
    first, second = await run_whoami(paths, project), await run_whoami(paths, project)
    assert first["pid"] != second["pid"]
    assert host.proc is not None
    for seen in (first, second):
        assert seen["pid"] == seen["pgid"]  # its own process group
        assert seen["sid"] not in (os.getsid(0), os.getsid(host.proc.pid))  # not the terminal's, not the host's
        assert seen["cwd"] == str(project)
        assert seen["marker"] == mode  # the host's environment, passed on
        assert seen["template"] is None
        assert seen["fds"][:3] == [0, 1, 2] and len(seen["fds"]) <= 8  # its pipes, no template leftovers
    [template] = templates(host.proc.pid)
    assert first["ppid"] == second["ppid"] == template  # never the host: a node cannot signal it as its parent


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_a_killed_template_is_started_again_and_the_host_is_never_a_workers_parent(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, mode: str
) -> None:
    write_workflow(project, "whoami", WHOAMI)
    host = await host_process("--worker-start", mode).start()
    assert host.proc is not None
    await run_whoami(paths, project)  # the template is up and used
    [first] = templates(host.proc.pid)
    os.kill(first, signal.SIGKILL)
    await wait_for(lambda: templates(host.proc.pid) not in ([], [first]))
    [second] = templates(host.proc.pid)
    seen = await run_whoami(paths, project)
    assert seen["ppid"] == second != host.proc.pid
    assert "the fork server exited; starting another" in host.log.read_text()
