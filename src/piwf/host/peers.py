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
from typing import Any

import trio
import trio_util

from piwf import faults, processes
from piwf.errors import PiwfError
from piwf.store.api import HostRecord
from piwf.host.state import HostState, log
from piwf.host.worker_process import reap_registered


async def serve_peers(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Take over the peers on this machine that are proved dead, at start and as they die."""
    watched: set[int] = set()  # the epochs of the peers watched for their exit
    async with trio.open_nursery() as nursery:
        await scan(host, nursery, watched)
        task_status.started()
        async with contextlib.aclosing(trio_util.periodic(host.config.poll_s)) as ticks:
            async for _ in ticks:
                await scan(host, nursery, watched)


async def scan(host: HostState, nursery: trio.Nursery, watched: set[int]) -> None:
    """One read of the peers' rows: take over each peer on this machine proved dead now,
    and watch each one still alive for its exit."""
    try:
        peers = await host.store.hosts.peers()
    except PiwfError as exc:
        log.warning("could not read the other hosts' leases: %s", exc)
        return
    machine = processes.machine_id()
    for peer in peers:
        if peer.machine != machine or peer.epoch in watched or peer.pid is None:
            continue  # another machine's: only its lease's expiry counts
        pidfd = _open_pidfd(peer.pid)
        if not processes.alive(peer.pid, peer.identity):  # after opening: the pidfd is of this process, if any
            _close(pidfd)
            await take_over(host, peer)
        elif pidfd is not None:
            watched.add(peer.epoch)
            nursery.start_soon(_watch, host, peer, pidfd, watched)


async def _watch(host: HostState, peer: HostRecord, pidfd: int, watched: set[int]) -> None:
    try:
        await trio.lowlevel.wait_readable(pidfd)  # readable once the process has exited
    finally:
        _close(pidfd)
        watched.discard(peer.epoch)
    if not processes.alive(peer.pid or 0, peer.identity):
        await take_over(host, peer)


async def take_over(host: HostState, peer: HostRecord) -> bool:
    """End the lease of ``peer``, proved dead; kill what it left; free its claims. False
    when another host did it first (or its row moved on: it stopped, or was restarted)."""
    try:
        remains = await host.store.hosts.take_over_peer(peer, host.now())
    except PiwfError as exc:
        log.warning("could not take over from host %s (epoch %d): %s", peer.host_id, peer.epoch, exc)
        return False
    if remains is None:
        return False
    log.info("host %s (pid %d, epoch %d) on this machine is dead: taking over its claims", peer.host_id,
             peer.pid or 0, peer.epoch)
    faults.point("host.peer.taken")
    for worker_id, pid, identity in remains.workers:
        if processes.kill_recorded_group(pid, identity):
            log.info("killed orphaned worker %s (pid %d) of host epoch %d", worker_id, pid, peer.epoch)
    for uid, pid, identity in remains.reconcilers:
        if processes.kill_recorded_group(pid, identity):
            log.info("killed the orphaned reconcile worker of %s (pid %d)", uid, pid)
    await reap_registered(host, remains.processes)
    await _expire_claims(host, peer)
    return True


async def _expire_claims(host: HostState, peer: HostRecord) -> None:
    try:
        runs, reconciles = await host.store.hosts.expire_peer_claims(peer.epoch, host.now())
    except PiwfError as exc:  # they expire with their leases instead
        log.warning("could not free the claims of dead host epoch %d: %s", peer.epoch, exc)
        return
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
    records = await host.store.hosts.live_hosts(now)
    own = host.lease.epoch if host.lease is not None else None
    return [{
        "hostId": r.host_id, "epoch": r.epoch, "machine": r.machine, "pid": r.pid, "startedAt": r.started_at,
        "heartbeatAt": r.heartbeat_at, "expiresAt": r.expires_at,
        "heartbeatAgeMs": None if r.heartbeat_at is None else max(0, now - r.heartbeat_at),
        "activeRuns": r.active_runs, "activeReconciles": r.active_reconciles,
        "this": r.epoch == own, "hostname": socket.gethostname() if r.epoch == own else None,
    } for r in records]
