"""Walks a workflow graph, reusing accepted steps and journaling new ones.

The executor knows nothing of hosts: it talks to a ``Journal``. The worker's journal sends
each attempt start and each accepted output to the host and waits for the answer before
going on, so a step is either accepted durably or will run again.
"""

from __future__ import annotations

import os
import subprocess
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import msgspec

from ..errors import DefinitionError, NodeFailed
from ..wire import canonical_json
from .definition import DEFAULT_EXIT, Compute, Route, Shell, Workflow

TRACEBACK_TAIL = 4000


class Stop(Exception):
    """The journal asked the run to stop at this node boundary (paused, claim lost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Journal(Protocol):
    def start(self, seq: int, node: str) -> str: ...
    def accept(self, attempt_id: str, output: Any, exit_name: str) -> None: ...
    def fail(self, attempt_id: str, error: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Step:
    seq: int
    node: str
    exit: str | None
    output: Any


@dataclass(frozen=True)
class Context:
    """What a compute node sees."""

    run_id: str
    node: str
    attempt_id: str
    input: Any
    outputs: Mapping[str, Any]
    project_path: str


def execute(workflow: Workflow, *, run_id: str, project_path: str, input: Any,
            accepted: list[Step], journal: Journal) -> Any:
    """Run the graph to its end; returns the last node's output."""
    history = {step.seq: step for step in accepted}
    outputs: dict[str, Any] = {}
    node: str | None = workflow.start_at
    seq, last = 0, None
    while node is not None:
        step = history.get(seq)
        if step is not None:
            if step.node != node:
                raise DefinitionError(f"step {seq} ran {step.node!r} but the graph now leads to {node!r}")
            output, exit_name = step.output, step.exit or DEFAULT_EXIT
        else:
            attempt_id = journal.start(seq, node)
            ctx = Context(run_id, node, attempt_id, input, MappingProxyType(dict(outputs)), project_path)
            try:
                output, exit_name = run_node(workflow.nodes[node], ctx)
                workflow.next_node(node, exit_name)  # an unknown exit fails this node
            except Exception as exc:
                error = describe_error(exc, node)
                journal.fail(attempt_id, error)
                raise NodeFailed(error["message"], error) from exc
            journal.accept(attempt_id, output, exit_name)
        outputs[node] = output
        last = output
        node = workflow.next_node(node, exit_name)
        seq += 1
    return last


def run_node(node: Compute | Shell, ctx: Context) -> tuple[Any, str]:
    if isinstance(node, Shell):
        return run_shell(node, ctx.project_path), DEFAULT_EXIT
    result = node.fn(ctx)
    exit_name = DEFAULT_EXIT
    if isinstance(result, Route):
        exit_name, result = result.exit, result.value
    try:
        canonical_json(result)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"node output is not JSON: {exc}") from exc
    return result, exit_name


def run_shell(node: Shell, project_path: str) -> dict[str, Any]:
    cwd = Path(project_path) / node.cwd if node.cwd else Path(project_path)
    env = {**os.environ, **(node.env or {})}
    try:
        done = subprocess.run(list(node.argv), cwd=cwd, env=env, capture_output=True,
                              timeout=node.timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{node.argv[0]} timed out after {node.timeout} s") from exc
    except OSError as exc:
        raise OSError(f"cannot run {node.argv[0]}: {exc.strerror}") from exc
    output = {
        "stdout": done.stdout.decode(errors="replace"),
        "stderr": done.stderr.decode(errors="replace"),
        "exitCode": done.returncode,
    }
    if done.returncode != 0:
        raise ShellExit(output, node.argv[0])
    return output


class ShellExit(Exception):
    def __init__(self, output: dict[str, Any], program: str) -> None:
        stderr = output["stderr"].strip().splitlines()
        hint = f": {stderr[-1][:200]}" if stderr else ""
        super().__init__(f"{program} exited with status {output['exitCode']}{hint}")
        self.output = output


def describe_error(exc: BaseException, node: str) -> dict[str, Any]:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL:]
    error = {"type": type(exc).__name__, "message": f"node {node}: {exc}", "node": node, "traceback": tail}
    if isinstance(exc, ShellExit):
        error["output"] = exc.output
    return error
