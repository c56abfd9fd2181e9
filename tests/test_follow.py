"""Following a run (issue 23, point 9): `run events --follow`, `run logs --follow`, the
follow-up commands, and `piwf watch` (quits on `q`; `--once` shows runs that just ended).
Real hosts, real workers, the real command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.paths import StatePaths

from .conftest import piwf, wait_for, write_workflow
from .test_cli_wait import DECIDES, fast_host  # noqa: F401 (a fixture)
from .test_delivery import ends_source
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call

CHATTY = """
    import sys
    from pathlib import Path
    from piwf import Workflow, compute, shell

    def hold(ctx):
        print("holding \\x1b[31mred", flush=True)  # an escape sequence: shown escaped
        Path(ctx.project_path, "holding").write_text("yes")
        while not Path(ctx.project_path, "gate").exists():
            pass
        return 1

    workflow = Workflow(name="chatty", start_at="say", nodes={
        "say": shell(["sh", "-c", "echo to stdout; echo to stderr >&2"]), "hold": compute(hold)},
        edges=[("say", "hold")])
"""


class Follower:
    """A real `piwf ... --follow` process, its stdout read as it comes."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.out = b""
        self.err = b""

    async def until(self, text: bytes) -> None:
        assert self.proc.stdout is not None
        with trio.fail_after(30):
            while text not in self.out:
                chunk = await self.proc.stdout.receive_some(65536)
                assert chunk, f"the follower exited without printing {text!r}: {self.out!r}"
                self.out += chunk

    async def finish(self) -> int:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        with trio.fail_after(30):
            while chunk := await self.proc.stdout.receive_some(65536):
                self.out += chunk
            while chunk := await self.proc.stderr.receive_some(65536):
                self.err += chunk
            return await self.proc.wait()


async def follower(paths: StatePaths, *args: str) -> Follower:
    proc = await trio.lowlevel.open_process([sys.executable, "-m", "piwf", *args, "--state-dir", str(paths.root)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            stdin=subprocess.DEVNULL)
    return Follower(proc)


async def test_run_events_follow_prints_each_event_as_it_comes_and_ends_with_the_run(
        host: Any, paths: StatePaths, project: Path) -> None:
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())
    follow = await follower(paths, "run", "events", run_id, "--follow")
    await follow.until(b"node=wait")  # what happened before it started: printed at once
    assert follow.proc.returncode is None  # and it keeps following
    (project / "gate").write_text("open")
    assert await follow.finish() == 0
    trace = (await piwf(paths, "run", "events", run_id)).stdout
    assert follow.out == trace  # the same lines as the whole trace, each once
    assert b" completed " in trace and b"worker.finished" in trace.splitlines()[-1]


async def test_run_events_follow_of_an_ended_run_prints_its_trace_and_exits(
        host: Any, paths: StatePaths, project: Path) -> None:
    run_id = await start(paths, project, "greet")
    await wait_run(paths, run_id)
    follow = await follower(paths, "run", "events", run_id, "--follow", "--json")
    assert await follow.finish() == 0
    lines = [json.loads(line) for line in follow.out.splitlines()]
    assert (lines[0]["type"], lines[-1]["type"]) == ("created", "worker.finished")
    assert [e["eventId"] for e in lines] == sorted({e["eventId"] for e in lines})


async def test_run_logs_follow_prints_a_live_workers_output_as_it_comes(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "chatty", CHATTY)
    run_id = await start(paths, project, "chatty")
    follow = await follower(paths, "run", "logs", run_id, "-f")
    await follow.until(b"holding \\x1b[31mred\n")  # printed while the worker still runs, escaped
    assert follow.proc.returncode is None and b"to stdout\nto stderr\n" in follow.out
    (project / "gate").write_text("open")
    assert await follow.finish() == 0
    worker = (await call(paths, "run.status", run_id=run_id))["workers"][0]["workerEpoch"]
    lines = follow.out.decode().splitlines()
    assert lines[0] == f"== generation 1, worker {worker}: running"
    assert lines[-1] == f"== worker {worker}: exited (exit 0)"
    stored = (await piwf(paths, "run", "logs", run_id)).stdout.decode().splitlines()
    assert lines[1:-1] == stored[1:]  # the same output as the host kept


async def test_run_logs_follow_of_an_ended_run_prints_what_run_logs_prints(
        host: Any, paths: StatePaths, project: Path) -> None:
    run_id = await start(paths, project, "greet")
    await wait_run(paths, run_id)
    follow = await follower(paths, "run", "logs", run_id, "--follow")
    assert await follow.finish() == 0
    assert follow.out == (await piwf(paths, "run", "logs", run_id)).stdout


LOUD = """
    import sys
    from pathlib import Path
    from piwf import Workflow, compute

    def loud(ctx):
        sys.stdout.write("x" * 100_000 + "\\nend\\n")
        sys.stdout.flush()
        while not Path(ctx.project_path, "gate").exists():
            pass
        return 1

    workflow = Workflow(name="loud", start_at="loud", nodes={"loud": compute(loud)})
"""


async def test_run_output_keeps_the_last_64_kib_and_says_how_much_was_dropped(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "loud", LOUD)
    run_id = await start(paths, project, "loud")

    async def printed() -> dict[str, Any] | None:
        out = await call(paths, "run.output", run_id=run_id, payload={"timeoutMs": 1000})
        return out if out["next"] >= 100_005 else None

    out = await wait_for(printed)
    assert out["live"] and out["next"] == 100_005 and out["dropped"] == 100_005 - 65_536 == out["offset"]
    assert out["text"].endswith("x\nend\n") and len(out["text"]) == 65_536
    nothing = await call(paths, "run.output", run_id=run_id,
                         payload={"workerEpoch": out["workerEpoch"], "after": out["next"]})
    assert (nothing["text"], nothing["next"], nothing["live"]) == ("", out["next"], True)
    other = await call(paths, "run.output", run_id=await start(paths, project, "greet"),
                       payload={"workerEpoch": out["workerEpoch"]})
    assert other["text"] == "" and not other["live"]  # another run's worker is not read through this one
    (project / "gate").write_text("open")
    await wait_run(paths, run_id)
    ended = await call(paths, "run.output", run_id=run_id, payload={"workerEpoch": out["workerEpoch"],
                                                                   "after": out["next"], "timeoutMs": 20_000})
    assert not ended["live"] and ended["text"] == ""


async def test_followup_add_and_remove_from_the_command_line(host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "ends", ends_source("approve"))
    run_id = await start(paths, project, "ends", originSessionId="agent-9")
    request = await open_request(paths, run_id)
    empty = await piwf(paths, "followup", "add", run_id, " ", check=False)  # before: protocol words, exit 1
    assert (empty.returncode, empty.stderr, empty.stdout) == (2, b"piwf: TEXT must not be empty\n", b"")
    first = (await piwf(paths, "followup", "add", run_id, "Then open a pull request")).stdout.decode()
    fup = first.split(":")[0]
    assert first == (f"{fup}: follow-up 1 of run {run_id}, queued; "  # numbered 1: the empty one was not sent
                     f"take it back with: piwf followup remove {fup}\n") and fup.startswith("fup-")
    gone = json.loads((await piwf(paths, "followup", "add", run_id, "Never mind", "--json")).stdout)
    retry = await piwf(paths, "followup", "add", run_id, "Tell the team", "--request-key", "k")
    again = await piwf(paths, "followup", "add", run_id, "Tell the team", "--request-key", "k")
    assert "(already queued under this key); take it back with" in again.stdout.decode()
    assert retry.stdout.split(b":")[0] == again.stdout.split(b":")[0]
    removed = await piwf(paths, "followup", "remove", run_id, gone["followUpId"])
    assert removed.stdout.decode() == f"{gone['followUpId']}: removed\n"
    twice = await piwf(paths, "followup", "remove", run_id, "fup-0000000000000000", check=False)
    assert twice.returncode != 0 and twice.stderr.decode().count("\n") == 1
    await piwf(paths, "decide", request["requestId"], "yes")
    await wait_run(paths, run_id)
    turns = (await call(paths, "delivery.list", payload={"sessionId": "agent-9"}))["turns"]
    assert [(t["cause"], [f["prompt"] for f in t["followUps"]]) for t in turns] == [
        ("completed", ["Then open a pull request", "Tell the team"])]


async def test_followup_list_shows_what_is_queued_in_order_and_remove_takes_the_id_alone(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "ends", ends_source("approve"))
    run_id = await start(paths, project, "ends", originSessionId="agent-9")
    other = await start(paths, project, "ends", originSessionId="agent-2")
    ids = [(await piwf(paths, "followup", "add", run, text)).stdout.decode().split(":")[0]
           for run, text in ((run_id, "Then open a pull request"), (other, "Elsewhere"), (run_id, "Tell\x1b[2J"))]
    listed = await piwf(paths, "followup", "list", "--session", "agent-9")  # before: no such command (exit 2)
    assert listed.stdout.decode() == (f"{ids[0]}  {run_id} #1 for agent-9: Then open a pull request\n"
                                      f"{ids[2]}  {run_id} #2 for agent-9: Tell\\x1b[2J\n")  # escaped
    page = json.loads((await piwf(paths, "followup", "list", "--json")).stdout)
    assert [f["followUpId"] for f in page["followUps"]] == [ids[0], ids[2], ids[1]] and not page["more"]
    assert (await piwf(paths, "followup", "list", "--run", other, "--limit", "1")).stdout.decode().startswith(ids[1])
    first = await piwf(paths, "followup", "list", "--limit", "1")
    assert first.stdout.decode().splitlines()[1] == "... and more: --limit 2 shows more"
    alone = await piwf(paths, "followup", "remove", ids[0])  # before: "give the run and the follow-up", exit 2
    assert alone.stdout.decode() == f"{ids[0]}: removed\n"
    wrong = await piwf(paths, "followup", "remove", other, ids[2], check=False)  # not that run's: nothing changes
    assert wrong.returncode != 0 and wrong.stderr.decode() == f"piwf: notFound: follow-up {ids[2]} of run {other} " \
                                                              "not found\n"
    unknown = await piwf(paths, "followup", "remove", "fup-0000000000000000", check=False)
    assert unknown.returncode != 0 and "follow-up fup-0000000000000000 not found" in unknown.stderr.decode()
    page = json.loads((await piwf(paths, "followup", "list", "--session", "agent-9", "--json")).stdout)
    assert [(f["followUpId"], f["order"]) for f in page["followUps"]] == [(ids[2], 2)]
    assert (await piwf(paths, "followup", "list", "--session", "nobody")).stdout == b"no follow-ups queued\n"


CRASHES_AT_THE_GATE = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def crash(ctx):
        print("before the gate", flush=True)
        while not Path(ctx.project_path, "gate").exists():
            pass
        os._exit(3)

    workflow = Workflow(name="crashes", start_at="a", nodes={"a": compute(crash)})
"""


async def test_following_a_run_that_becomes_held_ends_as_wait_does(  # held after its second crash in a row
        fast_host: Any, paths: StatePaths, project: Path) -> None:  # noqa: F811 (the fixture)
    write_workflow(project, "crashes", CRASHES_AT_THE_GATE)
    run_id = await start(paths, project, "crashes")
    logs = await follower(paths, "run", "logs", run_id, "--follow")
    events = await follower(paths, "run", "events", run_id, "--follow")
    await logs.until(b"before the gate\n")  # following its live worker
    await events.until(b"node=a")
    (project / "gate").write_text("open")  # it crashes twice in a row: held (before: followed for ever)
    assert await logs.finish() == 24 == await events.finish()
    held = (f"piwf: run {run_id} is held (crashed): worker crashed 2 times in a row; last output: before the gate; "
            f"see piwf run logs {run_id}, fix the cause, then piwf run resume {run_id}\n").encode()
    assert logs.err == held == events.err
    workers = [w["workerEpoch"] for w in (await call(paths, "run.status", run_id=run_id))["workers"]]
    assert len(workers) == 2 and logs.out.decode().splitlines()[-1] == f"== worker {workers[-1]}: crashed (exit 3)"
    assert events.out == (await piwf(paths, "run", "events", run_id)).stdout  # every event up to then, once


async def test_following_a_paused_run_or_one_waiting_for_an_answer_ends_as_wait_does(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "decides", DECIDES)
    waiting = await start(paths, project, "decides")
    follow = await follower(paths, "run", "events", waiting, "--follow")
    assert await follow.finish() == 25
    assert follow.err == f"piwf: run {waiting} waits for an answer: piwf inbox --run {waiting}\n".encode()
    as_json = await follower(paths, "run", "events", waiting, "--follow", "--json")
    assert await as_json.finish() == 25 and as_json.err == follow.err  # stdout: only the events' JSON lines
    assert [json.loads(line)["type"] for line in as_json.out.splitlines()] == [
        line.split()[1] for line in follow.out.decode().splitlines()]
    paused = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())
    await call(paths, "run.pause", run_id=paused)
    follow = await follower(paths, "run", "logs", paused, "-f")
    await follow.until(b"== generation 1")
    (project / "gate").write_text("open")  # its node ends; the run parks, paused
    assert await follow.finish() == 23
    assert follow.err.startswith(f"piwf: run {paused} is paused: ".encode()) and follow.err.count(b"\n") == 1


async def test_watch_once_shows_the_runs_that_just_ended(host: Any, paths: StatePaths, project: Path) -> None:
    run_ids = [await start(paths, project, "greet") for _ in range(3)]
    for run_id in run_ids:
        await wait_run(paths, run_id)
    shown = (await piwf(paths, "watch", "--once")).stdout.decode()
    for run_id in run_ids:
        [row] = [line for line in shown.splitlines() if run_id in line and "greet" in line]  # its row
        assert "completed" in row
    assert "no runs" not in shown


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_watch_on_a_terminal_quits_on_q(host: Any, paths: StatePaths, project: Path, tmp_path: Path) -> None:
    socket, done = str(tmp_path / "tmux.sock"), tmp_path / "exited"
    command = f"{sys.executable} -m piwf watch --state-dir {paths.root}; echo $? > {done}; sleep 600"
    tmux = ["tmux", "-S", socket]
    await trio.run_process([*tmux, "new-session", "-d", "-x", "120", "-y", "40", command])
    try:
        async def drawn() -> bool:
            shown = (await trio.run_process([*tmux, "capture-pane", "-p"], capture_stdout=True)).stdout.decode()
            return "recent events" in shown and "q quits" in shown
        await wait_for(drawn)
        await trio.run_process([*tmux, "send-keys", "x"])  # another key does nothing
        await trio.run_process([*tmux, "send-keys", "q"])
        await wait_for(lambda: done.exists() and done.read_text().strip(), timeout=10)
        assert done.read_text() == "0\n"
        shown = (await trio.run_process([*tmux, "capture-pane", "-p"], capture_stdout=True)).stdout.decode()
        assert "Traceback" not in shown
    finally:
        await trio.run_process([*tmux, "kill-server"], check=False)
