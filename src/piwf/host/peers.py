"""The other hosts sharing the store: listing them, and failover by proof on one machine.

A host on the same machine as a peer (the same ``machine``: boot id and pid namespace, or
``$PIWF_BOOT_ID``) can prove it dead — its recorded pid is gone or carries another start
identity — and then need not wait for its lease: it ends that lease by a write fenced on
the peer's epoch, pid and identity (one host wins it, ``HostsStore.take_over_peer``),
kills what the peer left (its workers and the process groups they registered,
identity-checked), and only then expires the peer's run and reconcile claims, so they are
claimed again at once and never while the old workers live. A peer on another machine is
never judged by its pid (the pid would name another machine's process): its claims are
claimed again when they expire, and its workers are left alone.

    peer watcher        reads the peers' lease rows at start and every poll (one read); a
    │                   peer on this machine proved dead is taken over at once
    └── one watch per live peer on this machine: waits on a pidfd for its exit
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_util

from piwf import processes
from piwf.errors import PiwfError
from piwf.clock import Clock
from piwf.store.api import HostRecord, Store, open_store
from piwf.host.state import HostConfig, HostState, log
from piwf.host.worker_process import reap_registered


async def serve_peers(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Take over the peers on this machine that are proved dead, at start and as they die."""
    async with trio.open_nursery() as nursery:
        watch = PeerWatch(host, nursery)
        await watch.scan()
        task_status.started()
        async with contextlib.aclosing(trio_util.periodic(host.config.poll_s)) as ticks:
            async for _ in ticks:
                await watch.scan()


class PeerWatch:
    """The peers this host watches for their exit, and the dead ones whose claims it has
    still to free (a failed write is retried at the next scan)."""

    def __init__(self, host: HostState, nursery: trio.Nursery) -> None:
        self.host = host
        self.nursery = nursery
        self.watched: set[int] = set()  # epochs
        self.unfreed: dict[int, HostRecord] = {}  # epoch -> the peer taken over, its claims not yet freed

    async def scan(self) -> None:
        """One read of the peers' rows: take over each peer on this machine proved dead now,
        and watch each one still alive for its exit."""
        for peer in list(self.unfreed.values()):
            await self.free_claims(peer)
        try:
            peers = await self.host.store.hosts.peers()
        except PiwfError as exc:
            log.warning("could not read the other hosts' leases: %s", exc)
            return
        machine = processes.machine_id()
        for peer in peers:
            if peer.machine != machine or peer.epoch in self.watched or peer.pid is None:
                continue  # another machine's: only its lease's expiry counts
            pidfd = _open_pidfd(peer.pid)
            if not processes.alive(peer.pid, peer.identity):  # after opening: the pidfd is of this process, if any
                _close(pidfd)
                await self.take_over(peer)
            elif pidfd is not None:
                self.watched.add(peer.epoch)
                self.nursery.start_soon(self._watch, peer, pidfd)

    async def _watch(self, peer: HostRecord, pidfd: int) -> None:
        try:
            await trio.lowlevel.wait_readable(pidfd)  # readable once the process has exited
        finally:
            _close(pidfd)
            self.watched.discard(peer.epoch)
        if not processes.alive(peer.pid or 0, peer.identity):
            await self.take_over(peer)

    async def take_over(self, peer: HostRecord) -> bool:
        """End the lease of ``peer``, proved dead; kill what it left; free its claims. False
        when another host did it first (or its row moved on: it stopped, or was restarted)."""
        host = self.host
        try:
            remains = await host.store.hosts.take_over_peer(peer, host.now())
        except PiwfError as exc:  # the next scan finds it again
            log.warning("could not take over from host %s (epoch %d): %s", peer.host_id, peer.epoch, exc)
            return False
        if remains is None:
            return False
        log.info("host %s (pid %d, epoch %d) on this machine is dead: taking over its claims", peer.host_id,
                 peer.pid or 0, peer.epoch)
        for worker_id, pid, identity in remains.workers:
            if processes.kill_recorded_group(pid, identity):
                log.info("killed orphaned worker %s (pid %d) of host epoch %d", worker_id, pid, peer.epoch)
        for uid, pid, identity in remains.reconcilers:
            if processes.kill_recorded_group(pid, identity):
                log.info("killed the orphaned reconcile worker of %s (pid %d)", uid, pid)
        await reap_registered(host, remains.processes)
        await self.free_claims(peer)
        return True

    async def free_claims(self, peer: HostRecord) -> None:
        """The dead peer's claims expire now: its runs and reconciles are claimed again at once."""
        host = self.host
        try:
            runs, reconciles = await host.store.hosts.expire_peer_claims(peer.epoch, host.now())
        except PiwfError as exc:
            log.warning("could not free the claims of dead host epoch %d (retrying at the next scan): %s",
                        peer.epoch, exc)
            self.unfreed[peer.epoch] = peer
            return
        self.unfreed.pop(peer.epoch, None)
        log.info("%d run(s) and %d reconcile(s) of host epoch %d to claim again", len(runs), reconciles, peer.epoch)
        if runs:
            host.wake()  # here and, by the announcement, on the other hosts
        if reconciles:
            host.controllers.wake()  # announced to the other hosts too


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (None: no such process, or no pidfds here; the poll then finds its end)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:
        return None
    return fd


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


async def live_hosts(host: HostState) -> list[dict[str, Any]]:
    """``host.status``'s ``hosts``: the live hosts sharing the store, as its receipt lists them."""
    now = host.now()
    own = host.lease.epoch if host.lease is not None else None
    return [r.as_json(now, this=r.epoch == own, hostname=socket.gethostname() if r.epoch == own else None)
            for r in await host.store.hosts.live_hosts(now)]


@contextlib.asynccontextmanager
async def recorded_standby(config: HostConfig, clock: Clock, pid: int, identity: str) -> AsyncIterator[None]:
    """While a standby waits for its state directory's lock, with a PostgreSQL store: a row
    there says so (``piwf status`` through any host lists it), renewed every third of the
    lease and removed when it stops waiting. A store it cannot reach costs only the row; so
    does one of an older layout: a standby never migrates it (a newer standby waiting beside
    older live hosts would stop them all), the host it becomes does."""
    if config.store_url is None:  # SQLite: its standbys are the state directory's files
        yield
        return
    url = config.store_url
    try:
        store = await trio.to_thread.run_sync(lambda: open_store(
            config.state_dir, durability=config.durability, url=url, listen=False, pool_size=1, migrate=False))
    except PiwfError as exc:
        log.warning("standing by unrecorded in the store: %s", exc)
        yield
        return
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_renew_standby, store, config, clock, pid, identity)
            yield
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            try:
                await store.hosts.forget_standby(pid)
            except PiwfError as exc:  # it expires with its lease
                log.warning("could not remove this standby's row from the store: %s", exc)
            await store.close()


async def _renew_standby(store: Store, config: HostConfig, clock: Clock, pid: int, identity: str) -> None:
    async with contextlib.aclosing(trio_util.periodic(config.host_lease_ms / 3000)) as ticks:
        async for _ in ticks:
            try:
                await store.hosts.record_standby(pid=pid, identity=identity, lease_ms=config.host_lease_ms,
                                                 now=clock.now_ms())
            except PiwfError as exc:
                log.warning("could not record this standby in the store (retrying): %s", exc)
