"""Process identity: never signal a process that is not the one recorded."""

from __future__ import annotations

import os
import subprocess

from piwf import processes


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"], start_new_session=True)


def test_identity_names_boot_pid_and_start_time() -> None:
    me = processes.identity(os.getpid())
    assert me is not None
    boot, pid, ticks = me.rsplit(":", 2)
    assert boot == processes.boot_id() and int(pid) == os.getpid() and int(ticks) > 0
    assert processes.identity(2**22 + 12345) is None  # no such process


def test_a_mismatched_identity_is_never_signalled() -> None:
    proc = sleeper()
    try:
        real = processes.identity(proc.pid)
        boot, pid, ticks = real.rsplit(":", 2)
        decoy = f"{boot}:{pid}:{int(ticks) - 1}"  # same pid, another start: a reused pid
        assert not processes.kill_recorded_group(proc.pid, decoy)
        assert not processes.kill_recorded_group(proc.pid, None)
        assert proc.poll() is None
        assert processes.kill_recorded_group(proc.pid, real)
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_is_not_alive() -> None:
    proc = sleeper()
    recorded = processes.identity(proc.pid)
    assert processes.alive(proc.pid, recorded)
    os.kill(proc.pid, 9)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert processes.is_zombie(proc.pid) and not processes.alive(proc.pid, recorded)
    proc.wait()
    assert not processes.alive(proc.pid, recorded)
