"""The host lease: which host owns the state directory, and since which epoch (seed 001)."""

from __future__ import annotations

import hashlib
import os
import secrets

from piwf.errors import HostAlreadyRunning, StoreError
from piwf.store.sql import peers
from piwf.store.sqlite.db import Database
from piwf.store.api.types import HostClaim, HostRecord, LeaseRecord




def open_state(path: str | os.PathLike[str], *, durability: str) -> Database:
    """Open the state database for a host (which holds the host lock).

    After an unclean stop (the lease row still names a host: a clean stop releases it) the
    file is read through with ``PRAGMA quick_check`` on a read-only connection first: a
    damaged database is refused (CorruptStateError) before anything is written to it, the
    migration to a newer layout included.
    """
    return Database.open(path, durability=durability, verify=_check_after_unclean_stop)


def _check_after_unclean_stop(db: Database) -> None:
    if read_lease(db).host_id is not None:
        db.quick_check()


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def read_lease(db: Database) -> LeaseRecord:
    row = db.one(
        """SELECT epoch, host_id, pid, process_start_identity, started_at, heartbeat_at, expires_at
           FROM host_lease WHERE id = 1"""
    )
    if row is None:
        raise StoreError("host lease row is missing")
    return LeaseRecord(*row)


def acquire_lease(
    db: Database, *, host_id: str, pid: int, identity: str, lease_ms: int, now: int,
    owner_dead: bool = False,
) -> HostClaim:
    """Take the lease with a new epoch.

    A live lease is only taken when the caller has proved its owner dead (``owner_dead``):
    that is how a restarted host serves again at once instead of after the lease expires.
    """
    with db.write():
        current = read_lease(db)
        if current.live(now) and not owner_dead:
            raise HostAlreadyRunning(
                f"a live piwf host (pid {current.pid}) owns this state directory at epoch {current.epoch}"
            )
        token = secrets.token_urlsafe(32)
        epoch = current.epoch + 1
        db.execute(
            """UPDATE host_lease SET epoch = ?, host_id = ?, token_hash = ?, pid = ?,
                 process_start_identity = ?, started_at = ?, heartbeat_at = ?, expires_at = ?
               WHERE id = 1 AND epoch = ?""",
            (epoch, host_id, _token_hash(token), pid, identity, now, now, now + lease_ms, current.epoch),
        )
        if db.changes() != 1:
            raise StoreError("host lease changed during start-up")
    return HostClaim(host_id, token, epoch, pid, identity, now + lease_ms)


def renew_lease(db: Database, claim: HostClaim, lease_ms: int, now: int) -> HostClaim | None:
    """Extend the lease; None when it was lost (taken by another host).

    A lease that expired while nobody took it (the disk was full, the machine slept) is
    still this host's: another host needs the flock this one holds to take it.
    """
    with db.write():
        db.execute(
            """UPDATE host_lease SET heartbeat_at = ?, expires_at = ?
               WHERE id = 1 AND epoch = ? AND host_id = ? AND token_hash = ?""",
            (now, now + lease_ms, claim.epoch, claim.host_id, _token_hash(claim.token)),
        )
        if db.changes() != 1:
            return None
    return HostClaim(claim.host_id, claim.token, claim.epoch, claim.pid, claim.identity, now + lease_ms)


def release_lease(db: Database, claim: HostClaim) -> bool:
    with db.write():
        db.execute(
            """UPDATE host_lease SET host_id = NULL, token_hash = NULL, pid = NULL,
                 process_start_identity = NULL, started_at = NULL, heartbeat_at = NULL,
                 expires_at = NULL
               WHERE id = 1 AND epoch = ? AND host_id = ? AND token_hash = ?""",
            (claim.epoch, claim.host_id, _token_hash(claim.token)),
        )
        return db.changes() == 1


def live_hosts(db: Database, now: int) -> list[HostRecord]:
    """The state directory's host, if its lease is live, with what it holds. Its machine is
    the one its process identity names (``boot:pid:ticks``): the state directory's."""
    with db.read():
        lease = read_lease(db)
        if not lease.live(now) or lease.host_id is None:
            return []
        runs, reconciles = peers.activity(db, [lease.epoch], now)[lease.epoch]
    machine = lease.identity.split(":", 1)[0] if lease.identity and ":" in lease.identity else None
    return [HostRecord("", lease.epoch, lease.host_id, machine, lease.pid, lease.identity, lease.started_at,
                       lease.heartbeat_at, lease.expires_at, runs, reconciles)]
