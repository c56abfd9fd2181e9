"""The host protocol's run graph: ``run.graph``, and the workflow graph a run records.

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
from typing import Annotated

from msgspec import Meta, Struct

from piwf.protocol.host import RunRequest
from piwf.status import RunStatus

__all__ = [
    "GRAPH_REQUESTS", "GetRunGraph", "GraphEdge", "GraphNode", "NodeDefinition", "NodeState", "PathStep", "RunGraph",
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
    edges: list[GraphEdge]
    path: Annotated[list[PathStep], Meta(description="every node attempt in order, revisits included")]


class GetRunGraph(RunRequest, tag="run.graph"):
    """The run's workflow graph (as recorded when it started or adopted a changed workflow),
    each node's state, and the path the run took."""

    is_read = True
    receipt_type = RunGraph


GRAPH_REQUESTS = (GetRunGraph,)
