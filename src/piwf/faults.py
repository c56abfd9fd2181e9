"""Named fault points at the commit and reply boundaries of host and worker.

``PIWF_FAULT=point:action[:nth]`` arms one point in every process that inherits the
variable: on the ``nth`` time (default 1) the point is reached, the process

- ``exit``: ends at once with status 86 (as if killed: no cleanup, no flush),
- ``raise``: raises ``FaultInjected`` (an unexpected error at that spot),
- ``sleep``: hangs for an hour (a stalled process: lease expiry, zombie workers).

``PIWF_FAULT_TRACE=FILE`` appends the name of every point reached, one per line, so a
test can prove each declared point is reachable.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from piwf.errors import PiwfError

FAULT_EXIT_STATUS = 86
ACTIONS = ("exit", "raise", "sleep")

POINTS: dict[str, str] = {
    "host.takeover.committed": "a new host took the lease and expired the old claims",
    "host.claim.committed": "the dispatcher claimed a run, before its worker starts",
    "host.command.committed": "a client command committed, before the reply is sent",
    "host.reply.sent": "a reply was written to a client",
    "host.worker.committed": "a worker message committed, before the answer is sent",
    "host.worker.answered": "an answer was written to a worker",
    "host.worker.recorded": "a worker ended: its end recorded and its run parked, unless the run had ended",
    "host.lease.renewed": "the heartbeat renewed the host lease",
    "host.group.syncing": "at full durability, commits are waiting for their group's fsync: nothing answered",
    "host.group.synced": "a group's fsync returned, before any of its answers is sent",
    "host.deadline.due": "the deadline timer woke with a request due, before it closes any",
    "host.deadline.committed": "the deadline timer closed requests whose deadline passed, before it logs",
    "host.reconcile.claimed": "the controller dispatcher claimed a resource, before its worker starts",
    "host.reconcile.answered": "an answer was written to a reconcile worker",
    "host.reconcile.recorded": "a reconcile ended: its failure recorded unless its worker reported",
    "worker.started": "a worker process started, before it reports ready",
    "worker.message.sent": "a worker wrote a message, before reading the answer",
    "worker.answer.received": "a worker read the host's answer",
    "worker.effect.applying": "an effect was recorded as applying, before apply() runs",
    "worker.effect.applied": "apply() returned, before the effect is settled",
    "worker.shell.spawned": "a shell node's process was started, before it is registered",
}


class FaultInjected(RuntimeError):
    """Deliberately not a PiwfError: it stands for an unexpected failure (a bug, a crash of
    a library) at that spot, which no handler expects."""


class BadFaultSpec(PiwfError):
    code = "badFaultSpec"
    exit_code = 2


@dataclass
class _Armed:
    point: str
    action: str
    nth: int
    seen: int = 0


def parse(spec: str) -> _Armed:
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise BadFaultSpec(f"PIWF_FAULT must be point:action[:nth], not {spec!r}")
    point, action = parts[0], parts[1]
    if point not in POINTS:
        raise BadFaultSpec(f"PIWF_FAULT names unknown fault point {point!r}; known: {', '.join(sorted(POINTS))}")
    if action not in ACTIONS:
        raise BadFaultSpec(f"PIWF_FAULT action must be one of {', '.join(ACTIONS)}, not {action!r}")
    try:
        nth = int(parts[2]) if len(parts) == 3 else 1
    except ValueError:
        nth = 0
    if nth < 1:
        raise BadFaultSpec(f"PIWF_FAULT count must be a positive integer, not {parts[2]!r}")
    return _Armed(point, action, nth)


_armed: _Armed | None = None
_trace: str | None = None


def configure(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Read ``PIWF_FAULT`` and ``PIWF_FAULT_TRACE``; a bad spec raises BadFaultSpec."""
    global _armed, _trace
    spec = environ.get("PIWF_FAULT")
    _armed = parse(spec) if spec else None
    _trace = environ.get("PIWF_FAULT_TRACE") or None


def point(name: str) -> None:
    """Mark that ``name`` was reached; act if it is the armed point's nth time."""
    if _trace is not None:
        _record(name, _trace)
    if _armed is None or _armed.point != name:
        return
    _armed.seen += 1
    if _armed.seen != _armed.nth:
        return
    if _armed.action == "exit":
        os._exit(FAULT_EXIT_STATUS)
    if _armed.action == "raise":
        raise FaultInjected(f"fault injected at {name}")
    time.sleep(3600)


def _record(name: str, trace: str) -> None:
    assert name in POINTS, f"undeclared fault point {name}"
    fd = os.open(trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{name}\n".encode())
    finally:
        os.close(fd)
