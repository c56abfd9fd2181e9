"""The host lease of the "directory" shape (HostsStore; SQLite's): one lease per state
directory, its epoch growing with each host that takes it; a live lease is taken only from an
owner proved dead. A backend of the "host" shape (one lease row per host) adds its tests here,
marked ``lease("host")``."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import HostAlreadyRunning

LEASE = 30_000
pytestmark = pytest.mark.lease("directory")


async def take(store: Any, clock: ManualClock, host: str = "h1", **kw: Any) -> Any:
    return await store.hosts.acquire_lease(host_id=host, pid=1, identity="id", lease_ms=LEASE, now=clock.now_ms(),
                                           **kw)


async def test_a_fresh_store_has_no_lease_holder(store: Any, clock: ManualClock) -> None:
    lease = await store.hosts.read_lease()
    assert lease.host_id is None and not lease.live(clock.now_ms())


async def test_lease_epochs_grow_and_a_live_lease_is_refused(store: Any, clock: ManualClock) -> None:
    first = await take(store, clock)
    assert first.epoch == 1 and first.expires_at == clock.now_ms() + LEASE
    with pytest.raises(HostAlreadyRunning, match="live piwf host"):
        await take(store, clock, "h2")
    assert (await store.hosts.read_lease()).host_id == "h1"
    clock.advance(LEASE)
    second = await take(store, clock, "h2")
    assert second.epoch == 2 and second.token != first.token
    assert await store.hosts.renew_lease(first, LEASE, clock.now_ms()) is None  # the old owner lost it
    assert not await store.hosts.release_lease(first)
    assert (await store.hosts.read_lease()).host_id == "h2"


async def test_a_proved_dead_owner_is_taken_over_at_once(store: Any, clock: ManualClock) -> None:
    await take(store, clock)
    second = await take(store, clock, "h2", owner_dead=True)
    lease = await store.hosts.read_lease()
    assert second.epoch == 2 and (lease.host_id, lease.epoch) == ("h2", 2)


async def test_renew_and_release(store: Any, clock: ManualClock) -> None:
    claim = await take(store, clock)
    clock.advance(LEASE - 1)
    renewed = await store.hosts.renew_lease(claim, LEASE, clock.now_ms())
    assert renewed is not None and renewed.expires_at == clock.now_ms() + LEASE
    assert (await store.hosts.read_lease()).expires_at == renewed.expires_at
    assert await store.hosts.release_lease(renewed)
    assert not (await store.hosts.read_lease()).live(clock.now_ms())
    assert not await store.hosts.release_lease(renewed)
    assert await store.hosts.renew_lease(renewed, LEASE, clock.now_ms()) is None
    again = await take(store, clock, "h2")
    assert again.epoch == 2  # epochs never repeat


async def test_an_expired_lease_nobody_took_is_renewed_by_its_owner(store: Any, clock: ManualClock) -> None:
    claim = await take(store, clock)
    clock.advance(LEASE * 3)  # the disk was full, or the machine slept
    renewed = await store.hosts.renew_lease(claim, LEASE, clock.now_ms())
    assert renewed is not None and (await store.hosts.read_lease()).live(clock.now_ms())


async def test_another_store_on_the_same_database_sees_the_lease(store: Any, open_store: Any,
                                                                 clock: ManualClock) -> None:
    claim = await take(store, clock)
    other = await open_store()
    with pytest.raises(HostAlreadyRunning):
        await take(other, clock, "h2")
    assert (await other.hosts.read_lease()).epoch == claim.epoch
