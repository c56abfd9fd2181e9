"""Steps of the controller conformance tests: a resource, its claims, a reconcile's
messages (each one unit of work opened by the claim's fence)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from piwf.clock import ManualClock

P, C = "/project", "mirror"
LEASE = 120_000
MIN_REQUEUE_MS = 1000  # a requeue waits at least this long (one pass a second at most)


async def apply(store: Any, clock: ManualClock, key: str = "a", spec: Any = None, expected: int | None = None) -> Any:
    return await store.controllers.apply_resource(project=P, controller=C, key=key,
                                                  spec={"text": "hi"} if spec is None else spec,
                                                  initial={"seed": True}, expected_version=expected, now=clock.now)


async def claim(store: Any, clock: ManualClock, room: int = 4, exclude: frozenset[str] = frozenset(),
                epoch: int = 1) -> list[Any]:
    return await store.controller_queue.claim_due(room=room, exclude=exclude, lease_ms=LEASE, now=clock.now,
                                                  epoch=epoch)


async def fenced(store: Any, clock: ManualClock, c: Any, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """One message of the reconcile holding ``c``: the fence, then ``call(tx)``, one unit of work."""
    async with store.transaction() as tx:
        await tx.controller_queue.fence(c.uid, c.token, LEASE, clock.now)
        return await call(tx)


async def start(store: Any, clock: ManualClock, c: Any) -> dict[str, Any]:
    return await fenced(store, clock, c, lambda tx: tx.controller_queue.reconcile_view(c.uid))


async def settle(store: Any, clock: ManualClock, c: Any, **kw: Any) -> str:
    args: dict[str, Any] = dict(requeue_after_ms=None, settled=True, controller_status={"ok": 1}, keep_status=False,
                                conditions=[{"type": "Ready", "status": "True", "reason": "Synced"}], finalizers=None)
    args.update(kw)
    return await fenced(store, clock, c,
                        lambda tx: tx.controller_queue.finish_success(c.uid, c.token, now=clock.now, **args))


async def fail(store: Any, clock: ManualClock, c: Any, delay_ms: Any = 1000, permanent: bool = False) -> int:
    return await fenced(store, clock, c, lambda tx: tx.controller_queue.finish_failure(
        c.uid, c.token, error="boom", delay_ms=delay_ms, permanent=permanent, now=clock.now))


async def detail(store: Any, clock: ManualClock, key: str = "a") -> Any:
    return await store.controllers.get_resource(P, C, key, clock.now)


async def reconciled(store: Any, clock: ManualClock, key: str = "a") -> Any:
    """A resource applied, claimed and started: its claim."""
    await apply(store, clock, key)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    return c
