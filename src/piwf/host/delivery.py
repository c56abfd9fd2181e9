"""The host protocol's delivery operations (DESIGN.md §8): notifications and turns under
delivery claims, follow-ups, ``delivery.list``, and the ``run.watch`` long-poll.

Each write is one store operation inside the command log's transaction (``operations``
runs them); ``run.watch`` waits outside any transaction, on the host's change event, and
is cancelled with its connection's task when the host stops or the client goes away.
"""

from __future__ import annotations

import contextvars

import trio

from piwf.protocol import (
    ClaimNotification, ClaimTurn, DeliverNotification, DeliveryPage, ListDelivery, Outcome, QueueFollowUp,
    RemoveFollowUp, Request, ResolveTurn, WatchPage, WatchRuns,
)
from piwf.store.sqlite import delivery, runs, updates
from piwf.wire import HostResponse, check_id
from piwf.host.state import HostState


# The server's scope for the run.watch it is answering: cancelled when the client sends
# its next request behind the watch, which then answers at once with what it has.
WATCH_ENDS_EARLY: contextvars.ContextVar[trio.CancelScope | None] = contextvars.ContextVar(
    "WATCH_ENDS_EARLY", default=None)


def _accepted(request: Request, receipt: object) -> HostResponse:
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


def _notification_claim(host: HostState, request: ClaimNotification, prepared: None, after: list) -> HostResponse:
    check_id(request.payload.sessionId, "payload.sessionId")
    return _accepted(request, delivery.claim_notification(
        host.db, session_id=request.payload.sessionId, client_id=request.clientId,
        lease_ms=host.config.delivery_lease_ms, now=host.now()))


def _notification_deliver(host: HostState, request: DeliverNotification, prepared: None, after: list) -> HostResponse:
    payload = request.payload
    return _accepted(request, delivery.deliver_notification(
        host.db, notification_id=payload.notificationId, claim_id=payload.claimId, client_id=request.clientId,
        now=host.now()))


def _turn_claim(host: HostState, request: ClaimTurn, prepared: None, after: list) -> HostResponse:
    check_id(request.payload.sessionId, "payload.sessionId")
    return _accepted(request, delivery.claim_turn(
        host.db, session_id=request.payload.sessionId, client_id=request.clientId,
        lease_ms=host.config.delivery_lease_ms, now=host.now()))


def _turn_resolve(host: HostState, request: ResolveTurn, prepared: None, after: list) -> HostResponse:
    payload = request.payload
    return _accepted(request, delivery.resolve_turn(
        host.db, turn_id=payload.turnId, claim_id=payload.claimId, client_id=request.clientId,
        resolution=payload.resolution, now=host.now()))


def _followup_queue(host: HostState, request: QueueFollowUp, prepared: None, after: list) -> HostResponse:
    payload = request.payload
    return _accepted(request, delivery.queue_followup(
        host.db, run_id=request.runId, request_key=payload.requestKey, prompt=payload.prompt, now=host.now()))


def _followup_remove(host: HostState, request: RemoveFollowUp, prepared: None, after: list) -> HostResponse:
    return _accepted(request, delivery.remove_followup(
        host.db, run_id=request.runId, followup_id=request.payload.followUpId, now=host.now()))


async def _delivery_list(host: HostState, request: ListDelivery) -> DeliveryPage:
    payload, now = request.payload, host.now()
    if payload.sessionId is not None:
        check_id(payload.sessionId, "payload.sessionId")
    return DeliveryPage(
        notifications=delivery.list_notifications(host.db, session_id=payload.sessionId, run_id=payload.runId,
                                                  limit=payload.limit, now=now),
        turns=delivery.list_turns(host.db, session_id=payload.sessionId, run_id=payload.runId, limit=payload.limit,
                                  now=now))


async def _run_watch(host: HostState, request: WatchRuns) -> WatchPage:
    """A snapshot (no ``after``), or what changed after the cursor ``after``, once
    something has (or at ``timeoutMs``, or when the client sends another request behind
    this one: then with what there is, maybe nothing)."""
    payload, run_id = request.payload, request.runId
    if run_id is not None:
        runs.revision(host.db, run_id)  # notFound for an unknown run
    if payload.after is None:
        return updates.snapshot(host.db, run_id=run_id, limit=payload.limit, now=host.now())
    with WATCH_ENDS_EARLY.get() or trio.CancelScope(), trio.move_on_after(payload.timeoutMs / 1000):
        while updates.last_event(host.db, run_id) <= payload.after:
            await host.run_changed.wait()  # set after every change; nothing awaits between the check and here
    return updates.changes(host.db, after=payload.after, run_id=run_id, limit=payload.limit, now=host.now())


READS = {ListDelivery: _delivery_list, WatchRuns: _run_watch}
WRITES = {
    ClaimNotification: (None, _notification_claim),
    DeliverNotification: (None, _notification_deliver),
    ClaimTurn: (None, _turn_claim),
    ResolveTurn: (None, _turn_resolve),
    QueueFollowUp: (None, _followup_queue),
    RemoveFollowUp: (None, _followup_remove),
}
