"""A way measured and not taken (bench/measure_pg.py, bench/README.md): store calls on the
trio loop, without a thread; psycopg's waits become trio's.

psycopg runs every exchange with the server as a generator that says when it would block
(wait for the socket to be readable or writable) and a ``wait`` function that blocks the
thread until it can go on. ``GreenConnection.wait``, inside a ``StoreCall`` (a greenlet
running one store function, synchronous code as on SQLite), hands each wait to the trio
task that started the call, which awaits the socket with ``trio.lowlevel`` and switches
back: the function's statements run on the loop, and while one waits for the server the
loop serves other tasks. Outside a ``StoreCall`` (the pool's own threads: connecting,
configuring; a wait with a time limit) it waits as psycopg does.

The store ran this way at 5fa6a44; bench/profile_pg.py --compare measured it against a
thread hop per call: less CPU per call alone, but half the runs per second end to end.
"""

from __future__ import annotations

import contextvars
import select
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import trio
from greenlet import greenlet, getcurrent
from psycopg.waiting import Ready, Wait

_T = TypeVar("_T")
_INTERVAL = 0.1  # psycopg's own default (a wait outside a StoreCall)


class StoreCall(greenlet):  # type: ignore[misc]  # greenlet's class has no stubs for subclassing
    """One store function, run by ``run``; its waits go to the parent (the trio task)."""


class GreenConnection(psycopg.Connection[Any]):
    """A psycopg connection whose waits, inside a ``StoreCall``, are the trio task's."""

    def wait(self, gen: Any, interval: float = _INTERVAL, timeout: float | None = None) -> Any:
        call = getcurrent()
        if not isinstance(call, StoreCall) or timeout is not None:
            return super().wait(gen, interval, timeout)
        fileno = self.pgconn.socket
        try:
            state = next(gen)
            while True:
                ready = call.parent.switch((fileno, state))
                state = gen.send(ready)
        except StopIteration as stop:
            return stop.value


async def run(function: Callable[[], _T]) -> _T:
    """``function()`` on the loop, its socket waits awaited; shielded: once started it
    finishes (its caller learns whether it committed), as a thread would."""
    call = StoreCall(contextvars.copy_context().run)
    with trio.CancelScope(shield=True):
        request = call.switch(function)
        while not call.dead:
            fileno, state = request
            try:
                ready = await _ready(fileno, state)
            except BaseException as exc:  # handed to psycopg's generator, which fails with it
                request = call.throw(exc)
            else:
                request = call.switch(ready)
    result: _T = request
    return result


async def _ready(fileno: int, state: int) -> Ready:
    if state == Wait.R:
        await trio.lowlevel.wait_readable(fileno)
        return Ready.R
    if state == Wait.W:
        await trio.lowlevel.wait_writable(fileno)
        return Ready.W
    return await _either(fileno)


async def _either(fileno: int) -> Ready:
    """Readable or writable (psycopg flushing a long query while the server may answer):
    seldom, since a query fits the socket's buffer; what is ready now, else the first."""
    readable, writable, _ = select.select([fileno], [fileno], [], 0)
    if readable or writable:
        return (Ready.R if readable else Ready.NONE) | (Ready.W if writable else Ready.NONE)
    got: list[Ready] = []
    async with trio.open_nursery() as nursery:
        async def wait(waiter: Callable[[int], Any], ready: Ready) -> None:
            await waiter(fileno)
            got.append(ready)
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait, trio.lowlevel.wait_readable, Ready.R)
        nursery.start_soon(wait, trio.lowlevel.wait_writable, Ready.W)
    return got[0]
