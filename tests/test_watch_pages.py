"""Issue 22, point 7: a `run.watch` snapshot comes in pages of active runs (each page a
short request for the host), `piwf watch` still shows them all, and `piwf inbox` takes
`--limit` and says when there are more."""

from __future__ import annotations

import json
from pathlib import Path

from piwf.client import AsyncClient
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import piwf, write_workflow
from .test_interactions import open_request, start
from .test_settings import TUNED


async def start_many(client: AsyncClient, project: Path, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        started = await client.call("run.start", payload={"workflow": "gated", "projectPath": str(project)})
        ids.append(started.receipt["runId"])
    return ids


async def test_a_snapshot_of_many_active_runs_comes_in_pages(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    ids = await start_many(client, project, 450)
    pages, runs_after = [], None
    while True:
        payload = {"limit": 200, **({"runsAfter": runs_after} if runs_after else {})}
        page = (await client.call("run.watch", payload=payload)).receipt
        pages.append(page)
        runs_after = page["nextRunsAfter"]
        if runs_after is None:
            break
    assert [len(p["runs"]) for p in pages] == [200, 200, 50]
    shown = [r["runId"] for p in pages for r in p["runs"]]
    assert len(shown) == len(set(shown)) and set(shown) == set(ids)  # each once, oldest first
    assert all(len(p["events"]) <= 200 for p in pages)

    small = (await client.call("run.watch", payload={"limit": 1})).receipt  # the default page is bounded too
    assert len(small["runs"]) == 1 and small["nextRunsAfter"] == shown[0]
    refused = await client.call("run.watch", payload={"runsAfter": "no-such-run"})
    assert refused.outcome == "rejected" and "payload.runsAfter: no run 'no-such-run'" in (refused.error or "")


async def test_piwf_watch_once_still_shows_every_active_run_and_watch_goes_on_from_the_first_cursor(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    ids = await start_many(client, project, 230)
    done = await piwf(paths, "watch", "--once", "--json")
    page = json.loads(done.stdout)
    assert {r["runId"] for r in page["runs"]} == set(ids) and page["nextRunsAfter"] is None
    assert len(page["events"]) <= 12


async def test_inbox_limit_shows_the_oldest_and_says_there_are_more(
        host: HostState, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    ids = [await start(paths, project, "tuned") for _ in range(4)]
    for run_id in ids:
        await open_request(paths, run_id)
    text = (await piwf(paths, "inbox", "--limit", "3")).stdout.decode()
    assert sum(line.startswith("req-") for line in text.splitlines()) == 3, text
    assert "… more requests than these 3 (oldest first): piwf inbox --limit 30" in text
    listed = json.loads((await piwf(paths, "inbox", "--limit", "3", "--json")).stdout)
    assert len(listed["requests"]) == 3 and listed["more"] is True
    everything = json.loads((await piwf(paths, "inbox", "--json")).stdout)
    assert len(everything["requests"]) == 4 and everything["more"] is False
    assert "more requests" not in (await piwf(paths, "inbox")).stdout.decode()
    refused = await piwf(paths, "inbox", "--limit", "1000", check=False)
    assert refused.returncode != 0 and b"over 999" in refused.stderr
