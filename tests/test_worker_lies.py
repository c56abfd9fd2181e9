"""A worker that names another generation or worker than its own pipe's claim is a crash
(a protocol error), not a lost claim: its run backs off and is held, and can be cancelled
at any moment."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from piwf.client import AsyncClient
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import config, wait_for, write_workflow

LIAR = """
    import base64, json, os, time
    from pathlib import Path
    from piwf import Workflow, compute

    def lie(ctx):
        raw = os.environ["PIWF_WORKER_LAUNCH"]
        envelope = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        read_fd, write_fd = (int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(","))
        message = {"messageId": "lie", "workerEpoch": envelope["workerEpoch"] + ctx.input.get("epoch", ""),
                   "generation": envelope["generation"] + ctx.input.get("shift", 0), "expectedRevision": 0,
                   "operation": "steps.read", "payload": {"afterSeq": 0}}
        with open(Path(ctx.project_path) / "lied.log", "a") as f:
            f.write(f"{envelope['generation']}\\n")
        os.write(write_fd, (json.dumps(message) + "\\n").encode())
        time.sleep(600)  # whatever the answer: the host must stop this worker

    workflow = Workflow(name="liar", start_at="lie", nodes={"lie": compute(lie)})
"""


async def _start(client: AsyncClient, project: Path, **payload: object) -> str:
    started = await client.call("run.start", payload={"workflow": "liar", "projectPath": str(project), **payload})
    assert started.outcome == "accepted", started.error
    return started.receipt["runId"]


@pytest.mark.parametrize("lie", [{"shift": -1}, {"shift": 1}, {"epoch": "-other"}])
async def test_a_message_for_another_claim_on_a_workers_own_pipe_is_a_crash_and_the_run_is_held(
        paths: StatePaths, project: Path, nursery: trio.Nursery, lie: dict[str, object]) -> None:
    write_workflow(project, "liar", LIAR)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=3)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, input=lie)
        with trio.fail_after(20):  # today's main loops through generations and never holds it
            held = (await client.call("run.wait", run_id=run_id, payload={"timeoutMs": 20_000})).receipt
    assert (held["queueStatus"], held["hold"]) == ("parked", "crashed"), held
    assert [w["status"] for w in held["workers"]] == ["crashed"] * 3
    assert "broke the worker protocol: a message for worker" in held["statusDetail"]
    assert (project / "lied.log").read_text() == "1\n2\n3\n"  # one claim per crash, no more


async def test_a_lying_run_can_be_cancelled_at_any_moment(paths: StatePaths, project: Path,
                                                          nursery: trio.Nursery) -> None:
    write_workflow(project, "liar", LIAR)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=1000)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, input={"shift": -1})
        await wait_for(lambda: (project / "lied.log").exists()
                       and len((project / "lied.log").read_text().split()) >= 3)  # mid-loop, whatever its state
        cancelled = await client.call("run.cancel", run_id=run_id)
        assert cancelled.outcome == "accepted", cancelled.error
        done = (await client.call("run.wait", run_id=run_id)).receipt
    assert done["status"] == "cancelled"
