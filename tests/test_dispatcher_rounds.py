"""The run dispatcher's claim rounds: a round is run whenever it could find work, and not
when it could not (a real host, real workers, real SQLite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from piwf.client import AsyncClient
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import config, wait_for
from .test_warm_workers import warm_project


@pytest.mark.parametrize(("workflow", "session", "expected"), [
    ("greet", None, [1, 1, 1]), ("warm", None, [1, 1, 1]),
    ("greet", "agent-1", [1, 0, 1, 0, 1, 0]),  # a run of its session may wait on its end: a round
])
async def test_a_run_that_ends_itself_wakes_no_claim_round_that_could_find_nothing(
        paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch,
        workflow: str, session: str | None, expected: list[int]) -> None:
    """Each run's start wakes the one round that claims it; its end (it completed, it has
    no origin session, the last round left room) wakes none: nothing became claimable.
    The end of a run of a session wakes one (its session's next run may be claimable now)."""
    warm_project(project)
    host = await nursery.start(Host(config(paths, poll_s=3600.0)).serve)  # no backstop round meanwhile
    await trio.testing.wait_all_tasks_blocked()  # the dispatcher's first round is over
    aggregate = type(host.store.supervision)
    claim_runs = aggregate.claim_runs
    rounds: list[int] = []

    async def counted(self: Any, **kwargs: Any) -> Any:
        claimed = await claim_runs(self, **kwargs)
        rounds.append(len(claimed))
        return claimed

    monkeypatch.setattr(aggregate, "claim_runs", counted)
    async with AsyncClient(paths) as client:
        for _ in range(3):
            started = await client.call("run.start", payload={"workflow": workflow, "projectPath": str(project),
                                                               "originSessionId": session})
            done = await client.call("run.wait", run_id=started.receipt["runId"])
            assert done.receipt["status"] == "completed"
            await wait_for(lambda: not host.runs.active)  # its supervisor is over
            await trio.testing.wait_all_tasks_blocked()  # and a round it woke would have begun
    host.stop_requested.set()
    assert rounds == expected
