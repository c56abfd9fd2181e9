"""A full disk: explicit errors, nothing half-written, the host stays up and recovers."""

from __future__ import annotations

from pathlib import Path

from piwf.client import AsyncClient, make_request
from piwf.host.state import HostState
from piwf.paths import StatePaths


async def test_a_full_disk_refuses_writes_clearly_and_the_host_recovers_when_space_returns(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    # SQLite's own size limit makes the disk "full" for this connection: the same
    # SQLITE_FULL error a full file system gives, without needing one.
    pages = host.db.scalar("PRAGMA page_count")
    host.db.execute(f"PRAGMA max_page_count = {pages}")
    big_input = {"blob": "x" * 200_000}  # needs new pages
    request = make_request("run.start", client_id="c", payload={
        "workflow": "greet", "projectPath": str(project), "input": big_input})
    async with AsyncClient(paths) as client:
        refused = await client.send(request)
        assert refused.outcome == "unavailable"
        assert refused.error is not None and "disk full" in refused.error and "nothing was changed" in refused.error
        status = await client.call("host.status")
        assert status.outcome == "accepted" and status.receipt["queuedRuns"] == 0  # nothing half-written

        host.db.execute("PRAGMA max_page_count = 1073741823")  # space is back
        accepted = await client.send(request)  # the same request, retried
        assert accepted.outcome == "accepted", accepted
        run_id = accepted.receipt["runId"]
        done = await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
        assert done.receipt["status"] == "completed"
