"""What the controller branch of the nursery tree keeps: the reconcile lane's state (its
active reconciles and their scopes, the ends the store refused, the dispatcher's wake-up)
and the randomness of the back-off jitter (injectable)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from piwf.store.api import ControllerClaim, Delay
from piwf.host.lane_state import Active, Backoff, End, LaneState

ActiveReconcile = Active[ControllerClaim]


@dataclass(eq=False)
class ReconcileEnd(End[ControllerClaim]):
    """A reconcile that ended without reporting (crash, timeout, host stop): its failure,
    kept until the store records it."""

    error: str
    delay_ms: Delay
    counted: bool


@dataclass(eq=False)
class ControllerState(LaneState[ControllerClaim, ReconcileEnd]):
    random: random.Random = field(default_factory=random.Random)

    def backoff_ms(self, errors_before: int) -> int:
        """``min(60 s, 1 s·2^min(n, 6))`` for the n-th failure in a row (n counted before
        it, so the first waits about 1 s), less up to 10 % jitter."""
        return Backoff(base_ms=1000, max_ms=60_000, max_exponent=6, jitter=0.1, random=self.random).delay_ms(
            errors_before)
