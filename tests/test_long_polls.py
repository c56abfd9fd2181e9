"""Issue 22, point 5: long polls (`run.watch`, `run.wait`) never lock out `status`, `stop`
or short requests. At the connection cap a newcomer takes the slot of the longest-running
long poll, which answers at once with what it has; its client connects again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from piwf.client import AsyncClient
from piwf.errors import HostUnavailable
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import piwf, wait_for

LONG_MS = 600_000


async def hold_long_polls(paths: StatePaths, nursery: trio.Nursery, count: int, operation: str,
                          answers: list[Any], **kwargs: Any) -> list[AsyncClient]:
    clients = []
    for _ in range(count):
        client = AsyncClient(paths)
        await client.connect()
        clients.append(client)

        async def poll(c: AsyncClient = client) -> None:
            try:
                answers.append(await c.call(operation, **kwargs))
            except HostUnavailable:
                answers.append(None)
            finally:
                with trio.CancelScope(shield=True):
                    await c.aclose()
        nursery.start_soon(poll)
    return clients


async def test_sixty_four_watches_leave_status_and_stop_served(
        host: HostState, paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    cursor = (await _call(paths, "run.watch", payload={"limit": 1})).receipt["cursor"]
    answers: list[Any] = []
    await hold_long_polls(paths, nursery, host.config.max_connections, "run.watch", answers,
                          payload={"after": cursor, "timeoutMs": LONG_MS})
    await wait_for(lambda: host.connections == host.config.max_connections)

    with trio.fail_after(15):
        status = await piwf(paths, "status", "--json")
    assert json.loads(status.stdout)["state"] == "running"
    # the displaced watch answered normally, with what it had (nothing new), and its connection closed
    await wait_for(lambda: answers)
    assert answers[0] is not None and answers[0].outcome == "accepted", answers
    assert answers[0].receipt["cursor"] == cursor and answers[0].receipt["events"] == []

    with trio.fail_after(15):  # a write is served as well
        started = await _call(paths, "run.start", payload={"workflow": "greet", "projectPath": str(project)})
    assert started.outcome == "accepted"


async def test_sixty_four_run_waits_leave_status_served(
        host: HostState, paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    gated = (await _call(paths, "run.start", payload={"workflow": "gated", "projectPath": str(project)})).receipt
    run_id = gated["runId"]
    answers: list[Any] = []
    await hold_long_polls(paths, nursery, host.config.max_connections, "run.wait", answers, run_id=run_id,
                          payload={"timeoutMs": LONG_MS})
    await wait_for(lambda: host.connections == host.config.max_connections)
    for _ in range(3):  # a newcomer takes the place of the longest-running long poll
        await wait_for(lambda: host.connections == host.config.max_connections)
        with trio.fail_after(15):
            assert (await _call(paths, "host.status")).outcome == "accepted"
        await hold_long_polls(paths, nursery, 1, "run.wait", [], run_id=run_id, payload={"timeoutMs": LONG_MS})
    await wait_for(lambda: len(answers) >= 3)
    assert all(a is not None and a.outcome == "accepted" and a.receipt["atRest"] is False for a in answers)
    (project / "gate").touch()
    with trio.fail_after(30):
        waited = await _call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})
    assert waited.receipt["atRest"] and waited.receipt["status"] == "completed"


async def _call(paths: StatePaths, operation: str, **kwargs: Any) -> Any:
    async with AsyncClient(paths) as client:
        return await client.call(operation, **kwargs)


async def test_a_long_poll_that_begins_as_the_server_ends_ends_at_once() -> None:
    """The host stopping cancels the departures watcher with the connections; a connection
    already past its last checkpoint may still begin a long poll: it ends at once (its
    ``gone`` scope cancelled), rather than registering on a closed epoll set."""
    import socket

    from piwf.host.departures import Departures

    departures = Departures()
    with trio.CancelScope() as ended:
        ended.cancel()
        await departures.serve()  # cancelled at once: the server ended, its epoll set closed
    gone, ends_early = trio.CancelScope(), trio.CancelScope()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        departures.watch(ours.fileno(), gone, ends_early)
        assert gone.cancel_called and not ends_early.cancel_called
        departures.forget(ours.fileno())
