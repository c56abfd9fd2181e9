"""The host protocol's delivery operations (DESIGN.md §8): notifications, turns,
follow-ups, live updates and ``run.watch``.

Imported by ``piwf.protocol`` (which re-exports every name here and puts the requests in
its union); import them from there.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from piwf.protocol.host import (
    WAIT_LIMIT_MS, InteractionRequest, NoPayload, Request, RunEvent, RunRequest, RunSummary, RunUpdate,
)
from piwf.status import FollowUpState, NotificationKind, TurnCause, TurnResolution

__all__ = [
    "CONTENT_LIMIT", "DELIVERY_REQUESTS", "ClaimNotification", "ClaimPayload", "ClaimTurn", "DeliverNotification",
    "DeliverPayload", "DeliverReceipt", "DeliveryPage", "FollowUp", "FollowUpPage", "FollowUpReceipt",
    "ListDelivery", "ListDeliveryPayload", "ListFollowUps", "ListFollowUpsPayload", "Notification",
    "NotificationClaim", "QueueFollowUp", "QueueFollowUpPayload", "QueuedFollowUp",
    "RemoveFollowUp", "RemoveFollowUpPayload", "ResolveTurn", "ResolveTurnPayload", "ResolveTurnReceipt", "Turn",
    "TurnClaim", "TurnFacts", "WatchEvent", "WatchPage", "WatchPayload", "WatchRuns", "WatchedRun",
]

CONTENT_LIMIT = 64 * 1024  # a notification's content, a turn's facts, an update's data (bytes of UTF-8 / JSON)
SessionId = Annotated[str, Meta(min_length=1, description="the origin session (an id, see Ids)")]


# --- payloads ---------------------------------------------------------------------------


class ClaimPayload(NoPayload, frozen=True):
    sessionId: SessionId


class DeliverPayload(NoPayload, frozen=True):
    notificationId: Annotated[str, Meta(min_length=1)]
    claimId: Annotated[str, Meta(min_length=1, description="from `notification.claim`")]


class ResolveTurnPayload(NoPayload, frozen=True):
    turnId: Annotated[str, Meta(min_length=1)]
    claimId: Annotated[str, Meta(min_length=1, description="from `turn.claim`")]
    resolution: Annotated[TurnResolution, Meta(description="what the session did with the turn")]


class QueueFollowUpPayload(NoPayload, frozen=True):
    requestKey: Annotated[str, Meta(min_length=1, max_length=512,
                                    description="the same key again is the same follow-up (`adopted`)")]
    prompt: Annotated[str, Meta(min_length=1, description="what to tell the session with the run's turn "
                                                          "(at most 64 KiB)")]


class RemoveFollowUpPayload(NoPayload, frozen=True):
    followUpId: Annotated[str, Meta(min_length=1)]


class ListFollowUpsPayload(NoPayload, frozen=True):
    sessionId: Annotated[str | None, Meta(description="only those for this session (its runs')")] = None
    runId: Annotated[str | None, Meta(description="only this run's")] = None
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many, in the order they are delivered")] = (
        100)


class ListDeliveryPayload(NoPayload, frozen=True):
    sessionId: Annotated[str | None, Meta(description="only this session's")] = None
    runId: Annotated[str | None, Meta(description="only this run's")] = None
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many of each, oldest first")] = 100


class WatchPayload(NoPayload, frozen=True):
    after: Annotated[int, Meta(ge=0), Meta(description="the `cursor` of the previous answer; absent: a snapshot "
                                                       "now (active runs, the latest events)")] | None = None
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many events (and, in a snapshot, "
                                                           "runs)")] = 200
    runsAfter: Annotated[str | None, Meta(description="a snapshot's next page: the `nextRunsAfter` of the "
                                                      "previous one")] = None
    timeoutMs: Annotated[int, Meta(ge=0, le=WAIT_LIMIT_MS, description="with `after`: answer after this long at "
                                                                      "the latest, changed or not (or as soon as "
                                                                      "the client's next request comes behind it)")
                         ] = 30_000


# --- receipts ---------------------------------------------------------------------------


class Notification(Struct):
    """A message from a run to its origin session (`ctx.notify`)."""

    notificationId: str
    runId: str
    workflow: str
    nodeId: str
    index: Annotated[int, Meta(description="1, 2, ... within its node's step")]
    sessionId: str
    kind: NotificationKind
    content: str
    createdAt: str
    claimExpiresAt: Annotated[str | None, Meta(description="while a delivery claim on it is live")]
    deliveredAt: str | None


class NotificationClaim(Struct):
    claimId: Annotated[str | None, Meta(description="deliver with it before it expires; null with no "
                                                    "notification")]
    notification: Annotated[Notification | None, Meta(description="the session's oldest undelivered "
                                                                  "notification, or null")]


class DeliverReceipt(Struct):
    notificationId: str
    delivered: bool


class TurnFacts(Struct, forbid_unknown_fields=True):
    """What a turn says about its run: a closed set of fields."""

    workflow: str
    status: Annotated[str, Meta(description="the run's engine status")]
    error: Annotated[str | None, Meta(description="the run's error message, cut to 4096 characters")]
    output: Annotated[str | None, Meta(description="the run's output as JSON, cut to 4096 characters")]
    hold: Annotated[str | None, Meta(description="why a held run is held: crashed, effect, source")]
    detail: Annotated[str | None, Meta(description="the run's status detail, cut to 4096 characters")]


class FollowUp(Struct):
    followUpId: str
    runId: str
    requestKey: str
    prompt: str
    order: Annotated[int, Meta(description="1, 2, ... per run")]
    state: FollowUpState


class Turn(Struct):
    """"Your turn": a run of the session ended or was held (DESIGN.md §8)."""

    turnId: str
    runId: str
    workflow: str
    sessionId: str
    cause: TurnCause
    facts: TurnFacts
    instructions: Annotated[str | None, Meta(description="from `ctx.present`, when the run completed")]
    followUps: Annotated[list[FollowUp], Meta(description="queued follow-ups of the run, in order; delivered "
                                                          "when the turn is resolved")]
    eligibleAt: str | None
    claimExpiresAt: str | None
    resolution: TurnResolution | None
    createdAt: str
    updatedAt: str


class TurnClaim(Struct):
    claimId: str | None
    turn: Annotated[Turn | None, Meta(description="the session's oldest unresolved turn, or null")]


class ResolveTurnReceipt(Struct):
    turnId: str
    resolution: TurnResolution
    followUpsDelivered: int


class QueuedFollowUp(FollowUp):
    sessionId: Annotated[str, Meta(description="the session it is delivered to: its run's origin session")]
    createdAt: str
    handedOut: Annotated[bool, Meta(description="the run's turn is claimed with it: it is delivered when that "
                                                "turn is resolved, unless the claim expires first")]


class FollowUpPage(Struct):
    followUps: Annotated[list[QueuedFollowUp], Meta(description="queued, in the order the session gets them: a "
                                                                "run's in their order, the runs by their first")]
    more: Annotated[bool, Meta(description="more are queued than `limit`")]


class FollowUpReceipt(Struct):
    followUpId: str
    runId: str
    order: int
    state: FollowUpState
    adopted: Annotated[bool, Meta(description="the follow-up was already queued under this `requestKey`")]


class DeliveryPage(Struct):
    notifications: Annotated[list[Notification], Meta(description="undelivered, oldest first")]
    turns: Annotated[list[Turn], Meta(description="unresolved and eligible, oldest first")]


class WatchedRun(RunSummary):
    currentNode: Annotated[str | None, Meta(description="the node of the run's latest step")]


class WatchEvent(Struct):
    runId: str
    event: RunEvent


class WatchPage(Struct):
    """What changed after a cursor (or a snapshot without one)."""

    cursor: Annotated[int, Meta(description="send it as `after` to get what changes next")]
    runs: Annotated[list[WatchedRun], Meta(description="snapshot: the active runs (and `runId`'s); "
                                                       "after a cursor: the runs the new events touched")]
    updates: Annotated[list[RunUpdate], Meta(description="current values of those runs' updates published "
                                                         "after the cursor (snapshot: all of them)")]
    events: Annotated[list[WatchEvent], Meta(description="new events, oldest first (snapshot: the latest)")]
    requests: Annotated[list[InteractionRequest], Meta(description="open requests of the runs in `runs`")]
    more: Annotated[bool, Meta(description="more events after `cursor` are already there: ask again at once")]
    nextRunsAfter: Annotated[str | None, Meta(description="a snapshot with more active runs than `limit`: send "
                                                          "it as `runsAfter` (no `after`) for the next page, and "
                                                          "watch from the first page's `cursor`")] = None


# --- requests ---------------------------------------------------------------------------


class ClaimNotification(Request, tag="notification.claim"):
    """Claim the session's oldest undelivered notification for a short lease (10 s)."""

    payload: ClaimPayload
    receipt_type = NotificationClaim


class DeliverNotification(Request, tag="notification.deliver"):
    """Say a claimed notification reached its session; a stale claim is a `conflict`."""

    payload: DeliverPayload
    receipt_type = DeliverReceipt


class ClaimTurn(Request, tag="turn.claim"):
    """Claim the session's oldest unresolved turn (with its run's follow-ups) for a short lease."""

    payload: ClaimPayload
    receipt_type = TurnClaim


class ResolveTurn(Request, tag="turn.resolve"):
    """Resolve a claimed turn; its follow-ups are delivered with it. A stale claim is a `conflict`."""

    payload: ResolveTurnPayload
    receipt_type = ResolveTurnReceipt


class QueueFollowUp(RunRequest, tag="followup.queue"):
    """Queue a prompt for the run's origin session, delivered with the run's turn."""

    payload: QueueFollowUpPayload
    receipt_type = FollowUpReceipt


class RemoveFollowUp(Request, tag="followup.remove"):
    """Take back a queued follow-up, found by its id (``runId``, when given, must be its run's)."""

    payload: RemoveFollowUpPayload
    receipt_type = FollowUpReceipt


class ListFollowUps(Request, tag="followup.list"):
    """The follow-ups still queued (a session's, a run's, or all), in the order they are delivered."""

    payload: ListFollowUpsPayload = ListFollowUpsPayload()
    is_read = True
    receipt_type = FollowUpPage


class ListDelivery(Request, tag="delivery.list"):
    """Undelivered notifications and unresolved turns, oldest first."""

    payload: ListDeliveryPayload = ListDeliveryPayload()
    is_read = True
    receipt_type = DeliveryPage


class WatchRuns(Request, tag="run.watch"):
    """Long-poll for changes after a cursor: runs, updates, events (one run's with `runId`)."""

    payload: WatchPayload = WatchPayload()
    is_read = True
    long_poll = True
    receipt_type = WatchPage


DELIVERY_REQUESTS = (ClaimNotification, DeliverNotification, ClaimTurn, ResolveTurn, QueueFollowUp, RemoveFollowUp,
                     ListFollowUps, ListDelivery, WatchRuns)
