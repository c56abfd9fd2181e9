"""`piwf run retry`: a failed or timed-out run continues, as the same run, from the node that
failed — against real hosts, real workers, real SQLite and the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import piwf, wait_for, write_workflow
from .test_interactions import _ended, open_request, start, wait_run
from .test_lifecycle import call, run_status

# count: a step that must not run twice; pay: an effect, then a failure until `fixed` exists.
FLAKY = """
    from pathlib import Path
    from piwf import Workflow, compute

    def count(ctx):
        with open(Path(ctx.project_path) / "count.log", "a") as f:
            f.write("counted\\n")
        return {"counted": True}

    def pay(ctx):
        def apply():
            with open(Path(ctx.project_path) / "paid.log", "a") as f:
                f.write("paid\\n")
            return {"receipt": 42}

        receipt = ctx.effect("pay", apply)
        if not (Path(ctx.project_path) / "fixed").exists():
            raise RuntimeError("the printer is out of paper")
        return {"receipt": receipt, "counted": ctx.outputs["count"]}

    workflow = Workflow(name="flaky", start_at="count", nodes={"count": compute(count), "pay": compute(pay)},
                        edges=[("count", "pay")])
"""

# A decision that times out (DEADLINE s, no default, no timeout exit) after a step.
LATE = """
    from pathlib import Path
    from piwf import Workflow, compute, decision

    def prep(ctx):
        with open(Path(ctx.project_path) / "prep.log", "a") as f:
            f.write("prepared\\n")
        return "ready"

    workflow = Workflow(
        name="late",
        start_at="prep",
        nodes={
            "prep": compute(prep),
            "approve": decision("Ship?", choices={"yes": "Ship"}, deadline=DEADLINE),
            "ship": compute(lambda ctx: {"shipped": ctx.outputs["approve"]["choice"]}),
        },
        edges=[("prep", "approve"), ("approve.yes", "ship")],
    )
"""


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def test_a_failed_run_continues_from_the_node_that_failed(host: Any, paths: StatePaths,
                                                               project: Path) -> None:
    write_workflow(project, "flaky", FLAKY)
    run_id = await start(paths, project, "flaky")
    failed = await wait_run(paths, run_id)
    assert (failed["status"], failed["queueStatus"]) == ("failed", "failed")
    assert "printer is out of paper" in failed["error"]["message"]
    (project / "fixed").touch()
    retried = await piwf(paths, "run", "retry", run_id)
    assert retried.stdout.decode().strip() == (
        f"{run_id}: retried (failed → queued, generation {failed['generation'] + 1}); it continues from node pay")
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed"
    assert done["output"] == {"receipt": {"receipt": 42}, "counted": {"counted": True}}
    assert lines(project / "count.log") == ["counted"]  # the accepted step was kept, not run again
    assert lines(project / "paid.log") == ["paid"]  # the applied effect kept its result, not applied again
    assert [(s["node"], s["status"]) for s in done["steps"]] == [("count", "accepted"), ("pay", "failed"),
                                                                 ("pay", "accepted")]
    assert done["generation"] > failed["generation"] + 1  # queued with a new one, then claimed with another
    events = (await call(paths, "run.events", run_id=run_id))["events"]
    [event] = [e for e in events if e["type"] == "retried"]
    assert (event["retriedFrom"], event["node"], event["by"].startswith("cli:")) == ("failed", "pay", True)


async def test_a_retried_request_is_answered_once(host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "flaky", FLAKY)
    run_id = await start(paths, project, "flaky")
    await wait_run(paths, run_id)
    async with AsyncClient(paths, client_id="operator") as client:
        first = await client.call("run.retry", run_id=run_id, request_id="retry-1")
        await wait_for(lambda: _ended(paths, run_id))  # failed again: the file is still missing
        again = await client.call("run.retry", run_id=run_id, request_id="retry-1")
    assert (first.outcome, again.outcome, again.receipt) == ("accepted", "adopted", first.receipt)
    events = (await call(paths, "run.events", run_id=run_id))["events"]
    assert [e["by"] for e in events if e["type"] == "retried"] == ["operator"]
    assert (await run_status(paths, run_id))["status"] == "failed"


async def test_retry_refuses_a_completed_cancelled_or_running_run_saying_why(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "flaky", FLAKY)
    (project / "fixed").touch()
    completed = await start(paths, project, "flaky")
    assert (await wait_run(paths, completed))["status"] == "completed"
    refused = await piwf(paths, "run", "retry", completed, check=False)
    assert refused.returncode != 0 and refused.stdout == b""
    assert f"run {completed} is completed: only a failed or timed-out run can be retried" in refused.stderr.decode()
    write_workflow(project, "sleepy", 'from piwf import Workflow, shell\nworkflow = Workflow(name="sleepy", '
                                      'start_at="nap", nodes={"nap": shell(["sleep", "300"])})\n')
    running = await start(paths, project, "sleepy")
    await wait_for(lambda: _is_running(paths, running))
    refused = await piwf(paths, "run", "retry", running, "--json", check=False)
    assert refused.returncode != 0 and "it has not ended" in refused.stderr.decode()
    await call(paths, "run.cancel", run_id=running)
    await wait_for(lambda: _ended(paths, running))
    refused = await piwf(paths, "run", "retry", running, check=False)
    assert refused.returncode != 0 and "a cancelled run stays cancelled" in refused.stderr.decode()
    missing = await piwf(paths, "run", "retry", "run-nope", check=False)
    assert missing.returncode != 0 and "run-nope not found" in missing.stderr.decode()
    assert (await run_status(paths, completed))["status"] == "completed"


async def _is_running(paths: StatePaths, run_id: str) -> bool:
    return (await run_status(paths, run_id))["queueStatus"] == "running"


async def test_a_timed_out_run_asks_again_and_its_expired_decision_stays_expired(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "late", LATE.replace("DEADLINE", "0.3"))
    run_id = await start(paths, project, "late")
    timed_out = await wait_for(lambda: _ended(paths, run_id))
    assert (timed_out["status"], timed_out["queueStatus"]) == ("timed_out", "failed")
    [expired] = (await call(paths, "interaction.list", payload={"runId": run_id, "open": False}))["requests"]
    assert expired["status"] == "expired"
    write_workflow(project, "late", LATE.replace("DEADLINE", "600"))  # the fix: the retry continues on it
    receipt = json.loads((await piwf(paths, "run", "retry", run_id, "--json")).stdout)
    assert (receipt["retriedFrom"], receipt["node"], receipt["status"]) == ("timed_out", "approve", "queued")
    assert receipt["definitionDigest"] != timed_out["definitionDigest"]  # the workflow as it is now
    asked = await open_request(paths, run_id)
    assert asked["requestId"] != expired["requestId"]
    late = await piwf(paths, "decide", expired["requestId"], "yes", check=False)
    assert late.returncode != 0 and b"expired" in late.stderr  # the old decision stays resolved
    await piwf(paths, "decide", asked["requestId"], "yes")
    done = await wait_for(lambda: _ended(paths, run_id))
    assert done["status"] == "completed" and done["output"] == {"shipped": "yes"}
    assert lines(project / "prep.log") == ["prepared"]
