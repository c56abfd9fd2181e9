"""Walks a workflow graph, reusing accepted steps and journaling new ones.

The executor knows nothing of hosts: it talks to a ``Journal``. The worker's journal sends
each attempt start and each accepted output to the host and waits for the answer before
going on, so a step is either accepted durably or will run again.
"""

from __future__ import annotations

import contextlib
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import msgspec

from piwf.errors import ClaimLost, DefinitionError, HostRefused, Invalid, NodeFailed
from piwf.engine.definition import DEFAULT_EXIT, TIMEOUT_EXIT, Ask, Compute, Decision, Route, Shell, Workflow
from piwf.engine.settings import as_value
from piwf.engine.values import TooDeep, as_stored

TRACEBACK_TAIL = 4000


class Stop(Exception):
    """The journal asked the run to stop at this node boundary (paused, claim lost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Not node failures: the run is being stopped under the node, or the host would not record
# what the node did; the node must not be recorded as failed for either.
STOPPING = (Stop, ClaimLost, HostRefused)


class Journal(Protocol):
    def start(self, seq: int, node: str) -> str: ...
    def accept(self, attempt_id: str, output: Any, exit_name: str, *, final: bool = False) -> None:
        """Record a node's output. ``final``: it is the run's last node, so the journal may
        complete the run with this output in the same step."""
        ...
    def fail(self, attempt_id: str, error: dict[str, Any]) -> None: ...
    def effect(self, node: str, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None) -> Any: ...
    def process_started(self, node: str, pid: int) -> None: ...
    def process_ended(self, pid: int) -> None: ...
    def wait_for(self, attempt_id: str, request: dict[str, Any]) -> None:
        """Open the attempt's interaction request; the run waits (raises Stop)."""
        ...
    def submission(self, attempt_id: str) -> tuple[str, Any] | None:
        """The submission to validate for a waiting attempt, as (id, value)."""
        ...
    def reject(self, submission_id: str, reason: str) -> None:
        """The submission does not fit: the run waits again (raises Stop)."""
        ...
    def notify(self, attempt_id: str, index: int, kind: str, content: str) -> None:
        """The attempt's ``index``-th notification to the run's origin session."""
        ...
    def present(self, instructions: str) -> None:
        """Instructions for the turn the run's completion gives its session."""
        ...
    def publish(self, attempt_id: str, type: str, key: str, data: Any) -> None:
        """Replace the run's current value of (type, key)."""
        ...
    def settings(self, attempt_id: str) -> Any:
        """The run's settings (JSON) as they were when the attempt started; None without any."""
        ...


class EffectRejected(Exception):
    """An effect's ``apply()`` failed once; its stored error is raised again, never retried."""

    def __init__(self, key: str, error: dict[str, Any]) -> None:
        super().__init__(f"effect {key!r} was rejected: {error.get('message', error)}")
        self.key = key
        self.error = error


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
    journal: Journal = field(repr=False, compare=False)
    _notified: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter, repr=False,
                                                            compare=False)
    _notified_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    settings: Any = None  # the workflow's settings type, as in force when the node started (None: it has none)

    def effect(self, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None = None) -> Any:
        """Apply an external side effect at most once per run and return its JSON result.

        The host records the effect before ``apply()`` runs and its result after. A key
        already settled returns the stored result (or raises ``EffectRejected``) without
        calling ``apply``. If an earlier attempt crashed while applying, ``observe()`` says
        what happened: a result means applied, ``None`` means not applied (apply again);
        without ``observe`` the run is held as ambiguous for an operator.
        """
        if not isinstance(key, str) or not key or len(key.encode()) > 256:
            raise ValueError("an effect key must be non-empty text of at most 256 bytes")
        return self.journal.effect(self.node, key, apply, observe)

    def notify(self, text: str, kind: str = "progress") -> None:
        """Tell the run's origin session ``text`` (``kind`` ``progress`` or ``final``); stored
        once per (run, step, text and kind, its number among the step's calls with that
        text), so a retried node does not say it twice, in whatever order its threads call.
        A detached run's notifications go to nobody."""
        if kind not in NOTIFICATION_KINDS:
            raise ValueError(f"notification kind must be progress or final, not {kind!r}")
        content = _content(text, "notification")
        with self._notified_lock:  # numbered and sent in one turn: the k-th of a text reaches the host after the k-1th
            self._notified[(kind, content)] += 1
            self.journal.notify(self.attempt_id, self._notified[(kind, content)], kind, content)

    def present(self, instructions: str) -> None:
        """Ask for a presentation turn when the run completes: its session is given the
        result with ``instructions`` (how to present it)."""
        self.journal.present(_content(instructions, "presentation instructions"))

    def publish(self, type: str, key: str, data: Any) -> None:
        """Replace the run's live value of (``type``, ``key``) with ``data`` (JSON, at most
        64 KiB); watchers (``run.watch``, ``piwf watch``) see it at once."""
        if not isinstance(type, str) or not 0 < len(type) <= 64 or not isinstance(key, str) or not 0 < len(key) <= 128:
            raise ValueError("an update's type must be 1 to 64 characters and its key 1 to 128")
        encoded, data = as_stored(data, f"update {type}/{key}", MAX_OUTPUT_NESTING)
        size = len(encoded)
        if size > CONTENT_LIMIT:
            raise ValueError(f"update {type}/{key} is {size} bytes as JSON; the limit is {CONTENT_LIMIT}")
        self.journal.publish(self.attempt_id, type, key, data)


NOTIFICATION_KINDS = ("progress", "final")
CONTENT_LIMIT = 64 * 1024  # a notification, presentation instructions, an update (bytes)


def _content(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be text, not {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is blank")
    if len(text.encode()) > CONTENT_LIMIT:
        raise ValueError(f"{what} is {len(text.encode())} bytes; the limit is {CONTENT_LIMIT}")
    return text


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
            try:
                # settings stored under an older definition that no longer fit fail the node, saying so
                settings = as_value(workflow.settings, journal.settings(attempt_id)) if workflow.settings else None
                ctx = Context(run_id, node, attempt_id, input, MappingProxyType(dict(outputs)), project_path,
                              journal, settings=settings)
                spec = workflow.nodes[node]
                if isinstance(spec, (Decision, Ask)):
                    output, exit_name = interact(workflow, node, ctx)
                else:
                    output, exit_name = run_node(spec, ctx, timeout_exit=(node, TIMEOUT_EXIT) in workflow.routes)
                following = workflow.next_node(node, exit_name)  # an unknown exit fails this node
            except STOPPING:
                raise
            except Exception as exc:
                error = describe_error(exc, node)
                journal.fail(attempt_id, error)
                raise NodeFailed(error["message"], error) from exc
            journal.accept(attempt_id, output, exit_name, final=following is None)
        outputs[node] = output
        last = output
        node = workflow.next_node(node, exit_name)
        seq += 1
    return last


MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # one node's output as JSON; a larger one fails the node
# Deepest nesting of an output (or effect result): well inside the frame limit (MAX_NESTING),
# which the messages carrying it (an answer's steps, a payload) add their own levels to.
MAX_OUTPUT_NESTING = 64


class OutputTooLarge(ValueError):
    """A node's output over MAX_OUTPUT_BYTES or nested deeper than MAX_NESTING: the node
    fails (once: it is not a crash to retry)."""


def run_node(node: Compute | Shell, ctx: Context, *, timeout_exit: bool = False) -> tuple[Any, str]:
    """A shell node whose program passed its ``timeout`` leaves through the node's
    ``timeout`` exit when the graph has one (output ``null``, as at a host time limit);
    else it fails."""
    if isinstance(node, Shell):
        try:
            return check_output(run_shell(node, ctx)), DEFAULT_EXIT
        except ShellTimedOut:
            if timeout_exit:
                return None, TIMEOUT_EXIT
            raise
    result = node.fn(ctx)
    exit_name = DEFAULT_EXIT
    if isinstance(result, Route):
        exit_name, result = result.exit, result.value
    return check_output(result), exit_name


def interact(workflow: Workflow, node_id: str, ctx: Context) -> tuple[Any, str]:
    """A decision or ask node reached live: its request is opened and the run waits. A
    decision comes back answered (an accepted step, written by the host); an ask comes back
    with a submission to validate here, in the worker: the value converted to ``expect``,
    then ``validate``. Accepted: it is the node's output. Refused: the run waits again."""
    node = workflow.nodes[node_id]
    pending = ctx.journal.submission(ctx.attempt_id) if isinstance(node, Ask) else None
    if pending is None:
        ctx.journal.wait_for(ctx.attempt_id, request_spec(workflow, node_id))
        raise Stop("waiting")  # wait_for raises it; a journal that returns must not go on
    submission_id, value = pending
    assert isinstance(node, Ask)
    try:
        converted = msgspec.convert(value, node.expect)
        output = check_output(msgspec.to_builtins(converted))
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        ctx.journal.reject(submission_id, str(exc) or type(exc).__name__)
        raise Stop("waiting") from None
    try:
        if node.validate is not None:
            node.validate(converted)
    except Invalid as exc:
        ctx.journal.reject(submission_id, str(exc) or "refused by validate()")
        raise Stop("waiting") from None
    except Exception as exc:  # the validator itself failed: the submission is refused, nothing is lost
        ctx.journal.reject(submission_id, f"validate() raised {type(exc).__name__}: {exc}")
        raise Stop("waiting") from None
    return output, DEFAULT_EXIT


def request_spec(workflow: Workflow, node_id: str) -> dict[str, Any]:
    """What the host stores for a waiting node's request."""
    node = workflow.nodes[node_id]
    assert isinstance(node, (Decision, Ask)), f"{node_id} is not a decision or ask node"
    spec: dict[str, Any] = {"timeoutExit": (node_id, TIMEOUT_EXIT) in workflow.routes}
    if node.deadline is not None:
        spec["deadlineMs"] = max(1, int(node.deadline * 1000))
    if isinstance(node, Decision):
        spec |= {"kind": "decision", "title": node.title, "choices": {
            key: {"label": c.label} | ({} if c.input is None else {"input": {
                "prompt": c.input.prompt, "minLength": c.input.min_length, "maxLength": c.input.max_length}})
            for key, c in node.choices.items()}}
        if node.default is not None:
            choice, text = node.default
            spec["default"] = {"choice": choice} | ({} if text is None else {"input": text})
    else:
        assert isinstance(node, Ask)
        spec |= {"kind": "ask", "title": node.prompt, "schema": node.schema()}
    return spec


def check_output(value: Any, what: str = "node output") -> Any:
    """An output must be JSON that the host can store and send back to a later worker,
    exactly (engine/values.py); returns it as later nodes see it."""
    try:
        encoded, stored = as_stored(value, what, MAX_OUTPUT_NESTING)
    except TooDeep as exc:
        raise OutputTooLarge(str(exc)) from None
    if len(encoded) > MAX_OUTPUT_BYTES:
        raise OutputTooLarge(f"{what} is {len(encoded)} bytes as JSON, over the {MAX_OUTPUT_BYTES}-byte limit")
    return stored


# The shell node's program starts only once the host has recorded its process: the gate
# line arrives on stdin after registration; if the worker dies first, the gate sees EOF
# and nothing runs. The program itself gets /dev/null as stdin.
GATE = 'read -r _ || exit 125; exec "$@" </dev/null'


def run_shell(node: Shell, ctx: Context) -> dict[str, Any]:
    """Run a shell node in its own process group, which dies with the node."""
    cwd = Path(ctx.project_path) / node.cwd if node.cwd else Path(ctx.project_path)
    env = {**os.environ, **(node.env or {})}
    program = node.argv[0]
    if shutil.which(program, path=env.get("PATH")) is None and not os.access(cwd / program, os.X_OK):
        raise OSError(f"cannot run {program}: not found or not executable")
    # Output goes to files, not pipes: a background child keeping a pipe open would hold
    # the node until it exits; with files the node ends when its program does.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with subprocess.Popen(["/bin/sh", "-c", GATE, "piwf-shell", *node.argv], cwd=cwd, env=env,
                              stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True) as proc:
            try:
                ctx.journal.process_started(ctx.node, proc.pid)
                _open_gate(proc)
                proc.wait(timeout=node.timeout)
            except subprocess.TimeoutExpired as exc:
                raise ShellTimedOut(f"{program} timed out after {node.timeout} s") from exc
            finally:
                _kill_group(proc.pid)  # whatever the program left behind in its group
                proc.wait()
                ctx.journal.process_ended(proc.pid)
        stdout, stderr = _read_back(out), _read_back(err)
    _echo(stdout, stderr)
    output = {
        "stdout": stdout.decode(errors="replace"),
        "stderr": stderr.decode(errors="replace"),
        "exitCode": proc.returncode,
    }
    if proc.returncode != 0:
        raise ShellExit(output, program)
    return output


def _open_gate(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # the gate's shell is gone (killed): wait() says so
        proc.stdin.write(b"go\n")
        proc.stdin.close()


def _read_back(handle: Any) -> bytes:
    handle.seek(0)
    return bytes(handle.read())


def _echo(stdout: bytes, stderr: bytes) -> None:
    """A shell node's output goes to the worker's own output too, which the host keeps
    (its last 64 KiB) for ``piwf run logs``; the node's output value keeps all of it."""
    for stream, data in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if data:
            stream.buffer.write(data)
            stream.flush()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class ShellTimedOut(TimeoutError):
    """A shell node's program passed the node's ``timeout`` (its group was killed)."""


class ShellExit(Exception):
    def __init__(self, output: dict[str, Any], program: str) -> None:
        stderr = output["stderr"].strip().splitlines()
        hint = f": {stderr[-1][:200]}" if stderr else ""
        super().__init__(f"{program} exited with status {output['exitCode']}{hint}")
        self.output = output


def describe_error(exc: BaseException, node: str) -> dict[str, Any]:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL:]
    error: dict[str, Any] = {"type": type(exc).__name__, "message": f"node {node}: {exc}", "node": node,
                             "traceback": tail, "where": raised_at(exc, os.getcwd())}
    if isinstance(exc, ShellExit):
        error["output"] = exc.output
    return error


_NOT_THE_USERS = tuple(str(Path(p).resolve()) + os.sep for p in {
    sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[1])})


def raised_at(exc: BaseException, project: str) -> dict[str, Any] | None:
    """Where in the user's code ``exc`` was raised: the last frame of its traceback in a
    file of the project (not of Python, a virtualenv or piwf), as ``file`` (relative to the
    project), ``line``, ``function`` and ``code``; None when no frame is the user's."""
    root = str(Path(project).resolve()) + os.sep
    theirs = tuple(prefix for prefix in _NOT_THE_USERS if not root.startswith(prefix))  # a project may hold a venv
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if path.startswith(root) and not path.startswith(theirs):
            return {"file": path[len(root):], "line": frame.lineno, "function": frame.name,
                    "code": (frame.line or "")[:500]}
    return None
