"""A run's graph as SVG, laid out here (the browser runs no layout code): layers by
distance from the start node (a breadth-first walk; an edge back to an earlier layer is
drawn as a curve), nodes in a layer side by side in the order the definition lists them.
Each node's box is coloured by its state — accepted, running, failed, waiting for a
person, not reached — and an edge the run took is drawn solid, one it did not dashed.

Every text in the SVG (node ids, kinds, exits) comes from the workflow and is escaped.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

BOX_W, BOX_H = 150, 40
GAP_X, GAP_Y = 30, 56
PAD = 16


@dataclass(frozen=True)
class Graph:
    nodes: list[dict[str, Any]]  # id, kind, state
    edges: list[dict[str, Any]]  # from, to, exit, taken
    start: str | None


STATE_WORDS = {"not_reached": "not reached"}


def from_run_graph(recorded: dict[str, Any]) -> Graph:
    """The graph ``run.graph`` answers: the workflow's nodes and edges as recorded for the
    run, each node in its latest attempt's state; an edge is drawn taken when the run left
    its node through its exit (the host's count, or, from a host without it, the path)."""
    path = recorded.get("path", [])
    taken = {(a["node"], a.get("exit"), b["node"]) for a, b in itertools.pairwise(path)}
    nodes = [{"id": n["id"], "kind": n.get("kind") or "", "state": STATE_WORDS.get(n["state"], n["state"]),
              "title": n.get("title")} for n in recorded.get("nodes", [])]
    known = {n["id"] for n in nodes}
    for step in path:  # a node the path visited that the record lacks (an old run): still drawn
        if step["node"] not in known:
            known.add(step["node"])
            nodes.append({"id": step["node"], "kind": "", "state": step["status"], "title": None})
    edges = [{"from": e["node"], "to": e["to"], "exit": None if e["exit"] == "next" else e["exit"],
              "taken": bool(e["taken"]) if "taken" in e else (e["node"], e["exit"], e["to"]) in taken}
             for e in recorded.get("edges", [])]  # the host counts how often each was taken
    if not edges:  # no definition recorded: the path taken, step after step
        edges = [{"from": a, "to": b, "exit": None, "taken": True}
                 for a, b in sorted({(a["node"], b["node"]) for a, b in itertools.pairwise(path)})]
    return Graph(nodes, edges, recorded.get("startAt") or (path[0]["node"] if path else None))


def from_steps(run: dict[str, Any]) -> Graph:
    """The path the run took, from its steps alone (a host that records no definition):
    each node it reached, in order, with its latest attempt's state."""
    order: list[str] = []
    states: dict[str, str] = {}
    for step in run.get("steps", []):
        if step["node"] not in states:
            order.append(step["node"])
        states[step["node"]] = {"interrupted": "failed"}.get(step["status"], step["status"])
    for request in run.get("waitingFor", []):
        if request["nodeId"] not in states:
            order.append(request["nodeId"])
        states[request["nodeId"]] = "waiting"
    nodes = [{"id": node, "kind": "", "state": states[node]} for node in order]
    edges = [{"from": a, "to": b, "exit": None, "taken": True} for a, b in itertools.pairwise(order)]
    return Graph(nodes, edges, order[0] if order else None)


def layers(graph: Graph) -> dict[str, int]:
    """Each node's layer: its distance from the start along edges (unreached ones last)."""
    out: dict[str, list[str]] = {}
    for edge in graph.edges:
        out.setdefault(edge["from"], []).append(edge["to"])
    depth: dict[str, int] = {}
    queue = deque([graph.start] if graph.start else [])
    if graph.start:
        depth[graph.start] = 0
    while queue:
        node = queue.popleft()
        for to in out.get(node, []):
            if to not in depth:
                depth[to] = depth[node] + 1
                queue.append(to)
    last = max(depth.values(), default=-1) + 1
    return {n["id"]: depth.get(n["id"], last) for n in graph.nodes}


def svg(graph: Graph) -> Markup:
    """The graph drawn: an ``<svg>`` element to put in a page as it is."""
    layer = layers(graph)
    rows: dict[int, list[str]] = {}
    for node in graph.nodes:
        rows.setdefault(layer[node["id"]], []).append(node["id"])
    width = max((len(r) for r in rows.values()), default=1) * (BOX_W + GAP_X) - GAP_X + 2 * PAD
    height = (max(rows, default=0) + 1) * (BOX_H + GAP_Y) - GAP_Y + 2 * PAD
    where: dict[str, tuple[float, float]] = {}
    for depth, ids in rows.items():
        row_w = len(ids) * (BOX_W + GAP_X) - GAP_X
        for i, node_id in enumerate(ids):
            where[node_id] = ((width - row_w) / 2 + i * (BOX_W + GAP_X), PAD + depth * (BOX_H + GAP_Y))
    parts = [f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="the run\'s graph">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" class="arrowhead"/></marker></defs>']
    parts += [_edge(edge, where) for edge in graph.edges if edge["from"] in where and edge["to"] in where]
    parts += [_node(node, *where[node["id"]]) for node in graph.nodes]
    parts.append("</svg>")
    return Markup("".join(parts))


def _edge(edge: dict[str, Any], where: dict[str, tuple[float, float]]) -> str:
    (x1, y1), (x2, y2) = where[edge["from"]], where[edge["to"]]
    sx, sy = x1 + BOX_W / 2, y1 + BOX_H
    ex, ey = x2 + BOX_W / 2, y2
    css = "edge taken" if edge.get("taken") else "edge"
    if ey > sy:  # downwards: a straight line
        path = f"M {sx:.0f} {sy:.0f} L {ex:.0f} {ey:.0f}"
        lx, ly = (sx + ex) / 2, (sy + ey) / 2
    else:  # back to an earlier layer (a loop): around the side
        bend = max(x1, x2) + BOX_W + GAP_X / 2
        sy, ey = y1 + BOX_H / 2, y2 + BOX_H / 2
        sx, ex = x1 + BOX_W, x2 + BOX_W
        path = f"M {sx:.0f} {sy:.0f} C {bend:.0f} {sy:.0f} {bend:.0f} {ey:.0f} {ex:.0f} {ey:.0f}"
        lx, ly = bend, (sy + ey) / 2
    label = (f'<text class="exit" x="{lx + 4:.0f}" y="{ly:.0f}">{escape(edge["exit"])}</text>'
             if edge.get("exit") else "")
    return f'<path class="{css}" d="{path}" marker-end="url(#arrow)"/>{label}'


def _node(node: dict[str, Any], x: float, y: float) -> str:
    state = str(node.get("state") or "not reached")
    css = "node state-" + state.replace(" ", "-").replace("_", "-")
    kind = escape(node.get("kind") or "")
    title = escape(f"{node['id']}: {state}" + (f" ({node.get('kind')})" if node.get("kind") else "")
                   + (f"\n{node['title']}" if node.get("title") else ""))
    return (f'<g class="{escape(css)}" data-node="{escape(node["id"])}" data-state="{escape(state)}">'
            f"<title>{title}</title>"
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" rx="6"/>'
            f'<text class="name" x="{x + BOX_W / 2:.0f}" y="{y + 17:.0f}">{escape(_cut(node["id"]))}</text>'
            f'<text class="kind" x="{x + BOX_W / 2:.0f}" y="{y + 32:.0f}">{kind} · {escape(state)}</text></g>')


def _cut(text: str, limit: int = 20) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
