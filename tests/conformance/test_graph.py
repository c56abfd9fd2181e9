"""A run's recorded workflow graph (``runs.run_graph``): recorded at creation, replaced when
the run adopts a changed workflow, answered with node states and the path; unknown for a
run made without one (before layout 14)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from piwf.clock import ManualClock
from piwf.errors import NotFound
from piwf.protocol import GraphEdge, NodeDefinition, WorkflowGraph
from piwf.store.api.types import Definition
from piwf.wire import canonical_json

from .helpers import claim


def graph_bytes(title: str) -> bytes:
    graph = WorkflowGraph(name="w", startAt="a", nodes=[
        NodeDefinition(id="a", kind="compute", title="prepare", exits=["next"]),
        NodeDefinition(id="b", kind="decision", title=title, exits=["yes", "no"]),
        NodeDefinition(id="c", kind="shell", title="echo done", exits=["next"]),
    ], edges=[GraphEdge(node="a", exit="next", to="b"), GraphEdge(node="b", exit="yes", to="c"),
              GraphEdge(node="b", exit="no", to="a")])
    return canonical_json(msgspec.to_builtins(graph))


async def accepted_then_running(store: Any, clock: ManualClock, accepted: tuple[str, str], running: str) -> None:
    """Run r1 claimed, node ``accepted[0]`` accepted through exit ``accepted[1]`` at seq 0,
    then node ``running`` running at seq 1."""
    got = await claim(store, clock)
    first, _ = await store.runs.start_attempt("r1", got.token, seq=0, node=accepted[0], generation=got.generation,
                                              now=clock.now_ms())
    await store.runs.accept_attempt("r1", got.token, attempt_id=first, output={}, exit_name=accepted[1],
                                    now=clock.now_ms())
    await store.runs.start_attempt("r1", got.token, seq=1, node=running, generation=got.generation,
                                   now=clock.now_ms())


async def test_a_run_answers_the_graph_it_recorded_with_each_nodes_state(store: Any, clock: ManualClock) -> None:
    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1", input={},
                                origin_session_id=None, now=clock.now_ms(), start_node="a",
                                graph=graph_bytes("Ship it?"))
    shown = await store.runs.run_graph("r1")
    assert (shown.known, shown.reason, shown.startAt, shown.definitionDigest) == (True, None, "a", "d1")
    assert [(n.id, n.kind, n.title, n.state) for n in shown.nodes] == [
        ("a", "compute", "prepare", "not_reached"), ("b", "decision", "Ship it?", "not_reached"),
        ("c", "shell", "echo done", "not_reached")]
    assert [(e.node, e.exit, e.to) for e in shown.edges] == [("a", "next", "b"), ("b", "yes", "c"), ("b", "no", "a")]
    await accepted_then_running(store, clock, ("a", "next"), "b")
    shown = await store.runs.run_graph("r1")
    assert [(n.id, n.state, n.visits, n.lastExit) for n in shown.nodes] == [
        ("a", "accepted", 1, "next"), ("b", "running", 1, None), ("c", "not_reached", 0, None)]
    assert [(p.seq, p.node, p.status, p.exit) for p in shown.path] == [(0, "a", "accepted", "next"),
                                                                        (1, "b", "running", None)]


async def test_a_run_that_adopts_a_changed_workflow_records_its_graph(store: Any, clock: ManualClock) -> None:
    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1", input={},
                                origin_session_id=None, now=clock.now_ms(), start_node="a", graph=graph_bytes("Old?"))
    await store.runs.pause_run("r1", clock.now_ms())
    await store.runs.resume_run("r1", clock.now_ms())
    assert (await store.runs.run_graph("r1")).nodes[1].title == "Old?"  # a plain resume keeps it
    got = await claim(store, clock)
    await store.queue.park_run("r1", got.token, clock.now_ms(), hold="source", detail="changed")
    await store.runs.resume_run("r1", clock.now_ms(), definition=Definition("d2", b"new", "a", graph_bytes("New?")))
    shown = await store.runs.run_graph("r1")
    assert (shown.definitionDigest, shown.nodes[1].title) == ("d2", "New?")


async def test_a_run_without_a_recorded_graph_answers_it_unknown(store: Any, clock: ManualClock) -> None:
    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1", input={},
                                origin_session_id=None, now=clock.now_ms())
    await accepted_then_running(store, clock, ("x", "left"), "y")
    shown = await store.runs.run_graph("r1")
    assert shown.known is False and shown.reason and "no definition is recorded" in shown.reason
    assert (shown.startAt, shown.edges) == (None, [])
    assert [(n.id, n.kind, n.exits, n.state) for n in shown.nodes] == [("x", "unknown", ["left"], "accepted"),
                                                                        ("y", "unknown", [], "running")]
    with pytest.raises(NotFound):
        await store.runs.run_graph("nope")


async def test_a_runs_attempts_come_with_their_outputs_a_page_at_a_time(store: Any, clock: ManualClock) -> None:
    from piwf.protocol import STEPS_PAGE_OUTPUT_BYTES

    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1", input={},
                                origin_session_id=None, now=clock.now_ms())
    got = await claim(store, clock)
    big = "x" * (STEPS_PAGE_OUTPUT_BYTES // 2)  # stored as a blob; two fill a page's budget
    for seq in range(3):
        attempt, _ = await store.runs.start_attempt("r1", got.token, seq=seq, node=f"n{seq}",
                                                    generation=got.generation, now=clock.now_ms())
        await store.runs.accept_attempt("r1", got.token, attempt_id=attempt, output={"seq": seq, "big": big},
                                        exit_name="next", now=clock.now_ms())
    failing, _ = await store.runs.start_attempt("r1", got.token, seq=3, node="n3", generation=got.generation,
                                                now=clock.now_ms())
    await store.runs.fail_attempt("r1", got.token, attempt_id=failing, error={"type": "ValueError", "message": "no"},
                                  now=clock.now_ms())
    first = await store.runs.run_steps("r1")
    assert [s.output["seq"] for s in first.steps] == [0] and first.next == 1  # two outputs would pass the budget
    assert (first.steps[0].node, first.steps[0].status, first.steps[0].exit) == ("n0", "accepted", "next")
    pages, offset = [first], first.next
    while offset is not None:
        pages.append(page := await store.runs.run_steps("r1", offset))
        offset = page.next
    steps = [step for page in pages for step in page.steps]
    assert [(s.seq, s.status) for s in steps] == [(0, "accepted"), (1, "accepted"), (2, "accepted"), (3, "failed")]
    assert steps[3].output is None and steps[3].error == {"type": "ValueError", "message": "no"}
    assert steps[3].attemptId == failing
    limited = await store.runs.run_steps("r1", 3, limit=1)
    assert ([s.seq for s in limited.steps], limited.next) == ([3], None)
    with pytest.raises(NotFound):
        await store.runs.run_steps("nope")


async def test_a_retried_run_records_the_graph_of_the_workflow_it_adopts(store: Any, clock: ManualClock) -> None:
    from .test_retry import failed

    await failed(store, clock)  # made without a graph: unknown, with the nodes it went through
    before = await store.runs.run_graph("r1")
    assert before.known is False and [(n.id, n.state) for n in before.nodes] == [("a", "accepted"), ("b", "failed")]
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice",
                               definition=Definition("d2", b"fixed", "a", graph_bytes("Fixed?")))
    after = await store.runs.run_graph("r1")
    assert (after.known, after.definitionDigest, after.nodes[1].title) == (True, "d2", "Fixed?")
    assert [(n.id, n.state) for n in after.nodes] == [("a", "accepted"), ("b", "failed"), ("c", "not_reached")]
