"""The host protocol's run graph: ``run.graph``, and the workflow graph a run records;
and ``run.steps``, a run's node attempts with their outputs, a page at a time.

A run records the graph of the workflow it executes (``WorkflowGraph``, made by
``piwf.engine.graph`` in the throwaway process that loads the workflow, never in the host)
when it starts and again when it adopts a changed workflow (``run.resume`` of a run held
for its source, ``run.retry``). ``run.graph`` answers it with each node's state for the run
and the path the run took.

Imported by ``piwf.protocol`` (which re-exports every name here and puts the request in
its union); import it from there.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from msgspec import Meta, Struct

from piwf.protocol.host import NoPayload, RunRequest, Step
from piwf.status import RunStatus

__all__ = [
    "GRAPH_REQUESTS", "STEPS_PAGE", "STEPS_PAGE_OUTPUT_BYTES", "GetRunGraph", "GetRunSteps", "GraphEdge", "GraphNode",
    "NodeDefinition", "NodeState", "PathStep", "RunEdge", "RunGraph", "RunStepsPage", "RunStepsPayload", "StepDetail",
    "WorkflowGraph",
]


class NodeState(enum.StrEnum):
    """A node's state in one run, from its latest attempt."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    FAILED = "failed"
    WAITING = "waiting"  # for a person or an agent: its decision or ask is open
    INTERRUPTED = "interrupted"  # its worker ended mid-attempt; a later claim runs it again
    NOT_REACHED = "not_reached"


class GraphEdge(Struct, frozen=True, forbid_unknown_fields=True):
    node: str
    exit: Annotated[str, Meta(description="the exit `node` leaves through (`next`: its plain edge)")]
    to: Annotated[str, Meta(description="the node it leads to")]


class NodeDefinition(Struct, frozen=True, forbid_unknown_fields=True):
    """One node as the workflow declares it (what a run records)."""

    id: str
    kind: Annotated[str, Meta(description="`compute`, `shell`, `decision`, `ask`")]
    title: Annotated[str | None, Meta(description="a decision's title, an ask's prompt, a shell node's command "
                                                  "line, a compute node's function name: workflow text")]
    exits: Annotated[list[str], Meta(description="the exits it may leave through (a decision: its choice ids)")]


class WorkflowGraph(Struct, frozen=True, forbid_unknown_fields=True):
    """A workflow's graph as recorded for a run: no code, no environment values."""

    name: str
    startAt: str
    nodes: list[NodeDefinition]
    edges: Annotated[list[GraphEdge], Meta(description="every (node, exit) that leads to a node; an exit with no "
                                                       "edge ends the run")]


class RunEdge(GraphEdge, frozen=True):
    taken: Annotated[int, Meta(description="how many times the run left `node` through `exit`")]


class GraphNode(Struct):
    id: str
    kind: Annotated[str, Meta(description="`compute`, `shell`, `decision`, `ask`, or `unknown` (no definition "
                                          "recorded)")]
    title: Annotated[str | None, Meta(description="a decision's title, an ask's prompt, a shell node's command "
                                                  "line, a compute node's function name: workflow text")]
    exits: Annotated[list[str], Meta(description="the exits it may leave through (a decision: its choice ids)")]
    state: NodeState
    visits: Annotated[int, Meta(description="its attempts in this run")]
    lastExit: Annotated[str | None, Meta(description="the exit of its latest accepted attempt")]
    requestId: Annotated[str | None, Meta(description="`waiting`: its open decision or ask")]


class PathStep(Struct):
    seq: int
    node: str
    status: Annotated[str, Meta(description="the attempt's: running, waiting, accepted, failed, interrupted")]
    exit: str | None


class RunGraph(Struct):
    """The graph of the workflow a run executes, each node's state in the run, and the path taken."""

    runId: str
    workflow: str
    status: RunStatus
    definitionDigest: str
    known: Annotated[bool, Meta(description="false: no definition is recorded for the run (it started before "
                                            "piwf recorded them); `nodes` are then the nodes its path visited "
                                            "(kind `unknown`) and `edges` is empty")]
    reason: Annotated[str | None, Meta(description="with `known: false`, why, in one line")]
    startAt: str | None
    nodes: list[GraphNode]
    edges: list[RunEdge]
    path: Annotated[list[PathStep], Meta(description="every node attempt in order, revisits included")]


class GetRunGraph(RunRequest, tag="run.graph"):
    """The run's workflow graph (as recorded when it started or adopted a changed workflow),
    each node's state, and the path the run took."""

    is_read = True
    receipt_type = RunGraph


STEPS_PAGE = 100
STEPS_PAGE_OUTPUT_BYTES = 4 * 1024 * 1024  # the outputs of one page, as stored JSON; a larger one comes alone


class RunStepsPayload(NoPayload, frozen=True):
    offset: Annotated[int, Meta(ge=0, description="attempts already seen: `next` of the last page")] = 0
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many attempts")] = STEPS_PAGE


class StepDetail(Step):
    attemptId: str
    output: Annotated[Any, Meta(description="an accepted attempt's output (null otherwise)")]
    error: Annotated[dict[str, Any] | None, Meta(description="a failed attempt's error: `type`, `message`, `node`, "
                                                             "`traceback`, `where`")]


class RunStepsPage(Struct):
    """Node attempts in order (`run.status` `steps`), with their outputs and errors."""

    steps: list[StepDetail]
    next: Annotated[int | None, Meta(description="more remain: send it as `offset`; null at the last attempt")]


class GetRunSteps(RunRequest, tag="run.steps"):
    """A page of the run's node attempts with their outputs and errors, in order."""

    payload: RunStepsPayload = RunStepsPayload()
    is_read = True
    receipt_type = RunStepsPage


GRAPH_REQUESTS = (GetRunGraph, GetRunSteps)
