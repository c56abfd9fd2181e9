"""Store.announce and Store.serve_wakeups: what one host announces reaches the other hosts
sharing the store (PostgreSQL: LISTEN/NOTIFY); SQLite has no other host, and both do
nothing there (serve_wakeups starts, then waits)."""

from __future__ import annotations

from typing import Any

import trio

from piwf.store.api import Wakeup


async def test_an_announcement_reaches_the_other_hosts_sharing_the_store(backend: Any, open_store: Any) -> None:
    a, b = await open_store(), await open_store()
    heard: list[Wakeup] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve_wakeups, lambda topic: None)
        await nursery.start(b.serve_wakeups, heard.append)
        assert a.announce(Wakeup.RUNS) is None  # never blocks, never fails
        if backend.name != "sqlite":
            with trio.fail_after(10):
                while Wakeup.RUNS not in heard:  # announced again until b's listener is up: coalesced
                    a.announce(Wakeup.RUNS)
                    await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
