"""The host protocol's delivery operations (DESIGN.md §8): notifications and turns under
delivery claims, follow-ups, ``delivery.list``, and the ``run.watch`` long-poll.

Each write is one store operation on the unit of work ``operations`` opens with the
command log (``tx``); ``run.watch`` waits outside any transaction, on the host's change
event, and is cancelled with its connection's task when the host stops or the client goes
away.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

import trio

from piwf.protocol import (
    ClaimNotification, ClaimTurn, DeliverNotification, DeliveryPage, FollowUpPage, ListDelivery, ListFollowUps,
    QueueFollowUp, RemoveFollowUp, Request, ResolveTurn, WatchPage, WatchRuns,
)
from piwf.store.api import UnitOfWork
from piwf.wire import HostResponse, Outcome, check_id
from piwf.host.operation_types import After, Reads, Writes
from piwf.host.state import HostState


# The server's scope for the run.watch it is answering: cancelled when the client sends
# its next request behind the watch, which then answers at once with what it has.
WATCH_ENDS_EARLY: contextvars.ContextVar[trio.CancelScope | None] = contextvars.ContextVar(
    "WATCH_ENDS_EARLY", default=None)


async def until_changed(host: HostState, done: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``done()`` is true: asked at once, then after every change announced
    (``host.changed``, here or by another host sharing the store). A change while ``done``
    reads the store (a backend whose reads go through a thread) asks again at once: the
    count of changes is taken before the read, so none falls between."""
    while True:
        seen = host.run_changed.count
        if await done():
            return
        await host.run_changed.wait(after=seen)


def _accepted(request: Request, receipt: object) -> HostResponse:
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


async def _notification_claim(host: HostState, tx: UnitOfWork, request: ClaimNotification, prepared: None,
                              after: After) -> HostResponse:
    check_id(request.payload.sessionId, "payload.sessionId")
    return _accepted(request, await tx.delivery.claim_notification(
        session_id=request.payload.sessionId, client_id=request.clientId,
        lease_ms=host.config.delivery_lease_ms, now=host.now()))


async def _notification_deliver(host: HostState, tx: UnitOfWork, request: DeliverNotification, prepared: None,
                                after: After) -> HostResponse:
    payload = request.payload
    return _accepted(request, await tx.delivery.deliver_notification(
        notification_id=payload.notificationId, claim_id=payload.claimId, client_id=request.clientId,
        now=host.now()))


async def _turn_claim(host: HostState, tx: UnitOfWork, request: ClaimTurn, prepared: None,
                      after: After) -> HostResponse:
    check_id(request.payload.sessionId, "payload.sessionId")
    return _accepted(request, await tx.delivery.claim_turn(
        session_id=request.payload.sessionId, client_id=request.clientId,
        lease_ms=host.config.delivery_lease_ms, now=host.now()))


async def _turn_resolve(host: HostState, tx: UnitOfWork, request: ResolveTurn, prepared: None,
                        after: After) -> HostResponse:
    payload = request.payload
    return _accepted(request, await tx.delivery.resolve_turn(
        turn_id=payload.turnId, claim_id=payload.claimId, client_id=request.clientId,
        resolution=payload.resolution, now=host.now()))


async def _followup_queue(host: HostState, tx: UnitOfWork, request: QueueFollowUp, prepared: None,
                          after: After) -> HostResponse:
    payload = request.payload
    return _accepted(request, await tx.delivery.queue_followup(
        run_id=request.runId, request_key=payload.requestKey, prompt=payload.prompt, now=host.now()))


async def _followup_remove(host: HostState, tx: UnitOfWork, request: RemoveFollowUp, prepared: None,
                           after: After) -> HostResponse:
    return _accepted(request, await tx.delivery.remove_followup(
        run_id=request.runId, followup_id=request.payload.followUpId, now=host.now()))


async def _followup_list(host: HostState, request: ListFollowUps) -> FollowUpPage:
    payload = request.payload
    if payload.sessionId is not None:
        check_id(payload.sessionId, "payload.sessionId")
    return await host.store.delivery.list_followups(session_id=payload.sessionId, run_id=payload.runId,
                                                    limit=payload.limit, now=host.now())


async def _delivery_list(host: HostState, request: ListDelivery) -> DeliveryPage:
    payload, now = request.payload, host.now()
    if payload.sessionId is not None:
        check_id(payload.sessionId, "payload.sessionId")
    return DeliveryPage(
        notifications=await host.store.delivery.list_notifications(
            session_id=payload.sessionId, run_id=payload.runId, limit=payload.limit, now=now),
        turns=await host.store.delivery.list_turns(
            session_id=payload.sessionId, run_id=payload.runId, limit=payload.limit, now=now))


async def _run_watch(host: HostState, request: WatchRuns) -> WatchPage:
    """A snapshot (no ``after``), or what changed after the cursor ``after``, once
    something has (or at ``timeoutMs``, or when the client sends another request behind
    this one: then with what there is, maybe nothing)."""
    payload, run_id, store = request.payload, request.runId, host.store
    if run_id is not None:
        await store.runs.revision(run_id)  # notFound for an unknown run
    if payload.after is None:  # a snapshot, in pages of `limit` active runs
        return await store.updates.snapshot(run_id=run_id, limit=payload.limit, now=host.now(),
                                            runs_after=payload.runsAfter)
    with WATCH_ENDS_EARLY.get() or trio.CancelScope(), trio.move_on_after(payload.timeoutMs / 1000):
        after = payload.after
        await until_changed(host, lambda: _moved_past(host, run_id, after))
    return await store.updates.changes(after=payload.after, run_id=run_id, limit=payload.limit, now=host.now())


async def _moved_past(host: HostState, run_id: str | None, after: int) -> bool:
    return await host.store.updates.last_event(run_id) > after


READS: Reads = {ListDelivery: _delivery_list, ListFollowUps: _followup_list, WatchRuns: _run_watch}
WRITES: Writes = {
    ClaimNotification: (None, _notification_claim),
    DeliverNotification: (None, _notification_deliver),
    ClaimTurn: (None, _turn_claim),
    ResolveTurn: (None, _turn_resolve),
    QueueFollowUp: (None, _followup_queue),
    RemoveFollowUp: (None, _followup_remove),
}
