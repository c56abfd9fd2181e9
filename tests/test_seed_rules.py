"""The seed's small rules (issue 22 point 24), against real hosts: a load failure keeps up
to 8,192 characters of its reason, and a host that is stopping answers `unavailable`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from piwf.client import make_request
from piwf.paths import StatePaths
from piwf.protocol.worker import LOAD_ERROR_LIMIT
from piwf.wire import encode_line

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_controllers import get, write_controller
from .test_lifecycle import call, run_status

# Loads in the throwaway process that run.start (controller.apply) inspects it in; raises
# a long error only in the worker that runs (reconciles) it.
LOUD_WORKFLOW = """
    import os
    from piwf import Workflow, compute

    if "PIWF_WORKER_LAUNCH" in os.environ:
        raise RuntimeError("x" * COUNT + "END")

    workflow = Workflow(name="loud", start_at="a", nodes={"a": compute(lambda ctx: 1)})
"""
LOUD_CONTROLLER = """
    import os
    from piwf import Controller, Result

    if "PIWF_RECONCILE_LAUNCH" in os.environ:
        raise RuntimeError("x" * COUNT + "END")

    controller = Controller(name="loud", reconcile=lambda ctx: Result.settled())
"""


def _reason(path: Path, count: int) -> str:
    return f"{path} failed to import: RuntimeError: {'x' * count}END"


async def test_a_workflow_load_failure_keeps_8192_characters_of_its_reason(
        host: Any, paths: StatePaths, project: Path) -> None:
    for count, kept_whole in ((6000, True), (20_000, False)):
        path = write_workflow(project, "loud", LOUD_WORKFLOW.replace("COUNT", str(count)))
        run_id = (await call(paths, "run.start", payload={"workflow": "loud", "projectPath": str(project)}))["runId"]

        run = await wait_for(lambda: _held(paths, run_id))  # noqa: B023 (awaited in this iteration)
        reason = _reason(path, count)
        assert run["statusDetail"].startswith("no live host can load its workflow: host-")  # the one host's reason
        assert run["statusDetail"].endswith(f": workflow cannot load: {reason[:LOAD_ERROR_LIMIT]}")
        assert run["statusDetail"].endswith("END") == kept_whole  # 6,000 were cut to 1,500 before


async def _held(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["hold"] == "source" else None


async def test_a_controller_load_failure_keeps_8192_characters_of_its_reason(
        host: Any, paths: StatePaths, project: Path) -> None:
    path = write_controller(project, "loud", LOUD_CONTROLLER.replace("COUNT", "6000"))
    await call(paths, "controller.apply", payload={"projectPath": str(project), "controller": "loud", "key": "k",
                                                   "spec": {}})

    async def failed() -> dict[str, Any] | None:
        got = await get(paths, project, "loud", "k")
        return got if got and got["lastError"] else None

    got = await wait_for(failed)
    assert got["lastError"] == f"controller cannot load: {_reason(path, 6000)}"


@pytest.mark.parametrize("operation", ["run.start", "host.status"])
async def test_a_stopping_host_answers_unavailable_and_changes_nothing(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, operation: str) -> None:
    """A request behind `host.stop` on its connection is answered `unavailable` ("the host
    is stopping"), a read as a write, and what it asked for does not happen."""
    host = await host_process().start()
    lines = [make_request("host.stop", client_id="c", request_id="stop"),
             make_request(operation, client_id="c", request_id="behind",
                          payload={"workflow": "greet", "projectPath": str(project)} if operation == "run.start"
                          else {})]
    stream = await trio.open_unix_socket(str(paths.socket))
    async with stream:
        await stream.send_all(b"".join(encode_line(line) for line in lines))  # one write: read as one chunk
        received = b""
        with trio.fail_after(20):
            while received.count(b"\n") < len(lines):
                chunk = await stream.receive_some(65536)
                assert chunk, f"the host closed the connection after {received!r}"
                received += chunk
    answers = [msgspec.json.decode(line) for line in received.splitlines()]
    assert [(a["requestId"], a["outcome"]) for a in answers] == [("stop", "accepted"), ("behind", "unavailable")]
    assert answers[1]["error"] == "the host is stopping"
    assert await host.wait() == 0
    await host_process().start()
    assert json.loads((await piwf(paths, "run", "list", "--json")).stdout) == []  # the start did nothing
