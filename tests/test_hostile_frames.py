"""Frames nested too deep for a recursive decoder, against a real `piwf serve` process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import trio

from piwf.client import AsyncClient
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from piwf.wire import HOST_REQUEST, MAX_NESTING

from .conftest import HostProcess

DEPTH = 100_000


def deep(depth: int = DEPTH) -> str:
    return "[" * depth + "]" * depth


async def exchange_or_hangup(paths: StatePaths, line: bytes) -> dict | None:
    """Send one line on a new connection: the reply, or None if the host hung up."""
    async with AsyncClient(paths) as client:
        with trio.fail_after(20):
            try:
                return json.loads(await client.send_line(line))
            except (HostUnavailable, trio.BrokenResourceError):
                return None


async def test_deeply_nested_lines_are_refused_and_the_host_keeps_serving(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    served = await host_process().start()
    run_start = {"schema": HOST_REQUEST, "requestId": "deep-1", "clientId": "c", "idempotencyKey": "k",
                 "operation": "run.start", "payload": {"workflow": "greet", "projectPath": str(project)}}
    nested_start = json.dumps(run_start)[:-2] + ', "input": ' + deep() + "}}"
    async with AsyncClient(paths) as bystander:  # connected before, served throughout
        for line in (b"[" * DEPTH, ("[" * DEPTH).encode() + b"]" * 10, nested_start.encode()):
            reply = await exchange_or_hangup(paths, line + b"\n")
            assert reply is not None and reply["outcome"] == "rejected", reply
            assert f"nested deeper than {MAX_NESTING} levels" in reply["error"]
            assert (await bystander.call("host.status")).outcome == "accepted"
        assert (await bystander.call("run.list")).receipt == []  # the nested start queued nothing
    status = await exchange_or_hangup(paths, json.dumps({**run_start, "operation": "host.status",
                                                         "payload": {}}).encode() + b"\n")
    assert status is not None and status["outcome"] == "accepted"
    assert served.proc is not None and served.proc.returncode is None


async def test_nesting_up_to_the_limit_is_accepted(host_process: Callable[..., HostProcess], paths: StatePaths,
                                                  project: Path) -> None:
    await host_process().start()
    # The envelope and payload take two levels: the input may take the rest.
    run_input = json.loads(deep(MAX_NESTING - 2))
    async with AsyncClient(paths) as client:
        started = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project),
                                                          "input": run_input})
        assert started.outcome == "accepted", started.error
        shown = await client.call("run.status", run_id=started.receipt["runId"])
        assert shown.outcome == "accepted" and shown.receipt["input"] == run_input
