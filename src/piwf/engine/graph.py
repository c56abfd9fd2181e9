"""A workflow's graph as a run records it (``piwf.protocol.WorkflowGraph``): nodes with
their kind, title and exits, and every edge resolved to the node it leads to.

Made where the workflow is loaded (the throwaway process of ``piwf.engine.inspect``), so
the host records and serves it without importing user code. It holds no code and no
environment values: only what a person looking at the run is shown.
"""

from __future__ import annotations

import shlex

from piwf.engine.definition import (
    DEFAULT_EXIT, TIMEOUT_EXIT, Ask, Decision, Node, Shell, Workflow,
)
from piwf.protocol import GraphEdge, NodeDefinition, WorkflowGraph


def workflow_graph(workflow: Workflow) -> WorkflowGraph:
    nodes, edges = [], []
    for node_id, node in sorted(workflow.nodes.items()):
        exits = _exits(workflow, node_id, node)
        nodes.append(NodeDefinition(id=node_id, kind=node.kind, title=_title(node), exits=exits))
        for exit_name in exits:
            target = _leads_to(workflow, node_id, node, exit_name)
            if target is not None:
                edges.append(GraphEdge(node=node_id, exit=exit_name, to=target))
    return WorkflowGraph(name=workflow.name, startAt=workflow.start_at, nodes=nodes, edges=edges)


def _leads_to(workflow: Workflow, node_id: str, node: Node, exit_name: str) -> str | None:
    """Where leaving ``node_id`` through ``exit_name`` goes (``Workflow.next_node``'s rule,
    without its refusal of an exit with no edge): None ends the run."""
    target = workflow.routes.get((node_id, exit_name))
    if target is None and isinstance(node, Decision) and exit_name != TIMEOUT_EXIT:
        return workflow.routes.get((node_id, DEFAULT_EXIT))  # one plain edge for every choice
    return target


def _exits(workflow: Workflow, node_id: str, node: Node) -> list[str]:
    """The exits a run may leave ``node`` through: a decision's choices (and ``timeout``
    when its deadline has no default); an ask's plain exit (and ``timeout`` with a
    deadline); else those its edges name, or the plain one when none does."""
    if isinstance(node, Decision):
        timeout = [TIMEOUT_EXIT] if node.deadline is not None and node.default is None else []
        return [*node.choices, *timeout]
    if isinstance(node, Ask):
        return [DEFAULT_EXIT, *([TIMEOUT_EXIT] if node.deadline is not None else [])]
    named = sorted(exit_name for (source, exit_name) in workflow.routes if source == node_id)
    return named or [DEFAULT_EXIT]


def _title(node: Node) -> str | None:
    if isinstance(node, Decision):
        return node.title
    if isinstance(node, Ask):
        return node.prompt
    if isinstance(node, Shell):
        return shlex.join(node.argv)
    fn = node.fn  # a compute node: its function's name
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
