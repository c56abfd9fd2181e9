"""Power loss, simulated under SQLite (piwf/store/sqlite/powercut.py): a process commits
through piwf's Database while the VFS below it remembers what was not synced; SIGUSR2 cuts
the power at a moment the test picks (after the k-th acknowledged commit, while the next
ones are being written); the file that remains is opened as a new host would open it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from piwf.store.sqlite.db import Database

WRITER = textwrap.dedent("""
    import os, random, sys
    from piwf.store.sqlite.db import Database
    path, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    db = Database.open(path, durability="normal" if mode == "normal" else "full")
    if mode == "group":
        db.defer_sync()  # as the group commit does: commit without SQLite's sync, then sync the WAL
    db.conn.execute("PRAGMA wal_autocheckpoint = 8")  # checkpoints often: the database file is written too
    db.conn.execute("CREATE TABLE IF NOT EXISTS acked (n INTEGER PRIMARY KEY, body BLOB NOT NULL)")
    n = db.scalar("SELECT coalesce(max(n), 0) FROM acked")
    while True:
        n += 1
        with db.write():
            db.execute("INSERT INTO acked (n, body) VALUES (?, ?)", (n, os.urandom(rng.randint(10, 9000))))
        if mode == "group":
            db.sync_wal()
        print(n, flush=True)  # acknowledged: at full (either way) it is durable now
""")


def _cut_once(path: Path, mode: str, seed: int, after: int) -> tuple[list[int], dict]:
    env = {**os.environ, "PIWF_POWER_CUT": str(seed)}
    with subprocess.Popen([sys.executable, "-c", WRITER, str(path), mode, str(seed)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        acked = []
        for line in child.stdout:
            acked.append(int(line))
            if len(acked) == after:
                child.send_signal(signal.SIGUSR2)
                break
        acked.extend(int(line) for line in child.stdout)  # acknowledged before the cut came: acknowledged too
        err = child.stderr.read().decode()
        assert child.wait(timeout=60) == -signal.SIGKILL, err
    cut = [json.loads(line)["powerCut"] for line in err.splitlines() if line.startswith('{"powerCut"')]
    assert len(cut) == 1, err
    return acked, cut[0]


def _reopen(path: Path) -> set[int]:
    db = Database.open_readonly(path)
    try:
        assert db.scalar("PRAGMA integrity_check") == "ok"
        return {n for (n,) in db.execute("SELECT n FROM acked")}
    finally:
        db.close()


@pytest.mark.parametrize("mode", ["full", "group"])
def test_at_full_durability_a_power_cut_loses_no_acknowledged_commit(tmp_path: Path, mode: str) -> None:
    """SQLite's own syncs (full) and the group syncer's fdatasync of the WAL (group) alike:
    whatever is thrown away, every commit acknowledged before the cut is there, the file
    passes integrity_check, and the cuts did throw unsynced writes away."""
    rng = random.Random(20261202)
    path = tmp_path / "state.db"
    dropped = 0
    acknowledged: set[int] = set()
    for cut in range(8):
        acked, done = _cut_once(path, mode, seed=cut, after=rng.randint(1, 60))
        acknowledged.update(acked)
        dropped += done["blocksDropped"] + done["blocksTorn"]
        present = _reopen(path)
        assert acknowledged <= present, (cut, done, sorted(acknowledged - present)[:5])
    assert dropped > 0  # the cuts landed on unsynced writes


def test_at_normal_durability_a_power_cut_keeps_a_prefix_of_the_commits(tmp_path: Path) -> None:
    """synchronous=NORMAL: the last commits before a cut may go (the docs say so), but what
    remains is every commit up to some point, and the file opens and checks ok."""
    rng = random.Random(7)
    path = tmp_path / "state.db"
    for cut in range(8):
        _cut_once(path, "normal", seed=100 + cut, after=rng.randint(1, 60))
        present = _reopen(path)
        assert present == set(range(1, len(present) + 1)), cut  # a prefix: nothing missing in between


@pytest.mark.parametrize("mode", ["all", "subset", "torn"])
def test_a_cut_leaves_each_block_as_synced_written_or_torn_and_restores_the_synced_length(
        tmp_path: Path, mode: str) -> None:
    """The VFS's bookkeeping alone, on a plain file: after a cut every 4 KiB block is what
    it was at the last sync, what was written since, or (torn) a mix of their 512-byte
    sectors; with every write dropped the file is exactly as synced, in length too."""
    from piwf.store.sqlite import powercut

    rng = random.Random(3)
    for trial in range(30):
        path = tmp_path / f"f{trial}"
        synced = os.urandom(rng.randint(0, 5) * powercut.BLOCK + rng.randint(0, powercut.BLOCK))
        path.write_bytes(synced)
        vfs = powercut.PowerCutVFS(trial, name=f"piwf-powercut-test-{mode}-{trial}")
        written = bytearray(synced)
        for _ in range(rng.randint(1, 6)):  # writes past the end, over the middle, and a truncation
            if rng.random() < 0.2:
                size = rng.randint(0, len(written))
                vfs.remember(str(path), size, len(written))
                del written[size:]
            else:
                offset = rng.randint(0, len(written) + 100)
                data = os.urandom(rng.randint(1, 9000))
                vfs.remember(str(path), offset, offset + len(data))
                written[len(written):offset] = bytes(max(0, offset - len(written)))
                written[offset:offset + len(data)] = data
            path.write_bytes(bytes(written))
        vfs.cut(mode)
        vfs.unregister()
        after = path.read_bytes()
        if mode == "all":
            assert after == synced, trial
            continue
        for start in range(0, len(after), powercut.SECTOR):  # each sector: as synced, or as written, or zeros
            sector = after[start:start + powercut.SECTOR]
            candidates = {bytes(written[start:start + powercut.SECTOR]), synced[start:start + powercut.SECTOR]}
            assert any(sector == c.ljust(len(sector), b"\0")[:len(sector)] for c in candidates), (trial, start)
