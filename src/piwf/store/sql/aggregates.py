"""The SQLite backend's aggregates: each method calls the named function of its module on
the store's one ``Database``, inline (no thread hop, no statement of its own): what a
method costs over the function is one coroutine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from piwf.protocol import EVENTS_PAGE
from piwf.store.api.rules import RETENTION_MS
from piwf.store.sql import commands as _commands
from piwf.store.sql import runs as _runs
from piwf.store.sql import base as _base
from piwf.store.sql import queue as _queue
from piwf.store.sql import supervision as _supervision
from piwf.store.sql import workers as _workers
from piwf.store.sql import effects as _effects
from piwf.store.sql import interactions as _interactions
from piwf.store.sql import deadlines as _deadlines
from piwf.store.sql import delivery as _delivery
from piwf.store.sql import updates as _updates
from piwf.store.sql import settings as _settings
from piwf.store.sql import controllers as _controllers
from piwf.store.sql import controller_queue as _controller_queue
from piwf.store.sql import controller_effects as _controller_effects

if TYPE_CHECKING:
    from piwf.protocol import (
        AnswerReceipt, ChangeSettingsReceipt, DeliverReceipt, FollowUpReceipt, InteractionRequest, Notification,
        NotificationClaim, ResolveTurnReceipt, RunDetail, RunEventsPage, RunSettings, RunSummary, SubmitReceipt, Turn,
        TurnClaim, UpdateAction, UpdateReceipt, WatchPage,
    )
    from piwf.protocol.resources import ApplyReceipt, ResourceDetail, ResourceRef, ResourceSummary
    from piwf.protocol.worker import InteractionOpenPayload, PendingSubmission, WorkerMessage, WorkerResponse
    from piwf.status import NotificationKind, TurnResolution, WorkerStatus
    from piwf.store.api.types import (
        Actor, Claim, CommandKey, ControllerClaim, Delay, NewScope, WorkerEnded,
    )
    from piwf.store.sql.database import Database
    from piwf.wire import HostResponse


class SqliteCommandsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def lookup(self, request: CommandKey, fingerprint: bytes) -> HostResponse | None:
        return _commands.lookup(self.db, request, fingerprint)

    async def record(
            self, request: CommandKey, fingerprint: bytes, response: HostResponse, epoch: int,
            now: int) -> None:
        return _commands.record(self.db, request, fingerprint, response, epoch, now)

    async def prune(self, now: int, retention_ms: int = RETENTION_MS) -> int:
        return _commands.prune(self.db, now, retention_ms)


class SqliteRunsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_run(
            self, *, run_id: str, workflow: str, project_path: str, source: bytes, digest: str, input: Any,
            origin_session_id: str | None, now: int, start_node: str | None = None,
            settings: NewScope | None = None) -> dict[str, Any]:
        return _runs.create_run(
            self.db, run_id=run_id, workflow=workflow, project_path=project_path, source=source, digest=digest,
            input=input, origin_session_id=origin_session_id, now=now, start_node=start_node, settings=settings)

    async def revision(self, run_id: str) -> int:
        return _runs.revision(self.db, run_id)

    async def check_revision(self, run_id: str, expected: int | None) -> int:
        return _runs.check_revision(self.db, run_id, expected)

    async def pause_run(self, run_id: str, now: int, *, expected_revision: int | None = None) -> dict[str, Any]:
        return _runs.pause_run(self.db, run_id, now, expected_revision=expected_revision)

    async def resume_run(
            self, run_id: str, now: int, *, definition: tuple[str, bytes, str | None] | None = None,
            expected_revision: int | None = None) -> dict[str, Any]:
        return _runs.resume_run(self.db, run_id, now, definition=definition, expected_revision=expected_revision)

    async def hold_of(self, run_id: str) -> str | None:
        return _runs.hold_of(self.db, run_id)

    async def is_paused(self, run_id: str) -> bool:
        return _runs.is_paused(self.db, run_id)

    async def start_attempt(
            self, run_id: str, token: str, *, seq: int, node: str, generation: int, now: int) -> tuple[str, int]:
        return _runs.start_attempt(self.db, run_id, token, seq=seq, node=node, generation=generation, now=now)

    async def accept_attempt(
            self, run_id: str, token: str, *, attempt_id: str, output: Any, exit_name: str | None, now: int,
            waiting: bool = False) -> int:
        return _runs.accept_attempt(
            self.db, run_id, token, attempt_id=attempt_id, output=output, exit_name=exit_name, now=now,
            waiting=waiting)

    async def fail_attempt(self, run_id: str, token: str, *, attempt_id: str, error: dict[str, Any], now: int) -> int:
        return _runs.fail_attempt(self.db, run_id, token, attempt_id=attempt_id, error=error, now=now)

    async def accepted_steps(
            self, run_id: str, after_seq: int = -1, budget: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        return _runs.accepted_steps(self.db, run_id, after_seq, budget)

    async def ready_state(self, run_id: str) -> tuple[Any, str | None, bool, str]:
        return _runs.ready_state(self.db, run_id)

    async def run_source(self, run_id: str) -> tuple[str, str, str, Any, str | None]:
        return _runs.run_source(self.db, run_id)

    async def get_run(self, run_id: str, now: int = 0) -> RunDetail:
        return _runs.get_run(self.db, run_id, now)

    async def run_summary(self, run_id: str) -> RunSummary:
        return _runs.run_summary(self.db, run_id)

    async def list_runs(self, limit: int = 50, status: str | None = None) -> list[RunSummary]:
        return _runs.list_runs(self.db, limit, status)

    async def run_events(self, run_id: str, after: int = 0, limit: int = EVENTS_PAGE) -> RunEventsPage:
        return _runs.run_events(self.db, run_id, after, limit)

    async def status_counts(self, now: int) -> dict[str, int]:
        return _runs.status_counts(self.db, now)


class SqliteQueueStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def fenced_revision(self, run_id: str, token: str, now: int) -> int:
        return _queue.fenced_revision(self.db, run_id, token, now)

    async def revision_of(self, run_id: str) -> int | None:
        return _base.revision_of(self.db, run_id)

    async def expire_claims_before(self, epoch: int, now: int) -> list[str]:
        return _queue.expire_claims_before(self.db, epoch, now)

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        return _queue.renew_claims(self.db, claims, lease_ms, now)

    async def mark_running(self, run_id: str, token: str, now: int) -> bool:
        return _queue.mark_running(self.db, run_id, token, now)

    async def park_run(
            self, run_id: str, token: str, now: int, *, hold: str | None = None, detail: str | None = None) -> bool:
        return _queue.park_run(self.db, run_id, token, now, hold=hold, detail=detail)

    async def complete_run(self, run_id: str, token: str, output: Any, now: int) -> int:
        return _queue.complete_run(self.db, run_id, token, output, now)

    async def fail_run(self, run_id: str, token: str, error: dict[str, Any], now: int) -> int:
        return _queue.fail_run(self.db, run_id, token, error, now)

    async def cancel_run(
            self, run_id: str, now: int, *, token: str | None = None, expected_revision: int | None = None) -> bool:
        return _queue.cancel_run(self.db, run_id, now, token=token, expected_revision=expected_revision)


class SqliteSupervisionStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim_runs(
            self, *, room: int, exclude: frozenset[str], runner_id: str, lease_ms: int, now: int, epoch: int,
    ) -> list[tuple[Claim, str]]:
        return _supervision.claim_runs(
            self.db, room=room, exclude=exclude, runner_id=runner_id, lease_ms=lease_ms, now=now, epoch=epoch)

    async def end_worker(
            self, *, worker_id: str, run_id: str, token: str, status: WorkerStatus, now: int,
            exit_code: int | None, signal: int | None, diagnostic: str | None, park: bool, max_crashes: int,
            last_output: str = '', backoff: Delay | None = None) -> WorkerEnded:
        return _supervision.end_worker(
            self.db, worker_id=worker_id, run_id=run_id, token=token, status=status, now=now,
            exit_code=exit_code, signal=signal, diagnostic=diagnostic, park=park, max_crashes=max_crashes,
            last_output=last_output, backoff=backoff)


class SqliteWorkersStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def read_message(self, message: WorkerMessage) -> WorkerResponse | None:
        return _workers.read_message(self.db, message)

    async def record_message(self, message: WorkerMessage, response: WorkerResponse, now: int) -> None:
        return _workers.record_message(self.db, message, response, now)

    async def prune_messages(self, batch: int = 500) -> int:
        return _workers.prune_messages(self.db, batch)

    async def mark_ready(self, worker_id: str, now: int) -> None:
        return _workers.mark_ready(self.db, worker_id, now)

    async def attach_process(self, worker_id: str, pid: int, identity: str) -> None:
        return _workers.attach_process(self.db, worker_id, pid, identity)

    async def orphan_before(self, host_epoch: int, now: int) -> list[tuple[str, int, str]]:
        return _workers.orphan_before(self.db, host_epoch, now)

    async def orphaned_processes(self, host_epoch: int) -> list[tuple[str, int, str]]:
        return _workers.orphaned_processes(self.db, host_epoch)

    async def register_process(
            self, *, worker_id: str, run_id: str, pid: int, identity: str, node: str | None, now: int) -> None:
        return _workers.register_process(
            self.db, worker_id=worker_id, run_id=run_id, pid=pid, identity=identity, node=node, now=now)

    async def unregister_process(self, worker_id: str, pid: int, now: int) -> None:
        return _workers.unregister_process(self.db, worker_id, pid, now)

    async def live_processes(self, worker_ids: list[str]) -> list[tuple[str, int, str]]:
        return _workers.live_processes(self.db, worker_ids)

    async def mark_processes_gone(self, rows: list[tuple[str, int, str]], now: int) -> None:
        return _workers.mark_processes_gone(self.db, rows, now)


class SqliteEffectsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def reserve(
            self, run_id: str, key: str, *, node: str, generation: int, observable: bool, now: int) -> dict[str, Any]:
        return _effects.reserve(self.db, run_id, key, node=node, generation=generation, observable=observable, now=now)

    async def begin_apply(self, run_id: str, key: str, *, generation: int, now: int) -> None:
        return _effects.begin_apply(self.db, run_id, key, generation=generation, now=now)

    async def settle(
            self, run_id: str, key: str, *, generation: int, result: Any = None, error: dict[str, Any] | None = None,
            now: int) -> None:
        return _effects.settle(self.db, run_id, key, generation=generation, result=result, error=error, now=now)

    async def interrupted_before(self, run_id: str, generation: int, now: int) -> list[str]:
        return _effects.interrupted_before(self.db, run_id, generation, now)

    async def resolve(self, run_id: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        return _effects.resolve(self.db, run_id, key, applied=applied, result=result, now=now)


class SqliteInteractionsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def open_request(self, run_id: str, token: str, payload: InteractionOpenPayload, now: int) -> str:
        return _interactions.open_request(self.db, run_id, token, payload, now)

    async def waiting_attempt(
            self, run_id: str, seq: int, node: str, now: int) -> tuple[str, PendingSubmission | None] | None:
        return _interactions.waiting_attempt(self.db, run_id, seq, node, now)

    async def park_again(self, run_id: str, token: str, now: int) -> None:
        return _interactions.park_again(self.db, run_id, token, now)

    async def accept_submission(self, run_id: str, submission_id: str, value: Any, now: int) -> None:
        return _interactions.accept_submission(self.db, run_id, submission_id, value, now)

    async def reject_submission(self, run_id: str, token: str, submission_id: str, error: str, now: int) -> None:
        return _interactions.reject_submission(self.db, run_id, token, submission_id, error, now)

    async def answer_decision(
            self, *, request_id: str, choice: str, text: str | None, answered_by: str, expected_revision: int | None,
            now: int) -> AnswerReceipt:
        return _interactions.answer_decision(
            self.db, request_id=request_id, choice=choice, text=text, answered_by=answered_by,
            expected_revision=expected_revision, now=now)

    async def submit(
            self, *, request_id: str, value: Any, session_id: str | None, submitted_by: str,
            expected_revision: int | None, now: int) -> SubmitReceipt:
        return _interactions.submit(
            self.db, request_id=request_id, value=value, session_id=session_id, submitted_by=submitted_by,
            expected_revision=expected_revision, now=now)

    async def update(
            self, *, request_id: str, expected_revision: int, action: UpdateAction, client_id: str,
            entry_id: str | None, progress: str | None, lease_ms: int, now: int) -> UpdateReceipt:
        return _interactions.update(
            self.db, request_id=request_id, expected_revision=expected_revision, action=action, client_id=client_id,
            entry_id=entry_id, progress=progress, lease_ms=lease_ms, now=now)

    async def expire_due(self, now: int) -> tuple[list[str], list[tuple[str, Exception]]]:
        return _deadlines.expire_due(self.db, now)

    async def next_deadline(self) -> int | None:
        return _deadlines.next_deadline(self.db)

    async def list_requests(
            self, *, session_id: str | None = None, run_id: str | None = None, open_only: bool = True,
            limit: int = 100, now: int) -> list[InteractionRequest]:
        return _interactions.list_requests(
            self.db, session_id=session_id, run_id=run_id, open_only=open_only, limit=limit, now=now)


class SqliteDeliveryStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def notify(
            self, run_id: str, token: str, *, attempt_id: str, index: int, kind: NotificationKind, content: str,
            now: int) -> str | None:
        return _delivery.notify(
            self.db, run_id, token, attempt_id=attempt_id, index=index, kind=kind, content=content, now=now)

    async def request_presentation(self, run_id: str, token: str, *, instructions: str, now: int) -> str | None:
        return _delivery.request_presentation(self.db, run_id, token, instructions=instructions, now=now)

    async def claim_notification(
            self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> NotificationClaim:
        return _delivery.claim_notification(
            self.db, session_id=session_id, client_id=client_id, lease_ms=lease_ms, now=now)

    async def deliver_notification(
            self, *, notification_id: str, claim_id: str, client_id: str, now: int) -> DeliverReceipt:
        return _delivery.deliver_notification(
            self.db, notification_id=notification_id, claim_id=claim_id, client_id=client_id, now=now)

    async def list_notifications(
            self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Notification]:
        return _delivery.list_notifications(self.db, session_id=session_id, run_id=run_id, limit=limit, now=now)

    async def claim_turn(self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> TurnClaim:
        return _delivery.claim_turn(self.db, session_id=session_id, client_id=client_id, lease_ms=lease_ms, now=now)

    async def resolve_turn(
            self, *, turn_id: str, claim_id: str, client_id: str, resolution: TurnResolution, now: int,
    ) -> ResolveTurnReceipt:
        return _delivery.resolve_turn(
            self.db, turn_id=turn_id, claim_id=claim_id, client_id=client_id, resolution=resolution, now=now)

    async def list_turns(self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Turn]:
        return _delivery.list_turns(self.db, session_id=session_id, run_id=run_id, limit=limit, now=now)

    async def queue_followup(self, *, run_id: str, request_key: str, prompt: str, now: int) -> FollowUpReceipt:
        return _delivery.queue_followup(self.db, run_id=run_id, request_key=request_key, prompt=prompt, now=now)

    async def remove_followup(self, *, run_id: str, followup_id: str, now: int) -> FollowUpReceipt:
        return _delivery.remove_followup(self.db, run_id=run_id, followup_id=followup_id, now=now)

    async def prune(self, now: int, retention_ms: int) -> int:
        return _delivery.prune(self.db, now, retention_ms)


class SqliteUpdatesStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def publish(
            self, run_id: str, token: str, *, attempt_id: str, type: str, key: str, data: Any, now: int) -> int:
        return _updates.publish(self.db, run_id, token, attempt_id=attempt_id, type=type, key=key, data=data, now=now)

    async def last_event(self, run_id: str | None = None) -> int:
        return _updates.last_event(self.db, run_id)

    async def snapshot(self, *, run_id: str | None, limit: int, now: int, runs_after: str | None = None) -> WatchPage:
        return _updates.snapshot(self.db, run_id=run_id, limit=limit, now=now, runs_after=runs_after)

    async def changes(self, *, after: int, run_id: str | None, limit: int, now: int) -> WatchPage:
        return _updates.changes(self.db, after=after, run_id=run_id, limit=limit, now=now)


class SqliteSettingsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def ensure_scope(
            self, run_id: str, *, settings: Any, mutable: list[str], patch: Any, actor_id: str | None, now: int) -> str:
        return _settings.ensure_scope(
            self.db, run_id, settings=settings, mutable=mutable, patch=patch, actor_id=actor_id, now=now)

    async def find_scope(self, run_id: str, scope_id: str | None = None) -> tuple[str, int, Any]:
        return _settings.find_scope(self.db, run_id, scope_id)

    async def get_settings(self, run_id: str, scope_id: str | None = None) -> RunSettings:
        return _settings.get_settings(self.db, run_id, scope_id)

    async def prior_change(
            self, run_id: str, request_key: str, scope_id: str | None = None, patch: Any = None,
    ) -> ChangeSettingsReceipt | None:
        return _settings.prior_change(self.db, run_id, request_key, scope_id, patch)

    async def change_settings(
            self, run_id: str, *, scope_id: str, base: int, expected: int | None, patch: Any, settings: Any,
            actor: Actor, actor_id: str | None, now: int, request_key: str | None = None,
    ) -> tuple[ChangeSettingsReceipt, bool]:
        return _settings.change_settings(
            self.db, run_id, scope_id=scope_id, base=base, expected=expected, patch=patch, settings=settings,
            actor=actor, actor_id=actor_id, now=now, request_key=request_key)

    async def attempt_settings(self, run_id: str, attempt_id: str) -> tuple[int | None, Any]:
        return _settings.attempt_settings(self.db, run_id, attempt_id)

    async def started_by(self, uid: str, run_id: str) -> bool:
        return _settings.started_by(self.db, uid, run_id)


class SqliteControllersStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def apply_resource(
            self, *, project: str, controller: str, key: str, spec: Any, initial: Any, expected_version: int | None,
            now: int) -> ApplyReceipt:
        return _controllers.apply_resource(
            self.db, project=project, controller=controller, key=key, spec=spec, initial=initial,
            expected_version=expected_version, now=now)

    async def request_reconcile(self, project: str, controller: str, key: str, now: int) -> ResourceRef:
        return _controllers.request_reconcile(self.db, project, controller, key, now)

    async def request_delete(
            self, project: str, controller: str, key: str, now: int, *, force: bool = False) -> ResourceRef:
        return _controllers.request_delete(self.db, project, controller, key, now, force=force)

    async def get_resource(self, project: str, controller: str, key: str, now: int) -> ResourceDetail:
        return _controllers.get_resource(self.db, project, controller, key, now)

    async def list_resources(self, project: str | None, controller: str | None) -> list[ResourceSummary]:
        return _controllers.list_resources(self.db, project, controller)

    async def locate_uid(self, project: str, controller: str, key: str) -> str:
        return _controllers.locate_uid(self.db, project, controller, key)

    async def status_counts(self, now: int) -> dict[str, int]:
        return _controllers.status_counts(self.db, now)

    async def add_resource_event(self, uid: str, kind: str, payload: dict[str, Any], now: int) -> None:
        return _controllers.add_resource_event(self.db, uid, kind, payload, now)


class SqliteControllerQueueStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim_due(
            self, *, room: int, exclude: frozenset[str], lease_ms: int, now: int, epoch: int) -> list[ControllerClaim]:
        return _controller_queue.claim_due(self.db, room=room, exclude=exclude, lease_ms=lease_ms, now=now, epoch=epoch)

    async def next_due(self) -> int | None:
        return _controller_queue.next_due(self.db)

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        return _controller_queue.renew_claims(self.db, claims, lease_ms, now)

    async def expire_claims_before(self, epoch: int, now: int) -> int:
        return _controller_queue.expire_claims_before(self.db, epoch, now)

    async def attach_worker(self, uid: str, token: str, pid: int, identity: str) -> None:
        return _controller_queue.attach_worker(self.db, uid, token, pid, identity)

    async def orphaned_workers(self, epoch: int) -> list[tuple[str, int, str]]:
        return _controller_queue.orphaned_workers(self.db, epoch)

    async def fence(self, uid: str, token: str, lease_ms: int, now: int) -> None:
        return _controller_queue.fence(self.db, uid, token, lease_ms, now)

    async def reconcile_view(self, uid: str) -> dict[str, Any]:
        return _controller_queue.reconcile_view(self.db, uid)

    async def finish_success(
            self, uid: str, token: str, *, requeue_after_ms: int | None, settled: bool, controller_status: Any,
            conditions: list[dict[str, Any]], finalizers: list[str] | None, keep_status: bool, now: int) -> str:
        return _controller_queue.finish_success(
            self.db, uid, token, requeue_after_ms=requeue_after_ms, settled=settled,
            controller_status=controller_status, conditions=conditions, finalizers=finalizers,
            keep_status=keep_status, now=now)

    async def finish_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, permanent: bool, now: int,
            counted: bool = True) -> int:
        return _controller_queue.finish_failure(
            self.db, uid, token, error=error, delay_ms=delay_ms, permanent=permanent, now=now, counted=counted)

    async def record_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, now: int, counted: bool = True) -> int | None:
        return _controller_queue.record_failure(
            self.db, uid, token, error=error, delay_ms=delay_ms, now=now, counted=counted)


class SqliteControllerEffectsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def reserve(
            self, uid: str, spec_generation: int, key: str, *, generation: int, observable: bool, now: int,
    ) -> dict[str, Any]:
        return _controller_effects.reserve(
            self.db, uid, spec_generation, key, generation=generation, observable=observable, now=now)

    async def begin_apply(self, uid: str, spec_generation: int, key: str, *, generation: int, now: int) -> None:
        return _controller_effects.begin_apply(self.db, uid, spec_generation, key, generation=generation, now=now)

    async def settle(
            self, uid: str, spec_generation: int, key: str, *, generation: int, result: Any = None,
            error: dict[str, Any] | None = None, now: int) -> None:
        return _controller_effects.settle(
            self.db, uid, spec_generation, key, generation=generation, result=result, error=error, now=now)

    async def resolve(self, uid: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        return _controller_effects.resolve(self.db, uid, key, applied=applied, result=result, now=now)

    async def find_child(self, uid: str, request_key: str, workflow: str, run_input: Any) -> dict[str, Any] | None:
        return _controller_effects.find_child(self.db, uid, request_key, workflow, run_input)

    async def record_child(
            self, uid: str, request_key: str, workflow: str, run_input: Any, run_id: str, now: int) -> dict[str, Any]:
        return _controller_effects.record_child(self.db, uid, request_key, workflow, run_input, run_id, now)

    async def sync_children(self, now: int) -> list[str]:
        return _controller_effects.sync_children(self.db, now)
