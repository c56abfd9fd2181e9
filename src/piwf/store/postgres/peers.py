"""The hosts sharing a PostgreSQL store, as one of them sees the others: who holds a lease
(``piwf status``), and the fenced write by which a host on the same machine ends the lease
of a peer it proved dead (``HostsStore.take_over_peer``).
"""

from __future__ import annotations

from dataclasses import replace

from piwf.store.api.types import HostRecord, PeerRemains
from piwf.store.postgres.hosts import boot_id
from piwf.store.sql import peers
from piwf.store.sql.database import Database

# HostRecord's fields, in order, of a row holding a lease (its token is set).
COLUMNS = "directory, epoch, host_id, boot_id, pid, process_start_identity, started_at, heartbeat_at, expires_at"
HOLDING = "token_hash IS NOT NULL AND epoch IS NOT NULL AND host_id IS NOT NULL"


def live_hosts(db: Database, now: int) -> list[HostRecord]:
    """The hosts whose lease is live at ``now``, oldest first, with what each holds, then the
    standbys not expired (one snapshot)."""
    with db.read():
        rows = db.execute(f"SELECT {COLUMNS} FROM hosts WHERE {HOLDING} AND expires_at > ? ORDER BY epoch",
                          (now,)).fetchall()
        counts = peers.activity(db, [row[1] for row in rows], now)
        waiting = db.execute(f"SELECT {STANDBY_COLUMNS} FROM hosts WHERE {STANDING_BY} AND expires_at > ? "
                             "ORDER BY started_at, pid", (now,)).fetchall()
    records = [HostRecord(*row) for row in rows]
    return [*(replace(r, active_runs=counts[r.epoch][0], active_reconciles=counts[r.epoch][1]) for r in records),
            *(replace(HostRecord(*row), standby=True) for row in waiting)]


# A standby's row: its state directory's id and its pid (a state directory may have several),
# no epoch and no token, so nothing that reads leases takes it for a host's.
STANDBY_COLUMNS = COLUMNS.replace("epoch,", "0,", 1)
STANDING_BY = "host_id = 'standby' AND token_hash IS NULL AND epoch IS NULL"


def _standby_key(directory: str, pid: int) -> str:
    return f"{directory}#standby-{pid}"


def record_standby(db: Database, directory: str, *, pid: int, identity: str, lease_ms: int, now: int) -> None:
    """Upsert this standby's row until ``now + lease_ms``, and forget the expired ones of its
    state directory (standbys killed while they waited)."""
    with db.write():
        db.execute(f"DELETE FROM hosts WHERE {STANDING_BY} AND expires_at <= ? AND directory LIKE ?",
                   (now, f"{directory}#standby-%"))
        db.execute("""INSERT INTO hosts (directory, host_id, boot_id, pid, process_start_identity, started_at,
                                         heartbeat_at, expires_at)
                      VALUES (?, 'standby', ?, ?, ?, ?, ?, ?)
                      ON CONFLICT (directory) DO UPDATE SET boot_id = EXCLUDED.boot_id, pid = EXCLUDED.pid,
                        process_start_identity = EXCLUDED.process_start_identity,
                        heartbeat_at = EXCLUDED.heartbeat_at, expires_at = EXCLUDED.expires_at""",
                   (_standby_key(directory, pid), boot_id(), pid, identity, now, now, now + lease_ms))


def forget_standby(db: Database, directory: str, pid: int) -> None:
    db.execute(f"DELETE FROM hosts WHERE directory = ? AND {STANDING_BY}", (_standby_key(directory, pid),))


def others(db: Database, directory: str) -> list[HostRecord]:
    """Every host but this directory's holding a lease, expired or not."""
    rows = db.execute(f"SELECT {COLUMNS} FROM hosts WHERE {HOLDING} AND directory <> ? ORDER BY epoch",
                      (directory,)).fetchall()
    return [HostRecord(*row) for row in rows]


def take_over(db: Database, peer: HostRecord, now: int) -> PeerRemains | None:
    """End ``peer``'s lease now, fenced on the row as it was read (epoch, machine, pid and
    identity, its token still set): of several hosts doing it at once one changes the row
    (the others wait for its lock, then find the token gone). The winner's transaction also
    reads what is left to kill; its workers stay recorded active until ``expire_claims``
    (after the kill), so a winner that dies in between leaves them to the next takeover of
    that state directory, and the claims to their leases."""
    with db.write():
        db.execute("""UPDATE hosts SET token_hash = NULL, expires_at = LEAST(expires_at, ?)
                      WHERE directory = ? AND epoch = ? AND token_hash IS NOT NULL AND boot_id = ? AND pid = ?
                        AND process_start_identity = ?""",
                   (now, peer.directory, peer.epoch, peer.machine, peer.pid, peer.identity))
        if db.changes() != 1:
            return None
        workers = peers.active_workers(db, peer.epoch)
        return PeerRemains(workers, peers.registered_processes(db, peer.epoch), peers.reconcilers(db, peer.epoch))
