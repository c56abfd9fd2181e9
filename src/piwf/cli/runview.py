"""How a run reads on a terminal: its state in a word (held runs as held, with the
command that releases them), how a wait for it ended (with its exit code), and how a
failure reads (its type, and the line of the user's code that raised it).

Shared by ``run show``, ``run list``, ``run start --wait``, ``run wait``, ``answer --wait``
and ``piwf watch``; it imports nothing heavy (no rich, no trio).
"""

from __future__ import annotations

import shlex

from piwf.cli.text import shown
from piwf.errors import ExitCode

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: one-shot commands start without it
if TYPE_CHECKING:
    from typing import Any

HELD_FOR_A_PERSON = ("crashed", "effect", "source")  # holds only someone can release (not a pause, not a wait)
WHY_HELD = {"crashed": "its worker crashed too many times in a row", "effect": "an effect's outcome is unknown",
            "source": "its workflow file changed or does not load"}


def held(run: dict[str, Any]) -> bool:
    """Held for a person: parked with a hold that only someone acting releases."""
    return run.get("hold") in HELD_FOR_A_PERSON and run["queueStatus"] in ("queued", "parked")


def state(run: dict[str, Any]) -> str:
    """A run's state in a word or two: ``held (crashed)``, ``paused``, else its engine status."""
    if held(run):
        return f"held ({run['hold']})"
    if run["paused"] and run["queueStatus"] in ("queued", "parked"):
        return "paused"
    return str(run["status"])


def release(run: dict[str, Any]) -> str:
    """What someone does to let a held, paused or waiting run go on: the command to run."""
    run_id, hold = run["runId"], run.get("hold")
    if hold == "effect":
        keys = [e["key"] for e in run.get("effects", []) if e["status"] == "ambiguous"]
        if not keys:  # a summary (run list, watch) has no effects
            return f"see piwf run show {run_id}, then piwf run resolve-effect {run_id} KEY --applied|--not-applied"
        return "; ".join(f"piwf run resolve-effect {run_id} {shlex.quote(shown(key))} --applied|--not-applied"
                         for key in keys)
    if hold == "source":  # resume goes on with the file as it is then: restoring it alone releases nothing
        detail = str(run.get("statusDetail") or "")
        if detail.startswith("no live host can load"):  # placement: each host tries it again once its file changes
            queue = shown(run.get("queue", "default"))
            if "workflow cannot load" in detail and "source changed" not in detail:
                return (f"fix the workflow file: the run is tried again once it changes (or start a host of queue "
                        f"{queue} that can load it), or piwf run resume {run_id}")
            return (f"restore the workflow file: the run is tried again once it changes (or start a host of queue "
                    f"{queue} that has it); or keep the change: piwf run resume {run_id}")
        if str(run.get("statusDetail") or "").startswith("workflow cannot load"):
            return f"fix the workflow file, then piwf run resume {run_id}"
        return f"restore the workflow file or keep the change, then piwf run resume {run_id}"
    if hold == "crashed":
        return f"see piwf run logs {run_id}, fix the cause, then piwf run resume {run_id}"
    if state(run) != "paused" and (hold == "waiting" or run["status"] == "waiting"):
        return f"piwf inbox --run {run_id}"  # a paused run's answer is refused until it is resumed
    return f"piwf run resume {run_id}"


class Ending:
    """How a wait for a run ended: the exit code, and one line saying why (empty on success).
    A plain class: ``run show`` imports this module, and ``dataclasses`` would load ``inspect``."""

    __slots__ = ("code", "reason")

    def __init__(self, code: ExitCode, reason: str) -> None:
        self.code, self.reason = code, reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ending) and (other.code, other.reason) == (self.code, self.reason)

    def __hash__(self) -> int:
        return hash((self.code, self.reason))

    def __repr__(self) -> str:
        return f"Ending(code={self.code!r}, reason={self.reason!r})"

    def as_json(self) -> dict[str, Any]:
        outcome = "completed" if self.code == ExitCode.OK else self.code.outcome
        return {"outcome": outcome, "exitCode": int(self.code), "reason": self.reason}


def ending(run: dict[str, Any]) -> Ending | None:
    """How a wait for ``run`` ends as the run stands: None while something will still happen
    to it without anyone acting (queued, running, between crashes)."""
    run_id, status = run["runId"], run["status"]
    if status == "completed":
        return Ending(ExitCode.OK, "")
    if status in ("failed", "timed_out"):
        code = ExitCode.RUN_FAILED if status == "failed" else ExitCode.RUN_TIMED_OUT
        return Ending(code, f"run {run_id} {'failed' if status == 'failed' else 'timed out'}: {_error_line(run)}")
    if status == "cancelled":
        return Ending(ExitCode.RUN_CANCELLED, f"run {run_id} was cancelled")
    return held_ending(run) or (
        Ending(ExitCode.RUN_WAITING, f"run {run_id} waits for an answer: {release(run)}")
        if status == "waiting" and run["queueStatus"] == "parked" else None)


def held_ending(run: dict[str, Any]) -> Ending | None:
    """The ending of a run held for a person or paused; None otherwise."""
    if held(run):
        why = run.get("statusDetail") or WHY_HELD[run["hold"]]
        return Ending(ExitCode.RUN_HELD, f"run {run['runId']} is held ({run['hold']}): {shown(why, 500)}; "
                                         f"{release(run)}")
    if state(run) == "paused":
        return Ending(ExitCode.RUN_PAUSED, f"run {run['runId']} is paused: {release(run)}")
    return None


def _error_line(run: dict[str, Any]) -> str:
    error = run.get("error") or {}
    if not error:
        return shown(run.get("statusDetail") or "no error recorded", 500)
    where = error.get("where")
    return error_head(error) + (f" at {shown(where['file'])}:{where['line']}" if where else "")


def error_head(error: dict[str, Any]) -> str:
    """``KeyError: 'text' (node a)``: the exception's type, its message, the node."""
    message = str(error.get("message") or "")
    node = error.get("node")
    if node is not None and message.startswith(f"node {node}: "):
        message = message[len(f"node {node}: "):]
    return f"{shown(error.get('type') or 'Error')}: {shown(message, 1000)}" + (
        f" (node {shown(node)})" if node is not None else "")


def format_error(error: dict[str, Any]) -> list[str]:
    """A failure in a few lines: its type and message, the node, and where the user's code
    raised it (``--json`` has the whole traceback)."""
    lines = [f"error:    {error_head(error)}"]
    where = error.get("where")
    if where:
        lines.append(f"  at {shown(where['file'], 500)}:{where['line']} in {shown(where['function'])}")
        if where.get("code"):
            lines.append(f"    {shown(where['code'], 500)}")
    return lines
