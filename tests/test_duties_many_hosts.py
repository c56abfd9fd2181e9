"""The duties every host does, done once with three hosts on one PostgreSQL store (issue
21): deadline expiry, pruning (``--retain``), reconcile claims and child-run watching. No leader: each host
runs each duty, and each due item is taken by one of them (the store's locks:
tests/conformance/test_interleavings_duties.py and test_interleavings_people.py show the
interleavings one by one). Real in-process hosts with real workers; what each host did
is read from its log records (one logger for the three: the records name the items)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.client import AsyncClient

from .conftest import wait_for, write_workflow
from .test_control_any_host import serve, store_url  # noqa: F401 (store_url: a fixture)
from .test_controllers import ctl, get, mirror, ready, write_controller  # noqa: F401 (mirror: a fixture)
from .test_controllers_lifecycle import CHILDISH
from .test_interactions import start
from .test_lifecycle import call

EXPIRING = """
    from piwf import Workflow, compute, decision

    def hold(ctx):
        ctx.notify("held by its default")
        return {"held": ctx.outputs["approve"]}

    workflow = Workflow(
        name="expiring",
        start_at="approve",
        nodes={
            "approve": decision("Deploy?", choices={"yes": "Deploy", "no": "Hold"}, deadline=1.0, default="no"),
            "deploy": compute(lambda ctx: "deployed"),
            "hold": compute(hold),
        },
        edges=[("approve.yes", "deploy"), ("approve.no", "hold")],
    )
"""

RUNS = 6


def _logged(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "piwf.host" and r.msg.startswith(start)]


async def test_each_deadline_is_kept_once_by_three_hosts(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="piwf.host")
    write_workflow(project, "expiring", EXPIRING)
    hosts = [await serve(nursery, tmp_path, f"h{n}", store_url) for n in range(3)]
    run_ids = [await start(hosts[n % 3], project, "expiring", originSessionId=f"s{n}") for n in range(RUNS)]
    for run_id in run_ids:  # each ends through its default, whichever host kept its deadline
        async def ended(run_id: str = run_id) -> dict[str, Any] | None:
            run = await call(hosts[0], "run.status", run_id=run_id)
            return run if run["status"] not in ("queued", "running", "waiting") else None

        done = await wait_for(ended, timeout=20)
        assert done["status"] == "completed", done
        assert done["output"]["held"]["provenance"] == "timeout"
    closed = [request for r in _logged(caplog, "closed %d request(s) at their deadline")
              for request in str(r.args[1]).split(", ")]  # type: ignore[index]
    assert len(closed) == RUNS and len(set(closed)) == RUNS, closed  # every request closed once, by one host
    for n, run_id in enumerate(run_ids):
        events = [e["type"] for e in (await call(hosts[1], "run.events", run_id=run_id))["events"]]
        assert events.count("decision.answered") == 1
        page = await call(hosts[2], "delivery.list", payload={"sessionId": f"s{n}"})
        assert [x["content"] for x in page["notifications"]] == ["held by its default"]
        assert len(page["turns"]) == 1  # the run's end, told once


async def test_three_hosts_retaining_runs_delete_each_once(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="piwf.host")
    hosts = [await serve(nursery, tmp_path, f"h{n}", store_url, retain_ms=3000) for n in range(3)]
    run_ids = [await start(hosts[n % 3], project, "greet") for n in range(RUNS)]

    async def all_gone() -> bool:
        return (await call(hosts[0], "run.list", payload={"limit": 100})) == []

    await wait_for(all_gone, timeout=30)
    deleted = sum(r.args[0] for r in _logged(caplog, "deleted %d run(s)"))  # type: ignore[index,misc]
    assert deleted == RUNS
    assert not _logged(caplog, "could not delete")
    for run_id in run_ids:
        async with AsyncClient(hosts[1]) as client:
            assert (await client.call("run.status", run_id=run_id)).outcome == "notFound"


async def test_three_hosts_take_each_reconcile_once(
        nursery: trio.Nursery, tmp_path: Path, mirror: Path, store_url: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="piwf.host")
    hosts = [await serve(nursery, tmp_path, f"h{n}", store_url) for n in range(3)]
    keys = [f"k{n}" for n in range(RUNS)]
    for n, key in enumerate(keys):
        await ctl(hosts[n % 3], "apply", mirror, "mirror", key, spec={"text": key})

    async def all_ready() -> bool:
        return all([ready(await get(hosts[0], mirror, "mirror", key)) for key in keys])

    await wait_for(all_ready, timeout=30)
    passes = Counter((str(r.args[0]), r.args[1]) for r in _logged(caplog, "%s: reconciling (claim %d)"))  # type: ignore[index]
    assert passes and max(passes.values()) == 1, passes  # no claim of a resource taken twice
    assert {label for label, _ in passes} == {f"resource mirror/{key}" for key in keys}
    for key in keys:
        assert (mirror / "out" / f"{key}.txt").read_text() == key


async def test_three_hosts_watching_child_runs_record_each_move_once(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:  # noqa: F811
    write_controller(project, "childish", CHILDISH)
    hosts = [await serve(nursery, tmp_path, f"h{n}", store_url) for n in range(3)]
    keys = [f"k{n}" for n in range(RUNS)]
    for n, key in enumerate(keys):
        await ctl(hosts[n % 3], "apply", project, "childish", key, spec={"workflow": "greet"})

    async def settled(key: str) -> dict[str, Any] | None:
        got = await get(hosts[0], project, "childish", key)
        done = (got is not None and not got["reconciling"]
                and got["status"]["controllerStatus"].get("child") == "succeeded")
        return got if done else None

    for key in keys:  # every host watches the children; each move is recorded by one of them
        got = await wait_for(lambda key=key: settled(key), timeout=30)
        moves = [e["detail"]["state"] for e in got["events"] if e["type"] == "workflow_changed"]
        assert moves == ["succeeded"], got["events"]
