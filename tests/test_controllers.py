"""Controllers end to end: real hosts, real reconcile worker processes, files as the world."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from piwf.client import AsyncClient
from piwf.errors import RequestTooLarge
from piwf.paths import StatePaths

from .conftest import piwf, wait_for, write_workflow

ROOT = Path(__file__).resolve().parents[1]
# The worked example of docs/controllers.md, as the page shows it: keep out/<key>.txt in
# sync with the spec; a finalizer removes the file when the resource is deleted.
MIRROR = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "controllers.md").read_text(), re.S).group(1)


def write_controller(project: Path, name: str, source: str) -> Path:
    path = project / ".piwf" / "controllers" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


async def ctl(paths: StatePaths, operation: str, project: Path, name: str, key: str | None = None,
              **payload: Any) -> Any:
    body: dict[str, Any] = {"projectPath": str(project), "controller": name, **payload}
    if key is not None:
        body["key"] = key
    async with AsyncClient(paths) as client:
        response = await client.call(f"controller.{operation}", payload=body)
    assert response.outcome in ("accepted", "adopted"), response
    return response.receipt


async def refused(paths: StatePaths, operation: str, payload: dict[str, Any]) -> Any:
    async with AsyncClient(paths) as client:
        response = await client.call(f"controller.{operation}", payload=payload)
    assert response.outcome not in ("accepted", "adopted"), response
    return response


async def get(paths: StatePaths, project: Path, name: str, key: str) -> dict[str, Any] | None:
    async with AsyncClient(paths) as client:
        response = await client.call("controller.get", payload={"projectPath": str(project), "controller": name,
                                                                "key": key})
    if response.outcome == "notFound":
        return None
    assert response.outcome == "accepted", response
    return response.receipt


def ready(resource: dict[str, Any] | None) -> bool:
    return (resource is not None and resource["status"]["observedGeneration"] == resource["generation"]
            and resource["ready"] == "True" and not resource["reconciling"])


@pytest.fixture
def mirror(project: Path) -> Path:
    write_controller(project, "mirror", MIRROR)
    return project


async def test_the_sample_controller_converges_rewrites_and_finalizes(host: Any, paths: StatePaths,
                                                                     mirror: Path) -> None:
    receipt = await ctl(paths, "apply", mirror, "mirror", "greeting", spec={"text": "hello"})
    assert (receipt["generation"], receipt["resourceVersion"]) == (1, 1)
    got = await wait_for(lambda: _ready(paths, mirror, "greeting"))
    assert (mirror / "out" / "greeting.txt").read_text() == "hello"
    assert got["status"]["controllerStatus"] == {"written": "hello", "bytes": 5}
    assert got["finalizers"] == ["mirror/file"]
    [condition] = got["status"]["conditions"]
    assert condition["type"] == "Ready" and condition["observedGeneration"] == 1
    assert condition["lastTransitionTime"]

    changed = await ctl(paths, "apply", mirror, "mirror", "greeting", spec={"text": "bye"})
    assert changed["generation"] == 2
    await wait_for(lambda: _ready(paths, mirror, "greeting", generation=2))
    assert (mirror / "out" / "greeting.txt").read_text() == "bye"
    applied = [e for e in got["events"] + (await get(paths, mirror, "mirror", "greeting"))["events"]
               if e["type"] == "effect_applied"]
    assert len({e["eventId"] for e in applied}) == 2  # `write` once per spec generation

    deleting = await ctl(paths, "delete", mirror, "mirror", "greeting")
    assert not deleting["deleted"]
    await wait_for(lambda: _gone(paths, mirror, "greeting"))
    assert not (mirror / "out" / "greeting.txt").exists()
    status = await wait_for(lambda: _idle(paths))
    assert status["pendingControllers"] == 0


async def test_a_pass_that_changes_nothing_keeps_the_resource_version(host: Any, paths: StatePaths,
                                                                     mirror: Path) -> None:
    await ctl(paths, "apply", mirror, "mirror", "greeting", spec={"text": "hello"})
    first = await wait_for(lambda: _ready(paths, mirror, "greeting"))

    async def passes() -> int:
        got = await get(paths, mirror, "mirror", "greeting")
        assert got is not None
        return sum(e["type"] == "reconcile_finished" for e in got["events"])

    done = await passes()
    for wanted in (done + 1, done + 2):  # the same spec reconciled again: the same status, written as nothing
        await ctl(paths, "reconcile", mirror, "mirror", "greeting")
        await wait_for(lambda: _passed(passes, wanted))  # noqa: B023 (awaited in this iteration)
    again = await get(paths, mirror, "mirror", "greeting")
    assert again is not None and (again["resourceVersion"], again["status"]) == (
        first["resourceVersion"], first["status"])
    changed = await ctl(paths, "apply", mirror, "mirror", "greeting", spec={"text": "bye"})
    assert changed["resourceVersion"] == first["resourceVersion"] + 1  # a compare-and-set token still
    moved = await wait_for(lambda: _ready(paths, mirror, "greeting", generation=2))
    assert moved["resourceVersion"] == changed["resourceVersion"] + 1


async def _passed(passes: Any, at_least: int) -> bool:
    return bool(await passes() >= at_least)


async def _ready(paths: StatePaths, project: Path, key: str, generation: int = 1) -> dict[str, Any] | None:
    got = await get(paths, project, "mirror", key)
    return got if ready(got) and got["generation"] == generation else None


async def _gone(paths: StatePaths, project: Path, key: str) -> bool:
    return await get(paths, project, "mirror", key) is None


async def _host_status(paths: StatePaths) -> dict[str, Any]:
    async with AsyncClient(paths) as client:
        return (await client.call("host.status")).receipt


async def _idle(paths: StatePaths) -> dict[str, Any] | None:
    status = await _host_status(paths)
    return status if status["activeControllerWorkers"] == 0 else None


async def test_bad_input_is_one_line_and_changes_nothing(host: Any, paths: StatePaths, mirror: Path) -> None:
    write_controller(mirror, "broken", "raise RuntimeError('no')\n")
    write_controller(mirror, "empty", "x = 1\n")
    base = {"projectPath": str(mirror), "key": "k", "spec": {}}
    for name, words in (("broken", "failed to import"), ("empty", "defines no module-level"),
                        ("missing", "no controller")):
        response = await refused(paths, "apply", {**base, "controller": name})
        assert response.outcome == "rejected" and words in response.error and "\n" not in response.error
    await ctl(paths, "apply", mirror, "mirror", "k", spec={"text": "a"})
    stale = await refused(paths, "apply", {**base, "controller": "mirror", "spec": {"text": "b"},
                                           "expectedResourceVersion": 99})
    assert stale.outcome == "conflict"
    # a spec over 1 MiB cannot fit a request line (1 MiB): the client refuses to send it
    # (the store's own check of the spec's size: tests/conformance/test_controllers.py)
    with pytest.raises(RequestTooLarge, match="at most 1048576 bytes"):
        await refused(paths, "apply", {**base, "controller": "mirror", "key": "big",
                                       "spec": {"text": "x" * (1024 * 1024 - 200)}})
    unknown = await refused(paths, "reconcile", {"projectPath": str(mirror), "controller": "mirror", "key": "nope"})
    assert unknown.outcome == "notFound"
    async with AsyncClient(paths) as client:
        listed = (await client.call("controller.list", payload={"projectPath": str(mirror)})).receipt
    assert [r["key"] for r in listed] == ["k"]
    got = await get(paths, mirror, "mirror", "k")
    assert got is not None and got["spec"] == {"text": "a"}


# Starts the `gated` workflow (tests/conftest.py) as its child; Ready once the child succeeded.
PARENT = """
    from piwf import Controller, Result

    def reconcile(ctx):
        child = ctx.workflows.ensure("main", "gated", {"who": ctx.resource.spec["who"]})
        ctx.log(f"child {child['runId']} is {child['state']}")
        if child["state"] in ("running", "waiting"):
            return Result.settled(status={"child": child["state"]},
                                  conditions=[{"type": "Ready", "status": "False", "reason": "ChildRunning"}])
        return Result.settled(status={"child": child["state"], "output": child["output"]},
                              conditions=[{"type": "Ready", "status": "True", "reason": "ChildDone"}])

    controller = Controller(name="parent", reconcile=reconcile)
"""


async def test_a_child_run_ending_queues_its_resource_and_shows_in_status(host: Any, paths: StatePaths,
                                                                         project: Path) -> None:
    write_controller(project, "parent", PARENT)
    await ctl(paths, "apply", project, "parent", "p", spec={"who": "ada"})

    async def child_running() -> dict[str, Any] | None:
        got = await get(paths, project, "parent", "p")
        ok = got and got["status"].get("controllerStatus", {}).get("child") == "running" and not got["reconciling"]
        return got if ok else None

    got = await wait_for(child_running)
    run = got["status"]["workflowRun"]
    assert run["requestKey"] == "main" and run["state"] == "running" and run["attempt"] == 1
    assert got["children"] == [{"requestKey": "main", "workflow": "gated", "runId": run["runId"], "state": "running",
                                "attempt": 1}]
    human = (await piwf(paths, "controller", "get", "parent", "p", "--project", str(project))).stdout.decode()
    assert f"children:   1 run(s) its reconciles started\n  {run['runId']} gated running, attempt 1 (key main)" in human
    await wait_for(lambda: (project / "wait.log").exists())
    (project / "gate").touch()

    async def child_done() -> dict[str, Any] | None:
        got = await get(paths, project, "parent", "p")
        return got if got and got["ready"] == "True" and not got["reconciling"] else None

    done = await wait_for(child_done)
    assert done["status"]["workflowRun"] == {**run, "state": "succeeded"}
    assert done["status"]["controllerStatus"]["output"]["input"] == {"who": "ada"}
    async with AsyncClient(paths) as client:
        child = (await client.call("run.status", run_id=run["runId"])).receipt
    assert child["status"] == "completed"
    assert (project / "once.log").read_text().count(run["runId"]) == 1  # one child run, not one per pass
    assert any(e["type"] == "log" for e in done["events"])


async def test_the_cli_applies_shows_lists_reconciles_and_deletes(host: Any, paths: StatePaths, mirror: Path) -> None:
    import json

    where = ("--project", str(mirror))
    applied = json.loads((await piwf(paths, "controller", "apply", "mirror", "cli", "--spec", '{"text": "x"}',
                                     *where, "--json")).stdout)
    assert applied["generation"] == 1 and applied["changed"]
    await wait_for(lambda: _ready(paths, mirror, "cli"))
    shown = json.loads((await piwf(paths, "controller", "get", "mirror", "cli", *where, "--json")).stdout)
    for field in ("uid", "resourceVersion", "generation", "spec", "status", "finalizers", "deletionTimestamp",
                  "consecutiveErrors", "availableAt", "lastError", "events"):
        assert field in shown, field
    human = (await piwf(paths, "controller", "get", "mirror", "cli", cwd=mirror)).stdout.decode()
    assert "Ready=True Synced" in human and "finalizers: mirror/file" in human
    listed = json.loads((await piwf(paths, "controller", "list", "mirror", "--json")).stdout)
    assert [r["key"] for r in listed] == ["cli"]
    await piwf(paths, "controller", "reconcile", "mirror", "cli", *where)
    await piwf(paths, "controller", "delete", "mirror", "cli", *where)
    await wait_for(lambda: _gone(paths, mirror, "cli"))
    missing = await piwf(paths, "controller", "get", "mirror", "cli", *where, check=False)
    assert missing.returncode != 0 and missing.stderr.decode().count("\n") == 1
    bad = await piwf(paths, "controller", "apply", "mirror", "cli", "--spec", "{nope", *where, check=False)
    assert bad.returncode == 2 and "--spec is not valid JSON" in bad.stderr.decode()


# Its child run waits for a person's decision (docs/people-in-the-loop.md).
APPROVER = """
    from piwf import Controller, Result

    def reconcile(ctx):
        child = ctx.workflows.ensure("approval", "deploy", {})
        ready = "True" if child["state"] == "succeeded" else "False"
        return Result.settled(status={"child": child["state"]},
                              conditions=[{"type": "Ready", "status": ready, "reason": child["state"]}])

    controller = Controller(name="approver", reconcile=reconcile)
"""


async def test_a_child_run_waiting_for_a_decision_shows_waiting_then_succeeded(host: Any, paths: StatePaths,
                                                                              project: Path) -> None:
    from .test_interactions import deploy_source, open_request

    write_workflow(project, "deploy", deploy_source())
    write_controller(project, "approver", APPROVER)
    await ctl(paths, "apply", project, "approver", "a", spec={})

    async def child_in(state: str) -> dict[str, Any] | None:
        got = await get(paths, project, "approver", "a")
        ok = got and got["status"].get("workflowRun", {}).get("state") == state and not got["reconciling"]
        return got if ok and got["status"]["controllerStatus"] == {"child": state} else None

    waiting = await wait_for(lambda: child_in("waiting"))
    request = await open_request(paths, waiting["status"]["workflowRun"]["runId"])
    async with AsyncClient(paths) as client:
        assert (await client.call("decision.answer", payload={"requestId": request["requestId"],
                                                              "choice": "yes"})).outcome == "accepted"
    done = await wait_for(lambda: child_in("succeeded"))
    assert done["ready"] == "True"
