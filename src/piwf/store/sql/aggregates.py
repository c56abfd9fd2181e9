"""The aggregates of both backends: each method calls the named function of its module
through the backend's ``Runner``, which supplies the ``Database`` the function runs on.

SQLite's runner (``Inline``) calls it on the trio loop at once (no thread hop, no statement
of its own): what a method costs over the function is two coroutines. PostgreSQL's
(``piwf.store.postgres.runner``) runs it in a worker thread on the connection of the open
unit of work, or on one taken from its pool for that call, shielded from cancellation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from piwf.protocol import EVENTS_PAGE, STEPS_PAGE
from piwf.store.api.retention import BLOB_SWEEP, PRUNE_BATCH
from piwf.store.api.rules import RETENTION_MS
from piwf.store.sql import commands as _commands
from piwf.store.sql import runs as _runs
from piwf.store.sql import run_detail
from piwf.store.sql import graph as _graph
from piwf.store.sql import retry as _retry
from piwf.store.sql import retention as _retention
from piwf.store.sql import base as _base
from piwf.store.sql import queue as _queue
from piwf.store.sql import placement as _placement
from piwf.store.sql import supervision as _supervision
from piwf.store.sql import workers as _workers
from piwf.store.sql import effects as _effects
from piwf.store.sql import interactions as _interactions
from piwf.store.sql import deadlines as _deadlines
from piwf.store.sql import delivery as _delivery
from piwf.store.sql import updates as _updates
from piwf.store.sql import settings as _settings
from piwf.store.sql import listing

if TYPE_CHECKING:
    from piwf.store import api
    from piwf.protocol import (
        AnswerReceipt, ChangeSettingsReceipt, DeliverReceipt, FollowUpPage, FollowUpReceipt, InteractionRequest,
        Notification, NotificationClaim, ResolveTurnReceipt, RunDetail, RunEventsPage, RunGraph, RunSettings,
        RunStepsPage, RunSummary, SubmitReceipt, Turn, TurnClaim, UpdateAction, UpdateReceipt, WatchPage,
    )
    from piwf.protocol.worker import InteractionOpenPayload, PendingSubmission, WorkerMessage, WorkerResponse
    from piwf.status import NotificationKind, TurnResolution, WorkerStatus
    from piwf.store.api.types import (
        Actor, Claim, CommandKey, Definition, Delay, NewScope, Pruned, WorkerEnded,
    )
    from piwf.store.api.types import RunFilter
    from piwf.wire import HostResponse

from piwf.store.sql.controller_aggregates import (
    ControllerEffectsAggregate, ControllerQueueAggregate, ControllersAggregate,
)
from piwf.store.sql.runner import Runner


class CommandsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def lookup(self, request: CommandKey, fingerprint: bytes) -> HostResponse | None:
        return await self.call(_commands.lookup, request, fingerprint)

    async def record(
            self, request: CommandKey, fingerprint: bytes, response: HostResponse, epoch: int,
            now: int) -> None:
        return await self.call(_commands.record, request, fingerprint, response, epoch, now)

    async def prune(self, now: int, retention_ms: int = RETENTION_MS) -> int:
        return await self.call(_commands.prune, now, retention_ms)


class RunsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def create_run(
            self, *, run_id: str, workflow: str, project_path: str, source: bytes, digest: str, input: Any,
            origin_session_id: str | None, now: int, start_node: str | None = None,
            settings: NewScope | None = None, graph: bytes | None = None, queue: str = "default") -> dict[str, Any]:
        return await self.call(
            _runs.create_run, run_id=run_id, workflow=workflow, project_path=project_path, source=source, digest=digest,
            input=input, origin_session_id=origin_session_id, now=now, start_node=start_node, settings=settings,
            graph=graph, queue=queue)

    async def revision(self, run_id: str) -> int:
        return await self.call(_runs.revision, run_id)

    async def check_revision(self, run_id: str, expected: int | None) -> int:
        return await self.call(_runs.check_revision, run_id, expected)

    async def pause_run(self, run_id: str, now: int, *, expected_revision: int | None = None) -> dict[str, Any]:
        return await self.call(_runs.pause_run, run_id, now, expected_revision=expected_revision)

    async def resume_run(
            self, run_id: str, now: int, *, definition: Definition | None = None,
            expected_revision: int | None = None) -> dict[str, Any]:
        return await self.call(
            _runs.resume_run, run_id, now, definition=definition, expected_revision=expected_revision)

    async def retry_run(
            self, run_id: str, now: int, *, actor: str, expected_revision: int | None = None,
            definition: Definition | None = None) -> dict[str, Any]:
        return await self.call(_retry.retry_run, run_id, now, actor=actor, expected_revision=expected_revision,
                               definition=definition)

    async def hold_of(self, run_id: str) -> str | None:
        return await self.call(_runs.hold_of, run_id)

    async def is_paused(self, run_id: str) -> bool:
        return await self.call(_runs.is_paused, run_id)

    async def start_attempt(
            self, run_id: str, token: str, *, seq: int, node: str, generation: int, now: int) -> tuple[str, int]:
        return await self.call(_runs.start_attempt, run_id, token, seq=seq, node=node, generation=generation, now=now)

    async def begin_attempt(
            self, run_id: str, token: str, *, seq: int, node: str, generation: int,
            now: int) -> tuple[str, int, int | None]:
        return await self.call(_runs.begin_attempt, run_id, token, seq=seq, node=node, generation=generation, now=now)

    async def accept_attempt(
            self, run_id: str, token: str, *, attempt_id: str, output: Any, exit_name: str | None, now: int,
            waiting: bool = False) -> int:
        return await self.call(
            _runs.accept_attempt, run_id, token, attempt_id=attempt_id, output=output, exit_name=exit_name, now=now,
            waiting=waiting)

    async def fail_attempt(self, run_id: str, token: str, *, attempt_id: str, error: dict[str, Any], now: int) -> int:
        return await self.call(_runs.fail_attempt, run_id, token, attempt_id=attempt_id, error=error, now=now)

    async def accepted_steps(
            self, run_id: str, after_seq: int = -1, budget: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        return await self.call(_runs.accepted_steps, run_id, after_seq, budget)

    async def ready_state(self, run_id: str) -> tuple[Any, str | None, bool, str]:
        return await self.call(_runs.ready_state, run_id)

    async def run_source(self, run_id: str) -> tuple[str, str, str, Any, str | None]:
        return await self.call(_runs.run_source, run_id)

    async def get_run(self, run_id: str, now: int = 0) -> RunDetail:
        return await self.call(run_detail.get_run, run_id, now)

    async def run_graph(self, run_id: str) -> RunGraph:
        return await self.call(_graph.run_graph, run_id)

    async def run_steps(self, run_id: str, offset: int = 0, limit: int = STEPS_PAGE) -> RunStepsPage:
        return await self.call(_graph.run_steps, run_id, offset, limit)

    async def run_summary(self, run_id: str) -> RunSummary:
        return await self.call(_runs.run_summary, run_id)

    async def list_runs(self, limit: int = 50, status: str | None = None,
                        where: RunFilter | None = None) -> list[RunSummary]:
        return await self.call(listing.list_runs, limit, status, where)

    async def run_events(self, run_id: str, after: int = 0, limit: int = EVENTS_PAGE) -> RunEventsPage:
        return await self.call(_runs.run_events, run_id, after, limit)

    async def status_counts(self, now: int) -> dict[str, int]:
        return await self.call(_runs.status_counts, now)


class QueueAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def fenced_revision(self, run_id: str, token: str, now: int) -> int:
        return await self.call(_queue.fenced_revision, run_id, token, now)

    async def revision_of(self, run_id: str) -> int | None:
        return await self.call(_base.revision_of, run_id)

    async def expire_claims_before(self, epoch: int, now: int) -> list[str]:
        return await self.call(_queue.expire_claims_before, epoch, now)

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        return await self.call(_queue.renew_claims, claims, lease_ms, now)

    async def mark_running(self, run_id: str, token: str, now: int) -> bool:
        return await self.call(_queue.mark_running, run_id, token, now)

    async def park_run(
            self, run_id: str, token: str, now: int, *, hold: str | None = None, detail: str | None = None) -> bool:
        return await self.call(_queue.park_run, run_id, token, now, hold=hold, detail=detail)

    async def complete_run(self, run_id: str, token: str, output: Any, now: int) -> int:
        return await self.call(_queue.complete_run, run_id, token, output, now)

    async def fail_run(self, run_id: str, token: str, error: dict[str, Any], now: int) -> int:
        return await self.call(_queue.fail_run, run_id, token, error, now)

    async def cancel_run(
            self, run_id: str, now: int, *, token: str | None = None, runner_id: str | None = None,
            any_claim: bool = False, expected_revision: int | None = None) -> bool:
        return await self.call(_queue.cancel_run, run_id, now, token=token, runner_id=runner_id,
                               any_claim=any_claim, expected_revision=expected_revision)


class SupervisionAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def claim_runs(
            self, *, room: int, exclude: frozenset[str], runner_id: str, lease_ms: int, now: int, epoch: int,
            queues: tuple[str, ...] = ("default",),
    ) -> list[tuple[Claim, str]]:
        return await self.call(
            _supervision.claim_runs, room=room, exclude=exclude, runner_id=runner_id, lease_ms=lease_ms, now=now,
            epoch=epoch, queues=queues)

    async def end_worker(
            self, *, worker_id: str, run_id: str, token: str, status: WorkerStatus, now: int,
            exit_code: int | None, signal: int | None, diagnostic: str | None, park: bool, max_crashes: int,
            last_output: str = '', backoff: Delay | None = None, answers: bool = True) -> WorkerEnded:
        return await self.call(
            _supervision.end_worker, worker_id=worker_id, run_id=run_id, token=token, status=status, now=now,
            exit_code=exit_code, signal=signal, diagnostic=diagnostic, park=park, max_crashes=max_crashes,
            last_output=last_output, backoff=backoff, answers=answers)


class PlacementAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def serve_queues(self, host_id: str, queues: tuple[str, ...], now: int) -> None:
        return await self.call(_placement.serve_queues, host_id, queues, now)

    async def release_unloadable(
            self, run_id: str, token: str, *, host_id: str, reason: str, source_hash: str | None, now: int) -> bool:
        return await self.call(_placement.release_unloadable, run_id, token, host_id=host_id, reason=reason,
                               source_hash=source_hash, now=now)

    async def settle(self, now: int) -> list[str]:
        return await self.call(_placement.settle, now)

    async def own_records(self, host_id: str) -> list[tuple[str, str, str, str | None]]:
        return await self.call(_placement.own_records, host_id)

    async def forget(self, host_id: str, run_ids: list[str]) -> int:
        return await self.call(_placement.forget, host_id, run_ids)


class WorkersAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def read_message(self, message: WorkerMessage) -> WorkerResponse | None:
        return await self.call(_workers.read_message, message)

    async def record_message(self, message: WorkerMessage, response: WorkerResponse, now: int) -> None:
        return await self.call(_workers.record_message, message, response, now)

    async def prune_messages(self, batch: int = 500) -> int:
        return await self.call(_workers.prune_messages, batch)

    async def mark_ready(
            self, worker_id: str, now: int, *, pid: int | None = None, identity: str | None = None) -> None:
        return await self.call(_workers.mark_ready, worker_id, now, pid=pid, identity=identity)

    async def attach_process(self, worker_id: str, pid: int, identity: str) -> None:
        return await self.call(_workers.attach_process, worker_id, pid, identity)

    async def amend_end(self, *, worker_id: str, run_id: str, status: WorkerStatus, now: int, exit_code: int | None,
                        signal: int | None, diagnostic: str | None) -> bool:
        return await self.call(_workers.amend_end, worker_id, run_id, status, now, exit_code=exit_code,
                               signal=signal, diagnostic=diagnostic)

    async def orphan_before(self, host_epoch: int, now: int) -> list[tuple[str, int, str]]:
        return await self.call(_workers.orphan_before, host_epoch, now)

    async def orphaned_processes(self, host_epoch: int) -> list[tuple[str, int, str]]:
        return await self.call(_workers.orphaned_processes, host_epoch)

    async def register_process(
            self, *, worker_id: str, run_id: str, pid: int, identity: str, node: str | None, now: int) -> None:
        return await self.call(
            _workers.register_process, worker_id=worker_id, run_id=run_id, pid=pid, identity=identity, node=node,
            now=now)

    async def unregister_process(self, worker_id: str, pid: int, now: int) -> bool:
        return await self.call(_workers.unregister_process, worker_id, pid, now)

    async def live_processes(self, worker_ids: list[str]) -> list[tuple[str, int, str]]:
        return await self.call(_workers.live_processes, worker_ids)

    async def mark_processes_gone(self, rows: list[tuple[str, int, str]], now: int) -> None:
        return await self.call(_workers.mark_processes_gone, rows, now)


class EffectsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def reserve(
            self, run_id: str, key: str, *, node: str, generation: int, observable: bool, now: int) -> dict[str, Any]:
        return await self.call(
            _effects.reserve, run_id, key, node=node, generation=generation, observable=observable, now=now)

    async def begin_apply(self, run_id: str, key: str, *, generation: int, now: int) -> None:
        return await self.call(_effects.begin_apply, run_id, key, generation=generation, now=now)

    async def settle(
            self, run_id: str, key: str, *, generation: int, result: Any = None, error: dict[str, Any] | None = None,
            now: int) -> None:
        return await self.call(_effects.settle, run_id, key, generation=generation, result=result, error=error, now=now)

    async def interrupted_before(self, run_id: str, generation: int, now: int) -> list[str]:
        return await self.call(_effects.interrupted_before, run_id, generation, now)

    async def resolve(self, run_id: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        return await self.call(_effects.resolve, run_id, key, applied=applied, result=result, now=now)


class InteractionsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def open_request(self, run_id: str, token: str, payload: InteractionOpenPayload, now: int) -> str:
        return await self.call(_interactions.open_request, run_id, token, payload, now)

    async def waiting_attempt(
            self, run_id: str, seq: int, node: str, now: int) -> tuple[str, PendingSubmission | None] | None:
        return await self.call(_interactions.waiting_attempt, run_id, seq, node, now)

    async def park_again(self, run_id: str, token: str, now: int) -> None:
        return await self.call(_interactions.park_again, run_id, token, now)

    async def accept_submission(self, run_id: str, submission_id: str, value: Any, now: int) -> None:
        return await self.call(_interactions.accept_submission, run_id, submission_id, value, now)

    async def reject_submission(self, run_id: str, token: str, submission_id: str, error: str, now: int) -> None:
        return await self.call(_interactions.reject_submission, run_id, token, submission_id, error, now)

    async def answer_decision(
            self, *, request_id: str, choice: str, text: str | None, answered_by: str, expected_revision: int | None,
            now: int) -> AnswerReceipt:
        return await self.call(
            _interactions.answer_decision, request_id=request_id, choice=choice, text=text, answered_by=answered_by,
            expected_revision=expected_revision, now=now)

    async def submit(
            self, *, request_id: str, value: Any, session_id: str | None, submitted_by: str,
            expected_revision: int | None, now: int) -> SubmitReceipt:
        return await self.call(
            _interactions.submit, request_id=request_id, value=value, session_id=session_id, submitted_by=submitted_by,
            expected_revision=expected_revision, now=now)

    async def update(
            self, *, request_id: str, expected_revision: int, action: UpdateAction, client_id: str,
            entry_id: str | None, progress: str | None, lease_ms: int, now: int) -> UpdateReceipt:
        return await self.call(
            _interactions.update, request_id=request_id, expected_revision=expected_revision, action=action,
            client_id=client_id,
            entry_id=entry_id, progress=progress, lease_ms=lease_ms, now=now)

    async def expire_due(self, now: int) -> tuple[list[str], list[tuple[str, Exception]]]:
        return await self.call(_deadlines.expire_due, now)

    async def next_deadline(self) -> int | None:
        return await self.call(_deadlines.next_deadline)

    async def list_requests(
            self, *, session_id: str | None = None, run_id: str | None = None, open_only: bool = True,
            limit: int = 100, now: int) -> list[InteractionRequest]:
        return await self.call(
            _interactions.list_requests, session_id=session_id, run_id=run_id, open_only=open_only, limit=limit,
            now=now)


class DeliveryAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def notify(
            self, run_id: str, token: str, *, attempt_id: str, index: int, kind: NotificationKind, content: str,
            now: int) -> str | None:
        return await self.call(
            _delivery.notify, run_id, token, attempt_id=attempt_id, index=index, kind=kind, content=content, now=now)

    async def request_presentation(self, run_id: str, token: str, *, instructions: str, now: int) -> str | None:
        return await self.call(_delivery.request_presentation, run_id, token, instructions=instructions, now=now)

    async def claim_notification(
            self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> NotificationClaim:
        return await self.call(
            _delivery.claim_notification, session_id=session_id, client_id=client_id, lease_ms=lease_ms, now=now)

    async def deliver_notification(
            self, *, notification_id: str, claim_id: str, client_id: str, now: int) -> DeliverReceipt:
        return await self.call(
            _delivery.deliver_notification, notification_id=notification_id, claim_id=claim_id, client_id=client_id,
            now=now)

    async def list_notifications(
            self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Notification]:
        return await self.call(_delivery.list_notifications, session_id=session_id, run_id=run_id, limit=limit, now=now)

    async def claim_turn(self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> TurnClaim:
        return await self.call(
            _delivery.claim_turn, session_id=session_id, client_id=client_id, lease_ms=lease_ms, now=now)

    async def resolve_turn(
            self, *, turn_id: str, claim_id: str, client_id: str, resolution: TurnResolution, now: int,
    ) -> ResolveTurnReceipt:
        return await self.call(
            _delivery.resolve_turn, turn_id=turn_id, claim_id=claim_id, client_id=client_id, resolution=resolution,
            now=now)

    async def list_turns(self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Turn]:
        return await self.call(_delivery.list_turns, session_id=session_id, run_id=run_id, limit=limit, now=now)

    async def queue_followup(self, *, run_id: str, request_key: str, prompt: str, now: int) -> FollowUpReceipt:
        return await self.call(_delivery.queue_followup, run_id=run_id, request_key=request_key, prompt=prompt, now=now)

    async def remove_followup(self, *, run_id: str | None, followup_id: str, now: int) -> FollowUpReceipt:
        return await self.call(_delivery.remove_followup, run_id=run_id, followup_id=followup_id, now=now)

    async def list_followups(self, *, session_id: str | None, run_id: str | None, limit: int,
                             now: int) -> FollowUpPage:
        return await self.call(_delivery.list_followups, session_id=session_id, run_id=run_id, limit=limit, now=now)

    async def prune(self, now: int, retention_ms: int) -> int:
        return await self.call(_delivery.prune, now, retention_ms)


class UpdatesAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def publish(
            self, run_id: str, token: str, *, attempt_id: str, type: str, key: str, data: Any, now: int) -> int:
        return await self.call(
            _updates.publish, run_id, token, attempt_id=attempt_id, type=type, key=key, data=data, now=now)

    async def last_event(self, run_id: str | None = None) -> int:
        return await self.call(_updates.last_event, run_id)

    async def snapshot(self, *, run_id: str | None, limit: int, now: int, runs_after: str | None = None) -> WatchPage:
        return await self.call(_updates.snapshot, run_id=run_id, limit=limit, now=now, runs_after=runs_after)

    async def changes(self, *, after: int, run_id: str | None, limit: int, now: int) -> WatchPage:
        return await self.call(_updates.changes, after=after, run_id=run_id, limit=limit, now=now)


class SettingsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def ensure_scope(
            self, run_id: str, *, settings: Any, mutable: list[str], patch: Any, actor_id: str | None, now: int) -> str:
        return await self.call(
            _settings.ensure_scope, run_id, settings=settings, mutable=mutable, patch=patch, actor_id=actor_id, now=now)

    async def find_scope(self, run_id: str, scope_id: str | None = None) -> tuple[str, int, Any]:
        return await self.call(_settings.find_scope, run_id, scope_id)

    async def get_settings(self, run_id: str, scope_id: str | None = None) -> RunSettings:
        return await self.call(_settings.get_settings, run_id, scope_id)

    async def prior_change(
            self, run_id: str, request_key: str, scope_id: str | None = None, patch: Any = None,
    ) -> ChangeSettingsReceipt | None:
        return await self.call(_settings.prior_change, run_id, request_key, scope_id, patch)

    async def change_settings(
            self, run_id: str, *, scope_id: str, base: int, expected: int | None, patch: Any, settings: Any,
            actor: Actor, actor_id: str | None, now: int, request_key: str | None = None,
    ) -> tuple[ChangeSettingsReceipt, bool]:
        return await self.call(
            _settings.change_settings, run_id, scope_id=scope_id, base=base, expected=expected, patch=patch,
            settings=settings,
            actor=actor, actor_id=actor_id, now=now, request_key=request_key)

    async def attempt_settings(self, run_id: str, attempt_id: str) -> tuple[int | None, Any]:
        return await self.call(_settings.attempt_settings, run_id, attempt_id)

    async def started_by(self, uid: str, run_id: str) -> bool:
        return await self.call(_settings.started_by, uid, run_id)


class RetentionAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def prune_runs(self, *, ended_before: int, now: int, limit: int = PRUNE_BATCH) -> Pruned:
        return await self.call(_retention.prune_runs, ended_before=ended_before, now=now, limit=limit)

    async def prunable_runs(self, *, ended_before: int, sample: int = 20) -> tuple[int, list[str]]:
        return await self.call(_retention.prunable_runs, ended_before=ended_before, sample=sample)

    async def sweep_blobs(self, *, after: str, now: int, limit: int = BLOB_SWEEP) -> tuple[int, str | None]:
        return await self.call(_retention.sweep_blobs, after=after, now=now, limit=limit)


class Aggregates:
    """The aggregates of a store or of a unit of work (all but ``hosts``, the backend's
    own), each calling its module through ``call``."""

    def __init__(self, call: Runner) -> None:
        self.commands: api.CommandsStore = CommandsAggregate(call)
        self.runs: api.RunsStore = RunsAggregate(call)
        self.queue: api.QueueStore = QueueAggregate(call)
        self.supervision: api.SupervisionStore = SupervisionAggregate(call)
        self.placement: api.PlacementStore = PlacementAggregate(call)
        self.workers: api.WorkersStore = WorkersAggregate(call)
        self.effects: api.EffectsStore = EffectsAggregate(call)
        self.interactions: api.InteractionsStore = InteractionsAggregate(call)
        self.delivery: api.DeliveryStore = DeliveryAggregate(call)
        self.updates: api.UpdatesStore = UpdatesAggregate(call)
        self.settings: api.SettingsStore = SettingsAggregate(call)
        self.controllers: api.ControllersStore = ControllersAggregate(call)
        self.controller_queue: api.ControllerQueueStore = ControllerQueueAggregate(call)
        self.controller_effects: api.ControllerEffectsStore = ControllerEffectsAggregate(call)
        self.retention: api.RetentionStore = RetentionAggregate(call)
