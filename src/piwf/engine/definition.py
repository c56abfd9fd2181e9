"""Workflow definitions: nodes, edges, validation and a digest of the whole graph."""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DefinitionError
from ..wire import canonical_json

DEFAULT_EXIT = "next"


@dataclass(frozen=True)
class Route:
    """Returned by a compute node to leave through a named exit with ``value`` as output."""

    exit: str
    value: Any = None


@dataclass(frozen=True)
class Compute:
    fn: Callable[[Any], Any]
    kind: str = field(default="compute", init=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "code": _code_digest(self.fn)}


@dataclass(frozen=True)
class Shell:
    argv: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    timeout: float | None = None
    kind: str = field(default="shell", init=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "argv": list(self.argv), "cwd": self.cwd,
                "env": dict(self.env or {}), "timeout": self.timeout}


Node = Compute | Shell


def compute(fn: Callable[[Any], Any]) -> Compute:
    """A node that calls ``fn(ctx)`` and takes its JSON return value as output."""
    if not callable(fn):
        raise DefinitionError(f"compute() needs a callable, not {type(fn).__name__}")
    return Compute(fn)


def shell(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Shell:
    """A node that runs ``argv``; output ``{"stdout", "stderr", "exitCode"}``; non-zero fails it."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise DefinitionError("shell() needs a non-empty list of strings as argv")
    if timeout is not None and timeout <= 0:
        raise DefinitionError("shell() timeout must be positive")
    return Shell(tuple(argv), cwd, dict(env) if env else None, timeout)


class Workflow:
    """An explicit graph: what runs and where it can go is visible in the edges.

    ``edges`` are ``(from, to)`` pairs; ``("node.exit", "to")`` leaves ``node`` through a
    named exit, chosen by a compute node returning ``Route(exit, value)``.
    """

    def __init__(self, name: str, start_at: str, nodes: Mapping[str, Node],
                 edges: Iterable[tuple[str, str]] = ()) -> None:
        self.name = name
        self.start_at = start_at
        self.nodes = dict(nodes)
        self.edges = [tuple(edge) for edge in edges]
        self.routes = self._validate()

    def _validate(self) -> dict[tuple[str, str], str]:
        if not isinstance(self.name, str) or not self.name.replace("-", "_").isidentifier():
            raise DefinitionError(f"workflow name {self.name!r} must be letters, digits, '-' or '_'")
        if not self.nodes:
            raise DefinitionError(f"workflow {self.name} has no nodes")
        for node_id, node in self.nodes.items():
            if not isinstance(node, (Compute, Shell)):
                raise DefinitionError(f"node {node_id!r} is not a compute() or shell() node")
            if "." in node_id:
                raise DefinitionError(f"node id {node_id!r} must not contain '.'")
        if self.start_at not in self.nodes:
            raise DefinitionError(f"start node {self.start_at!r} is not one of the nodes")
        routes: dict[tuple[str, str], str] = {}
        for edge in self.edges:
            if len(edge) != 2:
                raise DefinitionError(f"edge {edge!r} must be a (from, to) pair")
            source, target = edge
            node_id, _, exit_name = source.partition(".")
            key = (node_id, exit_name or DEFAULT_EXIT)
            if node_id not in self.nodes:
                raise DefinitionError(f"edge {source} -> {target}: unknown node {node_id!r}")
            if target not in self.nodes:
                raise DefinitionError(f"edge {source} -> {target}: unknown node {target!r}")
            if key in routes:
                raise DefinitionError(f"two edges leave {source}: to {routes[key]!r} and to {target!r}")
            routes[key] = target
        self._check_reachable(routes)
        return routes

    def _check_reachable(self, routes: dict[tuple[str, str], str]) -> None:
        seen, todo = {self.start_at}, [self.start_at]
        while todo:
            current = todo.pop()
            for (source, _), target in routes.items():
                if source == current and target not in seen:
                    seen.add(target)
                    todo.append(target)
        unreachable = sorted(set(self.nodes) - seen)
        if unreachable:
            raise DefinitionError(f"unreachable from {self.start_at!r}: {', '.join(unreachable)}")

    def next_node(self, node_id: str, exit_name: str) -> str | None:
        """Where a node goes after leaving through ``exit_name``; None ends the run."""
        target = self.routes.get((node_id, exit_name))
        if target is not None:
            return target
        named = sorted(e for (n, e) in self.routes if n == node_id and e != DEFAULT_EXIT)
        if exit_name != DEFAULT_EXIT and named:
            raise DefinitionError(f"node {node_id} chose exit {exit_name!r}; its exits are {', '.join(named)}")
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "startAt": self.start_at,
            "nodes": {node_id: node.describe() for node_id, node in sorted(self.nodes.items())},
            "edges": sorted(list(edge) for edge in self.edges),
        }

    def digest(self) -> str:
        """Changes when the graph or any node's code changes; not for comments or moves."""
        return "sha256:" + hashlib.sha256(canonical_json(self.describe())).hexdigest()


def _code_digest(fn: Callable[[Any], Any]) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: digest its class's __call__
        code = getattr(type(fn).__call__, "__code__", None)
    if code is None:
        return "opaque:" + getattr(fn, "__qualname__", type(fn).__qualname__)
    return hashlib.sha256(repr(_code_shape(code)).encode()).hexdigest()


def _code_shape(code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(_code_shape(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, consts)
