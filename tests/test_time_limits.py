"""A node's time limit is the host's: a worker that is stopped (SIGSTOP) or just slow is
stopped at its node's limit; the node fails, or takes its `timeout` exit; an effect cut
short holds the run; an ask's validation is refused; `run show` says when a worker is
stopped. Before, a SIGSTOPped worker held its slot forever."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from piwf.engine.definition import compute
from piwf.errors import DefinitionError
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import HostProcess, config, piwf, wait_for, write_workflow
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call

STUCK = """
    import os, time
    from pathlib import Path
    from piwf import Workflow, compute, shell

    def stuck(ctx):
        Path(ctx.project_path, "started").write_text(str(os.getpid()))
        if ctx.input.get("effect"):
            ctx.effect("charge", lambda: time.sleep(600))
        while True:
            time.sleep(0.05)

    NODES = {
        "compute": compute(stuck, time_limit=LIMIT),
        "shell": shell(["sh", "-c", "echo $$ > started; exec sleep 600"], timeout=600, time_limit=LIMIT),
    }
    EXITS = [("stuck.timeout", "after")] if TIMEOUT_EXIT else []
    workflow = Workflow(name="stuck", start_at="stuck",
                        nodes={"stuck": NODES[KIND], "after": compute(lambda ctx: {"after": ctx.outputs["stuck"]})},
                        edges=[("stuck", "after"), *EXITS])
"""

SLOW_CHECK = """
    import os, time
    from pathlib import Path
    from piwf import Workflow, ask

    def check(value):
        if value == "hang":
            Path(PROJECT, "validating").write_text(str(os.getpid()))
            time.sleep(600)

    workflow = Workflow(name="slowcheck", start_at="name",
                        nodes={"name": ask("Name?", expect=str, validate=check, time_limit=0.5)})
"""


def _stuck(project: Path, kind: str, *, limit: float = 0.5, timeout_exit: bool = False) -> None:
    write_workflow(project, "stuck", f"LIMIT = {limit}\nKIND = {kind!r}\nTIMEOUT_EXIT = {timeout_exit}\n"
                   + STUCK.replace("\n    ", "\n"))


async def _worker_pid(paths: StatePaths, run_id: str) -> int:
    async def running() -> int | None:
        workers = (await call(paths, "run.status", run_id=run_id))["workers"]
        return next((w["pid"] for w in workers if w["status"] == "running" and w["pid"]), None)
    return await wait_for(running)


@pytest.mark.parametrize("kind", ["compute", "shell"])
async def test_a_sigstopped_worker_is_stopped_at_its_nodes_limit_and_the_node_fails(
        host: Any, paths: StatePaths, project: Path, kind: str) -> None:
    _stuck(project, kind)
    run_id = await start(paths, project, "stuck")
    pid = await _worker_pid(paths, run_id)
    await wait_for(lambda: (project / "started").exists())
    os.kill(pid, signal.SIGSTOP)  # nothing in the worker can act now; shell()'s own timeout included
    done = await wait_run(paths, run_id)
    assert done["status"] == "failed", done
    assert done["error"]["type"] == "TimeLimit"
    assert done["error"]["message"] == "node stuck: did not finish within its time limit of 0.5 s"
    assert [w["status"] for w in done["workers"]] == ["timedOut"]
    assert "[piwf] node stuck did not finish within its time limit of 0.5 s" in done["workers"][0]["diagnostic"]
    assert (await call(paths, "host.status"))["activeWorkers"] == 0  # its slot is free
    if kind == "shell":  # the program's own group went with it
        program = int((project / "started").read_text())
        await wait_for(lambda: not Path(f"/proc/{program}").exists() or _zombie(program))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_node_with_a_timeout_exit_takes_it_at_its_limit(host: Any, paths: StatePaths,
                                                                project: Path) -> None:
    _stuck(project, "compute", timeout_exit=True)  # slow, not stopped: the same limit
    done = await wait_run(paths, await start(paths, project, "stuck"))
    assert done["status"] == "completed", done.get("error")
    assert done["output"] == {"after": None}
    assert [(s["node"], s["status"], s["exit"]) for s in done["steps"]] == [
        ("stuck", "accepted", "timeout"), ("after", "accepted", "next")]
    assert [w["status"] for w in done["workers"]] == ["timedOut", "exited"]


async def test_a_node_stopped_at_its_limit_while_applying_an_effect_holds_the_run(
        host: Any, paths: StatePaths, project: Path) -> None:
    _stuck(project, "compute")
    run_id = await start(paths, project, "stuck", input={"effect": True})
    held = await wait_run(paths, run_id)
    assert (held["queueStatus"], held["hold"]) == ("parked", "effect"), held
    assert held["statusDetail"] == "ambiguous effect charge"
    assert [(e["key"], e["status"]) for e in held["effects"]] == [("charge", "ambiguous")]


async def test_an_ask_whose_validation_passes_its_limit_refuses_the_submission_and_waits_again(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "slowcheck", f"PROJECT = {str(project)!r}\n" + SLOW_CHECK.replace("\n    ", "\n"))
    run_id = await start(paths, project, "slowcheck")
    request = await open_request(paths, run_id)
    await call(paths, "interaction.submit", payload={"requestId": request["requestId"], "value": "hang"})

    async def refused() -> dict[str, Any] | None:
        page = await call(paths, "interaction.list", payload={"runId": run_id})
        last = page["requests"][0].get("lastSubmission") if page["requests"] else None
        return last if last and last["status"] == "rejected" else None
    last = await wait_for(refused)
    assert "before it completed validation" in last["error"]
    run = await call(paths, "run.status", run_id=run_id)
    assert run["status"] == "waiting"
    assert [w["status"] for w in run["workers"]][-1] == "timedOut"


async def test_run_show_says_when_a_worker_is_stopped(host: Any, paths: StatePaths, project: Path) -> None:
    _stuck(project, "compute", limit=600)
    run_id = await start(paths, project, "stuck")
    pid = await _worker_pid(paths, run_id)
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_for(lambda: _state(pid) == "T")
        shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
        assert f"(pid {pid}) is stopped (SIGSTOP or a debugger)" in shown
        status = await call(paths, "run.status", run_id=run_id)
        assert [w["stopped"] for w in status["workers"]] == [True]
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_for(lambda: _state(pid) != "T")
    assert [w["stopped"] for w in (await call(paths, "run.status", run_id=run_id))["workers"]] == [False]
    assert await call(paths, "run.cancel", run_id=run_id)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_time_limit_is_in_the_digest_only_when_set_and_is_a_positive_number() -> None:
    assert "timeLimit" not in compute(lambda ctx: 1).describe()
    assert compute(lambda ctx: 1, time_limit=2).describe()["timeLimit"] == 2.0
    for bad in (0, -1, True, "5", 10**9):
        with pytest.raises(DefinitionError, match="time_limit must be a number of seconds"):
            compute(lambda ctx: 1, time_limit=bad)  # type: ignore[arg-type]


SHELL_TIMEOUT = """
    from piwf import Workflow, compute, shell

    EXITS = [("slow.timeout", "after")] if TIMEOUT_EXIT else []
    workflow = Workflow(name="slowshell", start_at="slow",
                        nodes={"slow": shell(["sleep", "600"], timeout=0.2),
                               "after": compute(lambda ctx: {"after": ctx.outputs["slow"]})},
                        edges=[("slow", "after"), *EXITS])
"""


@pytest.mark.parametrize("timeout_exit", [True, False])
async def test_a_shell_nodes_own_timeout_takes_its_timeout_exit_too(
        host: Any, paths: StatePaths, project: Path, timeout_exit: bool) -> None:
    write_workflow(project, "slowshell", f"TIMEOUT_EXIT = {timeout_exit}\n" + SHELL_TIMEOUT.replace("\n    ", "\n"))
    done = await wait_run(paths, await start(paths, project, "slowshell"))
    if timeout_exit:
        assert done["status"] == "completed", done.get("error")
        assert done["output"] == {"after": None}
    else:
        assert done["status"] == "failed"
        assert done["error"]["message"] == "node slow: sleep timed out after 0.2 s"


async def test_the_hosts_node_time_limit_stops_a_node_without_one_of_its_own(
        paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    _stuck(project, "compute", limit=600)  # its own limit is longer: the host's wins
    await nursery.start(Host(config(paths, node_time_limit_s=0.5)).serve)
    run_id = await start(paths, project, "stuck")
    pid = await _worker_pid(paths, run_id)
    await wait_for(lambda: (project / "started").exists())
    os.kill(pid, signal.SIGSTOP)
    done = await wait_run(paths, run_id)
    assert done["status"] == "failed"
    assert done["error"]["message"] == "node stuck: did not finish within the host time limit of 0.5 s"


async def test_the_hosts_node_time_limit_takes_a_nodes_timeout_exit(
        paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    write_workflow(project, "noexit", """
        import time
        from piwf import Workflow, compute

        workflow = Workflow(name="noexit", start_at="slow",
                            nodes={"slow": compute(lambda ctx: time.sleep(600)),
                                   "after": compute(lambda ctx: "after the host's limit")},
                            edges=[("slow.timeout", "after")])
    """)
    await nursery.start(Host(config(paths, node_time_limit_s=0.5)).serve)
    done = await wait_run(paths, await start(paths, project, "noexit"))
    assert (done["status"], done["output"]) == ("completed", "after the host's limit"), done.get("error")


async def test_piwf_serve_takes_a_node_time_limit(host_process: Callable[..., HostProcess], paths: StatePaths,
                                                 project: Path) -> None:
    refused = await piwf(paths, "serve", "--node-time-limit", "0", check=False)
    assert refused.returncode == 2 and b"--node-time-limit" in refused.stderr
    _stuck(project, "compute", limit=600)
    await host_process("--node-time-limit", "0.5").start()
    done = await wait_run(paths, await start(paths, project, "stuck"))
    assert done["error"]["message"] == "node stuck: did not finish within the host time limit of 0.5 s"
