"""``run.graph``: the graph a run recorded of its workflow, each node's state and the path
taken (and ``run.steps``, its attempts with outputs), with real hosts on both stores; and
the pure parts (the graph a workflow makes, the states read from attempts) alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piwf import Route, Workflow, ask, compute, decision, shell
from piwf.engine.graph import workflow_graph
from piwf.paths import StatePaths
from piwf.protocol import NodeDefinition, WorkflowGraph
from piwf.status import RunStatus
from piwf.store.sql.graph import graph_answer

from .conftest import HostProcess, piwf, write_workflow
from .test_lifecycle import call, start

REVIEW = """
    from piwf import Workflow, compute, decision, shell

    workflow = Workflow(
        name="review",
        start_at="prepare",
        nodes={
            "prepare": compute(lambda ctx: {"ready": True}),
            "approve": decision(TITLE, choices={"yes": "Ship", "no": "Again"}),
            "ship": shell(["echo", "shipped"]),
        },
        edges=[("prepare", "approve"), ("approve.yes", "ship"), ("approve.no", "prepare")],
    )
"""


def review(project: Path, title: str) -> None:
    write_workflow(project, "review", REVIEW.replace("TITLE", repr(title)))


async def graph(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return await call(paths, "run.graph", run_id=run_id)


async def at_rest(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})


def states(shown: dict[str, Any]) -> dict[str, str]:
    return {node["id"]: node["state"] for node in shown["nodes"]}


def path(shown: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    return [(step["node"], step["status"], step["exit"]) for step in shown["path"]]


async def answer(paths: StatePaths, request_id: str, choice: str) -> None:
    await call(paths, "decision.answer", payload={"requestId": request_id, "choice": choice})


async def test_a_waiting_run_shows_its_waiting_node_the_accepted_ones_and_a_revisit_in_its_path(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, store_args: tuple[str, ...],
) -> None:
    review(project, "Ship <b>it</b>?")
    await host_process(*store_args).start()
    run_id = await start(paths, project, "review")
    assert (await at_rest(paths, run_id))["status"] == "waiting"
    shown = await graph(paths, run_id)
    assert shown["known"] is True and shown["startAt"] == "prepare" and shown["status"] == "waiting"
    assert states(shown) == {"approve": "waiting", "prepare": "accepted", "ship": "not_reached"}
    approve = next(node for node in shown["nodes"] if node["id"] == "approve")
    assert (approve["kind"], approve["title"], approve["exits"]) == ("decision", "Ship <b>it</b>?", ["yes", "no"])
    open_request = (await call(paths, "interaction.list", payload={"runId": run_id}))["requests"][0]
    assert approve["requestId"] == open_request["requestId"]
    assert {(e["node"], e["exit"], e["to"], e["taken"]) for e in shown["edges"]} == {
        ("prepare", "next", "approve", 1), ("approve", "yes", "ship", 0), ("approve", "no", "prepare", 0)}

    await answer(paths, approve["requestId"], "no")  # back to prepare, then waiting again
    assert (await at_rest(paths, run_id))["status"] == "waiting"
    again = await graph(paths, run_id)
    assert path(again) == [("prepare", "accepted", "next"), ("approve", "accepted", "no"),
                           ("prepare", "accepted", "next"), ("approve", "waiting", None)]
    revisited = {node["id"]: node for node in again["nodes"]}
    assert (revisited["prepare"]["visits"], revisited["approve"]["visits"]) == (2, 2)
    assert revisited["approve"]["lastExit"] == "no" and revisited["approve"]["requestId"] != approve["requestId"]

    await answer(paths, revisited["approve"]["requestId"], "yes")
    assert (await at_rest(paths, run_id))["status"] == "completed"
    done = await graph(paths, run_id)
    outputs = (await call(paths, "run.steps", run_id=run_id))["steps"]
    assert [s["output"] for s in outputs if s["node"] == "prepare"] == [{"ready": True}, {"ready": True}]
    assert outputs[-1]["output"]["stdout"] == "shipped\n"
    assert states(done) == {"approve": "accepted", "prepare": "accepted", "ship": "accepted"}
    assert path(done)[-2:] == [("approve", "accepted", "yes"), ("ship", "accepted", "next")]
    assert {(e["node"], e["exit"]): e["taken"] for e in done["edges"]} == {
        ("prepare", "next"): 2, ("approve", "no"): 1, ("approve", "yes"): 1}


async def test_a_failed_node_shows_failed_and_the_cli_prints_the_graph(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, store_args: tuple[str, ...],
) -> None:
    await host_process(*store_args).start()
    run_id = await start(paths, project, "boom")
    assert (await at_rest(paths, run_id))["status"] == "failed"
    shown = await graph(paths, run_id)
    assert shown["nodes"] == [{"id": "explode", "kind": "compute", "title": "explode", "exits": ["next"],
                               "state": "failed", "visits": 1, "lastExit": None, "requestId": None}]
    assert path(shown) == [("explode", "failed", None)]
    steps = await call(paths, "run.steps", run_id=run_id)
    assert steps["next"] is None and [(s["node"], s["status"]) for s in steps["steps"]] == [("explode", "failed")]
    assert steps["steps"][0]["error"]["message"].endswith("the fuse was lit") and steps["steps"][0]["output"] is None
    printed = await piwf(paths, "run", "graph", run_id)
    assert "explode" in printed.stdout.decode() and "failed" in printed.stdout.decode()
    as_json = json.loads((await piwf(paths, "run", "graph", run_id, "--json")).stdout)
    assert as_json == shown


async def test_a_run_whose_workflow_changed_records_the_new_definition_when_it_adopts_it(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, store_args: tuple[str, ...],
) -> None:
    review(project, "Old question?")
    await host_process(*store_args).start()
    run_id = await start(paths, project, "review")
    assert (await at_rest(paths, run_id))["status"] == "waiting"
    first = await graph(paths, run_id)
    review(project, "New question?")  # the source changes while the run waits
    request_id = next(node["requestId"] for node in first["nodes"] if node["id"] == "approve")
    await answer(paths, request_id, "yes")
    held = await at_rest(paths, run_id)
    assert held["hold"] == "source", held
    kept = await graph(paths, run_id)  # held, not adopted: still the graph it ran with
    assert kept["definitionDigest"] == first["definitionDigest"]
    assert next(n["title"] for n in kept["nodes"] if n["id"] == "approve") == "Old question?"
    await call(paths, "run.resume", run_id=run_id)
    assert (await at_rest(paths, run_id))["status"] == "completed"
    adopted = await graph(paths, run_id)
    assert adopted["definitionDigest"] != first["definitionDigest"]
    assert next(n["title"] for n in adopted["nodes"] if n["id"] == "approve") == "New question?"
    assert states(adopted) == {"approve": "accepted", "prepare": "accepted", "ship": "accepted"}


# --- the pure parts --------------------------------------------------------------------------------


def test_a_workflow_graph_names_every_exit_and_resolves_every_edge() -> None:
    def pick(ctx: Any) -> Route:
        return Route("left", 1)

    flow = Workflow("shapes", "pick", {
        "pick": compute(pick, time_limit=5),
        "left": shell(["echo", "it's here"], env={"TOKEN": "secret"}),
        "choose": decision("Which?", {"a": "A", "b": "B"}, deadline=60),
        "late": compute(lambda ctx: None),
        "value": ask("How many?", expect=int, deadline=30),
    }, [("pick.left", "left"), ("pick.right", "choose"), ("pick.timeout", "late"), ("left", "choose"),
        ("choose", "value"), ("choose.timeout", "late")])
    made = workflow_graph(flow)
    nodes = {node.id: node for node in made.nodes}
    assert nodes["pick"].exits == ["left", "right", "timeout"]
    assert (nodes["left"].title, nodes["left"].exits) == ("echo 'it'\"'\"'s here'", ["next"])
    assert nodes["choose"].exits == ["a", "b", "timeout"]  # a deadline with no default can time out
    assert nodes["value"].exits == ["next", "timeout"] and nodes["value"].title == "How many?"
    assert nodes["pick"].title.endswith("pick") and nodes["late"].title.endswith("<lambda>")
    edges = {(e.node, e.exit): e.to for e in made.edges}
    assert edges[("choose", "a")] == edges[("choose", "b")] == "value"  # one plain edge serves every choice
    assert edges[("choose", "timeout")] == "late" and ("value", "next") not in edges  # the end of the run
    assert "secret" not in json.dumps([n.title for n in made.nodes])  # no environment values
    ends = workflow_graph(Workflow("ends", "ask", {  # a deadline with no edge for it: the run ends timed out
        "ask": decision("Go?", {"yes": "Yes"}, deadline=60), "go": compute(lambda ctx: None)}, [("ask.yes", "go")]))
    assert ends.nodes[0].exits == ["yes", "timeout"]
    assert [(e.node, e.exit, e.to) for e in ends.edges] == [("ask", "yes", "go")]


def test_states_come_from_each_nodes_latest_attempt_and_an_ended_run_has_no_live_one() -> None:
    recorded = WorkflowGraph(name="w", startAt="a", nodes=[
        NodeDefinition(id="a", kind="compute", title=None, exits=["next"]),
        NodeDefinition(id="b", kind="ask", title="?", exits=["next"]),
        NodeDefinition(id="c", kind="compute", title=None, exits=["next"])], edges=[])
    attempts = [(0, "t1", "a", "interrupted", None), (0, "t2", "a", "accepted", "next"),
                (1, "t3", "b", "waiting", None)]
    waiting = graph_answer("r", "w", RunStatus.WAITING, "d", recorded, attempts, {"t3": "req-1"})
    assert [(n.id, n.state, n.visits, n.requestId) for n in waiting.nodes] == [
        ("a", "accepted", 2, None), ("b", "waiting", 1, "req-1"), ("c", "not_reached", 0, None)]
    cancelled = graph_answer("r", "w", RunStatus.CANCELLED, "d", recorded, attempts, {})
    assert [n.state for n in cancelled.nodes] == ["accepted", "interrupted", "not_reached"]
    assert [p.status for p in cancelled.path] == ["interrupted", "accepted", "interrupted"]


def test_what_run_graph_and_run_steps_read_goes_through_the_runs_key_and_indexes(db: Any) -> None:
    """Their cost follows the run's own rows, never the runs stored: no statement scans a table."""
    from piwf.store.sql import graph as sql_graph

    for statement, params in ((sql_graph.RUN_ROW, ("r",)), (sql_graph.ATTEMPTS, ("r",)),
                              (sql_graph.OPEN_REQUESTS, ("r",)), (sql_graph.STEPS, ("r", 1, 0))):
        plan = " ".join(str(row[-1]) for row in db.execute("EXPLAIN QUERY PLAN " + statement, params))
        assert "SCAN" not in plan.replace("SCAN CONSTANT ROW", ""), (statement, plan)
        assert "USING" in plan, (statement, plan)


ODD = """
    from piwf import Workflow, compute

    class Odd:
        def __call__(self, ctx):
            return {"odd": True}

        def __getattribute__(self, name):
            if name == "__qualname__":
                raise RuntimeError("no name for you")
            return object.__getattribute__(self, name)

    workflow = Workflow(name="odd", start_at="one", nodes={"one": compute(Odd())})
"""


async def test_a_workflow_whose_graph_cannot_be_made_still_runs_and_its_graph_reads_unknown(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path,
) -> None:
    write_workflow(project, "odd", ODD)
    await host_process().start()
    run_id = await start(paths, project, "odd")
    assert (await at_rest(paths, run_id))["status"] == "completed"
    shown = await graph(paths, run_id)
    assert shown["known"] is False and "could not be made" in shown["reason"]
    assert [(n["id"], n["state"]) for n in shown["nodes"]] == [("one", "accepted")]


def test_a_malformed_graph_from_the_inspecting_process_is_not_recorded() -> None:
    from piwf.host.catalog import _graph

    assert _graph("w", None) is None
    assert _graph("w", {"name": "w", "startAt": "a", "nodes": [{"id": 1}], "edges": []}) is None
    made = {"name": "w", "startAt": "a", "nodes": [{"id": "a", "kind": "compute", "title": None, "exits": ["next"]}],
            "edges": []}
    assert json.loads(_graph("w", made) or b"") == made
