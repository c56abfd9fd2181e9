"""Host leases on PostgreSQL: one row per host, keyed by its state directory's id.

A host restarted on the same state directory takes its own row over, as SQLite's host
takes the directory's one lease row (the flock proves the old owner gone: ``owner_dead``);
hosts on other state directories have rows of their own and are never touched. Epochs come
from one sequence, so they number all the hosts sharing the store and never repeat.
"""

from __future__ import annotations

import hashlib
import secrets

from piwf import processes
from piwf.errors import HostAlreadyRunning, SchemaError, StoreError
from piwf.store.postgres.schema import LAYOUT_VERSION
from piwf.store.api.types import HostClaim, LeaseRecord
from piwf.store.sql.database import Database

# LeaseRecord's fields (a row not yet taken has no epoch: 0, as SQLite's first lease row).
LEASE_COLUMNS = "COALESCE(epoch, 0), host_id, pid, process_start_identity, started_at, heartbeat_at, expires_at"


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def boot_id() -> str:
    """What the row's ``boot_id`` holds: the machine as far as pids go (``processes.machine_id``:
    the boot id and pid namespace, or ``$PIWF_BOOT_ID``), which hosts compare to know whether
    a peer's pid can prove it dead."""
    return processes.machine_id()


def read_lease(db: Database, directory: str) -> LeaseRecord:
    row = db.one(f"SELECT {LEASE_COLUMNS} FROM hosts WHERE directory = ?", (directory,))
    return LeaseRecord(0, None, None, None, None, None, None) if row is None else LeaseRecord(*row)


def acquire_lease(db: Database, directory: str, *, host_id: str, pid: int, identity: str, lease_ms: int, now: int,
                  owner_dead: bool = False) -> HostClaim:
    """Take this directory's lease with a new epoch. The row is locked (``FOR UPDATE``) from
    the read that judges it to the write, so two hosts starting on one directory at once
    (which the flock already prevents) cannot both take it."""
    with db.write():
        db.execute("INSERT INTO hosts (directory) VALUES (?) "
                   "ON CONFLICT (directory) DO NOTHING", (directory,))
        row = db.one(f"SELECT {LEASE_COLUMNS} FROM hosts WHERE directory = ? FOR UPDATE", (directory,))
        if row is None:
            raise StoreError("host lease row is missing")
        current = LeaseRecord(*row)
        if current.live(now) and not owner_dead:
            raise HostAlreadyRunning(
                f"a live piwf host (pid {current.pid}) owns this state directory at epoch {current.epoch}")
        token = secrets.token_urlsafe(32)
        epoch: int = db.scalar(
            """UPDATE hosts SET epoch = nextval('host_epochs'), host_id = ?, token_hash = ?, boot_id = ?, pid = ?,
                 process_start_identity = ?, started_at = ?, heartbeat_at = ?, expires_at = ?
               WHERE directory = ? RETURNING epoch""",
            (host_id, _token_hash(token), boot_id(), pid, identity, now, now, now + lease_ms, directory))
    return HostClaim(host_id, token, epoch, pid, identity, now + lease_ms)


def renew_lease(db: Database, directory: str, claim: HostClaim, lease_ms: int, now: int,
                layout_version: int = LAYOUT_VERSION) -> HostClaim | None:
    """Extend the lease; None when it was lost (taken over by a host on this directory).
    SchemaError when another host has since migrated the store to a newer layout than this
    piwf's: this host must stop rather than write by rules the store no longer keeps (the
    renewal, its one write, is rolled back)."""
    with db.write():
        layout: int | None = db.scalar(
            """UPDATE hosts SET heartbeat_at = ?, expires_at = ?
               WHERE directory = ? AND epoch = ? AND host_id = ? AND token_hash = ?
               RETURNING (SELECT version FROM piwf_layout WHERE id = 1)""",
            (now, now + lease_ms, directory, claim.epoch, claim.host_id, _token_hash(claim.token)))
        if db.changes() != 1:
            return None
        if layout is not None and layout > layout_version:
            raise SchemaError(f"the store was migrated to layout {layout} by a newer piwf; this one knows "
                              f"{layout_version} and stops: upgrade it")
    return HostClaim(claim.host_id, claim.token, claim.epoch, claim.pid, claim.identity, now + lease_ms)


def release_lease(db: Database, directory: str, claim: HostClaim) -> bool:
    db.execute("""UPDATE hosts SET host_id = NULL, token_hash = NULL, boot_id = NULL, pid = NULL,
                    process_start_identity = NULL, started_at = NULL, heartbeat_at = NULL, expires_at = NULL
                  WHERE directory = ? AND epoch = ? AND host_id = ? AND token_hash = ?""",
               (directory, claim.epoch, claim.host_id, _token_hash(claim.token)))
    return db.changes() == 1
