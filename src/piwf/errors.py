"""One error hierarchy for piwf.

Every error has a stable ``code``. Errors that reach a client over the host protocol
carry the wire outcome they map to (``rejected``, ``notFound``, ``conflict``, ...).
"""

from __future__ import annotations


class PiwfError(Exception):
    """Root of every error piwf raises on purpose."""

    code = "error"
    outcome = "rejected"
    exit_code = 1

    def __str__(self) -> str:
        text = super().__str__()
        return " ".join(text.split())  # one line, always


# --- store -----------------------------------------------------------------------------


class StoreError(PiwfError):
    code = "store"


class StorageFull(StoreError):
    """The disk (or the database's size limit) is full; the write changed nothing. Retry
    once space is freed: the host stays up meanwhile."""

    code = "storageFull"
    outcome = "unavailable"


class SchemaError(StoreError):
    """The database has an unknown or newer layout; it is refused and left untouched."""

    code = "schema"
    exit_code = 4


class CorruptStateError(StoreError):
    """The database file is not a readable SQLite database."""

    code = "corrupt"
    exit_code = 3


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


# --- workflows -------------------------------------------------------------------------


class WorkflowError(PiwfError):
    code = "workflow"


class DefinitionError(WorkflowError):
    """A workflow graph that does not validate."""

    code = "definition"


class WorkflowLoadError(WorkflowError):
    """A workflow file that cannot be found or imported."""

    code = "load"


class NodeFailed(WorkflowError):
    """A node raised or (for shell nodes) exited non-zero; ``error`` describes it."""

    code = "nodeFailed"

    def __init__(self, message: str, error: dict | None = None) -> None:
        super().__init__(message)
        self.error = error or {"type": "NodeFailed", "message": message}


# --- host ------------------------------------------------------------------------------


class HostError(PiwfError):
    code = "host"


class HostAlreadyRunning(HostError):
    code = "hostRunning"
    exit_code = 5


class StateDirError(HostError):
    code = "stateDir"


class HostUnavailable(HostError):
    """No host answers on the state directory's socket."""

    code = "unavailable"
    outcome = "unavailable"
