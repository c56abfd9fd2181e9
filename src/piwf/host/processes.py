"""Process identity that survives pid reuse, and signalling only what matches it.

An identity is ``boot_id:pid:start_ticks`` (field 22 of ``/proc/<pid>/stat``): a pid
alone can name another process after reuse, and psutil's ``create_time`` has 10 ms
resolution, too coarse under fast reuse (NOTES.md).
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path


@functools.cache
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "no-boot-id"


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])  # field 22 overall


def identity(pid: int) -> str | None:
    ticks = start_ticks(pid)
    return None if ticks is None else f"{boot_id()}:{pid}:{ticks}"


def matches(pid: int, recorded: str | None) -> bool:
    """True when the live process ``pid`` is the one recorded (same boot, same start)."""
    return recorded is not None and identity(pid) == recorded


def alive(pid: int, recorded: str | None) -> bool:
    """The recorded process still runs (a zombie has finished: it only awaits its reaping)."""
    return matches(pid, recorded) and not is_zombie(pid)


def is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("Z")


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
    """SIGKILL the group led by ``pid`` only if ``pid`` is still the recorded process."""
    if not matches(pid, recorded):
        return False
    return signal_group(pid, signal.SIGKILL)
