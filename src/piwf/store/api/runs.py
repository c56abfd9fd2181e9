"""The run side of the store: the host lease, commands, runs, their queue, workers, effects.

Every method may also raise StorageUnavailable (StorageFull among them: retry once the
storage is healthy) and StoreError; the ones listed per method are the refusals it means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from piwf.protocol import EVENTS_PAGE, STEPS_PAGE
from piwf.store.api.rules import RETENTION_MS

if TYPE_CHECKING:
    from piwf.protocol import RunDetail, RunEventsPage, RunGraph, RunStepsPage, RunSummary
    from piwf.protocol.worker import WorkerMessage, WorkerResponse
    from piwf.status import WorkerStatus
    from piwf.store.api.types import (
        Claim, CommandKey, Definition, Delay, HostClaim, HostRecord, LeaseRecord, NewScope, PeerRemains,
        RunFilter, WorkerEnded,
    )
    from piwf.wire import HostResponse


class HostsStore(Protocol):
    """The host lease. SQLite: one lease row per state directory (``id = 1``); the flock on
    the state directory proves no other host runs there, so ``acquire_lease`` may take a live
    lease whose owner is proved dead (``owner_dead``). PostgreSQL: one lease row per host
    (per state directory, taken over the same way), and the epoch numbers hosts across the
    shared store; the conformance suite tests the lease with both. The lease epoch is what
    every other method's ``epoch`` argument names.
    """

    async def read_lease(self) -> LeaseRecord:
        """Raises StoreError."""

    async def acquire_lease(
            self, *, host_id: str, pid: int, identity: str, lease_ms: int, now: int, owner_dead: bool = False,
    ) -> HostClaim:
        """Take the lease with a new epoch. Raises HostAlreadyRunning, StoreError."""

    async def renew_lease(self, claim: HostClaim, lease_ms: int, now: int) -> HostClaim | None:
        """Extend the lease; None when it was lost (taken by another host). SchemaError
        (PostgreSQL) when another host has migrated the shared store to a newer layout than
        this piwf knows: the host stops."""

    async def release_lease(self, claim: HostClaim) -> bool:
        ...

    async def live_hosts(self, now: int) -> list[HostRecord]:
        """The hosts sharing the store whose lease is live at ``now``, with the runs and
        reconciles each holds a live claim on, by epoch, then the standbys recorded and not
        expired (``standby``). SQLite: its one host (or none); its standbys are files."""

    async def record_standby(self, *, pid: int, identity: str, lease_ms: int, now: int) -> None:
        """A standby of this state directory waits for its lock: say so until ``now +
        lease_ms`` (renewed while it waits). SQLite: nothing (``piwf status`` reads the
        standbys' files)."""

    async def forget_standby(self, pid: int) -> None:
        """The standby ``pid`` stopped waiting (it took over, or stopped)."""

    async def peers(self) -> list[HostRecord]:
        """Every other host holding a lease (expired or not; no counts): one read, for a
        host looking for peers on its machine to prove dead. SQLite: none."""

    async def take_over_peer(self, peer: HostRecord, now: int) -> PeerRemains | None:
        """Mark ``peer`` dead (proved so by its caller, on the same machine): one fenced
        write on its epoch, pid and identity that ends its lease now (its token cleared, so
        no renewal of it succeeds). None when the row has moved on (released, restarted,
        taken over by another host: one host wins); else what the winner is to kill. Its
        claims stay until ``expire_peer_claims``, so nothing of it is claimed again before
        its workers are dead."""

    async def expire_peer_claims(self, epoch: int, now: int) -> tuple[list[str], int]:
        """After ``take_over_peer`` and the kill: the run and reconcile claims of dead epoch
        ``epoch`` expire now (the runs' ids, the reconciles' count), to be claimed again at
        once, and its workers still recorded active are recorded orphaned."""


class CommandsStore(Protocol):
    """The idempotent command log. A write request is carried out as one unit of work::

        async with store.transaction() as tx:
            stored = await tx.commands.lookup(request, fingerprint)
            if stored is None:
                response = ...  # the operation's calls on tx
                await tx.commands.record(request, fingerprint, response, epoch, now)
    """

    async def lookup(self, request: CommandKey, fingerprint: bytes) -> HostResponse | None:
        """A stored response for this request (``adopted``), a ``conflict``, or None if new."""

    async def record(
            self, request: CommandKey, fingerprint: bytes, response: HostResponse, epoch: int,
            now: int) -> None:
        """Record a write request's answer; call inside the unit of work that made its change (after ``lookup``
        found none). A request id or key recorded meanwhile: ConstraintViolation. Raises
        ConstraintViolation.
        """

    async def prune(self, now: int, retention_ms: int = RETENTION_MS) -> int:
        ...


class RunsStore(Protocol):
    """Runs: creation, revisions, operator holds, node attempts (fenced by the claim
    ``token``), and reads, each from one snapshot.
    """

    async def create_run(
            self, *, run_id: str, workflow: str, project_path: str, source: bytes, digest: str, input: Any,
            origin_session_id: str | None, now: int, start_node: str | None = None,
            settings: NewScope | None = None, graph: bytes | None = None, queue: str = "default") -> dict[str, Any]:
        """A new run, queued on the named ``queue``, with its settings scope (``settings``, for a workflow that
        declares settings) and its workflow's graph (``graph``, canonical JSON of a ``WorkflowGraph``, which
        ``run_graph`` serves): the one way a run is made, by ``run.start`` and by a controller's
        ``ctx.workflows.ensure`` alike. Raises Rejected."""

    async def revision(self, run_id: str) -> int:
        """Raises NotFound."""

    async def check_revision(self, run_id: str, expected: int | None) -> int:
        """The run's revision if it is ``expected`` (None: any), checked by a write (a guard of the run that holds
        for the rest of the unit of work). Raises NotFound, Conflict."""

    async def pause_run(self, run_id: str, now: int, *, expected_revision: int | None = None) -> dict[str, Any]:
        """Hold a run: it is not claimed again, and an active worker stops at the next node boundary.
        ``expected_revision`` (None: any) is a compare-and-set on the run's revision, checked by the write itself,
        as is the run not having ended. Raises NotFound, Conflict, Rejected (in that order of checking).
        """

    async def resume_run(
            self, run_id: str, now: int, *, definition: Definition | None = None,
            expected_revision: int | None = None) -> dict[str, Any]:
        """Release a held run, its crash count and crash back-off cleared. ``definition`` (digest, source, start
        node, graph) replaces the run's workflow definition: resuming a run held because its workflow changed adopts
        the new one — only while it is still held so (``hold = 'source'``; Conflict if it was resumed
        meanwhile). ``expected_revision`` as for ``pause_run``; every condition is checked by the write itself.
        Raises NotFound, Conflict, Rejected.
        """

    async def retry_run(
            self, run_id: str, now: int, *, actor: str, expected_revision: int | None = None,
            definition: Definition | None = None) -> dict[str, Any]:
        """A failed or timed-out run queued again as the same run (engine and queue ``queued``, a new generation,
        no error): its accepted steps, applied effects and closed requests stay; its rejected effects are pending
        again; a controller following it sees it running; its trace says ``actor`` retried it; ``definition``
        (digest, source, start node) is the workflow it continues with (as for ``resume_run``). Every condition
        is checked by the write itself. Raises NotFound, Conflict (``expected_revision``), Rejected (any other
        status, or its session has another active run).
        """

    async def hold_of(self, run_id: str) -> str | None:
        ...

    async def is_paused(self, run_id: str) -> bool:
        ...

    async def start_attempt(
            self, run_id: str, token: str, *, seq: int, node: str, generation: int, now: int) -> tuple[str, int]:
        """Raises ClaimLost."""

    async def begin_attempt(
            self, run_id: str, token: str, *, seq: int, node: str, generation: int,
            now: int) -> tuple[str, int, int | None]:
        """``start_attempt``, and the settings change number the attempt started under (None: its run has
        no settings; ``settings.attempt_settings`` would answer (None, None)). Raises ClaimLost."""

    async def accept_attempt(
            self, run_id: str, token: str, *, attempt_id: str, output: Any, exit_name: str | None, now: int,
            waiting: bool = False) -> int:
        """Accept a running attempt's output (``waiting``: a waiting attempt's, whose request's submission was
        validated as ``output``). Raises ClaimLost, Rejected.
        """

    async def fail_attempt(self, run_id: str, token: str, *, attempt_id: str, error: dict[str, Any], now: int) -> int:
        """Raises ClaimLost, Rejected."""

    async def accepted_steps(
            self, run_id: str, after_seq: int = -1, budget: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Accepted steps after ``after_seq``, in order, whose outputs add up to at most ``budget`` bytes
        (always at least one); and whether more remain.
        """

    async def ready_state(self, run_id: str) -> tuple[Any, str | None, bool, str]:
        """(input, start node, paused, definition digest) for a worker reporting ready, from one read of the
        run. The start node is the one its workflow named when the run was created. Raises NotFound.
        """

    async def run_source(self, run_id: str) -> tuple[str, str, str, Any, str | None]:
        """(workflow, project path, digest, input, origin session) for launching a worker. Raises NotFound."""

    async def get_run(self, run_id: str, now: int = 0) -> RunDetail:
        """One run with its steps, workers and effects, read from one snapshot. Raises NotFound."""

    async def run_graph(self, run_id: str) -> RunGraph:
        """The graph of the workflow the run executes as recorded for it (unknown for a run made before layout
        14), each node's state in the run, and its path, from one snapshot; its cost follows the run's size,
        not the runs stored. Raises NotFound."""

    async def run_steps(self, run_id: str, offset: int = 0, limit: int = STEPS_PAGE) -> RunStepsPage:
        """The run's attempts from ``offset`` on, in order, with outputs and errors: at most ``limit``, whose
        outputs add up to at most STEPS_PAGE_OUTPUT_BYTES (always at least one); ``next`` when more remain.
        Raises NotFound."""

    async def run_summary(self, run_id: str) -> RunSummary:
        """The status fields of one run, without its input, output or steps. Raises NotFound."""

    async def list_runs(self, limit: int = 50, status: str | None = None,
                        where: RunFilter | None = None) -> list[RunSummary]:
        """At most ``limit`` runs, newest first (created at, then run id, descending), with
        ``status`` (kept for callers of old) and the ``where`` filter. Each filter is served
        by an index, so a page costs about the same at 100,000 runs as at 100. Raises
        NotFound when ``where.after`` names no run."""

    async def run_events(self, run_id: str, after: int = 0, limit: int = EVENTS_PAGE) -> RunEventsPage:
        """Events after ``after``, at most ``limit``; ``nextAfter`` set when more remain. Raises NotFound."""

    async def status_counts(self, now: int) -> dict[str, int]:
        """Run counts for host.status, from one snapshot. They cost the same however many runs have ever been
        stored: the counts are kept as runs change (layout 4, RUN_COUNTS_SQL), and expired claims are found
        through run_queue's (status, claim_expires_at) index.
        """


class QueueStore(Protocol):
    """The run queue: claims renewed, fenced, parked, ended. Every method given a
    ``token`` acts only under that live claim. ``fenced_revision`` is the fence that opens a
    worker message's unit of work: it holds the claim for the rest of it (SQLite: the write
    lock of ``BEGIN IMMEDIATE``; PostgreSQL: the row's lock). A ``worker.ready``, checked
    against no revision, is fenced by ``mark_running`` instead, its first write.
    """

    async def fenced_revision(self, run_id: str, token: str, now: int) -> int:
        """The run's revision, read under its live claim; ClaimLost otherwise. Raises ClaimLost."""

    async def revision_of(self, run_id: str) -> int | None:
        """The run's revision, None for an unknown run."""

    async def expire_claims_before(self, epoch: int, now: int) -> list[str]:
        """On takeover: claims held by earlier epochs are dead; make their runs claimable now."""

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        """Renew many live claims in one transaction; returns the run ids whose claim was lost."""

    async def mark_running(self, run_id: str, token: str, now: int) -> bool:
        """``starting → running``; False if it was running already. Fenced by the claim. Raises ClaimLost."""

    async def park_run(
            self, run_id: str, token: str, now: int, *, hold: str | None = None, detail: str | None = None) -> bool:
        """Release a live claim, leaving the run for the next claim."""

    async def complete_run(self, run_id: str, token: str, output: Any, now: int) -> int:
        """Settle a run as completed; returns its new revision. Raises ClaimLost, Conflict."""

    async def fail_run(self, run_id: str, token: str, error: dict[str, Any], now: int) -> int:
        """Raises ClaimLost, Conflict."""

    async def cancel_run(
            self, run_id: str, now: int, *, token: str | None = None, runner_id: str | None = None,
            any_claim: bool = False, expected_revision: int | None = None) -> bool:
        """Cancel a run. Without a token only unclaimed runs (queued, parked) can be cancelled, with
        ``runner_id`` also a run whose live claim that runner holds, and with ``any_claim`` a run whose live
        claim any runner holds (its host learns of it: ``Wakeup.CLAIMS``, or its next renewal, finds the claim
        gone); False when the run cannot be cancelled so.
        ``expected_revision`` (None: any) is a compare-and-set on the run's revision, checked in the same write.
        Raises NotFound (an unknown run), Conflict (another revision).
        """


class SupervisionStore(Protocol):
    """The dispatcher's and supervisors' operations, each one commit."""

    async def claim_runs(
            self, *, room: int, exclude: frozenset[str], runner_id: str, lease_ms: int, now: int, epoch: int,
            queues: tuple[str, ...] = ("default",),
    ) -> list[tuple[Claim, str]]:
        """Claim up to ``room`` runs of the named ``queues``, oldest first, none in ``exclude``, none before its
        crash back-off ends (``end_worker``) and none that ``runner_id`` recorded it cannot load
        (``PlacementStore.release_unloadable``), each with a fresh token and a worker record (its worker id): one
        transaction, one commit.
        """

    async def end_worker(
            self, *, worker_id: str, run_id: str, token: str, status: WorkerStatus, now: int,
            exit_code: int | None, signal: int | None, diagnostic: str | None, park: bool, max_crashes: int,
            last_output: str = '', backoff: Delay | None = None, answers: bool = True) -> WorkerEnded:
        """Record how a worker ended and, with ``park``, release its run's claim. A crash is counted on the run
        (durably: a run that keeps killing what runs it is held however often the host restarts); the
        ``max_crashes``-th in a row holds it with the worker's last output. ``backoff`` is how long the parked
        run waits before any host may claim it again, kept with the run (its ``not_before``, set in this
        transaction; ``claim_runs`` skips it until then): ms, or ms as a function of the crashes in a row
        before this one (applied only after a crash that does not hold the run); None: at once. Once the run
        has ended, the answers stored for its ended workers are deleted (``answers`` False: the caller knows
        none was stored, so none is looked for). Returns the run's crashes in a row
        (0 when this end was no crash), whether its run waits for a person again (the worker was validating
        a submission), and the ``not_before`` it was parked with.
        """


class PlacementStore(Protocol):
    """Which host may claim which run (store/sql/placement.py): the queues each host serves, and
    the runs a host claimed and could not load (its later claims pass them over). A run that
    every live host of its queue has recorded is held (hold ``source``); ``settle`` keeps that
    true as hosts come and go.
    """

    async def serve_queues(self, host_id: str, queues: tuple[str, ...], now: int) -> None:
        """Record the queues host ``host_id`` serves (call once its lease is taken); forget those of hosts
        holding no lease row any more."""

    async def release_unloadable(
            self, run_id: str, token: str, *, host_id: str, reason: str, source_hash: str | None, now: int) -> bool:
        """The claimed run's workflow cannot be loaded by ``host_id``: release the claim, record it with
        ``reason`` and the hash of the file it saw (None: none), and hold the run when no live host of its
        queue is left to try it; whether it was held. Raises ClaimLost."""

    async def settle(self, now: int) -> list[str]:
        """Release held runs a live host of their queue has not tried, hold those none can load, forget the
        records of hosts gone and runs ended; the ids of the runs released."""

    async def own_records(self, host_id: str) -> list[tuple[str, str, str, str | None]]:
        """(run id, project path, workflow, source hash) of the runs ``host_id`` recorded it cannot load."""

    async def forget(self, host_id: str, run_ids: list[str]) -> int:
        """Forget ``host_id``'s records of ``run_ids`` (the file it saw changed); how many there were."""


class WorkersStore(Protocol):
    """Worker records, their answered messages, and the process groups they registered.
    A worker message is one unit of work: ``queue.fenced_revision`` (the fence), the
    revision check, the handler's calls, then ``record_message`` of the worker's previous
    answer (the host keeps the latest until the next message; none in the unit that ends
    the run with the worker's end, which deletes them).
    """

    async def read_message(self, message: WorkerMessage) -> WorkerResponse | None:
        """The stored answer to a repeated message id (or a rejection if its body changed)."""

    async def record_message(self, message: WorkerMessage, response: WorkerResponse, now: int) -> None:
        """Record an answer; call inside the transaction that made the message's change."""

    async def prune_messages(self, batch: int = 500) -> int:
        """Delete the answers of up to ``batch`` ended workers of ended runs (those ``forget_messages`` missed:
        runs that ended while no worker of theirs was recorded ending, and answers stored before layout 4).
        Returns how many answers were deleted; call again until it returns 0.
        """

    async def mark_ready(
            self, worker_id: str, now: int, *, pid: int | None = None, identity: str | None = None) -> None:
        """The worker reported ready (once: a second time changes nothing); with ``pid`` and
        its start ``identity``, its process is recorded in the same write, as
        ``attach_process`` records it (the host records it so: one write per worker less)."""
        ...

    async def attach_process(self, worker_id: str, pid: int, identity: str) -> None:
        ...

    async def amend_end(self, *, worker_id: str, run_id: str, status: WorkerStatus, now: int, exit_code: int | None,
                        signal: int | None, diagnostic: str | None) -> bool:
        """A worker whose end was recorded as ``exited`` by ``supervision.end_worker`` in the
        unit of work that ended its run (before its process exited, exit code 0 presumed)
        ended otherwise: record how (its status, exit code or signal, output) and a
        ``worker.amended`` event. False (nothing changed) unless its record says exited."""
        ...

    async def orphan_before(self, host_epoch: int, now: int) -> list[tuple[str, int, str]]:
        """Mark workers of earlier host epochs orphaned; returns (worker id, pid, identity) to reap."""

    async def orphaned_processes(self, host_epoch: int) -> list[tuple[str, int, str]]:
        """Registered processes of workers started by earlier host epochs, still marked live."""

    async def register_process(
            self, *, worker_id: str, run_id: str, pid: int, identity: str, node: str | None, now: int) -> None:
        """Conflict when that process (pid and identity) is registered live to another worker."""

    async def unregister_process(self, worker_id: str, pid: int, now: int) -> bool:
        """Whether ``pid`` was registered live to this worker."""

    async def live_processes(self, worker_ids: list[str]) -> list[tuple[str, int, str]]:
        """(worker id, pid, identity) of registered processes not yet known to be gone."""

    async def mark_processes_gone(self, rows: list[tuple[str, int, str]], now: int) -> None:
        ...


class EffectsStore(Protocol):
    """A run's effect ledger; ``generation`` is the claim's, fencing a reserve or settle
    to the worker that holds it.
    """

    async def reserve(
            self, run_id: str, key: str, *, node: str, generation: int, observable: bool, now: int) -> dict[str, Any]:
        """What a node calling ``ctx.effect(key, ...)`` must do next. Raises Rejected."""

    async def begin_apply(self, run_id: str, key: str, *, generation: int, now: int) -> None:
        """``pending → applying``, recorded before ``apply()`` runs. After an observation that found nothing
        applied, the effect is already ``applying`` for this generation. Raises Rejected.
        """

    async def settle(
            self, run_id: str, key: str, *, generation: int, result: Any = None, error: dict[str, Any] | None = None,
            now: int) -> None:
        """``applying → applied`` (with its JSON result) or ``→ rejected`` (with its error). Raises Rejected."""

    async def interrupted_before(self, run_id: str, generation: int, now: int) -> list[str]:
        """Mark ambiguous the effects an earlier generation left ``applying``."""

    async def resolve(self, run_id: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        """An operator says whether an ambiguous effect was applied; the run's effect hold is released once no
        ambiguous effect is left. Raises NotFound, Rejected.
        """
