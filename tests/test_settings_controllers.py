"""Controllers steering the runs they started (DESIGN.md §9b): ctx.workflows.change_settings,
queue_follow_up and remove_follow_up, with real hosts and reconcile workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import wait_for, write_workflow
from .test_controllers import ctl, get, write_controller
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call
from .test_settings import TUNED, submit

# Starts `tuned` (it waits at its ask) for session s-steer, sets its budget from the spec,
# queues a follow-up for the session, and tries to steer a run it did not start.
STEER = """
    from piwf import Controller, PiwfError, Result

    def reconcile(ctx):
        spec = ctx.resource.spec
        child = ctx.workflows.ensure("main", "tuned", {}, session="s-steer")
        budget = spec["budget"]
        changed = ctx.workflows.change_settings(child["runId"], {"budget": budget}, f"budget-{budget}")
        queued = ctx.workflows.queue_follow_up(child["runId"], f"the budget is {budget} now", f"tell-{budget}")
        dropped = ctx.workflows.queue_follow_up(child["runId"], "never mind", "dropped")
        removed = ctx.workflows.remove_follow_up(child["runId"], dropped["followUpId"])
        refused = {}
        for what, call in (("settings", lambda: ctx.workflows.change_settings(spec["foreign"], {"budget": 1}, "x")),
                           ("followUp", lambda: ctx.workflows.queue_follow_up(spec["foreign"], "hi", "x"))):
            try:
                call()
                refused[what] = None
            except PiwfError as exc:
                refused[what] = str(exc)
        passes = (ctx.resource.status.get("controllerStatus") or {}).get("passes", [])
        passes.append([changed["changeNumber"], changed["adopted"], queued["followUpId"], queued["adopted"]])
        return Result.settled(status={"runId": child["runId"], "settings": changed["settings"], "passes": passes,
                                      "removed": removed["state"], "refused": refused})

    controller = Controller(name="steer", reconcile=reconcile)
"""


async def test_a_controller_steers_its_child_run_once_per_request_key(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    write_controller(project, "steer", STEER)
    foreign = await start(paths, project, "tuned")
    await ctl(paths, "apply", project, "steer", "s", spec={"budget": 5, "foreign": foreign})

    async def passed(more_than: int) -> dict[str, Any] | None:
        got = await get(paths, project, "steer", "s")
        status = (got or {}).get("status", {}).get("controllerStatus", {})
        return status if len(status.get("passes", [])) > more_than and not got["reconciling"] else None

    # The child going from running to waiting may write the resource under the first pass,
    # whose result is then set aside (a compare-and-set conflict) and the pass made again:
    # whatever passes are recorded made one change and one follow-up between them.
    first = await wait_for(lambda: passed(0))
    run_id = first["runId"]
    follow_up = first["passes"][0][2]
    assert all(p[0] == 1 and p[2] == follow_up for p in first["passes"]), first["passes"]
    assert first["settings"]["budget"] == 5 and first["removed"] == "removed"
    for refusal in first["refused"].values():
        assert refusal is not None and "was not started by this resource" in refusal

    await ctl(paths, "reconcile", project, "steer", "s")
    later = await wait_for(lambda: passed(len(first["passes"])))
    assert later["passes"][-1] == [1, True, follow_up, True], later["passes"]  # the same keys: adopted
    shown = await call(paths, "workflow.settings", run_id=run_id)
    assert shown["changeNumber"] == 1
    assert [(c["actor"], c["changeNumber"]) for c in shown["changes"]] == [("start", 0), ("controller", 1)]
    assert (await call(paths, "workflow.settings", run_id=foreign))["changeNumber"] == 0
    queued = [e for e in (await call(paths, "run.events", run_id=run_id))["events"] if e["type"] == "followup.queued"]
    assert len(queued) == 2  # "tell-5" and "dropped", each once over both passes

    await open_request(paths, run_id)
    await submit(paths, run_id, "go", sessionId="s-steer")
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed" and done["output"]["budget"] == 5
    async with AsyncClient(paths) as client:
        turn = (await client.claim_turn("s-steer")).receipt["turn"]
    assert [f["prompt"] for f in turn["followUps"]] == ["the budget is 5 now"]


RACED = """
    import json
    from piwf import Controller, PiwfError, Result

    def reconcile(ctx):
        child = ctx.workflows.ensure("main", "tuned", {}, session="s-race")
        try:
            outcome = ctx.workflows.change_settings(child["runId"], {"budget": 5}, "budget-5")["changeNumber"]
        except PiwfError as exc:
            outcome = str(exc)
        with open("outcomes.log", "a") as log:  # every pass's, also one whose result is set aside
            log.write(json.dumps(outcome) + "\\n")
        return Result.settled(status={"runId": child["runId"], "outcome": outcome})

    controller = Controller(name="raced", reconcile=reconcile)
"""


async def test_a_controllers_change_raced_by_another_is_checked_again_and_applied_after_it(
        host: Any, paths: StatePaths, project: Path) -> None:
    """The controller's patch is checked; before it is written, a client's change commits.
    The controller's change (no expected number) is checked again and applied after it
    (its pass got a conflict)."""
    write_workflow(project, "tuned", TUNED)
    write_controller(project, "raced", RACED)
    real = host.catalog.resolve_settings
    raced: list[Any] = []

    async def checked_then_raced(*args: Any, **kwargs: Any) -> Any:
        answer = await real(*args, **kwargs)
        if not raced:  # the controller's check is done: a client's change commits before its write
            raced.append(None)
            [child] = await call(paths, "run.list")
            async with AsyncClient(paths, client_id="racer") as client:
                raced[0] = await client.call("workflow.changeSettings", run_id=child["runId"],
                                             payload={"patch": {"limits": {"max": 3}}})
        return answer

    host.catalog.resolve_settings = checked_then_raced
    await ctl(paths, "apply", project, "raced", "r", spec={})

    async def settled() -> dict[str, Any] | None:
        got = await get(paths, project, "raced", "r")
        status = (got or {}).get("status", {}).get("controllerStatus", {})
        return status if "outcome" in status and not got["reconciling"] else None

    status = await wait_for(settled)
    assert raced[0].outcome == "accepted" and raced[0].receipt["changeNumber"] == 1
    outcomes = [json.loads(line) for line in (project / "outcomes.log").read_text().splitlines()]
    assert status["outcome"] == 2 and set(outcomes) == {2}, outcomes  # it was a conflict, then 2 on a pass again
    shown = await call(paths, "workflow.settings", run_id=status["runId"])
    assert shown["settings"]["budget"] == 5 and shown["settings"]["limits"] == {"max": 3}
    assert [(c["actor"], c["changeNumber"]) for c in shown["changes"]] == [("start", 0), ("client", 1),
                                                                           ("controller", 2)]
