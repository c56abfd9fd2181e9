"""The run queue against a model, driven by hypothesis through the store interface: claim,
renew, expire, run, park, complete, fail, cancel, pause, resume and host crashes in any order.

Invariants: at most one live claim per run, no run lost, generation only grows, the
lifecycle projection holds, the store agrees with the model on every run's queue status,
and the counts host.status reads equal the model's after every step.

The state machine is synchronous (hypothesis drives it) and runs on a worker thread; each
store call goes back to the test's trio loop (``trio.from_thread.run``), so any backend
runs it as it runs everything else. Each example starts on an empty database: a new one
on SQLite (a file), on PostgreSQL the test's one schema emptied (its rows deleted: a new
schema costs its tables' creation), with fewer examples there — the SQL is the same on both, what
PostgreSQL adds (its dialect, locks) is shown in fewer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Rejected

LEASE = 1000
LIVE = ("starting", "running")
ENDED = ("done", "failed", "cancelled")


@dataclass
class ModelRun:
    order: int
    status: str = "queued"
    token: str | None = None
    expires: int = 0
    generation: int = 0
    paused: bool = False
    tokens: list[str] = field(default_factory=list)  # every token issued for it, live or stale


def machine(start: Callable[[], Awaitable[Any]], finish: Callable[[Any], Awaitable[None]],
            ) -> type[RuleBasedStateMachine]:
    """``start()``: an example's empty store; ``finish(store)`` after the example."""

    class RunQueueMachine(RuleBasedStateMachine):
        issued = Bundle("issued")  # (run id, token) pairs ever handed out

        @initialize()
        def open(self) -> None:
            self.clock = ManualClock()  # every store call is given its time: the store keeps no clock
            self.store = self.call(start)
            self.model: dict[str, ModelRun] = {}
            self.epoch = 1

        def teardown(self) -> None:
            if hasattr(self, "store"):
                self.call(finish, self.store)

        # --- helpers ---

        def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return trio.from_thread.run(functools.partial(function, *args, **kwargs))

        def now(self) -> int:
            return self.clock.now_ms()

        def live(self, run: ModelRun) -> bool:
            return run.status in LIVE and run.expires > self.now()

        def claimable(self, run: ModelRun) -> bool:
            ready = run.status in ("queued", "parked") and not run.paused
            return ready or (run.status in LIVE and run.expires <= self.now())

        def holds(self, run_id: str, token: str) -> bool:
            run = self.model[run_id]
            return run.token == token and self.live(run)

        # --- rules ---

        @rule()
        def create(self) -> None:
            run_id = f"r{len(self.model)}"
            self.call(self.store.runs.create_run, run_id=run_id, workflow="w", project_path="/p", source=b"s",
                      digest="d", input=None, origin_session_id=None, now=self.now())
            self.model[run_id] = ModelRun(order=len(self.model))
            self.clock.advance(1)  # created_at orders claims

        @rule(target=issued)
        def claim_next(self) -> tuple[str, str] | None:
            expected = min((r for r in self.model.items() if self.claimable(r[1])), key=lambda r: r[1].order,
                           default=None)
            got = self.call(self.store.supervision.claim_runs, room=1, exclude=frozenset(), runner_id="h",
                            lease_ms=LEASE, now=self.now(), epoch=self.epoch)
            if expected is None:
                assert got == []
                return None
            run_id, run = expected
            [(claim, _)] = got
            assert claim.run_id == run_id and claim.token not in run.tokens
            run.status, run.token, run.expires = "starting", claim.token, self.now() + LEASE
            run.generation += 1
            run.tokens.append(claim.token)
            assert claim.generation == run.generation
            return run_id, claim.token

        @rule(pair=issued)
        def renew(self, pair: tuple[str, str] | None) -> None:
            if pair is None:
                return
            run_id, token = pair
            expected = self.holds(run_id, token)
            lost = self.call(self.store.queue.renew_claims, [(run_id, token)], LEASE, self.now())
            assert lost == (set() if expected else {run_id})
            if expected:
                self.model[run_id].expires = self.now() + LEASE

        @rule(pair=issued)
        def mark_running(self, pair: tuple[str, str] | None) -> None:
            if pair is None:
                return
            run_id, token = pair
            expected = self.holds(run_id, token)
            try:
                changed = self.call(self.store.queue.mark_running, run_id, token, self.now())
            except ClaimLost:
                assert not expected
                return
            assert expected
            assert changed == (self.model[run_id].status == "starting")
            self.model[run_id].status = "running"

        @rule(pair=issued)
        def park(self, pair: tuple[str, str] | None) -> None:
            if pair is None:
                return
            run_id, token = pair
            # park_run releases a claim whose token matches while the queue row is live, even
            # past expiry (the owner parking its own run before anyone else claimed it).
            run = self.model[run_id]
            expected = run.token == token and run.status in LIVE
            assert self.call(self.store.queue.park_run, run_id, token, self.now()) == expected
            if expected:
                run.status, run.token = "parked", None

        @rule(pair=issued, outcome=st.sampled_from(["done", "failed"]))
        def settle(self, pair: tuple[str, str] | None, outcome: str) -> None:
            if pair is None:
                return
            run_id, token = pair
            expected = self.holds(run_id, token)
            try:
                if outcome == "done":
                    self.call(self.store.queue.complete_run, run_id, token, {"ok": True}, self.now())
                else:
                    self.call(self.store.queue.fail_run, run_id, token, {"type": "X", "message": "m"}, self.now())
            except ClaimLost:
                assert not expected
                return
            assert expected
            self.model[run_id].status, self.model[run_id].token = outcome, None

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def cancel_unclaimed(self, data: st.DataObject) -> None:
            """Without a token: a run no live claim holds (an expired claim included)."""
            run_id = data.draw(st.sampled_from(sorted(self.model)))
            run = self.model[run_id]
            expected = run.status in ("queued", "parked") or (run.status in LIVE and run.expires <= self.now())
            assert self.call(self.store.queue.cancel_run, run_id, self.now()) == expected
            if expected:
                run.status = "cancelled"

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data(), pause=st.booleans())
        def pause_or_resume(self, data: st.DataObject, pause: bool) -> None:
            """An operator hold: the run is not claimed again until resumed."""
            run_id = data.draw(st.sampled_from(sorted(self.model)))
            run = self.model[run_id]
            try:
                self.call(self.store.runs.pause_run if pause else self.store.runs.resume_run, run_id, self.now())
            except Rejected:
                assert run.status in ENDED
                return
            run.paused = pause

        @rule(ms=st.integers(min_value=1, max_value=2 * LEASE))
        def advance(self, ms: int) -> None:
            self.clock.advance(ms)

        @rule()
        def host_crash(self) -> None:
            """A new host takes over: every claim of the old epoch is expired at once."""
            self.epoch += 1
            self.call(self.store.queue.expire_claims_before, self.epoch, self.now())
            for run in self.model.values():
                if run.status in LIVE:
                    run.expires = min(run.expires, self.now())

        # --- invariants ---

        @invariant()
        def agrees_with_the_model(self) -> None:
            if not hasattr(self, "store"):
                return
            stored = {r.runId: r for r in self.call(self.store.runs.list_runs, limit=1000)}
            assert sorted(stored) == sorted(self.model)  # no run lost, none invented
            for run_id, run in self.model.items():
                assert stored[run_id].queueStatus == run.status, run_id
                assert stored[run_id].generation == run.generation, run_id  # only ever bumped by a claim
                assert stored[run_id].paused == run.paused, run_id

        @invariant()
        def at_most_one_live_claim(self) -> None:
            if not hasattr(self, "store"):
                return
            for run_id, run in self.model.items():
                live = []
                for token in run.tokens[-3:]:  # the newest and the last two it replaced
                    try:
                        self.call(self.store.queue.fenced_revision, run_id, token, self.now())
                        live.append(token)
                    except ClaimLost:
                        pass
                assert live == ([run.token] if self.live(run) else [])

        @invariant()
        def counts_and_lifecycle_agree_with_the_model(self) -> None:
            if not hasattr(self, "store"):
                return
            counts = self.call(self.store.runs.status_counts, self.now())
            runs = list(self.model.values())

            def having(*statuses: str) -> int:
                return sum(run.status in statuses for run in runs)

            assert {k: counts[k] for k in ("queuedRuns", "runningRuns", "parkedRuns", "completedRuns",
                                           "failedRuns", "cancelledRuns", "pausedRuns", "expiredClaims",
                                           "lifecycleContradictions")} == {
                "queuedRuns": having("queued"), "runningRuns": having(*LIVE), "parkedRuns": having("parked"),
                "completedRuns": having("done"), "failedRuns": having("failed"),
                "cancelledRuns": having("cancelled"), "pausedRuns": sum(run.paused for run in runs),
                "expiredClaims": sum(run.status in LIVE and run.expires <= self.now() for run in runs),
                "lifecycleContradictions": 0}

    return RunQueueMachine


async def test_the_run_queue_agrees_with_a_model(backend: Any, open_store: Callable[..., Any],
                                                 clock: ManualClock) -> None:
    if backend.name == "postgresql":
        store = await open_store(clock, "model")

        async def start() -> Any:
            await backend.empty("model")
            return store

        async def finish(store: Any) -> None:
            return None  # the fixture closes it at the end of the test

        examples = 20
    else:
        databases = itertools.count()

        async def start() -> Any:
            return await open_store(clock, f"model{next(databases)}")

        async def finish(store: Any) -> None:
            await store.close()

        examples = 60
    config = settings(max_examples=examples, stateful_step_count=40, deadline=None)
    await trio.to_thread.run_sync(lambda: run_state_machine_as_test(machine(start, finish), settings=config))
