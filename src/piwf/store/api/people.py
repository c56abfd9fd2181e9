"""People and agents in the loop: interaction requests, delivery to sessions, run updates, settings.

Every method may also raise StorageUnavailable and StoreError (see ``piwf.store.api``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from piwf.protocol import (
        AnswerReceipt, ChangeSettingsReceipt, DeliverReceipt, FollowUpPage, FollowUpReceipt, InteractionRequest,
        Notification, NotificationClaim, ResolveTurnReceipt, RunSettings, SubmitReceipt, Turn, TurnClaim, UpdateAction,
        UpdateReceipt, WatchPage,
    )
    from piwf.protocol.worker import InteractionOpenPayload, PendingSubmission
    from piwf.status import NotificationKind, TurnResolution
    from piwf.store.api.types import Actor


class InteractionsStore(Protocol):
    """Interaction requests of decision and ask nodes (DESIGN.md §7). ``open_request``,
    ``park_again`` and ``reject_submission`` are fenced by the claim ``token`` they name
    (ClaimLost, nothing changed); ``accept_submission`` names none: call it on the unit of
    work of a fenced worker message (after ``queue.fenced_revision``)."""

    async def open_request(self, run_id: str, token: str, payload: InteractionOpenPayload, now: int) -> str:
        """The attempt's node waits: open (or find) its request and park the run as waiting. Raises ClaimLost,
        Rejected.
        """

    async def waiting_attempt(
            self, run_id: str, seq: int, node: str, now: int) -> tuple[str, PendingSubmission | None] | None:
        """The attempt at ``seq`` waiting for its request, and the submission to validate (if any); None when
        no attempt waits there. A waiting attempt of another node (the run resumed on a changed workflow) is
        given up: its request cancelled, its submission rejected saying why, so nothing submitted to it
        becomes another node's output. Raises Conflict.
        """

    async def park_again(self, run_id: str, token: str, now: int) -> None:
        """A worker reached a waiting node with nothing to validate: the run waits again. Raises ClaimLost."""

    async def accept_submission(self, run_id: str, submission_id: str, value: Any, now: int) -> None:
        """The validated value became the node's output (accepted in this transaction): settle. Raises
        Conflict, Rejected.
        """

    async def reject_submission(self, run_id: str, token: str, submission_id: str, error: str, now: int) -> None:
        """The value did not fit: the request is open again with the reason, the run waits. Raises
        ClaimLost, Rejected.
        """

    async def answer_decision(
            self, *, request_id: str, choice: str, text: str | None, answered_by: str, expected_revision: int | None,
            now: int) -> AnswerReceipt:
        """The first answer wins: resolution, request settled, attempt accepted with the answer as its output
        and the choice as its exit, and the run released, in one transaction. Raises Conflict, NotFound,
        Rejected.
        """

    async def submit(
            self, *, request_id: str, value: Any, session_id: str | None, submitted_by: str,
            expected_revision: int | None, now: int) -> SubmitReceipt:
        """A value for an ask, to be validated by the workflow in a worker: the run is released to the
        dispatcher, which claims it and starts that worker. Raises Conflict, NotFound, Rejected.
        """

    async def update(
            self, *, request_id: str, expected_revision: int, action: UpdateAction, client_id: str,
            entry_id: str | None, progress: str | None, lease_ms: int, now: int) -> UpdateReceipt:
        """Presentation claims (seed rules): ``claim`` needs the current revision and a request pending, or
        presenting by the same client or with an expired claim; ``presented`` and ``progress`` need the
        current revision of an open request. Raises Conflict, NotFound, Rejected.
        """

    async def expire_due(self, now: int) -> tuple[list[str], list[tuple[str, Exception]]]:
        """Close every open request past its deadline whose run is idle, each in its own transaction: a
        decision with a default is answered with it (provenance ``timeout``); otherwise the request expires
        and its node leaves through ``timeout`` when the graph has that exit, else the run ends
        ``timed_out``. Exactly once: each transaction closes only a request still open. Returns the request
        ids closed, and those that could not be (with the error; the others are closed all the same). Raises
        Conflict.
        """

    async def next_deadline(self) -> int | None:
        """The nearest deadline of an open request whose run is not claimed (a request being validated waits
        for its outcome: that outcome wakes the timer again).
        """

    async def list_requests(
            self, *, session_id: str | None = None, run_id: str | None = None, open_only: bool = True,
            limit: int = 100, now: int) -> list[InteractionRequest]:
        """Raises NotFound."""


class DeliveryStore(Protocol):
    """Notifications, turns and follow-ups for a run's origin session."""

    async def notify(
            self, run_id: str, token: str, *, attempt_id: str, index: int, kind: NotificationKind, content: str,
            now: int) -> str | None:
        """Store a notification for the run's origin session (inside the worker message's transaction): the
        ``index``-th call of the attempt with this ``kind`` and ``content``. Idempotent per (run, step, kind,
        content, index): a retried node notifying again finds the copy an earlier attempt stored, whatever
        order its threads call in. Stored ones are numbered 1, 2, ... per step in the order stored. None for
        a detached run (nobody hears). Raises ClaimLost, Rejected.
        """

    async def request_presentation(self, run_id: str, token: str, *, instructions: str, now: int) -> str | None:
        """``ctx.present``: the run's turn carries ``instructions`` when the run completes (the turn waits, not
        eligible, until the run ends). None for a detached run. Raises ClaimLost, Rejected.
        """

    async def claim_notification(
            self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> NotificationClaim:
        """The session's oldest undelivered notification, claimed for ``lease_ms``; nothing while it is claimed
        by someone else.
        """

    async def deliver_notification(
            self, *, notification_id: str, claim_id: str, client_id: str, now: int) -> DeliverReceipt:
        """Delivered, under a live claim this client holds; anything else is a ``conflict``. Raises Conflict,
        NotFound.
        """

    async def list_notifications(
            self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Notification]:
        ...

    async def claim_turn(self, *, session_id: str, client_id: str, lease_ms: int, now: int) -> TurnClaim:
        """The session's oldest unresolved eligible turn, claimed for ``lease_ms``, with its run's queued
        follow-ups (those it is resolved with); nothing while it is claimed by someone else or its run has
        notifications not yet delivered.
        """

    async def resolve_turn(
            self, *, turn_id: str, claim_id: str, client_id: str, resolution: TurnResolution, now: int,
    ) -> ResolveTurnReceipt:
        """Resolved under a live claim this client holds (anything else is a ``conflict``); the follow-ups the
        claim handed over are delivered with it. Raises Conflict, NotFound.
        """

    async def list_turns(self, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Turn]:
        ...

    async def queue_followup(self, *, run_id: str, request_key: str, prompt: str, now: int) -> FollowUpReceipt:
        """Queue ``prompt`` for the run's origin session, after the run's earlier follow-ups; the same
        ``request_key`` with the same prompt is the same follow-up (``adopted``). Raises Conflict, NotFound,
        Rejected.
        """

    async def remove_followup(self, *, run_id: str | None, followup_id: str, now: int) -> FollowUpReceipt:
        """Take back a queued follow-up, found by its id (``run_id``, when given, must be its run's: else
        NotFound). Raises NotFound, Rejected (already delivered)."""

    async def list_followups(self, *, session_id: str | None, run_id: str | None, limit: int,
                             now: int) -> FollowUpPage:
        """The follow-ups still queued (the session's runs', the run's, or all), in the order their session
        gets them: a run's by position, the runs by their first one queued; ``more`` past ``limit``. Raises
        NotFound (an unknown run)."""

    async def prune(self, now: int, retention_ms: int) -> int:
        """Forget what was delivered (notifications), resolved (turns) or delivered or removed (follow-ups)
        longer than ``retention_ms`` ago, of runs that have ended: nothing of a run still going is
        forgotten, so a node retried later still finds the notification it stored. Returns the rows deleted.
        """


class UpdatesStore(Protocol):
    """Run updates (``ctx.publish``) and the ``run.watch`` pages."""

    async def publish(
            self, run_id: str, token: str, *, attempt_id: str, type: str, key: str, data: Any, now: int) -> int:
        """Replace the run's (type, key) with ``data``, from the live attempt under a live claim (inside the
        worker message's transaction); returns the update's seq. Raises ClaimLost, Rejected.
        """

    async def last_event(self, run_id: str | None = None) -> int:
        """The newest event id (of one run, or of all): a watch waits until it moves past its cursor."""

    async def snapshot(self, *, run_id: str | None, limit: int, now: int, runs_after: str | None = None) -> WatchPage:
        """Now: the active runs (or ``run_id``), oldest first, at most ``limit`` of them after the run
        ``runs_after`` (``nextRunsAfter`` names the next page's start, None on the last), all their updates and
        open requests, and the latest ``limit`` events. An unknown ``run_id`` gives an empty page (the caller
        checks the run first); an unknown ``runs_after`` is Rejected.
        """

    async def changes(self, *, after: int, run_id: str | None, limit: int, now: int) -> WatchPage:
        """What changed after ``after``: the next ``limit`` events, the runs they touched with their updates
        published since, and those runs' open requests. An unknown ``run_id`` gives an empty page.
        """


class SettingsStore(Protocol):
    """A run's settings scope and its numbered changes (a compare-and-set on the number)."""

    async def ensure_scope(
            self, run_id: str, *, settings: Any, mutable: list[str], patch: Any, actor_id: str | None, now: int) -> str:
        """The run's settings scope, made with ``settings`` as change 0 (``patch``: the initial settings as the
        start request gave them) unless it exists; its id. Raises Rejected.
        """

    async def find_scope(self, run_id: str, scope_id: str | None = None) -> tuple[str, int, Any]:
        """(scope id, change number, settings) of the run's scope (``scope_id``: that one, which must be the
        run's); ``NotFound`` when the run has none. Raises NotFound, Rejected.
        """

    async def get_settings(self, run_id: str, scope_id: str | None = None) -> RunSettings:
        """Raises NotFound, Rejected."""

    async def prior_change(
            self, run_id: str, request_key: str, scope_id: str | None = None, patch: Any = None,
    ) -> ChangeSettingsReceipt | None:
        """The change made earlier under ``request_key`` (a controller's retry), if any; a ``conflict`` when
        that change was another patch (a request key names one change). Raises Conflict, NotFound, Rejected.
        """

    async def change_settings(
            self, run_id: str, *, scope_id: str, base: int, expected: int | None, patch: Any, settings: Any,
            actor: Actor, actor_id: str | None, now: int, request_key: str | None = None,
    ) -> tuple[ChangeSettingsReceipt, bool]:
        """Commit ``settings`` (``patch`` applied to the scope's settings at change ``base``, checked outside
        the host) as the next change: a compare-and-set on the change number, and the run not having ended, both
        checked by the write. Returns (receipt, adopted): ``request_key`` seen before returns that change, adopted.
        Raises Conflict, NotFound, Rejected.
        """

    async def attempt_settings(self, run_id: str, attempt_id: str) -> tuple[int | None, Any]:
        """(change number, settings) an attempt started under; (None, None) for a run without settings."""

    async def started_by(self, uid: str, run_id: str) -> bool:
        """Whether the controller resource ``uid`` started run ``run_id`` (``ctx.workflows.ensure``)."""
