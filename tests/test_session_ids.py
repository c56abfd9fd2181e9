"""What session ids protect (docs/people-in-the-loop.md): the socket admits only the same
user; inside it session and client ids are labels. A submission naming another session is
refused (a mistake caught); one naming the right session is taken from any client, and a
decision from any session; who answered is recorded as the client named itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import wait_for, write_workflow
from .test_interactions import open_request, start, wait_run
from .test_lifecycle import call

ASK = """
    from piwf import Workflow, ask, decision

    workflow = Workflow(name="both", start_at="name", nodes={
        "name": ask("Your name?", expect=str),
        "go": decision("Go?", choices={"yes": "Go"}),
    }, edges=[("name", "go")])
"""


async def test_session_ids_are_labels_that_catch_mistakes_not_credentials(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "both", ASK)
    run_id = await start(paths, project, "both", originSessionId="agent-a")
    request = await open_request(paths, run_id)
    async with AsyncClient(paths, client_id="agent-b-tool") as other:
        wrong = await other.call("interaction.submit", payload={"requestId": request["requestId"], "value": "b",
                                                               "sessionId": "agent-b"})
        assert wrong.outcome == "rejected"
        assert wrong.error == (f"request {request['requestId']} belongs to session agent-a; "
                               "submit with that sessionId")
        missing = await other.call("interaction.submit", payload={"requestId": request["requestId"], "value": "b"})
        assert missing.outcome == "rejected"
        # The same client, saying it is agent-a: a label, so it is taken.
        taken = await other.call("interaction.submit", payload={"requestId": request["requestId"], "value": "b",
                                                               "sessionId": "agent-a"})
        assert taken.outcome == "accepted", taken.error
    decision = await _next_request(paths, run_id, request["requestId"])
    async with AsyncClient(paths, client_id="anyone-at-all") as anyone:  # no session asked of a decision
        answered = await anyone.call("decision.answer", payload={"requestId": decision["requestId"],
                                                                "choice": "yes"})
        assert answered.outcome == "accepted", answered.error
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed"
    assert done["output"]["answeredBy"] == "anyone-at-all"  # as the client named itself
    async with AsyncClient(paths, client_id="not-agent-a") as stranger:  # its turn, claimed by anyone naming it
        claim = await stranger.call("turn.claim", payload={"sessionId": "agent-a"})
        assert claim.outcome == "accepted" and claim.receipt["turn"]["runId"] == run_id


async def _next_request(paths: StatePaths, run_id: str, after: str) -> dict[str, Any]:
    async def found() -> dict[str, Any] | None:
        page = await call(paths, "interaction.list", payload={"runId": run_id})
        fresh = [r for r in page["requests"] if r["requestId"] != after]
        return fresh[0] if fresh else None
    return await wait_for(found)
