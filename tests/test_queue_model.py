"""The run-queue store against a model, driven by hypothesis: claim, renew, expire, run,
park, complete, fail, cancel and host crashes in any order.

Invariants: at most one live claim per run, no run lost, generation only grows, the
lifecycle projection holds, the store agrees with the model on every run's status, and the
counts host.status reads (kept by triggers) equal a full count after every step.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Rejected
from piwf.store.sqlite import Database, queue, runs
from piwf.store.sqlite.runs import LIFECYCLE_CONTRADICTIONS

LEASE = 1000
LIVE = ("starting", "running")


@dataclass
class ModelRun:
    order: int
    status: str = "queued"
    token: str | None = None
    expires: int = 0
    generation: int = 0
    paused: bool = False


class RunQueueMachine(RuleBasedStateMachine):
    issued = Bundle("issued")  # (run id, token) pairs ever handed out, live or stale

    @initialize()
    def open_store(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.db = Database.open(Path(self.tmp.name) / "model.db", durability="normal")
        self.clock = ManualClock()
        self.model: dict[str, ModelRun] = {}
        self.epoch = 1
        self.tokens = 0

    def teardown(self) -> None:
        if hasattr(self, "db"):
            self.db.close()
            self.tmp.cleanup()

    # --- helpers ---

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
        runs.create_run(self.db, run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d",
                        input=None, origin_session_id=None, now=self.now())
        self.model[run_id] = ModelRun(order=len(self.model))
        self.clock.advance(1)  # created_at orders claims

    @rule(target=issued)
    def claim_next(self) -> tuple[str, str] | None:
        self.tokens += 1
        token = f"t{self.tokens}"
        expected = min((r for r in self.model.items() if self.claimable(r[1])), key=lambda r: r[1].order,
                       default=None)
        claim = queue.claim_next_run(self.db, runner_id="h", token=token, lease_ms=LEASE, now=self.now(),
                                     epoch=self.epoch)
        if expected is None:
            assert claim is None
            return None
        run_id, run = expected
        assert claim is not None and claim.run_id == run_id
        run.status, run.token, run.expires = "starting", token, self.now() + LEASE
        run.generation += 1
        assert claim.generation == run.generation
        return run_id, token

    @rule(pair=issued)
    def renew(self, pair: tuple[str, str] | None) -> None:
        if pair is None:
            return
        run_id, token = pair
        expected = self.holds(run_id, token)
        assert queue.renew_claim(self.db, run_id, token, LEASE, self.now()) == expected
        if expected:
            self.model[run_id].expires = self.now() + LEASE

    @rule(pair=issued)
    def mark_running(self, pair: tuple[str, str] | None) -> None:
        if pair is None:
            return
        run_id, token = pair
        expected = self.holds(run_id, token)
        try:
            changed = queue.mark_running(self.db, run_id, token, self.now())
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
        assert queue.park_run(self.db, run_id, token, self.now()) == expected
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
                queue.complete_run(self.db, run_id, token, {"ok": True}, self.now())
            else:
                queue.fail_run(self.db, run_id, token, {"type": "X", "message": "m"}, self.now())
        except ClaimLost:
            assert not expected
            return
        assert expected
        self.model[run_id].status, self.model[run_id].token = outcome, None

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def cancel_unclaimed(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.model)))
        run = self.model[run_id]
        expected = run.status in ("queued", "parked")
        assert queue.cancel_run(self.db, run_id, self.now()) == expected
        if expected:
            run.status = "cancelled"

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), pause=st.booleans())
    def pause_or_resume(self, data: st.DataObject, pause: bool) -> None:
        """An operator hold: the run is not claimed again until resumed."""
        run_id = data.draw(st.sampled_from(sorted(self.model)))
        run = self.model[run_id]
        try:
            (runs.pause_run if pause else runs.resume_run)(self.db, run_id, self.now())
        except Rejected:
            assert run.status in ("done", "failed", "cancelled")
            return
        run.paused = pause

    @rule(ms=st.integers(min_value=1, max_value=2 * LEASE))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule()
    def host_crash(self) -> None:
        """A new host takes over: every claim of the old epoch is expired at once."""
        self.epoch += 1
        queue.expire_claims_before(self.db, self.epoch, self.now())
        for run in self.model.values():
            if run.status in LIVE:
                run.expires = min(run.expires, self.now())

    # --- invariants ---

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "db"):
            return
        rows = dict(self.db.execute("SELECT run_id, status FROM run_queue").fetchall())
        assert len(rows) == len(self.model)  # no run lost, none invented
        for run_id, run in self.model.items():
            assert rows[run_id] == run.status, run_id

    @invariant()
    def at_most_one_live_claim_and_generations_match(self) -> None:
        if not hasattr(self, "db"):
            return
        for run_id, run in self.model.items():
            live = [f"t{i}" for i in range(1, self.tokens + 1)
                    if queue.verify_claim(self.db, run_id, f"t{i}", self.now())]
            assert live == ([run.token] if self.live(run) else [])
            generation = self.db.scalar("SELECT generation FROM run_queue WHERE run_id = ?", (run_id,))
            assert generation == run.generation  # only ever bumped by a claim

    @invariant()
    def lifecycle_holds(self) -> None:
        if hasattr(self, "db"):
            assert self.db.scalar(LIFECYCLE_CONTRADICTIONS) == 0

    @invariant()
    def maintained_counts_are_exact(self) -> None:
        if not hasattr(self, "db"):
            return
        counts = runs.status_counts(self.db, self.now())
        assert counts == runs.recounted(self.db, self.now())
        assert counts["pausedRuns"] == sum(run.paused for run in self.model.values())
        assert counts["queuedRuns"] == sum(run.status == "queued" for run in self.model.values())


RunQueueMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRunQueue = RunQueueMachine.TestCase
