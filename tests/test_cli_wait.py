"""Waiting for a run from the command line (issue 23, points 1-4): every way a wait ends
has its own exit code; the run id comes at once; progress only on a terminal; Ctrl-C
leaves the run going and says how to follow it; `run wait` re-attaches; `answer --wait`
ends at once when the run is held; a failure names its type and the user's line."""

from __future__ import annotations

import functools
import json
import os
import pty
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import config, piwf, wait_for, write_workflow
from .test_interactions import SLOW_CHECK, UNROUTED, open_request
from .test_lifecycle import call, run_status, start

CRASHES = """
    import os
    from piwf import Workflow, compute

    workflow = Workflow(name="crashes", start_at="a", nodes={"a": compute(lambda ctx: os._exit(3))})
"""

ASKS = """
    from piwf import Workflow, ask

    workflow = Workflow(name="asks", start_at="how_many", nodes={"how_many": ask("How many?", expect=int)})
"""

DECIDES = """
    from piwf import Workflow, decision

    workflow = Workflow(name="decides", start_at="go", nodes={"go": decision("Go?", choices={"yes": "Yes"})})
"""

FAILS = """
    from piwf import Workflow, compute


    def shout(ctx):
        return ctx.input["text"].upper()


    workflow = Workflow(name="fails", start_at="shout", nodes={"shout": compute(shout)})
"""


@pytest.fixture
async def fast_host(paths: StatePaths, nursery: trio.Nursery) -> AsyncIterator[HostState]:
    """An in-process host that holds a crashing run after its second crash in a row."""
    state = await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=2)).serve)
    yield state
    state.stop_requested.set()


async def wait_cli(paths: StatePaths, project: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await piwf(paths, "run", "start", *args, "--project", str(project), "--wait", check=False)


def lines(done: subprocess.CompletedProcess[bytes]) -> list[str]:
    return done.stdout.decode().splitlines()


async def test_each_way_a_wait_ends_has_its_own_exit_code(fast_host: HostState, paths: StatePaths,
                                                          project: Path) -> None:
    for name, source in (("crashes", CRASHES), ("decides", DECIDES), ("unrouted", UNROUTED), ("fails", FAILS)):
        write_workflow(project, name, source)
    completed = await wait_cli(paths, project, "greet")
    assert (completed.returncode, completed.stderr) == (0, b"")
    assert lines(completed)[0].startswith("run-")  # the id first, then the run
    assert lines(completed)[1] == f"run:      {lines(completed)[0]} (greet)"

    failed = await wait_cli(paths, project, "fails")
    assert failed.returncode == 20
    assert f"piwf: run {lines(failed)[0]} failed: KeyError: 'text' (node shout)".encode() in failed.stderr

    held = await wait_cli(paths, project, "crashes")  # before: exit 0, "running / parked"
    assert held.returncode == 24
    assert b"is held (crashed): worker crashed 2 times in a row" in held.stderr
    assert f"piwf run resume {lines(held)[0]}".encode() in held.stderr

    waiting = await wait_cli(paths, project, "decides")
    assert waiting.returncode == 25
    assert f"waits for an answer: piwf inbox --run {lines(waiting)[0]}".encode() in waiting.stderr

    asked = lines(await wait_cli(paths, project, "unrouted"))[0]  # it waits, until its deadline passes
    await wait_for(lambda: _status_is(paths, asked, "timed_out"))
    timed_out = await piwf(paths, "run", "wait", asked, check=False)
    assert timed_out.returncode == 21 and f"run {asked} timed out".encode() in timed_out.stderr

    alone = await piwf(paths, "run", "start", "sleepy", "--project", str(project), "--wait-timeout", "1s", check=False)
    assert (alone.returncode, alone.stderr) == (2, b"piwf: --wait-timeout goes with --wait\n")
    limit = await wait_cli(paths, project, "sleepy", "--wait-timeout", "1s")
    assert limit.returncode == 26
    sleepy = lines(limit)[0]
    assert f"is still running after 1 s; it goes on: piwf run wait {sleepy}".encode() in limit.stderr
    assert (await run_status(paths, sleepy))["status"] == "running"

    # Re-attached with `run wait`, as the wait's own limit and Ctrl-C say to.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(call, paths, "run.cancel", run_id=sleepy))
        cancelled = await piwf(paths, "run", "wait", sleepy, "--json", check=False)
    assert cancelled.returncode == 22
    document = json.loads(cancelled.stdout)
    assert document["status"] == "cancelled"
    assert document["wait"] == {"outcome": "runCancelled", "exitCode": 22, "reason": f"run {sleepy} was cancelled"}

    held_json = json.loads((await piwf(paths, "run", "wait", lines(held)[0], "--json", check=False)).stdout)
    assert (held_json["hold"], held_json["wait"]["outcome"], held_json["wait"]["exitCode"]) == ("crashed",
                                                                                               "runHeld", 24)


async def test_a_paused_run_ends_the_wait_with_its_own_code(fast_host: HostState, paths: StatePaths,
                                                            project: Path) -> None:
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())
    await call(paths, "run.pause", run_id=run_id)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, (project / "gate").touch)  # the node ends; the run parks
        paused = await piwf(paths, "run", "wait", run_id, check=False)
    assert paused.returncode == 23
    assert f"piwf: run {run_id} is paused: piwf run resume {run_id}".encode() in paused.stderr
    assert "status:   paused: running / parked" in lines(paused)
    unknown = await piwf(paths, "run", "wait", "run-nope", check=False)
    assert (unknown.returncode, unknown.stderr) == (6, b"piwf: notFound: run run-nope not found\n")


async def test_the_id_comes_at_once_and_ctrl_c_leaves_the_run_going(host: HostState, paths: StatePaths,
                                                                   project: Path) -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "run", "start", "sleepy", "--project", str(project), "--wait",
         "--state-dir", str(paths.root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    first = b""
    with trio.fail_after(20):
        while not first.endswith(b"\n"):
            first += await process.stdout.receive_some(1)  # the run id, before the run ends
    run_id = first.decode().strip()
    await wait_for(lambda: _running(paths, run_id))
    process.send_signal(signal.SIGINT)
    with trio.fail_after(20):
        assert await process.wait() == 130
    stderr = await _read_all(process.stderr)
    assert f"stopped waiting; run {run_id} goes on. Follow it with: piwf run wait {run_id}".encode() in stderr
    assert b"Traceback" not in stderr
    assert (await run_status(paths, run_id))["status"] == "running"
    await call(paths, "run.cancel", run_id=run_id)


async def _status_is(paths: StatePaths, run_id: str, status: str) -> bool:
    return bool((await run_status(paths, run_id))["status"] == status)


async def _running(paths: StatePaths, run_id: str) -> bool:
    return any(step["status"] == "running" for step in (await run_status(paths, run_id))["steps"])


async def _read_all(stream: Any) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def test_progress_is_drawn_on_a_terminal_only(host: HostState, paths: StatePaths, project: Path) -> None:
    plain = await piwf(paths, "run", "start", "greet", "--project", str(project), "--wait")
    assert plain.stderr == b"" and "\x1b" not in plain.stdout.decode()  # nothing extra into a pipe

    leader, follower = pty.openpty()
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "run", "start", "gated", "--project", str(project), "--wait",
         "--state-dir", str(paths.root)], stdout=subprocess.PIPE, stderr=follower,
        env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
    os.close(follower)
    drawn = bytearray()
    progress = trio.Event()

    async def read_the_terminal() -> None:  # all along, so the CLI never blocks on a full terminal
        while True:
            try:
                chunk = await trio.to_thread.run_sync(os.read, leader, 65536, abandon_on_cancel=True)
            except OSError:  # EIO: the CLI has exited and closed the terminal
                return
            if not chunk:
                return
            drawn.extend(chunk)
            if b"node wait, 1 step done" in drawn:  # the node running and the steps done
                progress.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_the_terminal)
            with trio.fail_after(20):
                await progress.wait()
            (project / "gate").touch()
            with trio.fail_after(20):
                assert await process.wait() == 0
            nursery.cancel_scope.cancel()
    finally:
        os.close(leader)
    assert b"0:00:0" in drawn  # the time waited
    assert process.stdout is not None
    out = (await _read_all(process.stdout)).decode()
    assert "status:   completed / done" in out


async def test_answer_wait_ends_at_once_when_the_run_is_held(host: HostState, paths: StatePaths,
                                                             project: Path) -> None:
    workflow = write_workflow(project, "asks", ASKS)
    run_id = await start(paths, project, "asks")
    request = await open_request(paths, run_id)
    workflow.write_text(workflow.read_text().replace("How many?", "How many, now?"))  # a new definition
    with trio.fail_after(20):  # before: 30 s, then "is still being validated" (exit 10)
        done = await piwf(paths, "answer", request["requestId"], "--value", "5", "--wait", check=False)
    assert done.returncode == 24, done.stderr
    assert f"run {run_id} is held (source): no live host can load its workflow: host-".encode() in done.stderr
    assert b"workflow source changed" in done.stderr
    assert f"piwf run resume {run_id}".encode() in done.stderr
    held = await run_status(paths, run_id)
    assert (held["hold"], held["queueStatus"]) == ("source", "parked")


async def test_ctrl_c_in_answer_wait_leaves_the_submission_to_be_validated(host: HostState, paths: StatePaths,
                                                                          project: Path) -> None:
    write_workflow(project, "slow_check", SLOW_CHECK.replace("PROJECT", repr(str(project))))
    run_id = await start(paths, project, "slow_check")
    request = await open_request(paths, run_id)
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "answer", request["requestId"], "--value", "5", "--wait",
         "--state-dir", str(paths.root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    await wait_for(lambda: (project / "validating").exists())  # the workflow is validating the value
    process.send_signal(signal.SIGINT)
    with trio.fail_after(20):
        assert await process.wait() == 130
    assert process.stderr is not None
    stderr = await _read_all(process.stderr)
    assert b"stopped waiting; submission sub-" in stderr and f"piwf inbox --run {run_id}".encode() in stderr
    (project / "release").touch()
    async def settled() -> bool:
        return (await run_status(paths, run_id))["status"] == "completed"
    await wait_for(settled)


async def test_a_failure_shows_its_type_and_the_users_line(host: HostState, paths: StatePaths,
                                                           project: Path) -> None:
    write_workflow(project, "fails", FAILS)
    run_id = lines(await wait_cli(paths, project, "fails"))[0]
    shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
    assert "error:    KeyError: 'text' (node shout)" in shown  # before: "error:    node shout: 'text'"
    assert "  at .piwf/workflows/fails.py:6 in shout\n    return ctx.input[\"text\"].upper()" in shown
    error = json.loads((await piwf(paths, "run", "show", run_id, "--json")).stdout)["error"]
    assert error["where"] == {"file": ".piwf/workflows/fails.py", "line": 6, "function": "shout",
                              "code": 'return ctx.input["text"].upper()'}
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert "piwf/engine/executor.py" in error["traceback"]  # the whole of it stays in --json
