"""Workflow definitions: nodes, edges, validation and a digest of the whole graph."""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from piwf.errors import DefinitionError
from piwf.wire import canonical_json
from piwf.engine import settings as run_settings

DEFAULT_EXIT = "next"


@dataclass(frozen=True)
class Route:
    """Returned by a compute node to leave through a named exit with ``value`` as output."""

    exit: str
    value: Any = None


@dataclass(frozen=True)
class Compute:
    fn: Callable[[Any], Any]
    time_limit: float | None = None  # seconds, enforced by the host (see node_limits)
    kind: str = field(default="compute", init=False)

    def describe(self) -> dict[str, Any]:
        return _limited({"kind": self.kind, "code": _code_digest(self.fn)}, self.time_limit)


@dataclass(frozen=True)
class Shell:
    argv: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    timeout: float | None = None
    time_limit: float | None = None
    kind: str = field(default="shell", init=False)

    def describe(self) -> dict[str, Any]:
        return _limited({"kind": self.kind, "argv": list(self.argv), "cwd": self.cwd,
                         "env": dict(self.env or {}), "timeout": self.timeout}, self.time_limit)


@dataclass(frozen=True)
class TextInput:
    """A line of text a choice takes; its length is counted in Unicode code points."""

    prompt: str
    min_length: int = 1
    max_length: int = 4000


TEXT_INPUT_LIMIT = 4000


@dataclass(frozen=True)
class Choice:
    label: str
    input: TextInput | None = None


@dataclass(frozen=True)
class Decision:
    title: str
    choices: Mapping[str, Choice]
    deadline: float | None = None
    default: tuple[str, str | None] | None = None
    kind: str = field(default="decision", init=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "title": self.title, "deadline": self.deadline,
                "default": list(self.default) if self.default else None,
                "choices": {key: [c.label, None if c.input is None else
                                  [c.input.prompt, c.input.min_length, c.input.max_length]]
                            for key, c in sorted(self.choices.items())}}


@dataclass(frozen=True)
class Ask:
    prompt: str
    expect: Any
    validate: Callable[[Any], Any] | None = None
    deadline: float | None = None
    time_limit: float | None = None  # on validating a submission, in a worker
    kind: str = field(default="ask", init=False)

    def schema(self) -> Any:
        return msgspec.json.schema(self.expect)

    def describe(self) -> dict[str, Any]:
        return _limited({"kind": self.kind, "prompt": self.prompt, "deadline": self.deadline,
                         "schema": self.schema(),
                         "validate": None if self.validate is None else _code_digest(self.validate)},
                        self.time_limit)


def _limited(described: dict[str, Any], time_limit: float | None) -> dict[str, Any]:
    """A node's description with its time limit, only when it has one: the digests of
    workflows written before time limits existed stay as they were."""
    return described if time_limit is None else {**described, "timeLimit": time_limit}


MAX_TIME_LIMIT_S = 366 * 24 * 3600


def _check_time_limit(what: str, time_limit: float | None) -> float | None:
    if time_limit is None:
        return None
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) \
            or not 0 < time_limit <= MAX_TIME_LIMIT_S:
        raise DefinitionError(f"{what} time_limit must be a number of seconds, more than 0 and at most a year")
    return float(time_limit)


Node = Compute | Shell | Decision | Ask
Interactive = (Decision, Ask)
TIMEOUT_EXIT = "timeout"


def compute(fn: Callable[[Any], Any], *, time_limit: float | None = None) -> Compute:
    """A node that calls ``fn(ctx)`` and takes its JSON return value as output.
    ``time_limit``: seconds the host lets it run (its worker is stopped at the limit)."""
    if not callable(fn):
        raise DefinitionError(f"compute() needs a callable, not {type(fn).__name__}")
    return Compute(fn, _check_time_limit("compute()", time_limit))


def decision(title: str, choices: Mapping[str, str | Choice], *, deadline: float | None = None,
             default: str | tuple[str, str] | None = None) -> Decision:
    """A node that waits for a person to choose; it leaves through the exit named by the
    chosen id (``timeout`` when its deadline passes with no default), with output
    ``{"choice", "input", "provenance", "answeredBy", "answeredAt"}``."""
    _check_title("decision() title", title)
    if not isinstance(choices, Mapping):
        raise DefinitionError("decision() choices must be a mapping of choice id to label")
    if not choices:
        raise DefinitionError("decision() needs at least one choice")
    made = {key: _choice(key, value) for key, value in choices.items()}
    labels = [c.label for c in made.values()]
    if len(set(labels)) != len(labels):
        raise DefinitionError("decision() choices must have different labels")
    _check_deadline("decision()", deadline)
    picked: tuple[str, str | None] | None = None
    if default is not None:
        if deadline is None:
            raise DefinitionError("decision() default needs a deadline")
        given = (default, None) if isinstance(default, str) else tuple(default)
        if len(given) != 2:
            raise DefinitionError("decision() default is a choice id or a (choice, text) pair")
        picked = (given[0], given[1])
        _check_default(made, *picked)
    return Decision(title, made, deadline, picked)


def _choice(key: Any, value: str | Choice) -> Choice:
    if not isinstance(key, str) or not key or "." in key or key in (DEFAULT_EXIT, TIMEOUT_EXIT):
        raise DefinitionError(f"choice id {key!r} must be non-empty text without '.', and not "
                              f"{DEFAULT_EXIT!r} or {TIMEOUT_EXIT!r}")
    choice = Choice(value) if isinstance(value, str) else value
    if not isinstance(choice, Choice):
        raise DefinitionError(f"choice {key!r} needs a label (text, or Choice(label, input=TextInput(...)))")
    _check_title(f"choice {key!r} label", choice.label)
    if choice.input is not None:
        _check_text_input(key, choice.input)
    return choice


def _check_text_input(key: str, text: object) -> None:
    """Seed: a choice's text takes at least one character at most (``max_length`` ≥ 1),
    within 0 ≤ min_length ≤ max_length ≤ TEXT_INPUT_LIMIT."""
    if not isinstance(text, TextInput):
        raise DefinitionError(f"choice {key!r}: input must be a TextInput(prompt, min_length, max_length)")
    bounds = (text.min_length, text.max_length)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in bounds):
        raise DefinitionError(f"choice {key!r}: TextInput min_length and max_length must be whole numbers")
    if text.max_length < 1:
        raise DefinitionError(f"choice {key!r}: TextInput max_length must be at least 1, not {text.max_length}")
    if not 0 <= text.min_length <= text.max_length <= TEXT_INPUT_LIMIT:
        raise DefinitionError(f"choice {key!r}: TextInput bounds must satisfy 0 <= min_length <= max_length <= "
                              f"{TEXT_INPUT_LIMIT}")


def _check_default(choices: Mapping[str, Choice], key: str, text: str | None) -> None:
    if key not in choices:
        raise DefinitionError(f"decision() default {key!r} is not one of the choices")
    wanted = choices[key].input
    if wanted is None and text is not None:
        raise DefinitionError(f"decision() default {key!r} takes no text")
    if wanted is not None and (text is None or not wanted.min_length <= len(text) <= wanted.max_length):
        raise DefinitionError(f"decision() default {key!r} needs text of {wanted.min_length} to "
                              f"{wanted.max_length} characters")


MAX_DEADLINE_S = 366 * 24 * 3600  # a year: a longer wait is a design, not a deadline
MAX_TITLE = 2000  # characters of a title, prompt or label


def _check_deadline(where: str, deadline: float | None) -> None:
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not 0 < deadline <= MAX_DEADLINE_S):
        raise DefinitionError(f"{where} deadline must be a number of seconds above 0 and at most "
                              f"{MAX_DEADLINE_S} (a year)")


def _check_title(where: str, text: Any) -> None:
    if not isinstance(text, str) or not text.strip():
        raise DefinitionError(f"{where} must be non-blank text")
    if len(text) > MAX_TITLE:
        raise DefinitionError(f"{where} is {len(text)} characters; at most {MAX_TITLE}")


def ask(prompt: str, *, expect: Any = Any, validate: Callable[[Any], Any] | None = None,
        deadline: float | None = None, time_limit: float | None = None) -> Ask:
    """A node that asks the run's origin session for a value of type ``expect``; the value
    is converted with msgspec and checked by ``validate`` (which may raise ``piwf.Invalid``)
    in a worker, and becomes the node's output. ``time_limit``: seconds the host lets one
    validation take (at the limit the submission is refused and the run waits again)."""
    _check_title("ask() prompt", prompt)
    if validate is not None and not callable(validate):
        raise DefinitionError("ask() validate must be callable")
    _check_deadline("ask()", deadline)
    try:
        msgspec.json.schema(expect)
    except (TypeError, ValueError) as exc:
        raise DefinitionError(f"ask() expect is not a type msgspec can check: {exc}") from None
    return Ask(prompt, expect, validate, deadline, _check_time_limit("ask()", time_limit))


def shell(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
    timeout: float | None = None, *, time_limit: float | None = None,
) -> Shell:
    """A node that runs ``argv``; output ``{"stdout", "stderr", "exitCode"}``; non-zero fails it.
    ``timeout``: the worker kills the program after so many seconds (the node fails);
    ``time_limit``: the host stops the whole worker, whatever state it is in."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise DefinitionError("shell() needs a non-empty list of strings as argv")
    if timeout is not None and timeout <= 0:
        raise DefinitionError("shell() timeout must be positive")
    return Shell(tuple(argv), cwd, dict(env) if env else None, timeout, _check_time_limit("shell()", time_limit))


class Workflow:
    """An explicit graph: what runs and where it can go is visible in the edges.

    ``edges`` are ``(from, to)`` pairs; ``("node.exit", "to")`` leaves ``node`` through a
    named exit, chosen by a compute node returning ``Route(exit, value)``.

    ``settings`` is a msgspec Struct type (every field with a default): what ``ctx.settings``
    is; ``mutable`` names the dotted paths of it a run may change while it goes on.

    ``reuse_worker`` opts in to warm workers (docs/concepts.md, "Warm workers"): ``True``
    lets one worker process execute up to ``WARM_RUNS`` of this workflow's runs one after
    another, a number at most that many; ``worker_memory_mb`` is the resident size past
    which such a worker is replaced (default ``WARM_MEMORY_MB``). Neither is part of the
    digest: they change how runs are hosted, not what they do.
    """

    def __init__(self, name: str, start_at: str, nodes: Mapping[str, Node],
                 edges: Iterable[tuple[str, str]] = (), *, settings: Any = None,
                 mutable: Iterable[str] = (), reuse_worker: bool | int = False,
                 worker_memory_mb: int | None = None) -> None:
        self.name = name
        self.start_at = start_at
        self.nodes = dict(nodes)
        self.edges = [tuple(edge) for edge in edges]
        self.routes = self._validate()
        self.settings, self.mutable = run_settings.check_declaration(name, settings, mutable)
        self.reuse = _check_reuse(name, reuse_worker, worker_memory_mb)

    def _validate(self) -> dict[tuple[str, str], str]:
        if not isinstance(self.name, str) or not self.name.replace("-", "_").isidentifier():
            raise DefinitionError(f"workflow name {self.name!r} must be letters, digits, '-' or '_'")
        if not self.nodes:
            raise DefinitionError(f"workflow {self.name} has no nodes")
        for node_id, node in self.nodes.items():
            if not isinstance(node, (Compute, Shell, Decision, Ask)):
                raise DefinitionError(f"node {node_id!r} is not a compute(), shell(), decision() or ask() node")
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
        self._check_decision_exits(routes)
        self._check_waiting_exits(routes)
        return routes

    def _check_waiting_exits(self, routes: dict[tuple[str, str], str]) -> None:
        """An exit no run could ever take is a mistake in the graph: an ask leaves only
        through its plain edge or ``timeout``, and ``timeout`` only from a node with a
        deadline and no default."""
        for (node_id, exit_name) in routes:
            node = self.nodes[node_id]
            if isinstance(node, Ask) and exit_name not in (DEFAULT_EXIT, TIMEOUT_EXIT):
                raise DefinitionError(f"ask {node_id!r} has no exit {exit_name!r}: it leaves through its plain "
                                      f"edge, or {TIMEOUT_EXIT!r} at its deadline")
            if exit_name != TIMEOUT_EXIT or not isinstance(node, (Ask, Decision)):
                continue
            if node.deadline is None:
                raise DefinitionError(f"{node_id}.{TIMEOUT_EXIT} can never be taken: {node_id!r} has no deadline")
            if isinstance(node, Decision) and node.default is not None:
                raise DefinitionError(f"{node_id}.{TIMEOUT_EXIT} can never be taken: {node_id!r} resolves to its "
                                      "default at the deadline")

    def _check_decision_exits(self, routes: dict[tuple[str, str], str]) -> None:
        """A decision whose choices lead somewhere must lead somewhere from each of them."""
        for node_id, node in self.nodes.items():
            if not isinstance(node, Decision):
                continue
            exits = {name for (source, name) in routes if source == node_id}
            unknown = exits - set(node.choices) - {TIMEOUT_EXIT, DEFAULT_EXIT}
            if unknown:
                raise DefinitionError(f"decision {node_id!r} has no choice {', '.join(sorted(unknown))}")
            chosen = exits & set(node.choices)
            if chosen and DEFAULT_EXIT in exits:
                raise DefinitionError(f"decision {node_id!r} has edges for its choices and a plain edge: "
                                      "give every choice its own edge, or use one plain edge for all")
            missing = [key for key in node.choices if key not in exits]
            if chosen and missing:
                raise DefinitionError(f"decision {node_id!r}: choice {', '.join(missing)} has no edge")

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
        if isinstance(self.nodes.get(node_id), Decision) and exit_name != TIMEOUT_EXIT:
            return self.routes.get((node_id, DEFAULT_EXIT))  # one plain edge for every choice
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
            **run_settings.describe(self.settings, self.mutable),  # nothing for a workflow without settings
        }

    def time_limits(self) -> dict[str, tuple[float | None, bool]]:
        """The nodes a time limit may stop: node id -> (their own limit in seconds or None,
        whether they have a ``timeout`` exit to take at a limit, theirs or the host's). The
        worker tells the host, which enforces them."""
        limits: dict[str, tuple[float | None, bool]] = {}
        for node_id, node in self.nodes.items():
            exit_ = (node_id, TIMEOUT_EXIT) in self.routes and not isinstance(node, Ask)  # an ask's is its deadline's
            if not isinstance(node, Decision) and (node.time_limit is not None or exit_):
                limits[node_id] = (node.time_limit, exit_)
        return limits

    def digest(self) -> str:
        """Changes when the graph or any node's code changes; not for comments or moves."""
        return "sha256:" + hashlib.sha256(canonical_json(self.describe())).hexdigest()


WARM_RUNS = 1000  # runs one warm worker executes at most, unless the workflow says fewer (or more)
WARM_MEMORY_MB = 512  # a warm worker past this resident size is replaced, unless the workflow says otherwise


@dataclass(frozen=True)
class WorkerReuse:
    """How a workflow's runs may share a worker process: at most ``runs`` runs each, and
    none after the process has grown past ``memory_mb`` resident."""

    runs: int
    memory_mb: int


def _check_reuse(name: str, reuse: bool | int, memory_mb: int | None) -> WorkerReuse | None:
    if not isinstance(reuse, (bool, int)) or (not isinstance(reuse, bool) and reuse < 1):
        raise DefinitionError(f"workflow {name}: reuse_worker must be True, False or a number of runs (1 or more), "
                              f"not {reuse!r}")
    if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1):
        raise DefinitionError(f"workflow {name}: worker_memory_mb must be a number of megabytes (1 or more), "
                              f"not {memory_mb!r}")
    if reuse is False or (reuse == 1 and not isinstance(reuse, bool)):
        if memory_mb is not None:
            raise DefinitionError(f"workflow {name}: worker_memory_mb applies to reused workers only "
                                  "(reuse_worker=True)")
        return None
    return WorkerReuse(runs=WARM_RUNS if reuse is True else int(reuse), memory_mb=memory_mb or WARM_MEMORY_MB)


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
