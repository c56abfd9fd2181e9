"""The host lock: an ``flock`` held for the host's whole life.

The descriptor is close-on-exec, so workers never inherit it, and the kernel drops it the
moment the host dies, however it dies. ``host.lock.json`` beside it says who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

from piwf.errors import HostAlreadyRunning
from piwf.paths import StatePaths


class HostLock:
    def __init__(self, paths: StatePaths, fd: int) -> None:
        self.paths = paths
        self._fd = fd

    @classmethod
    def acquire(cls, paths: StatePaths, record: dict[str, object]) -> HostLock:
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_record(paths)
            who = f"pid {holder['pid']}" if holder else "another process"
            raise HostAlreadyRunning(f"a piwf host ({who}) is already serving {paths.root}") from None
        lock = cls(paths, fd)
        lock._write_record(record)
        return lock

    @classmethod
    async def wait(cls, paths: StatePaths, record: dict[str, object]) -> HostLock:
        """Block until the lock is free and take it (``piwf serve --standby``): the kernel
        hands it to one waiter the moment its holder dies or releases it.

        The wait is a blocking ``flock`` in a thread. If cancelled, that thread is abandoned
        and its descriptor left open: closing it under a blocked ``flock`` could leave the
        lock held by no descriptor. The process is ending then anyway (a standby is
        cancelled only when told to stop)."""
        import trio  # here, not at the top: `piwf status` reads the lock record without trio

        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        await trio.to_thread.run_sync(fcntl.flock, fd, fcntl.LOCK_EX, abandon_on_cancel=True)
        lock = cls(paths, fd)
        lock._write_record(record)
        return lock

    def _write_record(self, record: dict[str, object]) -> None:
        tmp = self.paths.lock_record.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"schema": "piwf.host-lock.v1", **record}, handle)
            handle.write("\n")
        os.replace(tmp, self.paths.lock_record)

    def release(self) -> None:
        # The lock file itself stays: unlinking an flock'ed file lets two hosts lock two files.
        self.paths.lock_record.unlink(missing_ok=True)
        os.close(self._fd)


def read_record(paths: StatePaths) -> dict[str, object] | None:
    try:
        record: object = json.loads(paths.lock_record.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


STANDBY_PREFIX = "standby-"  # host/standby-<pid>.json: a `piwf serve --standby` waiting for the lock


@contextlib.contextmanager
def standing_by(paths: StatePaths, record: dict[str, object]) -> Iterator[None]:
    """While a standby waits for the lock, ``host/standby-<pid>.json`` says so (``piwf
    status`` shows it, ``piwf stop`` says when it took over); removed once it stops waiting.
    A standby killed while waiting leaves its file behind: readers check that its process
    still runs (``read_standbys``)."""
    path = paths.host_dir / f"{STANDBY_PREFIX}{record['pid']}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"schema": "piwf.standby.v1", **record}, handle)
    os.replace(tmp, path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def read_standbys(paths: StatePaths) -> list[dict[str, object]]:
    """The standbys waiting for the lock (their process still running), oldest pid first;
    none when there is no host directory. (``os`` and not pathlib: ``piwf status`` calls
    this, and loads no pathlib when a host answers.)"""
    host_dir = os.path.join(paths.name, "host")
    try:
        names = sorted(name for name in os.listdir(host_dir)
                       if name.startswith(STANDBY_PREFIX) and name.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        try:
            with open(os.path.join(host_dir, name), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("pid"), int) and _alive(record):
            found.append(record)
    return sorted(found, key=lambda r: int(str(r["pid"])))


def _alive(record: dict[str, object]) -> bool:
    from piwf.processes import alive

    return alive(int(str(record["pid"])), str(record.get("identity")))


def is_held(paths: StatePaths) -> bool:
    """Some process holds the host lock now (a host serving, or starting, or draining)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a shared lock taken here goes with it
    return False
