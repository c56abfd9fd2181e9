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


def test_piwf_boot_id_makes_another_machine_whose_groups_are_never_signalled() -> None:
    """``PIWF_BOOT_ID`` (tests, containers): a process taking another boot id records
    identities of it, and a process of this boot never signals what they name."""
    import sys

    code = ("import os; from piwf import processes; "
            "print(processes.boot_id(), processes.machine_id(), processes.identity(os.getpid()))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PIWF_BOOT_ID": "elsewhere"},
                          capture_output=True, text=True, check=True)
    boot, machine, identity = done.stdout.split()
    assert boot == machine == "elsewhere" and identity.startswith("elsewhere:")
    assert processes.machine_id().startswith(processes.boot_id() + "/pid:[")  # boot id and pid namespace
    proc = sleeper()
    try:
        ticks = processes.start_ticks(proc.pid)
        assert not processes.kill_recorded_group(proc.pid, f"elsewhere:{proc.pid}:{ticks}")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
