"""Slow, trickling and non-reading clients: every wait on a client is bounded, and no
client can lock the others out. In-process hosts with short configured timeouts."""

from __future__ import annotations

import fcntl
import json
import struct
import termios
from pathlib import Path
from typing import Any

import trio

from piwf.client import AsyncClient, make_request
from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths
from piwf.wire import encode_line

from .conftest import config, wait_for

MiB = 1024 * 1024


async def serve(nursery: trio.Nursery, paths: StatePaths, **overrides: Any) -> HostState:
    return await nursery.start(Host(config(paths, **overrides)).serve)


def status_line(client_id: str = "c") -> bytes:
    return encode_line(make_request("host.status", client_id=client_id))


def unread_by_host(client: AsyncClient) -> int:
    """Bytes the client sent that the host has not read yet (SIOCOUTQ)."""
    queued = fcntl.ioctl(client._stream.socket.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", queued)[0])


async def read_to_end(stream: trio.SocketStream) -> list[dict]:
    """Every line the host sent before it closed the connection."""
    data = b""
    with trio.fail_after(10):
        try:
            while chunk := await stream.receive_some(65536):
                data += chunk
        except trio.BrokenResourceError:
            pass  # reset after it closed: what it sent first was already read
    return [json.loads(line) for line in data.splitlines()]


async def test_a_request_trickled_byte_by_byte_is_cut_off_at_the_request_timeout(
    paths: StatePaths, nursery: trio.Nursery
) -> None:
    host = await serve(nursery, paths, request_timeout_s=0.5, idle_timeout_s=60)
    line = b" " * 1000 + status_line()  # over 10 s worth of bytes at this pace
    async with AsyncClient(paths) as bystander, await trio.open_unix_socket(str(paths.socket)) as slow:
        with trio.fail_after(10):
            for byte in line:
                try:
                    await slow.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    break  # the host hung up, as it should
                assert (await bystander.call("host.status")).outcome == "accepted"  # served meanwhile
                await trio.sleep(0.01)  # the pace of the trickle: 100 bytes a second
        replies = await read_to_end(slow)
    assert [r["outcome"] for r in replies] == ["rejected"]
    assert replies[0]["error"] == "request not complete 0.5 s after its first byte"
    await wait_for(lambda: host.connections == 0)


async def test_an_idle_connection_is_closed_after_the_idle_timeout(paths: StatePaths, nursery: trio.Nursery) -> None:
    await serve(nursery, paths, idle_timeout_s=0.3)
    async with await trio.open_unix_socket(str(paths.socket)) as idle:
        await idle.send_all(status_line())
        replies = await read_to_end(idle)
    assert [r["outcome"] for r in replies] == ["accepted", "rejected"]
    assert replies[1]["error"] == "connection idle for more than 0.3 s"


async def test_a_client_that_never_reads_its_replies_is_disconnected_and_not_buffered_for(
    paths: StatePaths, nursery: trio.Nursery
) -> None:
    host = await serve(nursery, paths, reply_timeout_s=0.5)
    batch = status_line("deaf") * 50  # ~10 KB of pipelined requests
    sent = 0

    async def flood(stream: trio.SocketStream) -> None:
        nonlocal sent
        try:
            while sent < 256 * MiB:
                await stream.send_all(batch)
                sent += len(batch)
        except trio.BrokenResourceError:
            return

    async with await trio.open_unix_socket(str(paths.socket)) as deaf, AsyncClient(paths) as bystander:
        with trio.fail_after(20):
            async with trio.open_nursery() as flooding:
                flooding.start_soon(flood, deaf)
                await wait_for(lambda: sent > 0)
                for _ in range(3):  # the others are served while the host waits on the deaf client
                    assert (await bystander.call("host.status")).outcome == "accepted"
        # The host read no more than the replies it could hand over (kernel buffers) allow.
        assert sent < 4 * MiB, sent
        assert (await bystander.call("host.status")).receipt["connectedClients"] == 1
    await wait_for(lambda: host.connections == 0)


async def test_at_the_cap_a_newcomer_displaces_the_connection_waiting_longest(
    paths: StatePaths, nursery: trio.Nursery
) -> None:
    """Three connections that each sent one byte of a request and then nothing hold every
    slot; before, everyone else was refused until the idle timeout (5 minutes)."""
    await serve(nursery, paths, max_connections=3)
    holders = []
    for _ in range(3):
        stream = await trio.open_unix_socket(str(paths.socket))
        await stream.send_all(b"{")
        holders.append(stream)
    async with AsyncClient(paths) as newcomer:
        status = await newcomer.call("host.status")
        assert status.outcome == "accepted", status.error
        assert status.receipt["connectedClients"] == 3
        displaced = await read_to_end(holders[0])  # the first to come has waited longest
        assert [r["outcome"] for r in displaced] == ["unavailable"]
        assert "to make room for a new one" in displaced[0]["error"]
        async with AsyncClient(paths) as another:
            assert (await another.call("host.status")).outcome == "accepted"
        assert [r["outcome"] for r in await read_to_end(holders[1])] == ["unavailable"]
        await holders[2].send_all(status_line()[1:])  # the last holder finishes its request
        replies = await holders[2].receive_some(65536)
        assert json.loads(replies)["outcome"] == "accepted"
    for stream in holders:
        await stream.aclose()


async def test_a_long_poll_gives_its_connection_to_a_newcomer_answering_first_with_what_it_has(
    paths: StatePaths, nursery: trio.Nursery, project: Path
) -> None:
    await serve(nursery, paths, max_connections=1)
    async with AsyncClient(paths) as waiter:
        run_id = (await waiter.call("run.start", payload={"workflow": "sleepy", "projectPath": str(project)})
                  ).receipt["runId"]
        wait = make_request("run.wait", client_id="w", run_id=run_id, payload={"timeoutMs": 600_000})
        await waiter._stream.send_all(encode_line(wait))
        await wait_for(lambda: unread_by_host(waiter) == 0)  # the host took the run.wait: it is answering
        async with AsyncClient(paths) as newcomer:
            status = json.loads(await newcomer.send_line(status_line()))
            assert status["outcome"] == "accepted"  # issue 22 point 5: a long poll never locks others out
            answer = json.loads(await waiter.read_line())  # at once, not after 600 s
            assert answer["outcome"] == "accepted" and not answer["receipt"]["atRest"]
            assert await waiter._stream.receive_some(100) == b""  # then its connection closed
            assert (await newcomer.call("run.cancel", run_id=run_id)).outcome == "accepted"
