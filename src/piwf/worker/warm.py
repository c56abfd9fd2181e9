"""A warm worker between two runs (a workflow declared with ``reuse_worker``).

After the answer that ends its part of a run, a worker whose workflow allows it drops what
the run left behind and offers itself for another run of the same workflow:

- the process groups the run registered (its shell nodes) are killed and reaped here, and
  the host kills them again by their recorded identity before it hands over another run;
- the environment and working directory go back to what they were when the process
  started (the launch envelope is not in it: a warm worker's next run comes over the pipe);
- it is not offered at all (it exits, as a fresh worker does) once it has executed its
  number of runs, has grown past its memory ceiling, or still has a thread or a child
  process of the run's alive: what a run left running must not see the next one.

Then it says ``worker.idle`` and waits for ``run.next``; the host may instead stop it (a
signal) or go away (the pipe's hang-up kills the process group, as during a run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass

from piwf.engine.definition import WorkerReuse
from piwf.protocol.worker import LaunchEnvelope, WorkerIdle, parse_next_run
from piwf.worker.channel import Channel

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Baseline:
    """What the process looked like before its first run: restored after each."""

    env: dict[str, str]
    cwd: str
    threads: int

    @classmethod
    def take(cls, launch_var: str) -> Baseline:
        env = dict(os.environ)
        env.pop(launch_var, None)  # the first run's envelope is that run's, not the process's
        return cls(env=env, cwd=os.getcwd(), threads=threading.active_count())

    def restore(self) -> None:
        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)


def next_run(channel: Channel, baseline: Baseline, reuse: WorkerReuse, runs: int) -> LaunchEnvelope | None:
    """Clean up after a run and wait for the next; None: this process is not reused (it ends)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _kill_registered(channel)
    baseline.restore()
    if runs >= reuse.runs or resident_mb() > reuse.memory_mb or not _alone(baseline):
        return None
    channel.tell(WorkerIdle(workerEpoch=channel.worker_id, runs=runs), idle=True)
    launch = parse_next_run(channel.next_line()).launch
    channel.rebind(launch.workerEpoch, launch.generation, launch.claimLeaseMs, launch.vouchedUntilMs)
    return launch


def _kill_registered(channel: Channel) -> None:
    """The run's registered process groups, still running when it ended, go now."""
    for pgid in list(channel.children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, 0)  # its leader is this process's child
    channel.children.clear()


def _alone(baseline: Baseline) -> bool:
    """No thread of the run's still alive, and no child process (running or unreaped)."""
    if threading.active_count() > baseline.threads:
        return False
    try:  # ECHILD only when there is no child at all; WNOWAIT leaves an unreaped one as it is
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / (1 << 20)
