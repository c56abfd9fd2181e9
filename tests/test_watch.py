"""Live updates, the run.watch long poll and `piwf watch`: real hosts, real workers, the
real command (into a pipe, and on a terminal driven by tmux)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.client import AsyncClient
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_interactions import start, wait_run
from .test_lifecycle import call, run_status

CRUNCH = """
    import time
    from pathlib import Path
    from piwf import Workflow, compute

    def crunch(ctx):
        ctx.publish("progress", "rows", {"done": 3, "of": 10})
        ctx.publish("progress", "rows", {"done": 7, "of": 10})
        Path(ctx.project_path, "published").write_text("yes")
        while not Path(ctx.project_path, "gate").exists():
            time.sleep(0.02)
        return "ok"

    workflow = Workflow(name="crunch", start_at="warmup", nodes={
        "warmup": compute(lambda ctx: 1), "crunch": compute(crunch)}, edges=[("warmup", "crunch")])
"""


async def crunching(paths: StatePaths, project: Path) -> str:
    write_workflow(project, "crunch", CRUNCH)
    run_id = await start(paths, project, "crunch")
    await wait_for(lambda: (project / "published").exists())
    return run_id


async def test_an_update_replaces_its_value_and_shows_in_run_status_and_watch(
        host: Any, paths: StatePaths, project: Path) -> None:
    run_id = await crunching(paths, project)
    [update] = (await run_status(paths, run_id))["updates"]
    assert (update["type"], update["key"], update["data"]) == ("progress", "rows", {"done": 7, "of": 10})
    snapshot = await call(paths, "run.watch")
    [run] = snapshot["runs"]
    assert (run["runId"], run["currentNode"], run["status"]) == (run_id, "crunch", "running")
    assert [u["data"]["done"] for u in snapshot["updates"]] == [7]
    (project / "gate").write_text("open")
    changed = await call(paths, "run.watch", payload={"after": snapshot["cursor"], "timeoutMs": 20_000})
    assert changed["events"] and changed["cursor"] > snapshot["cursor"]
    assert {e["runId"] for e in changed["events"]} == {run_id}
    assert (await wait_run(paths, run_id))["status"] == "completed"


async def test_a_watch_answers_when_something_changes_and_is_given_up_when_its_client_leaves(
        host: Any, paths: StatePaths, project: Path) -> None:
    cursor = (await call(paths, "run.watch"))["cursor"]
    answers: list[Any] = []
    answered = trio.Event()
    async with AsyncClient(paths) as watcher, trio.open_nursery() as nursery:
        async def watch() -> None:
            answers.append(await watcher.watch(after=cursor, timeout_ms=600_000))
            answered.set()

        nursery.start_soon(watch)
        await wait_for(lambda: host.connections == 1)
        run_id = await start(paths, project, "greet")
        with trio.fail_after(10):
            await answered.wait()
    assert answers[0].receipt["events"][0]["runId"] == run_id
    assert answers[0].receipt["events"][0]["event"]["type"] == "created"
    # a client that goes away mid-poll: the host gives the poll up and closes its end
    gone = AsyncClient(paths)
    await gone.connect()
    await gone._stream.send_all(_watch_line(cursor + 10_000))
    await wait_for(lambda: host.connections == 1)
    await gone.aclose()
    await wait_for(lambda: host.connections == 0)
    refused = await call(paths, "host.status")
    assert refused["connectedClients"] == 1  # only this request's own connection


async def test_a_request_pipelined_behind_a_watch_ends_the_watch_and_both_are_answered_in_order(
        host: Any, paths: StatePaths, monkeypatch: pytest.MonkeyPatch) -> None:
    from piwf.client import _decode, make_request
    from piwf.host.departures import Departures
    from piwf.wire import encode_line

    watched = trio.Event()  # the watch is waiting, its client watched for leaving or sending more
    real_watch = Departures.watch

    def watch(self: Departures, fd: int, gone: trio.CancelScope, ends_early: trio.CancelScope) -> None:
        real_watch(self, fd, gone, ends_early)
        watched.set()

    monkeypatch.setattr(Departures, "watch", watch)

    cursor = (await call(paths, "run.watch"))["cursor"]
    status = encode_line(make_request("host.status", client_id="c", request_id="behind"))
    async with AsyncClient(paths) as client:
        await client._stream.send_all(_watch_line(cursor + 10_000) + status)
        with trio.fail_after(5):  # not the watch's 600 s
            watch, behind = _decode(await client.read_line()), _decode(await client.read_line())
    assert watch.outcome == "accepted" and watch.receipt["events"] == []
    assert behind.requestId == "behind" and behind.outcome == "accepted"
    async with AsyncClient(paths) as client:  # the next request comes while the watch waits
        watched = trio.Event()
        await client._stream.send_all(_watch_line(cursor + 10_000))
        with trio.fail_after(5):
            await watched.wait()
        await client._stream.send_all(status)
        with trio.fail_after(5):
            watch, behind = _decode(await client.read_line()), _decode(await client.read_line())
    assert watch.receipt["events"] == [] and behind.requestId == "behind"


def _watch_line(after: int) -> bytes:
    from piwf.client import make_request
    from piwf.wire import encode_line

    return encode_line(make_request("run.watch", client_id="c", payload={"after": after, "timeoutMs": 600_000}))


async def test_a_watch_in_progress_ends_when_the_host_stops(host: Any, paths: StatePaths) -> None:
    cursor = (await call(paths, "run.watch"))["cursor"]
    outcome: list[str] = []
    ended = trio.Event()
    async with AsyncClient(paths) as watcher, trio.open_nursery() as nursery:
        async def watch() -> None:
            try:
                await watcher.watch(after=cursor + 10_000, timeout_ms=600_000)
                outcome.append("answered")
            except (HostUnavailable, trio.BrokenResourceError):
                outcome.append("closed")
            ended.set()

        nursery.start_soon(watch)
        await wait_for(lambda: host.connections == 1)
        host.stop_requested.set()
        with trio.fail_after(10):
            await ended.wait()
    assert outcome == ["closed"]


async def test_piwf_watch_once_shows_an_active_runs_node_and_latest_update(
        host: Any, paths: StatePaths, project: Path) -> None:
    run_id = await crunching(paths, project)
    wide = await trio.run_process([sys.executable, "-m", "piwf", "watch", "--once", "--state-dir", str(paths.root)],
                                  capture_stdout=True, env={**os.environ, "COLUMNS": "160"})
    text = wide.stdout.decode()
    row = next(line for line in text.splitlines() if run_id in line)
    assert "crunch" in row and "running" in row and "progress/rows" in row and '"done": 7' in row
    assert '"done": 3' not in text  # replaced, not appended
    narrow = await trio.run_process([sys.executable, "-m", "piwf", "watch", "--once", "--state-dir",
                                     str(paths.root)], capture_stdout=True, env={**os.environ, "COLUMNS": "40"})
    row = next(line for line in narrow.stdout.decode().splitlines() if run_id in line)  # into a pipe: not wrapped
    assert "running" in row and '"done": 7' in row, row
    one = (await piwf(paths, "watch", run_id, "--once", "--json")).stdout
    assert b'"currentNode": "crunch"' in one
    missing = await piwf(paths, "watch", "run-nope", "--once", check=False)
    assert missing.returncode == 6 and missing.stderr.count(b"\n") == 1
    (project / "gate").write_text("open")


async def test_piwf_watch_shows_a_change_within_200_ms(host: Any, paths: StatePaths, project: Path) -> None:
    """Measured from the reply to the request that made the change to the line of the
    redrawn view naming it, both observed as events (no sleeping)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "watch", "--state-dir", str(paths.root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "160"})
    assert proc.stdout is not None
    buffer = b""
    try:
        with trio.fail_after(20):
            while b"recent events" not in buffer:  # the first view is drawn
                buffer += await proc.stdout.receive_some(65536)
        async with AsyncClient(paths) as client:
            started = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project)})
            changed_at = trio.current_time()
            run_id = started.receipt["runId"]
            buffer = b""
            with trio.fail_after(20):
                while run_id.encode() not in buffer:
                    buffer += await proc.stdout.receive_some(65536)
            seen_at = trio.current_time()
        print(f"piwf watch: the view changed {seen_at - changed_at:.3f} s after the change")
        assert seen_at - changed_at < 0.2, f"the view changed {seen_at - changed_at:.3f} s after the change"
        assert b"cursor" in buffer
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_piwf_watch_on_a_terminal_draws_runs_updates_and_events(
        host: Any, paths: StatePaths, project: Path, tmp_path: Path) -> None:
    """`piwf watch` in a real terminal (a tmux pane, 120x40), read back with capture-pane."""
    socket = str(tmp_path / "tmux.sock")
    command = f"{sys.executable} -m piwf watch --state-dir {paths.root}"
    tmux = ["tmux", "-S", socket]
    await trio.run_process([*tmux, "new-session", "-d", "-x", "120", "-y", "40", command])
    try:
        run_id = await crunching(paths, project)

        async def screen() -> str | None:
            shown = (await trio.run_process([*tmux, "capture-pane", "-p"], capture_stdout=True)).stdout.decode()
            return shown if run_id in shown and '"done": 7' in shown else None

        shown = await wait_for(screen)
        row = next(line for line in shown.splitlines() if run_id in line and "crunch" in line)
        assert "running" in row and "progress/rows" in row
        assert "recent events" in shown and "update" in shown
        (project / "gate").write_text("open")

        async def completed() -> str | None:
            shown = (await trio.run_process([*tmux, "capture-pane", "-p"], capture_stdout=True)).stdout.decode()
            return shown if "completed" in shown else None

        await wait_for(completed)
    finally:
        await trio.run_process([*tmux, "kill-server"], check=False)


async def test_piwf_watch_outlives_a_host_restart(host_process: Callable[..., HostProcess], paths: StatePaths,
                                                  project: Path) -> None:
    write_workflow(project, "greet", """
        from piwf import Workflow, compute
        workflow = Workflow(name="greet", start_at="hi", nodes={"hi": compute(lambda ctx: "hi")})
    """)
    first = await host_process().start()
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "watch", "--json", "--state-dir", str(paths.root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    buffer = b""
    try:
        with trio.fail_after(20):
            while b"\n" not in buffer:  # the snapshot
                buffer += await proc.stdout.receive_some(65536)
        first.signal(signal.SIGTERM)
        assert await first.wait() == 0
        await host_process().start()
        run_id = await start(paths, project, "greet")
        with trio.fail_after(20):
            while run_id.encode() not in buffer:
                buffer += await proc.stdout.receive_some(65536)
        assert proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()
    stderr = b""
    while chunk := await proc.stderr.receive_some(65536):
        stderr += chunk
    lines = stderr.decode().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["piwf: lost the host", "piwf: reconnected to the host"], lines


async def test_a_change_announced_while_a_watch_reads_is_not_missed() -> None:
    """A backend that reads in a thread lets the host announce a change while ``done()``
    is reading: the long poll must ask again, not wait for the change after it."""
    from types import SimpleNamespace

    from piwf.host.delivery import until_changed
    from piwf.host.state import Changes

    host: Any = SimpleNamespace(run_changed=Changes())
    reads = 0

    async def done() -> bool:
        nonlocal reads
        reads += 1
        if reads == 1:  # the first read is in flight when the change lands
            host.run_changed.set()
            await trio.sleep(0)
            return False
        return True

    with trio.fail_after(5):
        await until_changed(host, done)
    assert reads == 2
