"""``run.graph``: the workflow graph a run recorded (``runs.graph_hash``, layout 14), each
node's state in the run, and the path it took; ``run.steps``: its attempts with outputs.

Read from one snapshot by primary key and per-run indexes (the run's row, its attempts,
its open requests): the cost follows the run's own size, never the runs stored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from piwf.errors import NotFound, StoreError
from piwf.protocol import (
    STEPS_PAGE, STEPS_PAGE_OUTPUT_BYTES, GraphNode, NodeState, PathStep, RunEdge, RunGraph, RunStepsPage, StepDetail,
    WorkflowGraph,
)
from piwf.status import AttemptStatus, RunStatus
from piwf.store.sql.database import Database
from piwf.store.sql.interactions import OPEN
from piwf.store.sql.timefmt import iso
from piwf.wire import decode_json

UNKNOWN = ("no definition is recorded for this run (it started before piwf recorded workflow graphs, or its "
           "graph could not be made): only the nodes it went through are shown")
LIVE_ATTEMPT = (AttemptStatus.RUNNING, AttemptStatus.WAITING)
ENDED_RUN = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELLED)

_graph_decoder = msgspec.json.Decoder(WorkflowGraph)


# What run.graph reads, each through the run's primary key or a per-run index (checked by
# tests/test_run_graph.py with SQLite's query plans).
RUN_ROW = "SELECT workflow, status, definition_digest, graph_hash FROM runs WHERE run_id = ?"
ATTEMPTS = "SELECT seq, started_at, attempt_id, node_id, status, exit_name FROM node_attempts WHERE run_id = ?"
OPEN_REQUESTS = f"SELECT attempt_id, request_id FROM interaction_requests WHERE run_id = ? AND {OPEN}"


def run_graph(db: Database, run_id: str) -> RunGraph:
    with db.read():
        row = db.one(RUN_ROW, (run_id,))
        if row is None:
            raise NotFound(f"run {run_id} not found")
        workflow, status, digest, graph_hash = row
        attempts = sorted(db.execute(ATTEMPTS, (run_id,)), key=lambda a: (a[0], a[1]))
        requests = dict(db.execute(OPEN_REQUESTS, (run_id,)))
        graph = None if graph_hash is None else _decode(db.get_blob(graph_hash), run_id)
    return graph_answer(run_id, workflow, RunStatus(status), digest, graph,
                        [(a[0], a[2], a[3], a[4], a[5]) for a in attempts], requests)


def _decode(data: bytes, run_id: str) -> WorkflowGraph:
    try:
        return _graph_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise StoreError(f"the recorded graph of run {run_id} cannot be read: {exc}") from None


Attempt = tuple[int, str, str, str, str | None]  # (seq, attempt id, node, attempt status, exit), in order


def graph_answer(run_id: str, workflow: str, status: RunStatus, digest: str, graph: WorkflowGraph | None,
                 attempts: list[Attempt], requests: dict[str, str]) -> RunGraph:
    """The answer from what was read (pure: unit-tested alone). A run that has ended has no
    live attempt, whatever an attempt row still says: it shows as interrupted."""
    latest: dict[str, Attempt] = {}
    visits: dict[str, int] = {}
    exits: dict[str, dict[str, None]] = {}  # a node's exits taken, in order (an unknown graph's nodes show them)
    last_exit: dict[str, str | None] = {}
    taken: dict[tuple[str, str], int] = {}
    for attempt in attempts:
        _, _, node, state, exit_name = attempt
        latest[node] = attempt
        visits[node] = visits.get(node, 0) + 1
        exits.setdefault(node, {})
        if state == AttemptStatus.ACCEPTED:
            last_exit[node] = exit_name
            exits[node][exit_name or "next"] = None
            taken[(node, exit_name or "next")] = taken.get((node, exit_name or "next"), 0) + 1
    definitions = ([(node, "unknown", None, list(taken)) for node, taken in exits.items()] if graph is None
                   else [(n.id, n.kind, n.title, n.exits) for n in graph.nodes])
    nodes = []
    for node_id, kind, title, node_exits in definitions:
        last = latest.get(node_id)
        state = NodeState.NOT_REACHED if last is None else NodeState(_ended(last[3], status))
        request = requests.get(last[1]) if last is not None and state == NodeState.WAITING else None
        nodes.append(GraphNode(id=node_id, kind=kind, title=title, exits=list(node_exits), state=state,
                               visits=visits.get(node_id, 0), lastExit=last_exit.get(node_id), requestId=request))
    path = [PathStep(seq=seq, node=node, status=_ended(state, status), exit=exit_name)
            for seq, _, node, state, exit_name in attempts]
    return RunGraph(runId=run_id, workflow=workflow, status=status, definitionDigest=digest, known=graph is not None,
                    reason=None if graph is not None else UNKNOWN, startAt=None if graph is None else graph.startAt,
                    nodes=nodes, path=path, edges=[] if graph is None else [
                        RunEdge(node=e.node, exit=e.exit, to=e.to, taken=taken.get((e.node, e.exit), 0))
                        for e in graph.edges])


def _ended(state: Any, status: RunStatus) -> str:
    return AttemptStatus.INTERRUPTED if state in LIVE_ATTEMPT and status in ENDED_RUN else str(state)


STEPS = """SELECT seq, node_id, status, generation, exit_name, started_at, finished_at, settings_change,
  attempt_id, output_json, output_hash, error_json,
  COALESCE(length(output_json), (SELECT length(content) FROM blobs WHERE hash = output_hash), 0)
FROM node_attempts WHERE run_id = ? ORDER BY seq, started_at, attempt_id LIMIT ? OFFSET ?"""


def run_steps(db: Database, run_id: str, offset: int = 0, limit: int = STEPS_PAGE,
              budget: int = STEPS_PAGE_OUTPUT_BYTES) -> RunStepsPage:
    """Attempts ``offset`` on, in the run's order (seq, then start), at most ``limit`` whose
    stored outputs add up to at most ``budget`` bytes (always at least one). Attempts are
    only ever added after the last, so an offset names the same place on every page."""
    with db.read():
        if db.one("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)) is None:
            raise NotFound(f"run {run_id} not found")
        rows = db.execute(STEPS, (run_id, limit + 1, offset)).fetchall()
        steps: list[StepDetail] = []
        used = 0
        for (seq, node, status, generation, exit_name, started, finished, change, attempt_id, inline, digest,
             error, size) in rows[:limit]:
            if steps and used + size > budget:
                break
            used += size
            steps.append(StepDetail(seq, node, status, generation, exit_name, iso(started), iso(finished),
                                    change, attemptId=attempt_id, output=db.get_json(inline, digest),
                                    error=None if error is None else decode_json(error.encode())))
    more = len(steps) < len(rows)
    return RunStepsPage(steps=steps, next=offset + len(steps) if more else None)
