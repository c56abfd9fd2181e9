"""What the store hands the host that is the store's own: claims, the lease record, ends.

Every backend returns these; they carry no backend object (no connection, no cursor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, NamedTuple, Protocol

Actor = Literal["start", "client", "controller"]  # who changed a run's settings
Delay = int | Callable[[int], int]  # ms, or ms as a function of the failures in a row before this one


class CommandKey(Protocol):
    """What the command log (``CommandsStore``) reads of a write request: its ids, the
    operation and the run it names. The host's requests (``piwf.wire.HostRequest``, the
    typed ``piwf.protocol.Request``) are command keys; the store names neither. The
    fingerprint the log compares is the caller's (``piwf.wire.request_fingerprint``)."""

    @property
    def requestId(self) -> str: ...
    @property
    def clientId(self) -> str: ...
    @property
    def idempotencyKey(self) -> str: ...
    @property
    def operation(self) -> str: ...
    @property
    def runId(self) -> str | None: ...


@dataclass(frozen=True)
class RunFilter:
    """Which runs ``RunsStore.list_runs`` lists (every field narrows it; all: none set)."""

    status: str | None = None  # this engine status
    workflow: str | None = None  # this workflow's runs
    session: str | None = None  # runs started by this origin session
    since: int | None = None  # created at or after this time (ms)
    held: bool = False  # held for a person (crashed, effect, source), not a pause or a wait
    after: str | None = None  # the rows after this run in the listing's order (the cursor: the last run shown)


class Definition(NamedTuple):
    """A workflow as a run adopts it (``RunsStore.resume_run``, ``retry_run``): its digest,
    source and start node, and its graph (canonical JSON of ``piwf.protocol.WorkflowGraph``,
    which ``run.graph`` serves; None: not recorded)."""

    digest: str
    source: bytes
    start_node: str | None
    graph: bytes | None = None


@dataclass(frozen=True)
class NewScope:
    """A new run's settings scope, made with the run (``RunsStore.create_run``): its
    settings (change 0), the paths that may change, the patch the start request gave and
    who gave it."""

    settings: Any
    mutable: list[str]
    patch: Any = None
    actor_id: str | None = None


@dataclass(frozen=True)
class RunLaunch:
    """What a worker of a claimed run is launched with, read in the claim's transaction."""

    workflow: str
    project_path: str
    definition_digest: str
    input_hash: str  # ``rules.input_hash`` of the run's input


@dataclass(frozen=True)
class Claim:
    """A run's claim: the token every fenced write names, and the run's generation."""

    run_id: str
    token: str
    generation: int
    expires_at: int
    launch: RunLaunch | None = None  # set by ``claim_runs`` (the host's claims): no read per launch
    sessionless: bool = False  # ``claim_runs`` read that the run has no origin session (no run waits on its end)

    @property
    def label(self) -> str:  # what the host's logs call the claimed run
        return f"run {self.run_id}"

    @property
    def first(self) -> bool:
        """The run's first claim: no attempt of it exists yet (each is started under a claim,
        and every claim, a retry's included, takes the next generation)."""
        return self.generation == 1


@dataclass(frozen=True)
class HostClaim:
    """The host lease this host holds (``token`` proves it; ``epoch`` numbers it)."""

    host_id: str
    token: str
    epoch: int
    pid: int
    identity: str
    expires_at: int


@dataclass(frozen=True)
class LeaseRecord:
    """The host lease as stored: who holds it, since when, until when."""

    epoch: int
    host_id: str | None
    pid: int | None
    identity: str | None
    started_at: int | None
    heartbeat_at: int | None
    expires_at: int | None

    def live(self, now: int) -> bool:
        return self.host_id is not None and self.expires_at is not None and self.expires_at > now

    def as_json(self, now: int) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "hostId": self.host_id,
            "pid": self.pid,
            "startedAt": self.started_at,
            "heartbeatAt": self.heartbeat_at,
            "expiresAt": self.expires_at,
            "live": self.live(now),
        }


@dataclass(frozen=True)
class HostRecord:
    """A host holding a lease in the store (``HostsStore.live_hosts``, ``peers``): which state
    directory's, on which machine (``machine``: boot id and pid namespace, or
    ``$PIWF_BOOT_ID``), which process, and (``live_hosts``) what it is running."""

    directory: str
    epoch: int
    host_id: str
    machine: str | None
    pid: int | None
    identity: str | None
    started_at: int | None
    heartbeat_at: int | None
    expires_at: int | None
    active_runs: int = 0
    active_reconciles: int = 0
    standby: bool = False  # a `piwf serve --standby` waiting for its state directory's lock (no epoch, no claims)

    def as_json(self, now: int, *, this: bool = False, hostname: str | None = None) -> dict[str, Any]:
        """As ``host.status`` lists it (``LiveHost``), seen at ``now`` by the host ``this`` names."""
        return {
            "hostId": self.host_id, "epoch": self.epoch, "machine": self.machine, "pid": self.pid,
            "startedAt": self.started_at, "heartbeatAt": self.heartbeat_at, "expiresAt": self.expires_at,
            "heartbeatAgeMs": None if self.heartbeat_at is None else max(0, now - self.heartbeat_at),
            "activeRuns": self.active_runs, "activeReconciles": self.active_reconciles,
            "this": this, "hostname": hostname, "standby": self.standby,
        }


@dataclass(frozen=True)
class PeerRemains:
    """What a host proved dead left, for the host that won its clean-up to kill: its run
    workers (worker id, pid, identity; recorded orphaned by ``expire_peer_claims``), the
    process groups they registered, and its reconcile workers (resource uid, pid, identity)."""

    workers: list[tuple[str, int, str]]
    processes: list[tuple[str, int, str]]
    reconcilers: list[tuple[str, int, str]]


@dataclass(frozen=True)
class ControllerClaim:
    """A reconcile's claim on one resource."""

    uid: str
    token: str
    claim_number: int  # this claim's number (column claim_generation); the worker's messages carry it as `generation`
    project: str
    controller: str
    key: str

    @property
    def label(self) -> str:  # what the host's logs call the claimed resource
        return f"resource {self.controller}/{self.key}"


class WorkerEnded(NamedTuple):
    """What recording a worker's end found."""

    crashes: int  # in a row, this end included (0: it was no crash)
    waiting_again: bool  # its run waits for a person again: deadlines apply to it again
    not_before: int | None = None  # its run was parked with a back-off: not claimed before this (ms)


class Wakeup(StrEnum):
    """What another host sharing the store committed that this host may act on
    (``Store.announce``, ``Store.serve_wakeups``)."""

    RUNS = "runs"  # a run to claim: started, released, answered, resumed
    CONTROLLERS = "controllers"  # a resource due for a reconcile
    CHANGES = "changes"  # something a watcher (run.watch, run.wait) waits for
    DEADLINES = "deadlines"  # a request opened, or waits again: its deadline to keep
    CLAIMS = "claims"  # a claimed run was cancelled (or a resource deleted by force): its host checks its claims


class Pruned(NamedTuple):
    """One batch of retention (``RetentionStore.prune_runs``): the runs deleted, how many
    blobs went with them, and whether more runs are due."""

    runs: list[str]
    blobs: int
    more: bool
