"""People in the loop in the chaos harness (``python -m piwf.chaos --loop-every K``).

One run in K waits for a decision and then an ask whose validator refuses odd numbers; a
simulated person answers both while the kills go on, with the same request ids on every
retry. At the end every such run must have completed with the person's choice and an even
amount, each request resolved once, and no answer refused.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from piwf.chaos.common import Harness
from piwf.client import make_request

# People in the loop: a decision, then an ask whose validator refuses odd numbers. A
# simulated person answers both while the kills go on (see Person).
LOOP = """
    from piwf import Invalid, Workflow, ask, compute, decision

    def even(value):
        if value % 2:
            raise Invalid("an even number, please")

    workflow = Workflow(
        name="loop",
        start_at="approve",
        nodes={
            "approve": decision("Go on?", choices={"yes": "Yes", "no": "No"}),
            "amount": ask("How much (even)?", expect=int, validate=even),
            "done": compute(lambda ctx: {"choice": ctx.outputs["approve"]["choice"], "amount": ctx.outputs["amount"]}),
        },
        edges=[("approve", "amount"), ("amount", "done")],
    )
"""



class Person:
    def __init__(self, chaos: Harness, rng: random.Random) -> None:
        self.chaos = chaos
        self.rng = rng
        self.decided: dict[str, str] = {}  # run id -> the choice the person made
        self.asked: dict[str, int] = {}  # request id -> submissions made
        self.refused: list[str] = []  # answers the host refused (none expected)

    def run(self) -> None:
        """Answer what waits, as a person would: each decision once (a random choice), each
        ask first with an odd number (refused by the workflow) and then with an even one; an
        ask whose submission was rejected (by the validator, or because the worker
        validating it was killed) is answered again."""
        chaos = self.chaos
        while not chaos.settled.is_set():
            try:
                page = chaos.call("interaction.list", payload={"limit": 1000})
            except RuntimeError:
                continue
            for request in page["requests"]:
                try:
                    if request["kind"] == "decision":
                        self.decide(request)
                    elif (request["lastSubmission"] or {}).get("status") != "validating":
                        self.submit(request)
                except RuntimeError:  # unanswered for long (the host is restarting): ask again
                    continue
            chaos.settled.wait(0.02)

    def decide(self, request: dict[str, Any]) -> None:
        choice = self.decided.get(request["runId"]) or self.rng.choice(["yes", "no"])
        response = self.chaos.request(make_request(
            "decision.answer", client_id="person", request_id=f"person-{request['requestId']}",
            payload={"requestId": request["requestId"], "choice": choice}))
        if response.outcome in ("accepted", "adopted"):
            self.decided[request["runId"]] = choice
        else:
            self.refused.append(f"{request['requestId']}: {response.error}")

    def submit(self, request: dict[str, Any]) -> None:
        tries = self.asked.get(request["requestId"], 0)
        response = self.chaos.request(make_request(
            "interaction.submit", client_id="person", request_id=f"person-{request['requestId']}-{tries}",
            payload={"requestId": request["requestId"], "value": 1 if tries == 0 else 2 * tries}))
        if response.outcome in ("accepted", "adopted"):
            self.asked[request["requestId"]] = tries + 1
        elif "being validated" not in (response.error or ""):  # listed just before it was
            self.refused.append(f"{request['requestId']}: {response.error}")

    def summary(self, final: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Every loop run completed with the person's choice and an even amount, and each
        of its requests resolved once."""
        lost = twice = 0
        loop_runs = self.chaos.tally.loop_runs
        for run_id in loop_runs:
            run = final[run_id]
            output = run.get("output") or {}
            if run["status"] != "completed" or output.get("choice") != self.decided.get(run_id) \
                    or not isinstance(output.get("amount"), int) or output["amount"] % 2:
                lost += 1
            kinds = Counter(e["type"] for e in self.chaos.call("run.events", run_id=run_id)["events"])
            twice += max(0, kinds["decision.answered"] - 1) + max(0, kinds["submission.accepted"] - 1)
        return {"loop_runs": len(loop_runs), "decisions_answered": len(self.decided),
                "asks_submitted": sum(self.asked.values()), "answers_lost": lost, "answered_twice": twice,
                "answers_refused": len(self.refused)}
