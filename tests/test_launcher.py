"""Worker start-up: forked from the preloaded template, or spawned; same isolation either way."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import trio

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
                "template": os.environ.get("PIWF_FORKSERVER_FD"),
                "pipes": [int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(",")]}

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
        assert seen["fds"][:3] == [0, 1, 2]
        leftovers = set(seen["fds"]) - {0, 1, 2, *seen["pipes"]}
        assert len(leftovers) <= 1  # its pipes, and the listing's own descriptor: no template leftovers
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


ENVELOPE = """
    import base64, json, os
    from piwf import Workflow, compute

    def envelope(ctx):
        raw = os.environ["PIWF_WORKER_LAUNCH"]
        return json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))

    workflow = Workflow(name="envelope", start_at="read", nodes={"read": compute(envelope)})
"""


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_the_launch_envelope_names_its_schema_and_protocol_version(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, mode: str
) -> None:
    write_workflow(project, "envelope", ENVELOPE)
    await host_process("--worker-start", mode).start()
    receipt = await call(paths, "run.start", payload={"workflow": "envelope", "projectPath": str(project)})
    done = await call(paths, "run.wait", run_id=receipt["runId"], payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    seen = done["output"]
    assert (seen["schema"], seen["protocolVersion"], seen["runId"]) == (
        "piwf.worker-launch.v1", 1, receipt["runId"])


def _launch(fields: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")


RUN_ENVELOPE = {"runId": "r", "generation": 1, "workerEpoch": "w", "projectPath": "/", "workflow": "w",
                "definitionDigest": "d", "inputHash": "h", "schema": "piwf.worker-launch.v1", "protocolVersion": 1}
RECONCILE_ENVELOPE = {"uid": "u", "generation": 1, "workerEpoch": "w", "projectPath": "/", "controller": "c",
                      "schema": "piwf.reconcile-launch.v1", "protocolVersion": 1}


@pytest.mark.parametrize("var, envelope, message", [
    ("PIWF_WORKER_LAUNCH", {**RUN_ENVELOPE, "protocolVersion": 2}, "protocol version 2; this worker follows "
                                                                   "piwf.worker-launch.v1, protocol version 1"),
    ("PIWF_WORKER_LAUNCH", {**RUN_ENVELOPE, "schema": "piwf.worker-launch.v2"}, "is piwf.worker-launch.v2"),
    ("PIWF_WORKER_LAUNCH", {k: v for k, v in RUN_ENVELOPE.items() if k != "schema"}, "is of no schema"),
    ("PIWF_WORKER_LAUNCH", {**RUN_ENVELOPE, "schema": "piwf.reconcile-launch.v1"}, "this worker follows "
                                                                                   "piwf.worker-launch.v1"),
    ("PIWF_WORKER_LAUNCH", "not an envelope", "unreadable"),
    ("PIWF_RECONCILE_LAUNCH", {**RECONCILE_ENVELOPE, "protocolVersion": 0}, "protocol version 0"),
    ("PIWF_RECONCILE_LAUNCH", {**RECONCILE_ENVELOPE, "extra": 1}, "unreadable: Object contains unknown field"),
])
async def test_a_worker_refuses_a_launch_envelope_it_does_not_know(
        tmp_path: Path, var: str, envelope: object, message: str) -> None:
    """A worker given an envelope of another schema or protocol version (a host of another
    piwf) says so in one line and exits 5, before it sends or reads anything."""
    raw = _launch(envelope) if isinstance(envelope, dict) else str(envelope)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIWF_")} | {var: raw}
    done = await trio.run_process([sys.executable, "-m", "piwf.worker"], env=env, cwd=tmp_path, check=False,
                                  capture_stdout=True, capture_stderr=True)
    assert done.returncode == 5, done.stderr
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("piwf ") and message in line, line


def test_a_forked_child_gets_exactly_the_runs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template's environment is changed in place into the run's: what the run does
    not have goes, what differs is replaced, what is the same stays."""
    from piwf.worker import forkserver

    template = {"KEPT": "1", "CHANGED": "old", "GONE": "x"}
    monkeypatch.setattr(os, "environ", template)
    forkserver._set_environment({"KEPT": "1", "CHANGED": "new", "ADDED": "y"})
    assert template == {"KEPT": "1", "CHANGED": "new", "ADDED": "y"}


def waiting_children(template: int, *workers: int) -> list[int]:
    """The template's one spare: its live children but ``workers`` (a worker whose run has
    ended may not have exited yet), when there is exactly one, else none."""
    found = []
    for child in psutil.Process(template).children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in workers and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
    return found if len(found) == 1 else []


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_a_worker_forked_ahead_takes_the_next_run_and_only_that_one(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, mode: str
) -> None:
    write_workflow(project, "whoami", WHOAMI)
    host = await host_process("--worker-start", mode).start()
    assert host.proc is not None
    first = await run_whoami(paths, project)
    [template] = templates(host.proc.pid)
    [spare] = await wait_for(lambda: waiting_children(template, first["pid"]))
    seen = await run_whoami(paths, project)
    assert seen["pid"] == spare == seen["pgid"] and seen["ppid"] == template
    assert seen["cwd"] == str(project) and len(set(seen["fds"]) - {0, 1, 2, *seen["pipes"]}) <= 1
    [after] = await wait_for(lambda: waiting_children(template, first["pid"], spare))  # another spare
    os.kill(template, signal.SIGKILL)
    await wait_for(lambda: gone(after))  # a spare ends with its template


async def test_a_spare_that_dies_before_its_run_is_reaped_and_the_run_gets_a_fresh_child(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    write_workflow(project, "whoami", WHOAMI)
    host = await host_process().start()
    assert host.proc is not None
    first = await run_whoami(paths, project)
    [template] = templates(host.proc.pid)
    [spare] = await wait_for(lambda: waiting_children(template, first["pid"]))
    os.kill(spare, signal.SIGKILL)
    await wait_for(lambda: gone(spare))  # dead: handing it a run fails, so the template forks one
    seen = await run_whoami(paths, project)
    assert seen["pid"] != spare and seen["ppid"] == template
    await wait_for(lambda: not psutil.pid_exists(spare))  # its exit reported, and reaped at the host's word


async def test_a_start_waiting_on_a_stopped_template_fails_as_soon_as_the_launcher_closes(tmp_path: Path) -> None:
    """The template's answers are waited for under one watchdog of the launcher's reader
    (host/fork_launcher.py), not a timeout per start: a launcher that stops fails the starts
    still waiting at once (not after TEMPLATE_READY_S), as LauncherUnavailable."""
    from piwf.host.fork_launcher import ForkLauncher
    from piwf.host.launcher import Launch, LauncherUnavailable
    from piwf.host.worker_process import Pipes

    launcher = ForkLauncher()
    serving = trio.CancelScope()
    refused: list[str] = []

    async def serve() -> None:
        with serving:
            await launcher.serve()

    async def start() -> None:
        with Pipes() as pipes, pytest.raises(LauncherUnavailable) as refusal:
            await launcher.start(Launch(str(tmp_path), dict(os.environ), pipes.to_worker_r, pipes.from_worker_w))
        refused.append(str(refusal.value))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await wait_for(lambda: launcher._process is not None and launcher._up.value)
        assert launcher._process is not None
        template = launcher._process.pid
        os.kill(template, signal.SIGSTOP)  # it reads no more Forks: the start waits for an answer
        try:
            nursery.start_soon(start)
            await wait_for(lambda: launcher._pending)
            with trio.fail_after(5):  # well before the 10 s a start may wait for the template
                serving.cancel()
                await wait_for(lambda: refused)
        finally:
            os.kill(template, signal.SIGCONT)
    assert refused == ["the fork server is closing"]


async def test_the_watchdog_passing_after_its_starts_were_answered_keeps_the_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's watchdog is set by a start and not moved by its answer: when it passes
    with no start left unanswered for TEMPLATE_READY_S, it watches again; the template lives on."""
    from piwf.host import fork_launcher
    from piwf.host.launcher import Launch, WorkerHandle, stop_worker
    from piwf.host.worker_process import Pipes

    monkeypatch.setattr(fork_launcher, "TEMPLATE_READY_S", 2.0)
    launcher = fork_launcher.ForkLauncher()

    async def started() -> WorkerHandle:
        with Pipes() as pipes:
            return await launcher.start(Launch(str(tmp_path), dict(os.environ), pipes.to_worker_r,
                                               pipes.from_worker_w))

    async def ended(worker: WorkerHandle) -> None:
        with trio.fail_after(10):
            await stop_worker(worker, 0, exited=False)
        assert worker.stdout is not None
        await worker.stdout.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launcher.serve)
        await wait_for(lambda: launcher._up.value and launcher._watchdog is not None)
        template, watchdog = launcher._process, launcher._watchdog
        assert template is not None and watchdog is not None
        await ended(await started())  # answered: nobody waits, the watchdog's deadline stays
        assert watchdog.deadline < math.inf and launcher._watchdog is watchdog
        await wait_for(lambda: launcher._watchdog is not watchdog)  # it passed, and watches again
        assert launcher._process is template and template.returncode is None and launcher._up.value
        await ended(await started())
        nursery.cancel_scope.cancel()
