"""Run settings (DESIGN.md §9b), end to end: real hosts, real workers, real SQLite."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call, run_status

# The first node asks (the run waits); the next reports the settings it sees.
TUNED = """
    import msgspec
    from piwf import Workflow, ask, compute

    class Limits(msgspec.Struct, frozen=True):
        max: int = 10

    class Settings(msgspec.Struct):
        budget: int = 1
        model: str = "small"
        limits: Limits = Limits()

    def report(ctx):
        assert isinstance(ctx.settings, Settings)
        return {"budget": ctx.settings.budget, "model": ctx.settings.model, "max": ctx.settings.limits.max}

    workflow = Workflow(
        name="tuned",
        start_at="go",
        nodes={"go": ask("Go?", expect=str), "report": compute(report)},
        edges=[("go", "report")],
        settings=Settings,
        mutable=("budget", "limits.max"),
    )
"""

PLAIN = """
    from piwf import Workflow, compute

    workflow = Workflow(name="plain", start_at="a", nodes={"a": compute(lambda ctx: {"settings": ctx.settings})})
"""


async def submit(paths: StatePaths, run_id: str, value: Any, **extra: Any) -> None:
    """Answer the run's ask, and return once the answer was taken: the run waits no more
    (right after the submission it is still at rest, waiting for a worker to validate it)."""
    request = await open_request(paths, run_id)
    await call(paths, "interaction.submit", payload={"requestId": request["requestId"], "value": value, **extra})

    async def taken() -> bool:
        page = await call(paths, "interaction.list", payload={"runId": run_id, "open": False})
        return all(r["status"] == "settled" for r in page["requests"])
    await wait_for(taken)


async def change(paths: StatePaths, run_id: str, patch: dict[str, Any], *, payload_scope: str | None = None,
                 **extra: Any) -> Any:
    payload: dict[str, Any] = {"patch": patch} if payload_scope is None else {"patch": patch, "scopeId": payload_scope}
    async with AsyncClient(paths, client_id="steering-test") as client:
        return await client.call("workflow.changeSettings", run_id=run_id, payload=payload, **extra)


async def test_a_waiting_run_gets_a_new_budget_and_its_next_node_sees_it(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    shown = json.loads((await piwf(paths, "run", "settings", run_id, "--json")).stdout)
    assert (shown["changeNumber"], shown["settings"]["budget"], shown["mutable"]) == (0, 1, ["budget", "limits.max"])

    done = await piwf(paths, "run", "settings", run_id, "--set", "budget=5", "--set", "limits.max=3", "--json")
    receipt = json.loads(done.stdout)
    assert receipt["changeNumber"] == 1 and receipt["settings"] == {"budget": 5, "model": "small",
                                                                    "limits": {"max": 3}}
    await submit(paths, run_id, "yes")
    run = await wait_run(paths, run_id)
    assert run["status"] == "completed" and run["output"] == {"budget": 5, "model": "small", "max": 3}
    assert [(s["node"], s["settingsChange"]) for s in run["steps"]] == [("go", 0), ("report", 1)]
    text = (await piwf(paths, "run", "show", run_id)).stdout.decode()
    assert "settings change 0" in text and "settings change 1" in text
    history = json.loads((await piwf(paths, "run", "settings", run_id, "--json")).stdout)
    assert [(c["changeNumber"], c["actor"]) for c in history["changes"]] == [(0, "start"), (1, "client")]
    assert [e for e in (await call(paths, "run.events", run_id=run_id))["events"]
            if e["type"] == "settings.changed"] != []


async def test_initial_settings_are_checked_against_the_type_and_a_plain_workflow_has_none(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    write_workflow(project, "plain", PLAIN)
    run_id = await start(paths, project, "tuned", settings={"model": "large", "budget": 2})
    await submit(paths, run_id, "go")
    assert (await wait_run(paths, run_id))["output"] == {"budget": 2, "model": "large", "max": 10}
    async with AsyncClient(paths) as client:
        bad = await client.call("run.start", payload={"workflow": "tuned", "projectPath": str(project),
                                                      "settings": {"budget": "lots"}})
        assert bad.outcome == "rejected" and "Expected `int`, got `str` - at `$.budget`" in bad.error
        none = await client.call("run.start", payload={"workflow": "plain", "projectPath": str(project),
                                                       "settings": {"budget": 2}})
        assert none.outcome == "rejected" and "declares no settings" in none.error
    plain = await start(paths, project, "plain")
    done = await wait_run(paths, plain)
    assert done["output"] == {"settings": None} and done["steps"][0]["settingsChange"] is None
    refused = await piwf(paths, "run", "settings", plain, check=False)
    assert refused.returncode != 0 and b"declares none" in refused.stderr
    runs = await call(paths, "run.list")
    assert len(runs) == 2  # the refused starts left nothing behind


async def test_an_unknown_settings_key_is_refused_at_the_start_as_a_change_refuses_it(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    for settings, path, missing in (('{"bogus": 1}', "bogus", "Settings has no field 'bogus'"),
                                    ('{"limits": {"mx": 3}}', "limits.mx", "Limits has no field 'mx'")):
        refused = await piwf(paths, "run", "start", "tuned", "--settings", settings, cwd=project, check=False)
        assert refused.returncode == 1
        assert refused.stderr.decode().splitlines() == [
            f"piwf: rejected: settings path {path!r} of workflow tuned: {missing}"]
    assert await call(paths, "run.list") == []  # nothing was started
    run_id = await start(paths, project, "tuned")
    changed = await piwf(paths, "run", "settings", run_id, "--set", "bogus=1", check=False)
    assert changed.stderr.decode().splitlines() == [
        "piwf: rejected: settings path 'bogus' of workflow tuned: Settings has no field 'bogus'"]


async def test_bad_changes_are_refused_with_the_reason_and_change_nothing(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)

    immutable = await piwf(paths, "run", "settings", run_id, "--set", 'model="large"', check=False)
    assert immutable.returncode != 0
    assert immutable.stderr.decode().strip().splitlines() == [
        "piwf: rejected: settings path 'model' of workflow tuned cannot change while a run goes on "
        "(mutable: budget, limits.max)"]
    wrong_type = await piwf(paths, "run", "settings", run_id, "--set", 'budget="five"', check=False)
    assert wrong_type.returncode != 0
    assert "Expected `int`, got `str` - at `$.budget`" in wrong_type.stderr.decode()
    assert len(wrong_type.stderr.decode().strip().splitlines()) == 1
    below = await change(paths, run_id, {"limits": {"max": 2, "min": 1}})
    assert below.outcome == "rejected" and "'limits.min'" in below.error
    huge = await change(paths, run_id, {"budget": 1, "note": "x" * 70_000})
    assert huge.outcome == "rejected" and "the limit is 65536" in huge.error
    not_object = await change(paths, run_id, [1])  # type: ignore[arg-type]
    assert not_object.outcome == "rejected" and "Expected `object`" in not_object.error
    bad_json = await piwf(paths, "run", "settings", run_id, "--set", "budget=five", check=False)
    assert bad_json.returncode != 0 and b"not valid JSON" in bad_json.stderr

    ok = await piwf(paths, "run", "settings", run_id, "--set", "budget=5", "--expect", "0", "--json")
    assert json.loads(ok.stdout)["changeNumber"] == 1
    stale = await piwf(paths, "run", "settings", run_id, "--set", "budget=6", "--expect", "0", check=False)
    assert stale.returncode != 0 and stale.stderr.decode().startswith("piwf: conflict: ")
    assert "at change 1, not 0" in stale.stderr.decode()

    first = await change(paths, run_id, {"budget": 7}, request_id="retry-me")
    again = await change(paths, run_id, {"budget": 7}, request_id="retry-me")
    assert (first.outcome, again.outcome) == ("accepted", "adopted") and again.receipt == first.receipt
    again_cli = await piwf(paths, "run", "settings", run_id, "--set", "budget=8", "--request-id", "cli-1", "--json")
    retried = await piwf(paths, "run", "settings", run_id, "--set", "budget=8", "--request-id", "cli-1", "--json")
    assert json.loads(again_cli.stdout) == json.loads(retried.stdout)

    shown = await call(paths, "workflow.settings", run_id=run_id)
    assert shown["changeNumber"] == 3 and shown["settings"]["budget"] == 8 and shown["settings"]["model"] == "small"

    await piwf(paths, "run", "cancel", run_id)
    ended = await change(paths, run_id, {"budget": 9})
    assert ended.outcome == "rejected" and "has ended (cancelled)" in ended.error
    missing = await change(paths, "run-nope", {"budget": 9})
    assert missing.outcome == "notFound"
    assert (await call(paths, "workflow.settings", run_id=run_id))["changeNumber"] == 3


@pytest.mark.parametrize("args, message", [
    (["--set", "budget"], "expected PATH=JSON"),
    (["--set", "=1"], "expected PATH=JSON"),
    (["--expect", "1"], "--expect goes with --set"),
    (["--set", "limits=1", "--set", "limits.max=2"], "changed below in one command"),
])
async def test_bad_cli_settings_arguments_are_one_line(
        paths: StatePaths, args: list[str], message: str) -> None:
    done = await piwf(paths, "run", "settings", "run-x", *args, check=False)
    assert done.returncode != 0 and message in done.stderr.decode()
    assert len(done.stderr.decode().strip().splitlines()) == 1


async def test_a_change_accepted_just_before_a_host_sigkill_is_seen_by_the_next_node(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    first = await host_process().start()
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    assert (await change(paths, run_id, {"budget": 5})).outcome == "accepted"
    first.kill_group()
    await first.wait()
    await host_process().start()
    assert (await call(paths, "workflow.settings", run_id=run_id))["settings"]["budget"] == 5
    await submit(paths, run_id, "go")
    run = await wait_run(paths, run_id)
    assert run["status"] == "completed" and run["output"]["budget"] == 5
    assert run["steps"][-1]["settingsChange"] == 1


async def test_a_host_dying_between_committing_a_change_and_answering_it_keeps_it_and_the_retry_adopts_it(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    from piwf.errors import HostUnavailable

    write_workflow(project, "tuned", TUNED)
    doomed = await host_process(env={"PIWF_FAULT": "host.command.committed:exit:2"}).start()  # 1: run.start
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    with pytest.raises(HostUnavailable):
        await change(paths, run_id, {"budget": 5}, request_id="lost-answer")
    assert await doomed.wait() == 86
    await host_process().start()
    retried = await change(paths, run_id, {"budget": 5}, request_id="lost-answer")
    assert retried.outcome == "adopted" and retried.receipt["changeNumber"] == 1
    await submit(paths, run_id, "go")
    run = await wait_run(paths, run_id)
    assert run["output"]["budget"] == 5 and run["steps"][-1]["settingsChange"] == 1


SLOW = """
    import time
    from pathlib import Path
    import msgspec
    from piwf import Workflow, compute

    class Settings(msgspec.Struct):
        budget: int = 1

    def slow(ctx):
        Path(ctx.project_path, "started").write_text(str(ctx.settings.budget))
        while not Path(ctx.project_path, "release").exists():
            time.sleep(0.01)
        return {"budget": ctx.settings.budget}

    workflow = Workflow(name="slow", start_at="slow", settings=Settings, mutable=["budget"],
                        nodes={"slow": compute(slow), "next": compute(lambda ctx: {"budget": ctx.settings.budget})},
                        edges=[("slow", "next")])
"""


async def test_a_running_node_keeps_its_settings_and_the_next_node_sees_the_change(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "slow", SLOW)
    run_id = await start(paths, project, "slow")
    await wait_for(lambda: (project / "started").exists())
    assert (await change(paths, run_id, {"budget": 5})).outcome == "accepted"
    (project / "release").write_text("go")
    run = await wait_run(paths, run_id)
    assert run["output"] == {"budget": 5}
    assert [(s["node"], s["settingsChange"]) for s in run["steps"]] == [("slow", 0), ("next", 1)]
    assert (await run_status(paths, run_id))["status"] == "completed"


async def test_the_settings_page_example_runs_as_the_page_says(host: Any, paths: StatePaths, project: Path) -> None:
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    write_workflow(project, "research", re.search(r"```python\n(.*?)```", page, re.S).group(1))
    run_id = await start(paths, project, "research")
    await open_request(paths, run_id)
    changed = await piwf(paths, "run", "settings", run_id, "--set", "budget=5", "--set", "limits.max_items=3")
    assert changed.stdout.decode().strip() == ('change 1: {"budget": 5, "limits": {"max_items": 3}, '
                                               '"model": "small"}')
    refused = await piwf(paths, "run", "settings", run_id, "--set", 'model="large"', check=False)
    assert refused.stderr.decode().strip() in page
    await submit(paths, run_id, "go")
    assert (await wait_run(paths, run_id))["output"] == {"model": "small", "budget": 5, "items": 3}


async def test_a_run_resumed_on_a_workflow_that_now_declares_settings_gets_them(
        host: Any, paths: StatePaths, project: Path) -> None:
    before = TUNED.replace("settings=Settings,", "").replace('mutable=("budget", "limits.max"),', "").replace(
        '"report": compute(report)', '"report": compute(lambda ctx: {"settings": ctx.settings})')
    write_workflow(project, "tuned", before)
    run_id = await start(paths, project, "tuned")
    request = await open_request(paths, run_id)
    refused = await change(paths, run_id, {"budget": 5})
    assert refused.outcome == "rejected" and "declares none" in refused.error
    write_workflow(project, "tuned", TUNED)  # the file changes under the waiting run
    await call(paths, "interaction.submit", payload={"requestId": request["requestId"], "value": "go"})

    async def held() -> bool:
        return (await run_status(paths, run_id))["hold"] == "source"
    await wait_for(held)
    await piwf(paths, "run", "resume", run_id)
    shown = await call(paths, "workflow.settings", run_id=run_id)
    assert (shown["changeNumber"], shown["settings"]["budget"]) == (0, 1)

    async def done() -> dict[str, Any] | None:
        run = await run_status(paths, run_id)
        return run if run["status"] == "completed" else None
    assert (await wait_for(done))["output"] == {"budget": 1, "model": "small", "max": 10}


async def test_a_change_names_its_scope_by_the_id_the_run_shows(host: Any, paths: StatePaths, project: Path) -> None:
    """The protocol keeps `scopeId` (docs/settings.md: scopes per sub-workflow later): today a
    run has one scope, mount path "" (the whole run); a change that names it is applied to it,
    one that names another run's scope or none of the run's is refused and changes nothing."""
    write_workflow(project, "tuned", TUNED)
    first, second = await start(paths, project, "tuned"), await start(paths, project, "tuned")
    await open_request(paths, first)
    shown = await call(paths, "workflow.settings", run_id=first)
    other = (await call(paths, "workflow.settings", run_id=second))["scopeId"]
    assert shown["mountPath"] == "" and shown["scopeId"] != other
    named = await change(paths, first, {"budget": 4}, payload_scope=shown["scopeId"])
    assert named.outcome == "accepted" and named.receipt["scopeId"] == shown["scopeId"]
    for scope in (other, "settings-nope"):
        refused = await change(paths, first, {"budget": 5}, payload_scope=scope)
        assert refused.outcome == "notFound" and f"has no settings scope {scope}" in refused.error
    read = await call(paths, "workflow.settings", run_id=first, payload={"scopeId": shown["scopeId"]})
    assert (read["changeNumber"], read["settings"]["budget"]) == (1, 4)
    assert (await call(paths, "workflow.settings", run_id=second))["changeNumber"] == 0


async def test_two_changes_at_once_without_an_expected_number_are_both_applied(
        host: Any, paths: StatePaths, project: Path) -> None:
    """Change A's patch is checked; before A is written, change B commits. A, sent without
    an expected change number, is checked again on B's settings and applied after it (it
    was refused as a conflict: the user had asked for no compare-and-set). With an expected
    number the same race is a conflict, and nothing of it is written."""
    write_workflow(project, "tuned", TUNED)
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    real = host.catalog.resolve_settings
    racing: list[dict[str, Any]] = []
    raced: list[Any] = []

    async def checked_then_raced(*args: Any, **kwargs: Any) -> Any:
        answer = await real(*args, **kwargs)
        if racing:  # this check is done: the racing change commits before its write
            raced.append(await change(paths, run_id, racing.pop()))
        return answer

    host.catalog.resolve_settings = checked_then_raced
    racing.append({"limits": {"max": 3}})
    first = await change(paths, run_id, {"budget": 5})
    assert raced[0].outcome == "accepted" and raced[0].receipt["changeNumber"] == 1
    assert first.outcome == "accepted", first.error
    assert first.receipt["changeNumber"] == 2
    assert first.receipt["settings"] == {"budget": 5, "model": "small", "limits": {"max": 3}}
    racing.append({"limits": {"max": 4}})
    again = await change(paths, run_id, {"budget": 6})  # the race again: both applied
    assert (again.outcome, again.receipt["changeNumber"], raced[1].receipt["changeNumber"]) == ("accepted", 4, 3)
    racing.append({"limits": {"max": 5}})
    async with AsyncClient(paths, client_id="steering-test") as client:
        refused = await client.call("workflow.changeSettings", run_id=run_id,
                                    payload={"patch": {"budget": 7}, "expectedChangeNumber": 4})
    assert refused.outcome == "conflict" and "not 4" in (refused.error or ""), refused
    shown = await call(paths, "workflow.settings", run_id=run_id)
    assert (shown["changeNumber"], shown["settings"]) == (5, {"budget": 6, "model": "small", "limits": {"max": 5}})
    assert [c["actor"] for c in shown["changes"]] == ["start"] + ["client"] * 5
