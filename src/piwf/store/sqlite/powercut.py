"""Power loss, simulated under SQLite: a VFS that forgets what was not synced.

``PIWF_POWER_CUT=SEED`` in a host's environment opens its state database through the VFS
``piwf-powercut``, which passes every call to the operating system's own and remembers, for
each block written since the file's last sync, what the block held at that sync. Every
sync passes through it — SQLite's own (``xSync``: the WAL before a checkpoint, the
database after it) and the group syncer's ``fdatasync`` of the WAL (``Database.sync_wal``
calls ``sync_path``) — and makes the file's blocks durable.

``SIGUSR2`` cuts the power: on a thread of its own, once no file operation is under way
(and none starts after), the cut kills every process the host started, then throws away
unsynced writes as a disk losing power may — all of them, an arbitrary subset of blocks,
or a subset with torn blocks (each 512-byte sector old or new) — then SIGKILLs the host.
What a new host opens is what the disk would hold after the reboot. One JSON line on
stderr says what was dropped.

Only for tests and the chaos harness (``python -m piwf.chaos --power-cuts N``): every write
goes through Python here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import apsw
import psutil

ENV = "PIWF_POWER_CUT"
NAME = "piwf-powercut"
BLOCK = 4096  # what the file system writes as one (a page of the page cache)
SECTOR = 512  # what a disk writes as one: a torn block is a mix of old and new sectors
MODES = ("all", "subset", "torn")


@dataclass
class _Unsynced:
    """One file's writes since its last sync: each dirty block's content at that sync
    (shorter than BLOCK, or empty, where the file was shorter), and its size then."""

    synced_size: int
    old: dict[int, bytes] = field(default_factory=dict)


class PowerCutVFS(apsw.VFS):
    def __init__(self, seed: int, name: str = NAME) -> None:
        super().__init__(name, "")
        self.lock = threading.Lock()  # one file operation at a time; the cut holds it to the end
        self.files: dict[str, _Unsynced] = {}
        self.rng = random.Random(seed)
        self.cut_in: int | None = None  # asked to cut: before the file operation after this many more

    def ask(self) -> None:
        """Cut before one of the next few file operations (drawn at random), so a cut lands
        between any two writes or syncs of a commit as well as between commits."""
        self.cut_in = self.rng.randint(0, 24)

    def before_operation(self) -> None:
        """Under the lock, at the start of every file operation: cut the power if its turn came."""
        if self.cut_in is None:
            return
        if self.cut_in == 0:
            power_off(self, "operation")
        self.cut_in -= 1

    def xOpen(self, name: Any, flags: list[int]) -> _File:
        return _File(self, name, flags)

    # --- bookkeeping, under the lock -----------------------------------------------------

    def unsynced(self, path: str) -> _Unsynced:
        found = self.files.get(path)
        if found is None:
            found = self.files[path] = _Unsynced(_size(path))
        return found

    def remember(self, path: str, start: int, end: int) -> None:
        """Before a write (or a truncation) of bytes [start, end): keep what each block it
        touches held at the last sync, unless kept already."""
        state = self.unsynced(path)
        missing = [b for b in range(start // BLOCK, (max(end, start + 1) - 1) // BLOCK + 1) if b not in state.old]
        if not missing:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            state.old.update((b, b"") for b in missing)
            return
        try:
            for block in missing:
                state.old[block] = os.pread(fd, BLOCK, block * BLOCK)
        finally:
            os.close(fd)

    def synced(self, path: str) -> None:
        self.files[path] = _Unsynced(_size(path))

    def sync_path(self, path: str) -> None:
        """fdatasync ``path`` (the group syncer's sync of the WAL): its blocks are durable."""
        with self.lock:
            self.before_operation()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self.synced(path)

    # --- the cut -------------------------------------------------------------------------

    def cut(self, mode: str | None = None) -> dict[str, Any]:
        """Throw away unsynced writes (``mode`` or one drawn at random). The caller holds
        the lock. Returns what was done."""
        mode = mode or self.rng.choice(MODES)
        dropped = torn = 0
        for path, state in self.files.items():
            if not state.old or not os.path.exists(path):
                continue
            d, t = _revert(path, state, mode, self.rng)
            dropped, torn = dropped + d, torn + t
        self.files.clear()
        return {"mode": mode, "blocksDropped": dropped, "blocksTorn": torn}


class _File(apsw.VFSFile):
    def __init__(self, vfs: PowerCutVFS, name: Any, flags: list[int]) -> None:
        super().__init__("", name, flags)
        self.vfs = vfs
        self.path = name.filename() if hasattr(name, "filename") else str(name)

    def xWrite(self, data: bytes, offset: int) -> None:
        with self.vfs.lock:
            self.vfs.before_operation()
            self.vfs.remember(self.path, offset, offset + len(data))
            super().xWrite(data, offset)

    def xTruncate(self, newsize: int) -> None:
        with self.vfs.lock:
            self.vfs.before_operation()
            self.vfs.remember(self.path, newsize, max(newsize, _size(self.path)))
            super().xTruncate(newsize)

    def xSync(self, flags: int) -> None:
        with self.vfs.lock:
            self.vfs.before_operation()
            super().xSync(flags)
            self.vfs.synced(self.path)


def _revert(path: str, state: _Unsynced, mode: str, rng: random.Random) -> tuple[int, int]:
    """Put back, per ``mode``, what each dirty block held at the last sync. Blocks a
    truncation removed since then come back together or not at all (it is one change of
    the file's size)."""
    current = _size(path)
    choices = {block: "drop" if mode == "all" else rng.choice(("drop", "keep", "tear") if mode == "torn" else
                                                               ("drop", "keep")) for block in sorted(state.old)}
    removed = [block for block in choices if block * BLOCK >= current]
    if removed:
        undo = "drop" if mode == "all" else rng.choice(("drop", "keep"))
        choices.update((block, undo) for block in removed)
    with open(path, "r+b") as file:
        new = {}
        for block in choices:
            file.seek(block * BLOCK)
            new[block] = file.read(BLOCK)
        # The file grew: a block past the synced size that survives (whole or torn) keeps its length.
        keep_length = current <= state.synced_size or any(
            choice != "drop" and block * BLOCK + len(new[block]) > state.synced_size
            for block, choice in choices.items())
        for block, choice in choices.items():
            if choice == "keep":
                continue
            old, now = state.old[block], new[block]
            length = max(len(old), len(now))
            if choice == "tear":
                old, now = old.ljust(length, b"\0"), now.ljust(length, b"\0")
                content = b"".join((old if rng.random() < 0.5 else now)[s:s + SECTOR] for s in range(0, length, SECTOR))
            else:
                content = old.ljust(length, b"\0") if keep_length else old
            file.seek(block * BLOCK)
            file.write(content)
        if not keep_length or (removed and choices[removed[0]] == "drop"):
            file.truncate(state.synced_size)
    return sum(c == "drop" for c in choices.values()), sum(c == "tear" for c in choices.values())


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


# --- arming a host ---------------------------------------------------------------------

_armed: PowerCutVFS | None = None


def armed() -> PowerCutVFS | None:
    """The VFS, registered on first use when ``PIWF_POWER_CUT`` is set (else None)."""
    global _armed
    if _armed is None and os.environ.get(ENV):
        try:
            seed = int(os.environ[ENV])
        except ValueError:
            raise SystemExit(f"{ENV} must be an integer seed, not {os.environ[ENV]!r}") from None
        _armed = PowerCutVFS(seed)
        _install_trigger(_armed)
    return _armed


def power_off(vfs: PowerCutVFS, at: str) -> NoReturn:
    """The cut, with ``vfs.lock`` held (and never released: no file operation runs after it):
    every process the host started dies, unsynced writes go as ``cut`` draws, the host dies."""
    for child in psutil.Process().children(recursive=True):  # the rest of the machine goes dark too
        with contextlib.suppress(psutil.Error):
            child.kill()
    done = vfs.cut() | {"at": at}
    sys.stderr.write(json.dumps({"powerCut": done}) + "\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL")


def _install_trigger(vfs: PowerCutVFS) -> None:
    """SIGUSR2 asks for a cut; if no file operation comes to take it within 2 s (an idle
    host), a thread of its own cuts."""
    asked = threading.Event()

    def cut_when_idle() -> None:
        asked.wait()
        time.sleep(2)
        vfs.lock.acquire()
        power_off(vfs, "idle")

    def on_signal(signum: int, frame: object) -> None:
        vfs.ask()
        asked.set()

    threading.Thread(target=cut_when_idle, name="piwf-powercut", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, on_signal)
