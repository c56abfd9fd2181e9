"""People and agents in the loop, end to end: real hosts, real workers, real SQLite."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_lifecycle import call, run_status

DEPLOY = """
    from pathlib import Path
    from piwf import Workflow, compute, decision

    def deploy(ctx):
        with open(Path(ctx.project_path) / "deployed.log", "a") as f:
            f.write(ctx.run_id + "\\n")
        return {"answer": ctx.outputs["approve"]}

    workflow = Workflow(
        name="deploy",
        start_at="approve",
        nodes={
            "approve": decision("Deploy build 42?", choices={"yes": "Deploy", "no": "Hold"},
                                deadline=DEADLINE, default=DEFAULT),
            "deploy": compute(deploy),
            "hold": compute(lambda ctx: {"held": ctx.outputs["approve"]}),
        },
        edges=[("approve.yes", "deploy"), ("approve.no", "hold")],
    )
"""

COUNT = """
    from pathlib import Path
    from piwf import Invalid, Workflow, ask

    def check(value):
        if value == 13:  # the test kills this worker while it validates
            Path(PROJECT, "validating").write_text("13")
            while True:
                pass
        if value > 10:
            raise Invalid("at most 10, please")

    workflow = Workflow(name="count", start_at="how_many",
                        nodes={"how_many": ask("How many?", expect=int, validate=check)})
"""

SLOW_CHECK = """
    import time
    from pathlib import Path
    from piwf import Workflow, ask

    def check(value):
        Path(PROJECT, "validating").write_text(str(value))
        while not Path(PROJECT, "release").exists():
            time.sleep(0.02)

    workflow = Workflow(name="slow_check", start_at="how_many",
                        nodes={"how_many": ask("How many?", expect=int, validate=check)})
"""

EXPIRING = """
    from piwf import Workflow, ask, compute, decision

    workflow = Workflow(
        name="expiring",
        start_at="approve",
        nodes={
            "approve": decision("Quick?", choices={"yes": "Yes"}, deadline=0.3),
            "late": compute(lambda ctx: {"late": ctx.outputs["approve"]}),
            "yes": compute(lambda ctx: "yes"),
        },
        edges=[("approve.yes", "yes"), ("approve.timeout", "late")],
    )
"""

UNROUTED = """
    from piwf import Workflow, ask

    workflow = Workflow(name="unrouted", start_at="why", nodes={"why": ask("Why?", expect=str, deadline=0.3)})
"""


def deploy_source(deadline: float | None = None, default: str | None = None) -> str:
    return DEPLOY.replace("DEADLINE", repr(deadline)).replace("DEFAULT", repr(default))


async def start(paths: StatePaths, project: Path, workflow: str, **payload: Any) -> str:
    receipt = await call(paths, "run.start", payload={"workflow": workflow, "projectPath": str(project), **payload})
    return receipt["runId"]


async def wait_run(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})


async def open_request(paths: StatePaths, run_id: str) -> dict[str, Any]:
    """The run's open request, once it waits."""
    async def found() -> dict[str, Any] | None:
        page = await call(paths, "interaction.list", payload={"runId": run_id})
        return page["requests"][0] if page["requests"] else None
    return await wait_for(found)


async def events(paths: StatePaths, run_id: str, kind: str) -> list[dict[str, Any]]:
    page = await call(paths, "run.events", run_id=run_id)
    return [e for e in page["events"] if e["type"] == kind]


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


# --- decisions --------------------------------------------------------------------------


async def test_a_decision_answered_by_piwf_decide_goes_on_along_the_chosen_exit(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    await host_process().start()
    run_id = await start(paths, project, "deploy")
    request = await open_request(paths, run_id)
    assert request["kind"] == "decision" and request["choices"]["yes"] == {"label": "Deploy"}
    assert (await wait_run(paths, run_id))["status"] == "waiting"
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["pendingInteractions"] == 1 and status["waitingRuns"] == 1

    decided = await piwf(paths, "decide", request["requestId"], "yes", "--request-id", "answer-1", "--json")
    assert json.loads(decided.stdout)["provenance"] == "human"
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed", done
    answer = done["output"]["answer"]
    assert answer["choice"] == "yes" and answer["provenance"] == "human" and answer["answeredBy"].startswith("cli:")
    assert [s["exit"] for s in done["steps"]] == ["yes", "next"]
    assert lines(project / "deployed.log") == [run_id]

    retried = await piwf(paths, "decide", request["requestId"], "yes", "--request-id", "answer-1", "--json")
    assert json.loads(retried.stdout) == json.loads(decided.stdout)  # the stored receipt
    async with AsyncClient(paths, client_id="cli:x") as client:
        first = await client.answer_decision(request["requestId"], "yes", request_id="py-1")
        assert first.outcome == "conflict"  # another client's answer won
        again = await client.answer_decision(request["requestId"], "yes", request_id="py-1")
        assert again.outcome == "conflict"  # refused requests are not logged: refused again
    async with AsyncClient(paths, client_id=answer["answeredBy"]) as client:
        adopted = await client.answer_decision(request["requestId"], "yes", request_id="answer-1")
        assert adopted.outcome == "adopted" and adopted.receipt == json.loads(decided.stdout)
    other = await piwf(paths, "decide", request["requestId"], "no", check=False)
    assert other.returncode == 7 and b"already answered" in other.stderr
    same_choice_other_client = await piwf(paths, "decide", request["requestId"], "yes", check=False)
    assert same_choice_other_client.returncode == 7
    assert len(await events(paths, run_id, "decision.answered")) == 1
    assert lines(project / "deployed.log") == [run_id]


async def test_bad_answers_are_refused_with_one_line_and_change_nothing(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    await host_process().start()
    run_id = await start(paths, project, "deploy")
    request = await open_request(paths, run_id)
    request_id = request["requestId"]
    cases = [
        (["decide", "req-nope", "yes"], 6, b"not found"),
        (["decide", request_id, "maybe"], 1, b"not a choice"),
        (["decide", request_id, "yes", "--input", "why not"], 1, b"takes no input"),
        (["answer", request_id, "--value", "5"], 1, b"is a decision"),
        (["answer", request_id, "--value", "{nope"], 2, b"not valid JSON"),
    ]
    for args, code, message in cases:
        done = await piwf(paths, *args, check=False)
        assert done.returncode == code, (args, done.stderr)
        assert message in done.stderr and done.stderr.count(b"\n") == 1, done.stderr
    async with AsyncClient(paths) as client:
        stale = await client.answer_decision(request_id, "yes", expected_revision=7)
        assert stale.outcome == "conflict" and "revision 1, not 7" in stale.error
    after = await open_request(paths, run_id)
    assert after == request  # nothing changed
    assert (await run_status(paths, run_id))["status"] == "waiting"


async def test_a_deadline_with_a_default_resolves_once_across_host_kills(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    """The host dies at the deadline just before the expiry commits (the next host fires
    it), and the next one just after it commits (the one after must not fire it again)."""
    write_workflow(project, "deploy", deploy_source(deadline=2, default="no"))
    first = await host_process(env={"PIWF_FAULT": "host.deadline.due:exit"}).start()
    run_id = await start(paths, project, "deploy")
    request = await open_request(paths, run_id)
    assert await first.wait() == 86  # at the deadline, nothing committed
    assert (await _offline_request(paths, request["requestId"]))["status"] == "pending"
    second = host_process(env={"PIWF_FAULT": "host.deadline.committed:exit"})
    await second.start(wait=False)  # the deadline has passed: it expires the request as it starts
    assert await second.wait() == 86  # right after the expiry committed
    third = await host_process().start()
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed", done
    answer = done["output"]["held"]
    assert (answer["choice"], answer["provenance"], answer["answeredBy"]) == ("no", "timeout", None)
    assert len(await events(paths, run_id, "decision.answered")) == 1
    assert [s["node"] for s in done["steps"] if s["status"] == "accepted"] == ["approve", "hold"]
    late = await piwf(paths, "decide", request["requestId"], "yes", check=False)
    assert late.returncode == 1 and b"resolved as no by its default" in late.stderr
    third.signal(signal.SIGTERM)
    assert await third.wait() == 0


async def _offline_request(paths: StatePaths, request_id: str) -> dict[str, Any]:
    """A request as stored, read with no host running."""
    from piwf.store.sql import interactions
    from piwf.store.sqlite import Database

    db = Database.open_readonly(paths.db)
    try:
        import msgspec

        return msgspec.to_builtins(interactions.get_request(db, request_id, 0))
    finally:
        db.close()


async def test_an_answer_at_the_deadline_is_refused_and_no_default_routes_timeout(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "expiring", EXPIRING)
    write_workflow(project, "unrouted", UNROUTED)
    routed = await start(paths, project, "expiring")
    unrouted = await start(paths, project, "unrouted")
    # Open or already expired: a loaded machine may take longer than the 0.3 s deadline
    # to show it open (a read waits for the fsync of what it shows, at full durability).
    request = await wait_for(lambda: _any_request(paths, routed))
    done = await wait_for(lambda: _ended(paths, routed))
    assert done["status"] == "completed" and done["output"]["late"]["provenance"] == "timeout"
    assert [s["exit"] for s in done["steps"]] == ["timeout", "next"]
    late = await piwf(paths, "decide", request["requestId"], "yes", check=False)
    assert late.returncode == 1 and b"expired" in late.stderr
    ended = await wait_for(lambda: _ended(paths, unrouted))
    assert ended["status"] == "timed_out" and ended["queueStatus"] == "failed"
    closed = await call(paths, "interaction.list", payload={"runId": unrouted, "open": False})
    assert closed["requests"][0]["status"] == "expired"


async def _any_request(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    page = await call(paths, "interaction.list", payload={"runId": run_id, "open": False})
    return page["requests"][0] if page["requests"] else None


async def _ended(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["status"] in ("completed", "failed", "timed_out", "cancelled") else None


async def test_two_clients_racing_on_100_fresh_decisions_have_one_winner_each(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    run_ids = [await start(paths, project, "deploy") for _ in range(100)]
    requests = await wait_for(lambda: _all_open(paths, 100), timeout=60)
    outcomes: dict[str, list[str]] = {r["requestId"]: [] for r in requests}

    async def answer(client: AsyncClient, request_id: str, choice: str) -> None:
        outcomes[request_id].append((await client.answer_decision(request_id, choice)).outcome)

    async with AsyncClient(paths, client_id="alice") as alice, AsyncClient(paths, client_id="bob") as bob:
        for request in requests:
            async with trio.open_nursery() as race:
                race.start_soon(answer, alice, request["requestId"], "yes")
                race.start_soon(answer, bob, request["requestId"], "no")
    assert all(sorted(o) == ["accepted", "conflict"] for o in outcomes.values()), outcomes
    for run_id in run_ids[:5]:
        assert (await wait_run(paths, run_id))["status"] == "completed"


async def _all_open(paths: StatePaths, n: int) -> list[dict[str, Any]] | None:
    page = await call(paths, "interaction.list", payload={"limit": 1000})
    return page["requests"] if len(page["requests"]) >= n else None


# --- asks ---------------------------------------------------------------------------------


async def test_an_ask_validates_in_the_worker_and_takes_the_first_value_that_fits(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "count", COUNT.replace("PROJECT", repr(str(project))))
    run_id = await start(paths, project, "count")
    request = await open_request(paths, run_id)
    assert request["schema"] == {"type": "integer"}
    request_id = request["requestId"]

    wrong_type = await piwf(paths, "answer", request_id, "--value", '"abc"', "--wait", check=False)
    assert wrong_type.returncode == 1 and b"Expected `int`, got `str`" in wrong_type.stdout
    refused = await piwf(paths, "answer", request_id, "--value", "50", "--wait", "--json", check=False)
    assert refused.returncode == 1 and json.loads(refused.stdout)["error"] == "at most 10, please"
    again = await open_request(paths, run_id)
    assert again["status"] == "pending" and again["revision"] == request["revision"]  # rejection: unchanged
    assert (await run_status(paths, run_id))["status"] == "waiting"

    accepted = await piwf(paths, "answer", request_id, "--value", "5", "--wait")
    assert b"accepted" in accepted.stdout
    done = await wait_run(paths, run_id)
    assert (done["status"], done["output"]) == ("completed", 5)
    settled = (await call(paths, "interaction.list", payload={"runId": run_id, "open": False}))["requests"][0]
    assert settled["status"] == "settled" and settled["resolution"]["value"] == 5


# holds the host's one worker until the file named by its input exists
BLOCKER = """
    import time
    from pathlib import Path
    from piwf import Workflow, compute

    def hold(ctx):
        Path(ctx.project_path, ctx.input["gate"] + ".started").write_text("")
        while not Path(ctx.project_path, ctx.input["gate"]).exists():
            time.sleep(0.02)
        return {}

    workflow = Workflow(name="blocker", start_at="hold", nodes={"hold": compute(hold)})
"""


async def test_a_run_with_a_submission_to_validate_goes_before_older_queued_runs(
        paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    """Seed: runs with a validating submission are claimed first: a person waits on them."""
    from piwf.host.host import Host

    from .conftest import config

    state = await nursery.start(Host(config(paths, max_workers=1)).serve)
    write_workflow(project, "count", COUNT.replace("PROJECT", repr(str(project))))
    write_workflow(project, "blocker", BLOCKER)

    async def hold_the_worker(gate: str) -> str:
        run_id = await start(paths, project, "blocker", input={"gate": gate})
        await wait_for(lambda: (project / f"{gate}.started").exists())
        return run_id

    first = await hold_the_worker("g1")
    older = await start(paths, project, "greet")  # queued behind the blocker, then held
    await piwf(paths, "run", "pause", older)
    asking = await start(paths, project, "count")
    (project / "g1").touch()
    request_id = (await open_request(paths, asking))["requestId"]  # it waits; the worker is free
    second = await hold_the_worker("g2")
    await piwf(paths, "run", "resume", older)  # ready, and older than the ask's run
    async with AsyncClient(paths) as client:
        assert (await client.submit_interaction(request_id, 5)).outcome == "accepted"
    (project / "g2").touch()

    async def ended(run_id: str) -> bool:
        return bool((await run_status(paths, run_id))["status"] == "completed")

    await wait_for(lambda: ended(asking))
    await wait_for(lambda: ended(older))
    claimed = {run: (await events(paths, run, "claimed"))[-1]["eventId"] for run in (asking, older)}
    assert claimed[asking] < claimed[older]
    for run in (first, second):
        assert (await wait_run(paths, run))["status"] == "completed"
    state.stop_requested.set()


async def test_a_worker_killed_while_validating_rejects_that_submission(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "count", COUNT.replace("PROJECT", repr(str(project))))
    run_id = await start(paths, project, "count")
    request_id = (await open_request(paths, run_id))["requestId"]
    async with AsyncClient(paths) as client:
        first = await client.submit_interaction(request_id, 13)
        assert first.outcome == "accepted"
        await wait_for(lambda: (project / "validating").exists())
        second = await client.submit_interaction(request_id, 5)
        assert second.outcome == "conflict" and "being validated" in second.error
    worker = next(w for w in (await run_status(paths, run_id))["workers"] if w["status"] == "running")
    os.killpg(worker["pid"], signal.SIGKILL)

    async def rejected() -> dict[str, Any] | None:
        last = (await open_request(paths, run_id))["lastSubmission"]
        return last if last["status"] == "rejected" else None
    last = await wait_for(rejected)
    assert last["submissionId"] == first.receipt["submissionId"] and "submit again" in last["error"]
    assert (await run_status(paths, run_id))["status"] == "waiting"
    await piwf(paths, "answer", request_id, "--value", "5", "--wait")
    assert (await wait_run(paths, run_id))["output"] == 5


async def test_a_value_being_validated_when_the_host_stops_is_validated_by_the_next_host(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "slow_check", SLOW_CHECK.replace("PROJECT", repr(str(project))))
    first = await host_process().start()
    run_id = await start(paths, project, "slow_check")
    request_id = (await open_request(paths, run_id))["requestId"]
    await call(paths, "interaction.submit", payload={"requestId": request_id, "value": 7})
    await wait_for(lambda: (project / "validating").exists())
    first.signal(signal.SIGTERM)  # a planned stop (piwf stop, systemctl restart)
    assert await first.wait() == 0
    (project / "release").touch()
    await host_process().start()
    done = await wait_run(paths, run_id)
    assert (done["status"], done["output"]) == ("completed", 7)
    settled = (await call(paths, "interaction.list", payload={"runId": run_id, "open": False}))["requests"][0]
    assert settled["lastSubmission"]["status"] == "accepted"


async def test_only_the_origin_session_may_answer_its_runs_ask(host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "count", COUNT.replace("PROJECT", repr(str(project))))
    run_id = await start(paths, project, "count", originSessionId="agent-7")
    request = await open_request(paths, run_id)
    assert request["originSessionId"] == "agent-7"
    listed = await piwf(paths, "inbox", "--session", "agent-7", "--json")
    assert [r["requestId"] for r in json.loads(listed.stdout)["requests"]] == [request["requestId"]]
    assert json.loads((await piwf(paths, "inbox", "--session", "other", "--json")).stdout)["requests"] == []
    stranger = await piwf(paths, "answer", request["requestId"], "--value", "3", check=False)
    assert stranger.returncode == 1 and b"belongs to session agent-7" in stranger.stderr
    await piwf(paths, "answer", request["requestId"], "--value", "3", "--session", "agent-7", "--wait")
    assert (await wait_run(paths, run_id))["output"] == 3


# --- waiting runs across restarts, cancel, pause --------------------------------------------


async def test_a_waiting_run_survives_a_host_kill_and_cancel_closes_its_request(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    first = await host_process().start()
    kept, cancelled = await start(paths, project, "deploy"), await start(paths, project, "deploy")
    before = await open_request(paths, kept)
    await open_request(paths, cancelled)
    inbox = json.loads((await piwf(paths, "inbox", "--json")).stdout)["requests"]
    assert {r["runId"] for r in inbox} == {kept, cancelled}
    first.kill_group()
    await first.wait()
    await host_process().start()
    after = json.loads((await piwf(paths, "inbox", "--json")).stdout)["requests"]
    assert {r["requestId"] for r in after} == {r["requestId"] for r in inbox}
    assert (await run_status(paths, kept))["status"] == "waiting"

    await piwf(paths, "run", "cancel", cancelled)
    closed = (await call(paths, "interaction.list", payload={"runId": cancelled, "open": False}))["requests"][0]
    assert closed["status"] == "cancelled"
    refused = await piwf(paths, "decide", closed["requestId"], "yes", check=False)
    assert refused.returncode == 1 and b"cancelled" in refused.stderr
    await piwf(paths, "decide", before["requestId"], "no")
    done = await wait_run(paths, kept)
    assert done["status"] == "completed" and done["output"]["held"]["choice"] == "no"
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["pendingInteractions"] == 0 and status["lifecycleContradictions"] == 0


async def test_pausing_and_resuming_a_waiting_run_keeps_it_waiting(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    run_id = await start(paths, project, "deploy")
    request = await open_request(paths, run_id)
    await piwf(paths, "run", "pause", run_id)
    await piwf(paths, "run", "resume", run_id)
    run = await run_status(paths, run_id)
    assert (run["status"], run["hold"]) == ("waiting", "waiting") and "waiting for decision" in run["statusDetail"]
    await piwf(paths, "run", "pause", run_id)
    await piwf(paths, "decide", request["requestId"], "yes")
    paused = await run_status(paths, run_id)
    assert (paused["status"], paused["hold"]) == ("running", "paused")  # answered, but held until resumed
    await piwf(paths, "run", "resume", run_id)
    assert (await wait_run(paths, run_id))["status"] == "completed"


async def test_presentation_claims_are_leases_held_by_one_client(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    run_id = await start(paths, project, "deploy")
    request_id = (await open_request(paths, run_id))["requestId"]
    async with AsyncClient(paths, client_id="tui") as tui, AsyncClient(paths, client_id="web") as web:
        claimed = await tui.update_interaction(request_id, 1, "claim")
        assert claimed.outcome == "accepted" and claimed.receipt["presenter"] == "tui"
        taken = await web.update_interaction(request_id, 2, "claim")
        assert taken.outcome == "conflict" and "presented by tui" in taken.error
        stale = await web.update_interaction(request_id, 1, "progress", progress="x")
        assert stale.outcome == "conflict"
        shown = await tui.update_interaction(request_id, 2, "presented", entry_id="msg-1")
        assert shown.receipt["status"] == "presenting" and shown.receipt["revision"] == 3
        missing = await tui.update_interaction(request_id, 3, "presented")
        assert missing.outcome == "rejected" and "entryId" in missing.error
        # presented: claiming ends, for another client and for the presenter alike
        for presenter in (web, tui):
            again = await presenter.update_interaction(request_id, 3, "claim")
            assert again.outcome == "conflict" and "presentation is over" in again.error
    request = await open_request(paths, run_id)
    assert (request["status"], request["entryId"], request["revision"], request["presenter"]) == (
        "presenting", "msg-1", 3, None)
    await piwf(paths, "decide", request_id, "yes")  # a presented request is still answered as before
    assert (await wait_run(paths, run_id))["status"] == "completed"


async def test_progress_on_a_request_is_a_run_update_a_watcher_sees(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "deploy", deploy_source())
    run_id = await start(paths, project, "deploy")
    request_id = (await open_request(paths, run_id))["requestId"]
    async with AsyncClient(paths, client_id="tui") as tui, AsyncClient(paths, client_id="agent") as agent:
        cursor = (await tui.watch(run_id=run_id)).receipt["cursor"]
        async with trio.open_nursery() as nursery:
            seen: list[dict[str, Any]] = []

            async def watch() -> None:
                page = (await tui.watch(after=cursor, run_id=run_id, timeout_ms=20_000)).receipt
                seen.append(page)

            nursery.start_soon(watch)
            reported = await agent.update_interaction(request_id, 1, "progress", progress="2 of 3 read")
            assert reported.outcome == "accepted" and reported.receipt["revision"] == 1  # not bumped
        [page] = seen
        [update] = page["updates"]
        assert (update["type"], update["key"], update["data"]["progress"], update["seq"]) == (
            "interaction.progress", request_id, "2 of 3 read", reported.receipt["updateSeq"])
        stale = await agent.update_interaction(request_id, 0, "progress", progress="x")
        assert stale.outcome == "conflict"
    shown = await run_status(paths, run_id)
    assert [u["data"]["progress"] for u in shown["updates"] if u["type"] == "interaction.progress"] == [
        "2 of 3 read"]
    await piwf(paths, "run", "cancel", run_id)
    async with AsyncClient(paths) as late:
        after = await late.update_interaction(request_id, 2, "progress", progress="late")
    assert after.outcome == "rejected" and "cancelled" in after.error


@pytest.mark.parametrize("source, message", [
    ('decision("Go?", choices={"a": "A"}, deadline=0)', "deadline must be a number of seconds above 0"),
    ('decision("Go?", choices={"a": "A"}, deadline=float("inf"))', "at most 31622400"),
    ('decision("Go?", choices=["a", "b"])', "must be a mapping of choice id to label"),
    ('decision("x" * 2001, choices={"a": "A"})', "2001 characters; at most 2000"),
    ('decision("Go?", choices={"a": "A"}, deadline=5, default="b")', "default 'b' is not one of the choices"),
    ('decision("Go?", choices={"a": "A"}, default="a")', "default needs a deadline"),
    ('decision("Go?", choices={})', "at least one choice"),
    ('decision("Go?", choices={"a": "Same", "b": "Same"})', "different labels"),
    ('decision("Go?", choices={"timeout": "T"})', "must be non-empty text"),
    ('ask("Why?", deadline=-1)', "deadline must be a number of seconds above 0"),
    ('ask("Why?", deadline=1e300)', "at most 31622400"),
    ('decision("Go?", choices={"a": Choice("A", input=TextInput("Why?", 0, 0))})',
     "TextInput max_length must be at least 1, not 0"),
    ('decision("Go?", choices={"a": Choice("A", input=TextInput("Why?", 0, -5))})', "at least 1, not -5"),
    ('decision("Go?", choices={"a": Choice("A", input=TextInput("Why?", 3, 2))})', "0 <= min_length <= max_length"),
    ('decision("Go?", choices={"a": Choice("A", input=TextInput("Why?", 1, 4001))})', "<= 4000"),
    ('decision("Go?", choices={"a": Choice("A", input=TextInput("Why?", 1, 2.5))})', "whole numbers"),
    ('decision("Go?", choices={"a": Choice("A", input="Why?")})', "input must be a TextInput"),
])
def test_a_bad_interactive_node_is_refused_when_the_workflow_loads(source: str, message: str) -> None:
    import piwf

    with pytest.raises(piwf.PiwfError, match=message):
        eval(source, {"decision": piwf.decision, "ask": piwf.ask, "Choice": piwf.Choice, "TextInput": piwf.TextInput})


async def test_a_text_input_of_no_characters_is_refused_by_run_start(
        host: Any, paths: StatePaths, project: Path) -> None:
    """Seed: TextInput refuses max_length < 1; the workflow is refused before any run."""
    write_workflow(project, "mute", """
        from piwf import Choice, TextInput, Workflow, decision

        workflow = Workflow(name="mute", start_at="ask", nodes={
            "ask": decision("Why?", choices={"say": Choice("Say", input=TextInput("Nothing", 0, 0))})})
    """)
    refused = await piwf(paths, "run", "start", "mute", "--project", str(project), check=False)
    assert refused.returncode == 1 and b"TextInput max_length must be at least 1, not 0" in refused.stderr
    assert json.loads((await piwf(paths, "run", "list", "--json")).stdout) == []


def test_a_decision_whose_choices_lead_somewhere_needs_an_edge_for_each() -> None:
    from piwf import PiwfError, Workflow, compute, decision

    nodes = {"d": decision("Go?", choices={"a": "A", "b": "B"}), "x": compute(lambda ctx: 1)}
    with pytest.raises(PiwfError, match="choice b has no edge"):
        Workflow("w", "d", nodes, [("d.a", "x")])
    with pytest.raises(PiwfError, match="has no choice c"):
        Workflow("w", "d", nodes, [("d.a", "x"), ("d.b", "x"), ("d.c", "x")])
    plain = Workflow("w", "d", nodes, [("d", "x")])  # one plain edge serves every choice
    assert plain.next_node("d", "b") == "x"


def test_exits_no_run_could_take_are_refused() -> None:
    from piwf import PiwfError, Workflow, ask, compute, decision

    x = compute(lambda ctx: 1)
    with pytest.raises(PiwfError, match="ask 'q' has no exit 'a'"):
        Workflow("w", "q", {"q": ask("Why?"), "x": x}, [("q.a", "x")])
    with pytest.raises(PiwfError, match=r"q\.timeout can never be taken: 'q' has no deadline"):
        Workflow("w", "q", {"q": ask("Why?"), "x": x}, [("q.timeout", "x")])
    with pytest.raises(PiwfError, match="resolves to its default"):
        Workflow("w", "d", {"d": decision("Go?", {"a": "A"}, deadline=5, default="a"), "x": x},
                 [("d.a", "x"), ("d.timeout", "x")])
    Workflow("w", "q", {"q": ask("Why?", deadline=5), "x": x}, [("q", "x"), ("q.timeout", "x")])
