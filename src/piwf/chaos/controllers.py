"""Controllers in the chaos harness (``python -m piwf.chaos --resources N``).

Applies N resources of a controller whose reconcile applies one effect per spec
generation (a ledger line ``<key> <generation>``, observable) and then settles, and
changes half of the specs while the host and its workers are being killed. At the end
every resource must converge (``Ready=True``, ``observedGeneration == generation``, not
held) and no ledger line may appear twice.
"""

from __future__ import annotations

import random
import textwrap
import time
from collections import Counter
from typing import Any

from piwf.chaos import ledger
from piwf.chaos.common import Harness
from piwf.client import make_request

CONTROLLER = """
    import os
    import time
    from pathlib import Path
    from piwf import Controller, Result
    from piwf.chaos import ledger

    LEDGER = Path(os.environ["PIWF_CHAOS_CTL_LEDGER"])

    def reconcile(ctx):
        apply, observe = ledger.effect(LEDGER, f"{ctx.resource.key} {ctx.generation}", "entry")
        done = ctx.effects.ensure("touch", apply, observe)
        time.sleep(ctx.resource.spec["pause"])
        return Result.settled(status={"entry": done["entry"]},
                              conditions=[{"type": "Ready", "status": "True", "reason": "Touched"}])

    controller = Controller(name="chaosctl", reconcile=reconcile)
"""


class ControllerChaos:
    def __init__(self, chaos: Harness) -> None:
        self.chaos = chaos
        self.count = chaos.args.resources
        self.ledger = chaos.root / "ctl-ledger.txt"
        self.ambiguous = 0
        self.rng = random.Random(chaos.args.seed + 2)  # its own: the other threads' draws stay the seed's

    def install(self) -> None:
        path = self.chaos.project / ".piwf" / "controllers" / "chaosctl.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(CONTROLLER))

    def env(self) -> dict[str, str]:
        return {"PIWF_CHAOS_CTL_LEDGER": str(self.ledger)}

    def _target(self, index: int) -> dict[str, Any]:
        return {"projectPath": str(self.chaos.project), "controller": "chaosctl", "key": f"r{index}"}

    def apply_all(self) -> None:
        """Apply every resource, then change the spec of every other one (a new generation)."""
        rng = self.rng
        for round_ in (1, 2):
            for index in range(self.count):
                if round_ == 2 and index % 2:
                    continue
                payload = {**self._target(index), "spec": {"round": round_, "pause": round(rng.uniform(0, 0.2), 3)}}
                request = make_request("controller.apply", client_id="chaos", idempotency_key=f"ctl-{round_}-{index}",
                                       request_id=f"ctl-{round_}-{index}", payload=payload)
                response = self.chaos.request(request)
                if response.outcome not in ("accepted", "adopted"):
                    raise RuntimeError(f"controller.apply r{index}: {response.outcome}: {response.error}")
                time.sleep(rng.uniform(0, 0.03))

    def settle(self, deadline: float) -> dict[str, Any]:
        final = [self._wait(index, deadline) for index in range(self.count)]
        applied = Counter(ledger.entries(self.ledger))
        converged = [r for r in final if _converged(r)]
        return {
            "resources": self.count,
            "resources_converged": len(converged),
            "resource_effects_applied": sum(applied.values()),
            "resource_effects_applied_twice": sum(1 for n in applied.values() if n > 1),
            "resources_missing_effect": sum(1 for r in converged
                                            if applied[f"{r['key']} {r['generation']}"] != 1),
            "resources_held_ambiguous": self.ambiguous,
        }

    def _wait(self, index: int, deadline: float) -> dict[str, Any]:
        while True:
            resource: dict[str, Any] = self.chaos.call("controller.get", payload=self._target(index))
            if resource["hold"] == "effect":
                self._resolve(resource)
            elif _converged(resource) or time.monotonic() > deadline:
                return resource
            time.sleep(0.05)

    def _resolve(self, resource: dict[str, Any]) -> None:
        """The operator's part: the ledger says whether the ambiguous effect was applied."""
        self.ambiguous += 1
        entry = f"{resource['key']} {resource['generation']}"
        applied = entry in ledger.entries(self.ledger)
        self.chaos.call("controller.resolve", payload={**self._target(int(resource["key"][1:])), "effectKey": "touch",
                                                       "applied": applied,
                                                       "result": {"entry": entry} if applied else None})


def _converged(resource: dict[str, Any]) -> bool:
    return (resource["ready"] == "True" and resource["observedGeneration"] == resource["generation"]
            and resource["hold"] is None and not resource["reconciling"] and resource["availableAt"] is None)


def bad(summary: dict[str, Any]) -> bool:
    if not summary.get("resources"):
        return False
    return bool(summary["resources_converged"] != summary["resources"] or summary["resource_effects_applied_twice"] > 0
                or summary["resources_missing_effect"] > 0)
