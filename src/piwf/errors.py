"""One error hierarchy for piwf.

Every error has a stable ``code``. Errors that reach a client over the host protocol
carry the wire outcome they map to (``rejected``, ``notFound``, ``conflict``, ...).
"""

from __future__ import annotations

from enum import IntEnum

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this module is on the CLI's path
if TYPE_CHECKING:
    from typing import Any


class ExitCode(IntEnum):
    """How ``piwf`` exits, one code per kind of failure (docs/operations.md has this table)."""

    OK = 0
    ERROR = 1  # the host rejected the request, a run waited on failed, or another error
    USAGE = 2  # bad arguments or environment (also argparse's code)
    CORRUPT = 3  # state.db is not a readable SQLite database
    SCHEMA = 4  # state.db has an unknown or newer layout
    HOST_RUNNING = 5  # another host already serves the state directory
    NOT_FOUND = 6  # the host answered notFound
    CONFLICT = 7  # the host answered conflict
    UNAVAILABLE = 8  # the host answered unavailable (a full disk): nothing was changed
    NO_HOST = 9  # no host serves the state directory, or it went away mid-request
    TIMEOUT = 10  # the host (or a workflow being loaded) did not answer in time
    WORKFLOW_INVALID = 11  # `piwf workflows list`: a workflow did not load
    STATE_DIR = 12  # the state directory cannot be used (a symlink, another owner, host.sock not a socket)
    SERVICE = 13  # `piwf service`: a file in the way or a failed systemctl/launchctl; a bad socket from LISTEN_FDS
    # How a wait ended (`run start --wait`, `run wait`, `answer --wait`), one code for each way but success.
    RUN_FAILED = 20
    RUN_TIMED_OUT = 21
    RUN_CANCELLED = 22
    RUN_PAUSED = 23
    RUN_HELD = 24  # held for a person: crashes in a row, an ambiguous effect, a changed or broken workflow
    RUN_WAITING = 25  # waits for an answer from a person or an agent
    WAIT_TIMEOUT = 26  # the wait's own limit (--wait-timeout) passed first; the run goes on
    INTERRUPTED = 130  # Ctrl-C (SIGINT): the command stopped; a run it waited for goes on
    INTERNAL = 70  # a bug in piwf

    @property
    def outcome(self) -> str:
        """The word for ``"outcome"`` in ``--json`` error documents: ``NOT_FOUND`` -> ``notFound``."""
        first, *rest = self.name.lower().split("_")
        return first + "".join(word.title() for word in rest)


# The host's reply outcomes (docs/protocol.md) and what the CLI exits with for each.
OUTCOME_EXIT = {"rejected": ExitCode.ERROR, "notFound": ExitCode.NOT_FOUND, "conflict": ExitCode.CONFLICT,
                "unavailable": ExitCode.UNAVAILABLE}


class PiwfError(Exception):
    """Root of every error piwf raises on purpose."""

    code = "error"
    outcome = "rejected"
    exit_code: int = ExitCode.ERROR

    def __str__(self) -> str:
        text = super().__str__()
        return " ".join(text.split())  # one line, always


# --- store -----------------------------------------------------------------------------


class StoreError(PiwfError):
    code = "store"


class StorageUnavailable(StoreError):
    """The storage failed the read or write (an I/O error, a read-only or vanished file,
    a lock held too long): the request was not carried out. Retry once the storage is
    healthy: the host stays up meanwhile."""

    code = "storageUnavailable"
    outcome = "unavailable"


class StorageFull(StorageUnavailable):
    """The disk (or the database's size limit) is full; the write changed nothing. Retry
    once space is freed: the host stays up meanwhile."""

    code = "storageFull"


class SchemaError(StoreError):
    """The database has an unknown or newer layout; it is refused and left untouched."""

    code = "schema"
    exit_code = ExitCode.SCHEMA


class CorruptStateError(StoreError):
    """The database file is not a readable SQLite database."""

    code = "corrupt"
    exit_code = ExitCode.CORRUPT


class ConstraintViolation(StoreError):
    """A write broke a uniqueness or integrity rule of the schema."""

    code = "constraint"


class ClaimLost(StoreError):
    """A write on behalf of a claim found the claim no longer live."""

    code = "claimLost"
    outcome = "claimLost"


# --- requests and operations ----------------------------------------------------------


class HostRefused(PiwfError):
    """The host would not record a worker's message (a refusal, a full disk). It is the
    worker's failure, not the node's: the worker ends and the run is tried again."""

    code = "hostRefused"


class RequestTooLarge(PiwfError):
    """A request over the host's line limit, refused by the client before sending it."""

    code = "rejected"


class ProtocolError(PiwfError):
    """A frame that cannot be read as a request; ``request_id`` when one could be read."""

    code = "protocol"

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class Rejected(PiwfError):
    """A well-formed request that cannot be carried out; nothing was changed."""

    code = "rejected"


class NotFound(PiwfError):
    code = "notFound"
    outcome = "notFound"


class Conflict(PiwfError):
    code = "conflict"
    outcome = "conflict"


class Stale(Conflict):
    """What a write was prepared from (outside its transaction: a settings patch checked in a
    throwaway process) changed before it committed, and the request did not ask for that
    state: the host prepares it again from the state as it is now, a few times, before it
    answers this conflict."""


# --- workflows -------------------------------------------------------------------------


class WorkflowError(PiwfError):
    code = "workflow"


class DefinitionError(WorkflowError):
    """A workflow graph that does not validate."""

    code = "definition"


class WorkflowLoadError(WorkflowError):
    """A workflow file that cannot be found or imported."""

    code = "load"


class Invalid(WorkflowError):
    """Raised by an ask's ``validate`` to refuse a submitted value; the message is the
    reason the person or agent sees, and the request is open again."""

    code = "invalid"


class NodeFailed(WorkflowError):
    """A node raised or (for shell nodes) exited non-zero; ``error`` describes it."""

    code = "nodeFailed"

    def __init__(self, message: str, error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = error or {"type": "NodeFailed", "message": message}


# --- controllers (raised by reconcile functions; see piwf.controllers) -----------------


class ControllerError(PiwfError):
    code = "controller"


class ControllerLoadError(ControllerError):
    """A controller file that cannot be found or imported, or defines no ``controller``."""

    code = "controllerLoad"


class TemporaryError(ControllerError):
    """Raised by a reconcile: try again after ``delay`` seconds (kopf's TemporaryError)."""

    code = "temporary"

    def __init__(self, message: str = "", delay: float = 60.0) -> None:
        super().__init__(message or f"temporary error; retry in {delay:g} s")
        if not 0 <= delay <= 86_400:
            raise ValueError("TemporaryError delay must be between 0 and 86400 seconds")
        self.delay = delay


class PermanentError(ControllerError):
    """Raised by a reconcile: do not retry until the resource's spec changes; its
    ``Ready`` condition says why (kopf's PermanentError)."""

    code = "permanent"


# --- host ------------------------------------------------------------------------------


class HostError(PiwfError):
    code = "host"


class HostAlreadyRunning(HostError):
    code = "hostRunning"
    exit_code = ExitCode.HOST_RUNNING


class StateDirError(HostError):
    """The state directory cannot be used as it is: a symlink, owned by someone else, a
    path too long for a socket, or something other than a socket at ``host/host.sock``."""

    code = "stateDir"
    exit_code = ExitCode.STATE_DIR


class HostUnavailable(HostError):
    """No host answers on the state directory's socket."""

    code = "unavailable"
    outcome = "unavailable"
    exit_code = ExitCode.NO_HOST


class HostTimeout(HostUnavailable):
    """The host did not answer within the client's timeout: it is frozen, overloaded, or
    busy with something slow (such as loading a workflow whose import hangs)."""

    code = "timeout"
    exit_code = ExitCode.TIMEOUT


class ServiceError(HostError):
    """Running as a service went wrong: a socket passed by the service manager that piwf
    cannot serve, a unit file piwf did not write in the way, a ``systemctl`` or
    ``launchctl`` command that failed."""

    code = "service"
    exit_code = ExitCode.SERVICE


# --- the command line ---------------------------------------------------------------------


class UsageError(PiwfError):
    """Bad arguments or a bad setting in the environment."""

    code = "usage"
    exit_code = ExitCode.USAGE


class HostReplied(PiwfError):
    """The host answered a request with an outcome other than accepted or adopted."""

    code = "reply"

    def __init__(self, outcome: str, error: str | None) -> None:
        super().__init__(f"{outcome}: {error or 'no reason given'}")
        self.outcome = outcome
        self.error = error
        self.exit_code = OUTCOME_EXIT.get(outcome, ExitCode.ERROR)


class InternalError(PiwfError):
    """An exception piwf did not expect: a bug, reported in one line like any other error."""

    code = "internal"
    exit_code = ExitCode.INTERNAL
