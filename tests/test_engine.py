"""Workflow definitions, validation, digests, loading and the executor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from piwf import Route, Workflow, compute, shell
from piwf.engine.executor import Step, Stop, execute
from piwf.engine.loader import load_workflow, workflow_names
from piwf.errors import DefinitionError, NodeFailed, WorkflowLoadError

from .conftest import write_workflow


def noop(ctx: Any) -> dict:
    return {}


class RecordingJournal:
    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def start(self, seq: int, node: str) -> str:
        if seq == self.stop_at:
            raise Stop("paused")
        self.events.append(("start", seq, node))
        return f"a{seq}"

    def accept(self, attempt_id: str, output: Any, exit_name: str, *, final: bool = False) -> None:
        self.events.append(("accept", attempt_id, output, exit_name))
        self.final = final

    def fail(self, attempt_id: str, error: dict) -> None:
        self.events.append(("fail", attempt_id, error["type"], error["message"]))

    def effect(self, node: str, key: str, apply: Any, observe: Any) -> Any:
        self.events.append(("effect", node, key))
        return apply()

    def process_started(self, node: str, pid: int) -> None:
        self.events.append(("process", node))

    def process_ended(self, pid: int) -> None:
        self.events.append(("process ended",))


def run(workflow: Workflow, journal: RecordingJournal | None = None, accepted: list[Step] | None = None,
        input: Any = None, project: str = "/") -> Any:
    return execute(workflow, run_id="r", project_path=project, input=input, accepted=accepted or [],
                   journal=journal or RecordingJournal())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"start_at": "nope", "nodes": {"a": compute(noop)}}, "start node 'nope'"),
    ({"start_at": "a", "nodes": {"a": compute(noop)}, "edges": [("a", "b")]}, "unknown node 'b'"),
    ({"start_at": "a", "nodes": {"a": compute(noop)}, "edges": [("x.yes", "a")]}, "unknown node 'x'"),
    ({"start_at": "a", "nodes": {"a": compute(noop), "b": compute(noop)}}, "unreachable from 'a': b"),
    ({"start_at": "a", "nodes": {"a": compute(noop), "b": compute(noop), "c": compute(noop)},
      "edges": [("a", "b"), ("a", "c")]}, "two edges leave a"),
    ({"start_at": "a", "nodes": {"a": compute(noop), "b": compute(noop), "c": compute(noop)},
      "edges": [("a.yes", "b"), ("a.yes", "c")]}, "two edges leave a.yes"),
    ({"start_at": "a", "nodes": {}}, "has no nodes"),
    ({"start_at": "a", "nodes": {"a": "not a node"}}, "not a compute"),
])
def test_invalid_graphs_are_refused_clearly(kwargs: dict, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        Workflow(name="w", **kwargs)


def test_shell_needs_an_argv_list() -> None:
    with pytest.raises(DefinitionError, match="non-empty list"):
        shell("echo hi")  # type: ignore[arg-type]


def test_digest_tracks_graph_and_code_but_not_identity() -> None:
    def make(fn: Any, argv: list[str]) -> Workflow:
        return Workflow("w", "a", {"a": compute(fn), "b": shell(argv)}, [("a", "b")])

    base = make(lambda ctx: 1, ["echo"]).digest()
    assert make(lambda ctx: 1, ["echo"]).digest() == base
    assert make(lambda ctx: 2, ["echo"]).digest() != base
    assert make(lambda ctx: 1, ["echo", "x"]).digest() != base


def test_executor_walks_edges_and_passes_outputs() -> None:
    workflow = Workflow("w", "a", {
        "a": compute(lambda ctx: {"n": ctx.input["n"] + 1}),
        "b": compute(lambda ctx: {"n": ctx.outputs["a"]["n"] * 10}),
    }, [("a", "b")])
    journal = RecordingJournal()
    assert run(workflow, journal, input={"n": 1}) == {"n": 20}
    assert [e[0] for e in journal.events] == ["start", "accept", "start", "accept"]
    assert journal.final  # the last accept says the run ends with it


def test_named_exits_route_by_the_returned_exit() -> None:
    workflow = Workflow("w", "check", {
        "check": compute(lambda ctx: Route("big" if ctx.input > 5 else "small", ctx.input)),
        "big": compute(lambda ctx: "big"),
        "small": compute(lambda ctx: "small"),
    }, [("check.big", "big"), ("check.small", "small")])
    assert run(workflow, input=9) == "big"
    assert run(workflow, input=1) == "small"


def test_an_undeclared_exit_fails_the_node() -> None:
    workflow = Workflow("w", "a", {"a": compute(lambda ctx: Route("maybe")), "b": compute(noop)},
                        [("a.yes", "b")])
    journal = RecordingJournal()
    with pytest.raises(NodeFailed, match="chose exit 'maybe'"):
        run(workflow, journal)
    assert journal.events[-1][0] == "fail"


def test_accepted_steps_are_reused_not_rerun() -> None:
    calls: list[str] = []
    workflow = Workflow("w", "a", {
        "a": compute(lambda ctx: calls.append("a") or {"from": "a"}),
        "b": compute(lambda ctx: calls.append("b") or {"saw": ctx.outputs["a"]}),
    }, [("a", "b")])
    result = run(workflow, accepted=[Step(0, "a", "next", {"from": "stored"})])
    assert calls == ["b"] and result == {"saw": {"from": "stored"}}


def test_history_that_diverges_from_the_graph_is_an_error() -> None:
    workflow = Workflow("w", "a", {"a": compute(noop)})
    with pytest.raises(DefinitionError, match="graph now leads"):
        run(workflow, accepted=[Step(0, "other", "next", {})])


def test_a_node_error_is_recorded_with_type_message_and_traceback() -> None:
    def explode(ctx: Any) -> None:
        raise ValueError("the fuse was lit")

    journal = RecordingJournal()
    with pytest.raises(NodeFailed) as info:
        run(Workflow("w", "a", {"a": compute(explode)}), journal)
    assert journal.events[-1] == ("fail", "a0", "ValueError", "node a: the fuse was lit")
    assert "explode" in info.value.error["traceback"]


def test_non_json_output_fails_the_node() -> None:
    with pytest.raises(NodeFailed, match="not JSON"):
        run(Workflow("w", "a", {"a": compute(lambda ctx: object())}))


def test_shell_output_and_failure(tmp_path: Path) -> None:
    ok = Workflow("w", "a", {"a": shell(["sh", "-c", "echo out; echo err >&2"])})
    assert run(ok, project=str(tmp_path)) == {"stdout": "out\n", "stderr": "err\n", "exitCode": 0}
    bad = Workflow("w", "a", {"a": shell(["sh", "-c", "echo nope >&2; exit 3"])})
    journal = RecordingJournal()
    with pytest.raises(NodeFailed, match="exited with status 3: nope"):
        run(bad, journal, project=str(tmp_path))


def test_shell_env_cwd_and_timeout(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    node = shell(["sh", "-c", "pwd; echo $GREETING"], cwd="sub", env={"GREETING": "hi"})
    out = run(Workflow("w", "a", {"a": node}), project=str(tmp_path))
    assert out["stdout"] == f"{tmp_path / 'sub'}\nhi\n"
    slow = Workflow("w", "a", {"a": shell(["sleep", "5"], timeout=0.05)})
    with pytest.raises(NodeFailed, match="timed out"):
        run(slow, project=str(tmp_path))


def test_stop_at_a_node_boundary() -> None:
    workflow = Workflow("w", "a", {"a": compute(noop), "b": compute(noop)}, [("a", "b")])
    journal = RecordingJournal(stop_at=1)
    with pytest.raises(Stop):
        run(workflow, journal)
    assert [e[0] for e in journal.events] == ["start", "accept"]


def test_load_workflow_from_a_project(project: Path) -> None:
    assert "greet" in workflow_names(project)
    assert load_workflow(project, "greet").start_at == "hello"


@pytest.mark.parametrize(("source", "message"), [
    ("x = 1\n", "no module-level `workflow"),
    ("raise RuntimeError('oops')\n", "failed to import: RuntimeError: oops"),
    ("from piwf import Workflow, compute\nworkflow = Workflow('other', 'a', {'a': compute(print)})\n",
     "defines workflow 'other'"),
])
def test_broken_workflow_files_are_refused_clearly(tmp_path: Path, source: str, message: str) -> None:
    write_workflow(tmp_path, "bad", source)
    with pytest.raises(WorkflowLoadError, match=message):
        load_workflow(tmp_path, "bad")


def test_missing_workflow_and_bad_names(tmp_path: Path) -> None:
    with pytest.raises(WorkflowLoadError, match="does not exist"):
        load_workflow(tmp_path, "ghost")
    with pytest.raises(WorkflowLoadError, match="not a workflow name"):
        load_workflow(tmp_path, "../etc")


def test_a_host_refusal_inside_a_node_is_not_the_node_failing(tmp_path: Path) -> None:
    """If the host will not record what a node does (a full disk), the worker ends and the
    run is tried again; the node is not recorded as failed."""
    from piwf.errors import HostRefused

    class RefusingJournal(RecordingJournal):
        def process_started(self, node: str, pid: int) -> None:
            raise HostRefused("host refused process.register: disk full")

    journal = RefusingJournal()
    workflow = Workflow("w", "sh", {"sh": shell(["echo", "hi"])})
    with pytest.raises(HostRefused):
        run(workflow, journal, project=str(tmp_path))
    assert [e[0] for e in journal.events] == ["start", "process ended"]  # and no "fail"
