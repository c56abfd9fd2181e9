"""A full disk: explicit errors, nothing half-written, the host stays up and recovers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from piwf.client import AsyncClient, make_request
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import HostProcess, wait_for


async def test_a_full_disk_refuses_writes_clearly_and_the_host_recovers_when_space_returns(
    host: HostState, paths: StatePaths, project: Path
) -> None:
    # SQLite's own size limit makes the disk "full" for this connection: the same
    # SQLITE_FULL error a full file system gives, without needing one.
    pages = host.store.db.scalar("PRAGMA page_count")
    host.store.db.execute(f"PRAGMA max_page_count = {pages}")
    big_input = {"blob": "x" * 200_000}  # needs new pages
    request = make_request("run.start", client_id="c", payload={
        "workflow": "greet", "projectPath": str(project), "input": big_input})
    async with AsyncClient(paths) as client:
        refused = await client.send(request)
        assert refused.outcome == "unavailable"
        assert refused.error is not None and "disk full" in refused.error and "nothing was changed" in refused.error
        status = await client.call("host.status")
        assert status.outcome == "accepted" and status.receipt["queuedRuns"] == 0  # nothing half-written

        host.store.db.execute("PRAGMA max_page_count = 1073741823")  # space is back
        accepted = await client.send(request)  # the same request, retried
        assert accepted.outcome == "accepted", accepted
        run_id = accepted.receipt["runId"]
        done = await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
        assert done.receipt["status"] == "completed"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB file system that can fill up (tmpfs; mounting it needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


async def test_a_run_in_flight_when_the_disk_fills_is_not_lost_and_finishes_once_space_returns(
    small_disk: Path, project: Path, tmp_path: Path
) -> None:
    paths = StatePaths.resolve(small_disk / "state")
    host = HostProcess(paths, tmp_path / "host.log")
    await host.start()
    try:
        async with AsyncClient(paths) as client:
            run_id = (await client.call("run.start", payload={"workflow": "gated", "projectPath": str(project)})
                      ).receipt["runId"]
            await wait_for(lambda: (project / "wait.log").exists())  # the run sits in its shell node
            filler = _fill_up(small_disk)
            (project / "gate").touch()  # the node ends; nothing it did can be written now
            await wait_for(lambda: "could not record the end of its worker" in host.log.read_text())
            assert (await client.call("host.status")).outcome == "accepted"  # the host stays up
            run = (await client.call("run.status", run_id=run_id)).receipt
            assert run["status"] == "running" and run["error"] is None  # not failed, not lost

            filler.unlink()  # space is back
            # Well within the 30 s claim lease: the host retries what it could not write, it
            # does not wait for its own claim to expire.
            done = (await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 15_000})).receipt
        assert done["status"] == "completed", done
        assert (project / "once.log").read_text().splitlines() == [run_id]  # its accepted step was kept
        assert "disk full" in host.log.read_text()
    finally:
        host.signal(signal.SIGTERM)
        await host.wait()


def _fill_up(disk: Path) -> Path:
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)
    return filler
