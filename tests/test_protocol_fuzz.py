"""Whatever a client sends, the host answers or hangs up, and keeps serving others."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piwf.client import Client
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from piwf.wire import HOST_REQUEST, OUTCOMES

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
operations = st.sampled_from(["host.status", "run.start", "run.list", "run.status", "run.events", "run.wait",
                              "run.cancel", "run.pause", "run.resume", "nope", ""])
requests = st.fixed_dictionaries(
    {"schema": st.sampled_from([HOST_REQUEST, "other"]), "requestId": st.text(min_size=1, max_size=8),
     "clientId": st.text(max_size=8), "idempotencyKey": st.text(min_size=1, max_size=8), "operation": operations},
    optional={"runId": st.text(max_size=8) | st.integers(), "expectedRevision": json_values,
              "payload": st.dictionaries(st.sampled_from(["workflow", "projectPath", "input", "limit", "after",
                                                          "timeoutMs", "status", "x"]), json_values, max_size=4)},
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StatePaths]:
    """One real `piwf serve` for every example."""
    paths = StatePaths.resolve(tmp_path_factory.mktemp("fuzz") / "state")
    log = open(Path(paths.root).parent / "host.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root)],
                            stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while not _answers(paths):
        assert proc.poll() is None and time.monotonic() < deadline, "host did not start"
        time.sleep(0.02)
    yield paths
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    log.close()


def _answers(paths: StatePaths) -> bool:
    try:
        with Client(paths, timeout=5) as client:
            return client.call("host.status").outcome == "accepted"
    except HostUnavailable:
        return False


def exchange(paths: StatePaths, line: bytes) -> dict | None:
    with Client(paths, timeout=30) as client:
        try:
            return json.loads(client.send_line(line))
        except (HostUnavailable, ConnectionResetError, BrokenPipeError):
            return None  # the host hung up: allowed for unreadable frames


def assert_still_serving(paths: StatePaths) -> None:
    with Client(paths, timeout=30) as client:
        status = client.call("host.status")
    assert status.outcome == "accepted" and status.receipt["lifecycleContradictions"] == 0


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes(served: StatePaths, data: bytes) -> None:
    reply = exchange(served, data.replace(b"\n", b" ") + b"\n")
    assert reply is None or reply["outcome"] in OUTCOMES
    assert_still_serving(served)


@FUZZ
@given(request=requests)
def test_random_requests(served: StatePaths, request: dict) -> None:
    if request["operation"] == "run.wait":
        request.setdefault("payload", {})["timeoutMs"] = 0
    reply = exchange(served, json.dumps(request).encode() + b"\n")
    assert reply is not None and reply["outcome"] in OUTCOMES
    assert reply["outcome"] not in ("accepted", "adopted") or request["schema"] == HOST_REQUEST
    if reply.get("error"):
        assert "\n" not in reply["error"]
    assert_still_serving(served)
