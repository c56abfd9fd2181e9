"""Process identity that survives pid reuse, and signalling only what matches it.

An identity is ``boot_id:pid:start_ticks`` (field 22 of ``/proc/<pid>/stat``): a pid
alone can name another process after reuse, and psutil's ``create_time`` has 10 ms
resolution, too coarse under fast reuse (NOTES.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from pathlib import Path


BOOT_ID_VARIABLE = "PIWF_BOOT_ID"  # for tests and containers: what this process takes as its boot id


@functools.cache
def boot_id() -> str:
    """The kernel's boot id, or ``$PIWF_BOOT_ID`` when set (a test making a host look like
    another machine's; a container that shares the kernel but not the pid namespace). A
    process started with another value sees this one's processes as another machine's."""
    given = os.environ.get(BOOT_ID_VARIABLE, "").strip()
    if given:
        return given
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "no-boot-id"


@functools.cache
def machine_id() -> str:
    """Which machine a host is on, as far as pids go: ``$PIWF_BOOT_ID`` when set, else the
    boot id and this process's pid namespace (two containers on one kernel share a boot id
    but not their pids: a pid proves nothing across them)."""
    if os.environ.get(BOOT_ID_VARIABLE, "").strip():
        return boot_id()
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # 'pid:[4026531836]'
    except OSError:
        return boot_id()
    return f"{boot_id()}/{namespace}"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state, ppid, pgrp, ...)."""
    try:  # os.open and os.read: a quarter of pathlib's read_text (read for every worker started)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    end = stat.rfind(")")
    return None if end < 0 else stat[end + 2:].split()


def start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22 overall


def parent_and_group(pid: int) -> tuple[int, int] | None:
    """The parent pid and process group of the live process ``pid`` (None: no such process)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[1]), int(fields[2]))


def identity(pid: int) -> str | None:
    ticks = start_ticks(pid)
    return None if ticks is None else f"{boot_id()}:{pid}:{ticks}"


def matches(pid: int, recorded: str | None) -> bool:
    """True when the live process ``pid`` is the one recorded (same boot, same start)."""
    return recorded is not None and identity(pid) == recorded


def alive(pid: int, recorded: str | None) -> bool:
    """The recorded process still runs (a zombie has finished: it only awaits its reaping)."""
    return matches(pid, recorded) and not is_zombie(pid)


def is_stopped(pid: int) -> bool:
    """The live process ``pid`` is stopped (SIGSTOP, SIGTSTP, or a tracer)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0].startswith("Z")


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group we own; False if it is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def kill_recorded_group(pid: int, recorded: str | None) -> bool:
    """SIGKILL the process group that the recorded process ``pid`` leads (or led).

    While the leader lives and matches its identity, the whole group is signalled. Once it
    has died, what is left of its group (children it started) is found by process group and
    killed one by one, but only processes started after the recorded leader on this boot:
    Linux does not hand out a pid while it still names a process group, so a group ``pid``
    with members left is the recorded one unless that pid was reused for a new group
    leader which then exited itself (a window piwf accepts). A live process with the pid
    but another identity proves the old group gone: nothing is signalled.
    """
    if recorded is None:
        return False
    if matches(pid, recorded):
        return signal_group(pid, signal.SIGKILL)
    boot, _, rest = recorded.partition(":")
    ticks = int(rest.rsplit(":", 1)[-1])
    if boot != boot_id() or start_ticks(pid) is not None:
        return False
    killed = False
    for member in group_members(pid):
        member_ticks = start_ticks(member)
        if member_ticks is not None and member_ticks >= ticks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, signal.SIGKILL)
                killed = True
    return killed


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[2]) == pgid:
                members.append(int(entry))
    return members
