"""Every status word piwf stores or sends, defined once.

The values are the words on the wire and in the database; ``StrEnum`` members are
``str``, so they bind as SQL parameters and encode as JSON strings unchanged.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A run's engine status: what the workflow is doing (DESIGN.md §4)."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class QueueStatus(StrEnum):
    """A run's queue status: who may work on it (seed 003)."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    PARKED = "parked"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Hold(StrEnum):
    """Why a parked run is not claimed again until someone acts."""

    PAUSED = "paused"
    SOURCE = "source"
    CRASHED = "crashed"
    EFFECT = "effect"
    WAITING = "waiting"  # for a person or an agent: an interaction request of the run is open


class AttemptStatus(StrEnum):
    RUNNING = "running"
    WAITING = "waiting"  # its node asked a person or an agent; the run waits for the answer
    ACCEPTED = "accepted"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class RequestStatus(StrEnum):
    """An interaction request (a decision or an ask): open, then how it was closed."""

    PENDING = "pending"
    PRESENTING = "presenting"  # a client holds the presentation claim
    SETTLED = "settled"  # answered, or its accepted submission became the node's output
    EXPIRED = "expired"  # its deadline passed with no default
    CANCELLED = "cancelled"  # its run was cancelled


class SubmissionStatus(StrEnum):
    VALIDATING = "validating"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


class Provenance(StrEnum):
    """Who resolved a decision."""

    HUMAN = "human"
    TIMEOUT = "timeout"


class NotificationKind(StrEnum):
    PROGRESS = "progress"
    FINAL = "final"


class TurnCause(StrEnum):
    """Why a session has a turn: how its run ended or was held (DESIGN.md §8)."""

    REQUESTED = "requested"  # ctx.present asked for one; it becomes eligible when the run completes
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    HELD = "held"  # held for a person: crashed, effect, source


class TurnResolution(StrEnum):
    PRESENTED = "presented"
    PROMPTED = "prompted"
    DISMISSED = "dismissed"


class FollowUpState(StrEnum):
    QUEUED = "queued"
    DELIVERED = "delivered"  # with its run's turn
    REMOVED = "removed"


class EffectStatus(StrEnum):
    PENDING = "pending"
    APPLYING = "applying"
    APPLIED = "applied"
    REJECTED = "rejected"
    AMBIGUOUS = "ambiguous"


class WorkerStatus(StrEnum):
    """A worker's record: live (starting, running), then how it ended."""

    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"  # ended on its own once its part was done: run ended or parked, or stopped at a boundary
    CRASHED = "crashed"  # ended while its run still needed it, whatever its exit status
    TIMED_OUT = "timedOut"  # did not report ready within the startup timeout, or its node passed its time limit; killed
    CANCELLED = "cancelled"  # stopped because its run was cancelled
    CLAIM_LOST = "claimLost"  # the run's claim moved on: told so and ended, or stopped
    STOPPED = "stopped"  # stopped because its host stopped (drain, or the host's scope was cancelled)
    ORPHANED = "orphaned"  # its host died before recording its end; a later host found the record open
    NOT_STARTED = "notStarted"  # could not be started (the fork server was being restarted): no crash


class StopReason(StrEnum):
    """Why the cancel scope of a run's or a reconcile's worker was cancelled: the
    ``reason`` it is cancelled with (host/lane.py)."""

    CANCELLED = "cancelled"  # runs only: run.cancel
    CLAIM_LOST = "claimLost"
    HOST_STOPPING = "hostStopping"
    STARTUP_TIMEOUT = "startupTimeout"
    RECONCILE_TIMEOUT = "reconcileTimeout"  # reconciles only: ready, but not done within the controller's timeout
    PROTOCOL = "protocolError"
    LINGERING = "lingering"  # told its part was done, the worker did not end within the kill grace
    NODE_TIME_LIMIT = "nodeTimeLimit"  # runs only: the node it ran passed its time limit
    UNRENEWED = "unrenewed"  # its claim or the host lease could not be renewed in time (host/fence.py)


# The worker status a stop leaves, and whether it counts as a crash.
STOPPED_AS = {
    StopReason.CANCELLED: WorkerStatus.CANCELLED,
    StopReason.CLAIM_LOST: WorkerStatus.CLAIM_LOST,
    StopReason.HOST_STOPPING: WorkerStatus.STOPPED,
    StopReason.STARTUP_TIMEOUT: WorkerStatus.TIMED_OUT,
    StopReason.RECONCILE_TIMEOUT: WorkerStatus.TIMED_OUT,
    StopReason.PROTOCOL: WorkerStatus.CRASHED,
    StopReason.LINGERING: WorkerStatus.CRASHED,
    StopReason.NODE_TIME_LIMIT: WorkerStatus.TIMED_OUT,  # its node's outcome is recorded with its end: no crash
    StopReason.UNRENEWED: WorkerStatus.CLAIM_LOST,  # the claim may be another host's by now: the run is not parked
}
ENDED = frozenset({QueueStatus.DONE, QueueStatus.FAILED, QueueStatus.CANCELLED})  # queue statuses that are final
ACTIVE_QUEUE = (QueueStatus.STARTING, QueueStatus.RUNNING)  # a claim is held
AT_REST = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELLED,
                     RunStatus.WAITING})  # nothing happens to such a run without someone acting
UNSUCCESSFUL = frozenset({RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELLED})
OPEN_REQUEST = (RequestStatus.PENDING, RequestStatus.PRESENTING)
CRASHES = frozenset({WorkerStatus.CRASHED, WorkerStatus.TIMED_OUT})
LIVE_WORKER = (WorkerStatus.STARTING, WorkerStatus.RUNNING)


# Named queues (``run start --queue``, ``serve --queue``): a run is claimed only by a host
# serving its queue. A name is a short identifier, so it prints, logs and goes in a unit
# file as it is.
DEFAULT_QUEUE = "default"
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}(?!\n)$"  # (?!\n): Python's $ also matches before a final newline


def queue_problem(name: str) -> str | None:
    """Why ``name`` cannot be a queue's name (None: it can)."""
    import re

    if re.fullmatch(QUEUE_PATTERN, name):
        return None
    return (f"queue name {name!r} is not a short identifier: 1 to 63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit")
