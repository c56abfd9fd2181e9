"""What the CLI tells a user to do next, against a real host (issue 23; probe findings
PROBE-23 items 2-5): a `run start --timeout` shorter than a slow import says the workflow is
still loading and gives the exact retry command (the same request id: adopted, not a second
run); a run held for its workflow file, and a paused run that waits for an answer, name
`piwf run resume`; `run wait` and `run start --wait` outlast a host restart."""

from __future__ import annotations

import os
import pty
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.cli.waiting import Deadline, wait_for_run
from piwf.client import Client
from piwf.host.host import Host
from piwf.host.lock import is_held
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import HostProcess, config, piwf, wait_for, write_workflow
from .test_cli_wait import ASKS, _read_all
from .test_interactions import open_request
from .test_lifecycle import call, run_status, start

SLOW_IMPORT = """
    import time
    from pathlib import Path
    from piwf import Workflow, shell

    while not Path(GATE).exists():  # its import takes until the test opens the gate
        time.sleep(0.02)
    workflow = Workflow(name="slowimp", start_at="a", nodes={"a": shell(["true"])})
"""


async def test_a_start_timeout_on_a_slow_import_says_it_loads_and_how_to_retry(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    gate = project / "imported"
    write_workflow(project, "slowimp", SLOW_IMPORT.replace("GATE", repr(str(gate))))
    first = await piwf(paths, "run", "start", "slowimp", "--project", str(project), "--timeout", "1", check=False)
    assert first.returncode == 10, first.stderr
    said = first.stderr.decode()
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert "frozen" not in said  # before: "did not answer within 1 s (frozen or overloaded? ...)"
    assert "workflow slowimp is still loading" in said, said
    assert "piwf run list --workflow slowimp" in said, said
    retry = re.search(r"retry with the same request id \(adopted, not a second run\): (piwf run start .*)$",
                      said.strip())
    assert retry, said
    words = shlex.split(retry.group(1))
    assert "--timeout" not in words and words[words.index("--project") + 1] == str(project)

    gate.touch()
    with trio.fail_after(60):  # the very command the CLI printed, word for word
        again = await trio.run_process([sys.executable, "-m", *words], capture_stdout=True,
                                       capture_stderr=True, check=False)
    assert (again.returncode, again.stderr) == (0, b""), again.stderr
    run_id = again.stdout.decode().strip()
    runs = await call(paths, "run.list", payload={"workflow": "slowimp"})
    assert [run["runId"] for run in runs] == [run_id]  # one run: the retry was adopted
    assert (await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000}))["status"] == "completed"


async def test_a_run_held_for_its_workflow_file_goes_on_once_the_file_is_restored_or_resumed(
        host: HostState, paths: StatePaths, project: Path) -> None:
    workflow = write_workflow(project, "asks", ASKS)
    original = workflow.read_text()
    run_id = await start(paths, project, "asks")
    request = await open_request(paths, run_id)
    workflow.write_text(original.replace("How many?", "How many, now?"))
    held = await piwf(paths, "answer", request["requestId"], "--value", "5", "--wait", check=False)
    assert held.returncode == 24, held.stderr
    said = held.stderr.decode()
    assert ("restore the workflow file: the run is tried again once it changes (or start a host of queue default "
            f"that has it); or keep the change: piwf run resume {run_id}") in said, said
    assert said.count("resume") == 1, said  # the host's detail does not say "resume" too
    shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
    assert "release:  restore the workflow file: the run is tried again once it changes" in shown

    workflow.write_text(original)  # restored exactly: the host finds it so on its next poll and goes on

    async def completed() -> bool:
        return bool((await run_status(paths, run_id))["status"] == "completed")

    await wait_for(completed, timeout=30)  # the answer given while it was held is validated, and taken

    workflow.write_text(original.replace("How many?", "How many, now?"))  # kept changed: resume adopts it
    second = await start(paths, project, "asks")
    request = await open_request(paths, second)
    workflow.write_text(original.replace("How many?", "How many, later?"))
    again = await piwf(paths, "answer", request["requestId"], "--value", "5", "--wait", check=False)
    assert again.returncode == 24, again.stderr
    await piwf(paths, "run", "resume", second)  # what the hint says: the run goes on with the file as it is
    resumed = await piwf(paths, "run", "wait", second, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert (await run_status(paths, second))["status"] == "completed"


async def test_a_run_held_for_a_file_that_does_not_load_says_fix_it_then_resume(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    workflow = write_workflow(project, "asks", ASKS)
    original = workflow.read_text()
    run_id = await start(paths, project, "asks")
    request = await open_request(paths, run_id)
    workflow.write_text(original + "\ndef broken(:\n")
    held = await piwf(paths, "answer", request["requestId"], "--value", "5", "--wait", check=False)
    assert held.returncode == 24, held.stderr
    said = held.stderr.decode()
    assert "is held (source): no live host can load its workflow: host-" in said and "workflow cannot load:" in said
    assert said.rstrip().endswith(f"; fix the workflow file: the run is tried again once it changes (or start a "
                                  f"host of queue default that can load it), or piwf run resume {run_id}"), said
    assert "go on with the new one" not in said  # before: the new one does not load


async def test_a_paused_run_that_waits_for_an_answer_is_released_by_resume(host: HostState, paths: StatePaths,
                                                                          project: Path) -> None:
    write_workflow(project, "asks", ASKS)
    run_id = await start(paths, project, "asks")
    await open_request(paths, run_id)
    await call(paths, "run.pause", run_id=run_id)
    paused = await piwf(paths, "run", "wait", run_id, check=False)
    assert paused.returncode == 23, paused.stderr
    assert paused.stderr == f"piwf: run {run_id} is paused: piwf run resume {run_id}\n".encode()  # not the inbox
    shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
    assert f"release:  piwf run resume {run_id}\n" in shown + "\n", shown
    await call(paths, "run.resume", run_id=run_id)
    waiting = await piwf(paths, "run", "wait", run_id, check=False)  # resumed, it waits for its answer again
    assert waiting.returncode == 25 and f"piwf inbox --run {run_id}".encode() in waiting.stderr


GATED_SHELL = """
    from piwf import Workflow, shell

    workflow = Workflow(name="gated_shell", start_at="wait", nodes={
        "wait": shell(["sh", "-c", "while [ ! -e gate ]; do sleep 0.02; done"]),
    })
"""


async def test_a_wait_outlasts_a_host_restart(host_process: Callable[..., HostProcess], paths: StatePaths,
                                              project: Path) -> None:
    write_workflow(project, "gated_shell", GATED_SHELL)
    host = await host_process().start()
    run_id = await start(paths, project, "gated_shell")
    leader, follower = pty.openpty()
    on_terminal = await trio.lowlevel.open_process(  # progress and the reconnect notice: a terminal's
        [sys.executable, "-m", "piwf", "run", "wait", run_id, "--state-dir", str(paths.root)],
        stdout=subprocess.PIPE, stderr=follower, env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
    os.close(follower)
    drawn = bytearray()
    results: dict[str, Any] = {}

    async def read_the_terminal() -> None:
        while True:
            try:
                chunk = await trio.to_thread.run_sync(os.read, leader, 65536, abandon_on_cancel=True)
            except OSError:  # EIO: the CLI has exited
                return
            if not chunk:
                return
            drawn.extend(chunk)

    async def piped() -> None:  # `piwf run wait RUN && deploy` in a script: nothing on stderr
        results["piped"] = await piwf(paths, "run", "wait", run_id, check=False)

    starting = await trio.lowlevel.open_process(  # `run start --wait`: its run id first, then the wait
        [sys.executable, "-m", "piwf", "run", "start", "gated_shell", "--project", str(project), "--wait",
         "--state-dir", str(paths.root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert starting.stdout is not None and starting.stderr is not None
    started = b""

    async def started_and_waiting() -> None:
        assert starting.stdout is not None and starting.stderr is not None
        out, err = await _read_all(starting.stdout), await _read_all(starting.stderr)
        results["start"] = subprocess.CompletedProcess(starting.args, await starting.wait(), started + out, err)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_the_terminal)
            nursery.start_soon(piped)
            with trio.fail_after(60):  # the run was started and answered: not a request the stop cuts short
                while not started.endswith(b"\n"):
                    started += await starting.stdout.receive_some(1)
            nursery.start_soon(started_and_waiting)
            await wait_for(lambda: _clients(paths, at_least=4))  # three waits, and this status call
            host.signal(signal.SIGTERM)  # `systemctl restart`: the host drains and exits ...
            assert await host.wait() == 0
            await host_process().start()  # ... and comes back
            (project / "gate").touch()
            with trio.fail_after(60):
                assert await on_terminal.wait() == 0
            await wait_for(lambda: len(results) == 2, timeout=60)  # the two other waits end as this one did
            nursery.cancel_scope.cancel()
    finally:
        os.close(leader)
    assert on_terminal.stdout is not None
    assert "status:   completed / done" in (await _read_all(on_terminal.stdout)).decode()
    assert b"piwf: lost the host" in drawn and b"reconnecting" in drawn and b"reconnected to the host" in drawn
    piped_done, start_done = results["piped"], results["start"]
    assert (piped_done.returncode, piped_done.stderr) == (0, b""), piped_done.stderr  # before: exit 9
    assert "status:   completed / done" in piped_done.stdout.decode()
    assert (start_done.returncode, start_done.stderr) == (0, b""), start_done.stderr
    assert "status:   completed / done" in start_done.stdout.decode()


async def _clients(paths: StatePaths, at_least: int) -> bool:
    try:
        return bool((await call(paths, "host.status"))["connectedClients"] >= at_least)
    except Exception:
        return False


async def test_a_wait_on_a_connection_just_answered_outlasts_a_restart(
        paths: StatePaths, project: Path, nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]) -> None:
    """`run start --wait` whose host stops right after answering the start: the wait that
    follows on the same connection waits for the host to come back (it used to find no
    host on its first connect and exit 9 at once)."""
    first = await nursery.start(Host(config(paths)).serve)
    run_id = await start(paths, project, "greet")
    await call(paths, "run.wait", run_id=run_id)
    client = Client(paths, timeout=10)
    await trio.to_thread.run_sync(client.call, "host.status")  # answered: the connection is kept
    first.stop_requested.set()
    await wait_for(lambda: not is_held(paths))  # that host is gone, its lock released
    said: list[str] = []
    ended: list[Any] = []

    def lost_or_ended() -> bool:
        said.append(capsys.readouterr().err)
        return "reconnecting" in "".join(said) or bool(ended)

    async with trio.open_nursery() as waiting:
        waiting.start_soon(_in_thread, ended, wait_for_run, client, run_id, Deadline(60_000))
        await wait_for(lost_or_ended)  # the wait found no host: it says so and tries again
        assert not ended, ended
        await nursery.start(Host(config(paths)).serve)
    client.close()
    assert "".join(said).count("piwf: lost the host") == 1
    assert ended[0]["status"] == "completed" and ended[0]["atRest"], ended


async def _in_thread(into: list[Any], function: Callable[..., Any], *args: Any) -> None:
    """``function(*args)`` in a thread (a blocking client beside a host in this process);
    its result, or the error it raised, into ``into``."""
    try:
        into.append(await trio.to_thread.run_sync(lambda: function(*args, say=True)))
    except Exception as exc:
        into.append(exc)
