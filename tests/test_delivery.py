"""Delivery to sessions end to end: real hosts, real workers, real SQLite, and the real
reference client (`piwf inbox --session S --follow`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.client import AsyncClient
from piwf.errors import HostUnavailable
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import HostProcess, config, piwf, wait_for, write_workflow
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call, run_status

TALK = """
    from piwf import Workflow, compute

    def talk(ctx):
        ctx.notify("one " + ctx.input.get("tag", ""))
        ctx.notify("two " + ctx.input.get("tag", ""))
        ctx.notify("three " + ctx.input.get("tag", ""), kind="final")
        return {"said": 3}

    workflow = Workflow(name="talk", start_at="talk", nodes={"talk": compute(talk)})
"""

KILLED = """
    import time
    from pathlib import Path
    from piwf import Workflow, compute

    def once(ctx):
        ctx.notify("before the kill")
        Path(ctx.project_path, "notified").write_text("yes")
        while not Path(ctx.project_path, "gate").exists():
            time.sleep(0.02)
        return "done"

    workflow = Workflow(name="killed", start_at="once", nodes={"once": compute(once)})
"""


class Follower:
    """`piwf inbox --session S --follow --json` as a real child process, its lines read as they come."""

    def __init__(self, paths: StatePaths, session: str) -> None:
        self.args = [sys.executable, "-m", "piwf", "inbox", "--session", session, "--follow", "--json",
                     "--state-dir", str(paths.root)]
        self.proc: trio.Process | None = None
        self.buffer = b""
        self.seen: list[dict[str, Any]] = []

    async def __aenter__(self) -> Follower:
        self.proc = await trio.lowlevel.open_process(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def next(self, timeout: float = 20) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self.buffer:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    stderr = await self.proc.stderr.receive_some(65536) if self.proc.stderr else b""
                    raise AssertionError(f"the follower ended: {stderr.decode()}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        item = json.loads(line)
        self.seen.append(item)
        return item


def said(item: dict[str, Any]) -> str:
    if item["type"] == "notification":
        return item["notification"]["content"]
    return f"turn {item['turn']['cause']}"


async def test_notifications_reach_the_follower_in_order_again_after_a_crashed_claim_and_never_twice(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "talk", TALK)
    await host_process("--delivery-lease", "1").start()
    first = await start(paths, project, "talk", originSessionId="agent-1", input={"tag": "a"})
    assert (await wait_run(paths, first))["status"] == "completed"
    async with AsyncClient(paths, client_id="crashy") as crashy:  # claims, then goes away without delivering
        claimed = await crashy.claim_notification("agent-1")
        assert claimed.receipt["notification"]["content"] == "one a"
    status = await call(paths, "host.status")
    assert (status["undeliveredNotifications"], status["unresolvedTurns"]) == (3, 1)

    async with Follower(paths, "agent-1") as follower:
        assert [said(await follower.next()) for _ in range(4)] == ["one a", "two a", "three a", "turn completed"]
        assert follower.seen[0]["notification"]["notificationId"] == claimed.receipt["notification"]["notificationId"]
        second = await start(paths, project, "talk", originSessionId="agent-1", input={"tag": "b"})
        assert [said(await follower.next()) for _ in range(4)] == ["one b", "two b", "three b", "turn completed"]
        assert follower.seen[-1]["turn"]["runId"] == second
        async with AsyncClient(paths) as late:  # everything was delivered, once
            assert (await late.claim_notification("agent-1")).receipt == {"claimId": None, "notification": None}
            stale = await late.deliver_notification(follower.seen[0]["notification"]["notificationId"],
                                                    claimed.receipt["claimId"])
            assert stale.outcome == "conflict" and "stale" in stale.error
    status = await call(paths, "host.status")
    assert (status["undeliveredNotifications"], status["unresolvedTurns"]) == (0, 0)
    assert len(follower.seen) == 8  # nothing more arrived than was sent


async def test_a_node_killed_after_notifying_and_retried_stores_no_second_copy(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "killed", KILLED)
    run_id = await start(paths, project, "killed", originSessionId="agent-2")
    await wait_for(lambda: (project / "notified").exists())
    worker = next(w for w in (await run_status(paths, run_id))["workers"] if w["status"] == "running")
    os.killpg(worker["pid"], signal.SIGKILL)
    (project / "notified").unlink()
    await wait_for(lambda: (project / "notified").exists())  # the retried node notified again
    (project / "gate").write_text("open")
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed" and len(done["workers"]) == 2
    page = await call(paths, "delivery.list", payload={"sessionId": "agent-2"})
    assert [n["content"] for n in page["notifications"]] == ["before the kill"]
    events = (await call(paths, "run.events", run_id=run_id))["events"]
    assert [e["type"] for e in events].count("notification") == 1


async def test_bad_delivery_requests_get_one_clear_line_and_change_nothing(
        host: Any, paths: StatePaths, project: Path) -> None:
    async with AsyncClient(paths) as client:
        not_text = await client.call("notification.claim", payload={"sessionId": 7})
        assert not_text.outcome == "rejected" and "Expected `str`, got `int` - at `$.payload.sessionId`" in \
            not_text.error
        unknown = await client.deliver_notification("ntf-nope", "claim-nope")
        assert unknown.outcome == "notFound"
        assert (await client.resolve_turn("turn-nope", "claim-nope")).outcome == "notFound"
        bad = await client.call("turn.resolve", payload={"turnId": "t", "claimId": "c", "resolution": "ignored"})
        assert bad.outcome == "rejected" and "resolution" in bad.error
        assert (await client.queue_followup("run-nope", "k", "p")).outcome == "notFound"
        run_id = await start(paths, project, "greet", originSessionId="agent-9")
        big = await client.queue_followup(run_id, "k", "x" * 70_000)
        assert big.outcome == "rejected" and "the limit is 65536" in big.error and "\n" not in big.error
        control = await client.claim_notification("agent\x1b[31m")
        assert control.outcome == "rejected" and "printable" in control.error
        await wait_run(paths, run_id)
        assert (await call(paths, "delivery.list", payload={"runId": run_id}))["turns"][0]["followUps"] == []
    status = await call(paths, "host.status")
    assert (status["undeliveredNotifications"], status["unresolvedTurns"]) == (0, 1)


# --- turns: exactly one per end, across a host SIGKILL right after it -----------------------

ENDS = """
    from piwf import Workflow, ask, compute, decision

    def finish(ctx):
        if ctx.input.get("present"):
            ctx.present("Show the answer as a table")
        if ctx.input.get("fail"):
            raise RuntimeError("it went wrong")
        return {"answer": 42}

    nodes = {"finish": compute(finish), "ask": ask("Why?", expect=str, deadline=0.3),
             "approve": decision("Go?", choices={"yes": "Yes"})}
    workflow = Workflow(name="ends", start_at=START, nodes={START: nodes[START]})
"""


def ends_source(start_at: str) -> str:
    return ENDS.replace("START", repr(start_at))


async def _end_and_die(paths: StatePaths, project: Path, host_process: Callable[..., HostProcess], case: str) -> str:
    """Start the case's run on a host that dies right after the transaction ending (or
    holding) the run commits; returns the run id."""
    if case in ("completed", "presented", "failed", "timed_out"):
        fault = {"completed": "host.worker.committed:exit:2", "presented": "host.worker.committed:exit:3",
                 "failed": "host.worker.committed:exit:3", "timed_out": "host.deadline.committed:exit"}[case]
        write_workflow(project, "ends", ends_source("ask" if case == "timed_out" else "finish"))
        doomed = await host_process(env={"PIWF_FAULT": fault}).start()
        run_id = await start(paths, project, "ends", originSessionId="s",
                             input={"present": case == "presented", "fail": case == "failed"})
    elif case == "cancelled":
        write_workflow(project, "ends", ends_source("approve"))
        doomed = await host_process(env={"PIWF_FAULT": "host.command.committed:exit:2"}).start()
        run_id = await start(paths, project, "ends", originSessionId="s")
        await open_request(paths, run_id)
        async with AsyncClient(paths) as client:
            with pytest.raises(HostUnavailable):
                await client.call("run.cancel", run_id=run_id)
    else:  # held: its workflow no longer loads when an answer lets it go on
        write_workflow(project, "ends", ends_source("approve"))
        first = await host_process().start()
        run_id = await start(paths, project, "ends", originSessionId="s")
        request = await open_request(paths, run_id)
        first.signal(signal.SIGTERM)
        assert await first.wait() == 0
        write_workflow(project, "ends", "this is not python")
        doomed = await host_process(env={"PIWF_FAULT": "host.worker.committed:exit:1"}).start()
        await call(paths, "decision.answer", payload={"requestId": request["requestId"], "choice": "yes"})
    assert await doomed.wait() == 86
    return run_id


@pytest.mark.parametrize("case, cause, status", [
    ("completed", "completed", "completed"), ("presented", "completed", "completed"), ("failed", "failed", "failed"),
    ("timed_out", "timed_out", "timed_out"), ("cancelled", "cancelled", "cancelled"), ("held", "held", "running"),
])
async def test_each_run_end_gives_its_session_exactly_one_turn_across_a_host_kill_right_after_it(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, case: str, cause: str,
        status: str) -> None:
    run_id = await _end_and_die(paths, project, host_process, case)
    await host_process().start()
    run = await wait_run(paths, run_id)
    assert run["status"] == status, run
    turns = (await call(paths, "delivery.list", payload={"sessionId": "s"}))["turns"]
    assert [(t["runId"], t["cause"], t["facts"]["status"]) for t in turns] == [(run_id, cause, status)]
    turn = turns[0]
    assert turn["instructions"] == ("Show the answer as a table" if case == "presented" else None)
    if case == "failed":
        assert "it went wrong" in turn["facts"]["error"]
    if case == "held":
        assert turn["facts"]["hold"] == "source"
    if case.startswith(("completed", "presented")):
        assert json.loads(turn["facts"]["output"]) == {"answer": 42}
    assert (await call(paths, "host.status"))["unresolvedTurns"] == 1


async def test_a_detached_run_yields_no_turn_and_a_crash_held_run_one(
        paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    write_workflow(project, "suicide", """
        import os, signal
        from piwf import Workflow, compute
        workflow = Workflow(name="suicide", start_at="die",
                            nodes={"die": compute(lambda ctx: os.kill(os.getpid(), signal.SIGKILL))})
    """)
    write_workflow(project, "talk", TALK)
    host = await nursery.start(Host(config(paths, max_crashes=1)).serve)
    detached = await start(paths, project, "talk")
    assert (await wait_run(paths, detached))["status"] == "completed"
    held = await start(paths, project, "suicide", originSessionId="s")
    run = await wait_for(lambda: _held(paths, held))
    assert run["hold"] == "crashed"
    turns = (await call(paths, "delivery.list"))["turns"]
    assert [(t["runId"], t["cause"], t["facts"]["hold"]) for t in turns] == [(held, "held", "crashed")]
    assert (await call(paths, "delivery.list"))["notifications"] == []  # the detached run's went nowhere
    host.stop_requested.set()


async def _held(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["hold"] is not None else None


async def test_inbox_lists_a_sessions_notifications_and_turns(host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "talk", TALK)
    run_id = await start(paths, project, "talk", originSessionId="agent-3")
    await wait_run(paths, run_id)
    listed = json.loads((await piwf(paths, "inbox", "--session", "agent-3", "--json")).stdout)
    assert [n["content"] for n in listed["notifications"]] == ["one ", "two ", "three "]
    assert [t["cause"] for t in listed["turns"]] == ["completed"]
    text = (await piwf(paths, "inbox", "--session", "agent-3")).stdout.decode()
    assert "[final]" in text and "[turn]" in text
    usage = await piwf(paths, "inbox", "--follow", check=False)
    assert usage.returncode == 2 and b"--follow needs --session" in usage.stderr


async def test_follow_ups_are_delivered_in_order_with_the_runs_turn(host: Any, paths: StatePaths,
                                                                     project: Path) -> None:
    write_workflow(project, "ends", ends_source("approve"))
    run_id = await start(paths, project, "ends", originSessionId="agent-4")
    request = await open_request(paths, run_id)
    async with AsyncClient(paths, client_id="agent") as agent:
        first = await agent.queue_followup(run_id, "k1", "Then open a pull request")
        second = await agent.queue_followup(run_id, "k2", "And tell the team")
        gone = await agent.queue_followup(run_id, "k3", "Never mind")
        assert [r.receipt["order"] for r in (first, second, gone)] == [1, 2, 3]
        again = await agent.queue_followup(run_id, "k1", "Then open a pull request")
        assert again.receipt["adopted"] and again.receipt["followUpId"] == first.receipt["followUpId"]
        other = await agent.queue_followup(run_id, "k1", "Something else")
        assert other.outcome == "conflict"
        removed = await agent.remove_followup(run_id, gone.receipt["followUpId"])
        assert removed.receipt["state"] == "removed"
        await agent.answer_decision(request["requestId"], "yes")
        await wait_run(paths, run_id)
        claim = (await agent.claim_turn("agent-4")).receipt
        assert [f["prompt"] for f in claim["turn"]["followUps"]] == ["Then open a pull request", "And tell the team"]
        resolved = await agent.resolve_turn(claim["turn"]["turnId"], claim["claimId"], "prompted")
        assert resolved.receipt["followUpsDelivered"] == 2
        late = await agent.queue_followup(run_id, "k4", "Too late")
        assert late.outcome == "rejected" and "no turn is left" in late.error


async def test_a_blank_notification_fails_its_node_with_a_clear_error(host: Any, paths: StatePaths,
                                                                       project: Path) -> None:
    write_workflow(project, "mute", """
        from piwf import Workflow, compute
        workflow = Workflow(name="mute", start_at="say", nodes={"say": compute(lambda ctx: ctx.notify("   "))})
    """)
    run_id = await start(paths, project, "mute", originSessionId="agent-5")
    done = await wait_run(paths, run_id)
    assert done["status"] == "failed" and "notification is blank" in done["error"]["message"]
    turns = (await call(paths, "delivery.list", payload={"sessionId": "agent-5"}))["turns"]
    assert [t["cause"] for t in turns] == ["failed"] and "blank" in turns[0]["facts"]["error"]


async def test_the_sessions_page_workflow_says_what_the_page_says(host: Any, paths: StatePaths,
                                                                   project: Path) -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "sessions.md").read_text()
    source = page.split("```python\n")[1].split("```")[0]
    write_workflow(project, "build", source)
    run_id = await start(paths, project, "build", originSessionId="agent-7")
    assert (await wait_run(paths, run_id))["updates"][0]["data"] == {"done": 10, "of": 10}
    listed = json.loads((await piwf(paths, "inbox", "--session", "agent-7", "--json")).stdout)
    assert [(n["kind"], n["content"]) for n in listed["notifications"]] == [
        ("progress", "compiling"), ("final", "build 42 is ready")]
    [turn] = listed["turns"]
    assert turn["instructions"] == "Show the test results as a table, failures first"
    client = page.split("```python\n")[2].split("```")[0]
    compile(client, "sessions.md", "exec")
    assert client.index("list_delivery") < client.index("claim_notification")  # reads before it writes
    assert json.loads(turn["facts"]["output"]) == {"passed": 118, "failed": 2}


CRASHES_UNTIL_TOLD = """
    import os, signal
    from pathlib import Path
    from piwf import Workflow, compute

    def work(ctx):
        if Path(ctx.project_path, "crash").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return {"rows": 3}

    workflow = Workflow(name="crashy", start_at="work", nodes={"work": compute(work)})
"""


async def test_a_turn_claimed_while_held_is_claimed_again_with_the_runs_later_end(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    """A client showing the `held` turn cannot resolve the `completed` end it never showed;
    the session hears of that end. The hold is kept across a host kill, with one turn."""
    write_workflow(project, "crashy", CRASHES_UNTIL_TOLD)
    (project / "crash").write_text("yes")
    async with trio.open_nursery() as nursery:  # held after one crash (`piwf serve` waits for five)
        quick = await nursery.start(Host(config(paths, max_crashes=1)).serve)
        run_id = await start(paths, project, "crashy", originSessionId="agent-8")
        assert (await wait_for(lambda: _held(paths, run_id)))["hold"] == "crashed"
        quick.stop_requested.set()
    killed = await host_process().start()
    killed.kill_group()
    await killed.wait()
    await host_process().start()
    assert (await run_status(paths, run_id))["hold"] == "crashed"
    turns = (await call(paths, "delivery.list", payload={"sessionId": "agent-8"}))["turns"]
    assert [(t["cause"], t["facts"]["hold"]) for t in turns] == [("held", "crashed")]
    async with AsyncClient(paths, client_id="A") as a:
        held = (await a.claim_turn("agent-8")).receipt
        assert held["turn"]["cause"] == "held"
        (project / "crash").unlink()
        await call(paths, "run.resume", run_id=run_id)
        assert (await wait_run(paths, run_id))["status"] == "completed"
        stale = await a.resolve_turn(held["turn"]["turnId"], held["claimId"], "presented")
        assert stale.outcome == "conflict" and "stale" in stale.error
    async with Follower(paths, "agent-8") as follower:
        turn = (await follower.next())["turn"]
        assert (turn["cause"], json.loads(turn["facts"]["output"])) == ("completed", {"rows": 3})

        async def resolved() -> bool:  # it prints, then resolves
            return (await call(paths, "host.status"))["unresolvedTurns"] == 0

        await wait_for(resolved)


async def test_two_followers_of_one_session_print_nothing_twice_and_both_keep_going(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "talk", TALK)
    async with Follower(paths, "agent-9") as one, Follower(paths, "agent-9") as two:
        def delivered() -> list[str]:
            return [said(item) for item in one.seen + two.seen]

        for runs_started, tag in enumerate(("a", "b"), 1):
            await start(paths, project, "talk", originSessionId="agent-9", input={"tag": tag})
            async with trio.open_nursery() as nursery:
                for follower in (one, two):
                    nursery.start_soon(_read_until, follower, delivered, 4 * runs_started, nursery.cancel_scope)
            assert one.proc is not None and two.proc is not None
            assert one.proc.returncode is None and two.proc.returncode is None
        keys = [item[item["type"]].get("notificationId") or item["turn"]["turnId"] for item in one.seen + two.seen]
        assert len(keys) == len(set(keys)) == 8, delivered()
    assert (await call(paths, "host.status"))["undeliveredNotifications"] == 0


async def _read_until(follower: Follower, delivered: Callable[[], list[str]], wanted: int,
                      scope: trio.CancelScope) -> None:
    """Read the follower's lines until both followers together printed ``wanted``."""
    while len(delivered()) < wanted:
        await follower.next(timeout=30)
    scope.cancel()


async def test_the_follower_claims_no_turn_while_its_runs_notification_is_claimed_elsewhere(
        host: Any, paths: StatePaths, project: Path) -> None:
    from piwf.cli.deliver import RACED_WAIT_MS, deliver_available
    from piwf.client import Client

    write_workflow(project, "talk", TALK)
    run_id = await start(paths, project, "talk", originSessionId="agent-10")
    await wait_run(paths, run_id)
    async with AsyncClient(paths, client_id="hog") as hog:
        assert (await hog.claim_notification("agent-10")).receipt["notification"]["content"] == "one "

    def twice() -> list[int | None]:
        with Client(paths, client_id="follower") as client:
            return [deliver_available(client, "agent-10", True) for _ in range(2)]

    waits = await trio.to_thread.run_sync(twice)
    assert all(w is not None and w > RACED_WAIT_MS for w in waits), waits  # until the hog's claim expires
    claims = host.store.db.scalar("SELECT COUNT(*) FROM host_commands WHERE client_id = 'follower'")
    assert claims == 0  # it wrote nothing


async def test_the_follower_outlives_a_host_restart(host_process: Callable[..., HostProcess], paths: StatePaths,
                                                    project: Path) -> None:
    write_workflow(project, "talk", TALK)
    first = await host_process().start()
    async with Follower(paths, "agent-11") as follower:
        await start(paths, project, "talk", originSessionId="agent-11", input={"tag": "a"})
        assert [said(await follower.next()) for _ in range(4)][-1] == "turn completed"
        first.signal(signal.SIGTERM)
        assert await first.wait() == 0
        await host_process().start()
        await start(paths, project, "talk", originSessionId="agent-11", input={"tag": "b"})
        assert [said(await follower.next()) for _ in range(4)] == ["one b", "two b", "three b", "turn completed"]
        assert follower.proc is not None and follower.proc.stderr is not None
        follower.proc.kill()
        await follower.proc.wait()
        stderr = b""
        while chunk := await follower.proc.stderr.receive_some(65536):
            stderr += chunk
    lines = stderr.decode().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["piwf: lost the host", "piwf: reconnected to the host"], lines


async def test_a_run_held_on_an_ambiguous_effect_gives_its_session_a_turn_saying_so(
        host: Any, paths: StatePaths, project: Path, tmp_path: Path) -> None:
    from .test_effects import PAY

    write_workflow(project, "pay", PAY)
    run_id = await start(paths, project, "pay", originSessionId="agent-12",
                         input={"ledger": str(tmp_path / "ledger.txt"), "dieInApply": str(tmp_path / "marker")})
    assert (await wait_run(paths, run_id))["hold"] == "effect"
    turns = (await call(paths, "delivery.list", payload={"sessionId": "agent-12"}))["turns"]
    assert [(t["cause"], t["facts"]["hold"], t["facts"]["detail"]) for t in turns] == [
        ("held", "effect", "ambiguous effect charge")]
