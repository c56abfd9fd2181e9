"""The hosts sharing a store (HostsStore.live_hosts, peers) and the takeover of a peer
proved dead (take_over_peer, expire_peer_claims): one fenced write on the peer's row, won
by one host; the peer's claims freed only after it, and nothing of any other host touched.
SQLite has one host per state directory: its peers are none."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from piwf.clock import ManualClock
from piwf.store.api import HostRecord

from . import controllers
from .helpers import LEASE, claim, claims, new_run


async def take(store: Any, clock: ManualClock, host: str = "h1", pid: int = 1) -> Any:
    return await store.hosts.acquire_lease(host_id=host, pid=pid, identity=f"id{pid}", lease_ms=LEASE,
                                           now=clock.now_ms())


async def test_live_hosts_lists_the_lease_holders_with_the_claims_they_hold(store: Any, clock: ManualClock) -> None:
    lease = await take(store, clock)
    await new_run(store, clock)
    await new_run(store, clock, "r2")
    assert await claim(store, clock, epoch=lease.epoch) is not None
    [me] = await store.hosts.live_hosts(clock.now_ms())
    assert (me.host_id, me.epoch, me.pid, me.identity) == ("h1", lease.epoch, 1, "id1")
    assert (me.active_runs, me.active_reconciles) == (1, 0)
    await controllers.apply(store, clock)
    await controllers.claim(store, clock, epoch=lease.epoch)
    assert (await store.hosts.live_hosts(clock.now_ms()))[0].active_reconciles == 1
    assert me.heartbeat_at == lease.expires_at - LEASE
    clock.advance(LEASE)
    assert await store.hosts.live_hosts(clock.now_ms()) == []  # its lease expired
    assert await store.hosts.peers() == []  # no other host holds a lease


async def test_a_peer_proved_dead_is_taken_over_by_one_host_before_its_claims_are_freed(
        store: Any, backend: Any, clock: ManualClock) -> None:
    mine = await take(store, clock)
    if backend.name == "sqlite":  # one host per state directory: no peers to take over
        nobody = HostRecord("d", 9, "p", "m", 2, "id2", 0, 0, LEASE)
        assert await store.hosts.take_over_peer(nobody, clock.now_ms()) is None
        assert await store.hosts.expire_peer_claims(9, clock.now_ms()) == ([], 0)
        return
    peer_store = await backend.open(clock, "conformance", directory="peer")
    try:
        peer = await take(peer_store, clock, "p", pid=2)
        await new_run(store, clock)
        [(peer_claim, worker_id)] = await claims(peer_store, clock, epoch=peer.epoch)
        await peer_store.workers.attach_process(worker_id, 42, "boot:42:7")
        await peer_store.workers.register_process(worker_id=worker_id, run_id="r1", pid=43, identity="boot:43:8",
                                                  node="n", now=clock.now_ms())
        await controllers.apply(store, clock)
        [resource] = await controllers.claim(peer_store, clock, epoch=peer.epoch)
        await peer_store.controller_queue.attach_worker(resource.uid, resource.token, 44, "boot:44:9")
        [seen] = await store.hosts.peers()
        assert (seen.host_id, seen.epoch, seen.pid, seen.identity) == ("p", peer.epoch, 2, "id2")
        assert [h.epoch for h in await store.hosts.live_hosts(clock.now_ms())] == [mine.epoch, peer.epoch]

        assert await store.hosts.take_over_peer(replace(seen, identity="other"), clock.now_ms()) is None  # moved on
        remains = await store.hosts.take_over_peer(seen, clock.now_ms())
        assert remains is not None and remains.workers == [(worker_id, 42, "boot:42:7")]
        assert remains.processes == [(worker_id, 43, "boot:43:8")]
        assert remains.reconcilers == [(resource.uid, 44, "boot:44:9")]
        assert await store.hosts.take_over_peer(seen, clock.now_ms()) is None  # one host wins
        assert await peer_store.hosts.renew_lease(peer, LEASE, clock.now_ms()) is None  # its lease is over
        assert await store.hosts.peers() == []
        assert await claim(store, clock, epoch=mine.epoch) is None  # its claims stay until freed

        assert await controllers.claim(store, clock, epoch=mine.epoch) == []
        assert [w.status for w in (await store.runs.get_run("r1")).workers] == ["starting"]  # until killed
        assert await store.hosts.expire_peer_claims(peer.epoch, clock.now_ms()) == (["r1"], 1)
        assert [w.status for w in (await store.runs.get_run("r1")).workers] == ["orphaned"]
        [retaken] = await controllers.claim(store, clock, epoch=mine.epoch)
        assert retaken.uid == resource.uid
        again = await claim(store, clock, epoch=mine.epoch)
        assert again is not None and again.generation == peer_claim.generation + 1
        assert await store.hosts.expire_peer_claims(peer.epoch, clock.now_ms()) == ([], 0)  # mine are not its
    finally:
        await backend.close(peer_store)


async def test_a_standby_is_listed_while_its_row_is_live_and_is_never_a_peer(
        store: Any, backend: Any, clock: ManualClock) -> None:
    await store.hosts.record_standby(pid=7, identity="id7", lease_ms=LEASE, now=clock.now_ms())
    if backend.name == "sqlite":  # its standbys are the state directory's files
        assert await store.hosts.live_hosts(clock.now_ms()) == []
        await store.hosts.forget_standby(7)
        return
    [standby] = await store.hosts.live_hosts(clock.now_ms())
    assert standby.standby and (standby.pid, standby.identity, standby.epoch, standby.active_runs) == (7, "id7", 0, 0)
    assert await store.hosts.peers() == []  # it holds no lease: nothing to take over
    lease = await take(store, clock)
    assert [(h.standby, h.pid) for h in await store.hosts.live_hosts(clock.now_ms())] == [(False, 1), (True, 7)]
    await store.hosts.record_standby(pid=8, identity="id8", lease_ms=LEASE, now=clock.now_ms())
    await store.hosts.forget_standby(7)  # it took over, or stopped
    clock.advance(LEASE)  # standby 8 was killed: its row expires
    assert await store.hosts.renew_lease(lease, LEASE, clock.now_ms()) is not None
    assert [h.standby for h in await store.hosts.live_hosts(clock.now_ms())] == [False]
    await store.hosts.record_standby(pid=9, identity="id9", lease_ms=LEASE, now=clock.now_ms())  # forgets 8's row
    assert [h.pid for h in await store.hosts.live_hosts(clock.now_ms()) if h.standby] == [9]
