"""How a run reads in the console: its state in a word, why it is held, and which of the
actions (cancel, pause, resume, retry, resolve an effect) apply to it as it stands. The
words are the CLI's (``piwf run list``, ``piwf watch``: docs/operations.md), so a person
reading both sees the same; the host refuses an action that does not apply all the same,
and the console shows its refusal.
"""

from __future__ import annotations

from typing import Any


# The CLI's words (piwf.cli.runview), written again here: the console may not import the
# CLI (an import contract), and the CLI keeps piwf.status free of what one-shot commands
# would have to import. tests/test_ui_parts.py checks the two say the same.
HELD_FOR_A_PERSON = ("crashed", "effect", "source")
WHY_HELD = {"crashed": "its worker crashed too many times in a row", "effect": "an effect's outcome is unknown",
            "source": "its workflow file changed or does not load"}
ENDED_QUEUE = ("done", "failed", "cancelled")
STATUSES = ("queued", "running", "waiting", "completed", "failed", "timed_out", "cancelled")


def held(run: dict[str, Any]) -> bool:
    """Held for a person: parked with a hold only someone acting releases."""
    return run.get("hold") in HELD_FOR_A_PERSON and run["queueStatus"] in ("queued", "parked")


def state(run: dict[str, Any]) -> str:
    """``held (crashed)``, ``paused``, else the engine status (``running``, ``waiting``, ...)."""
    if held(run):
        return f"held ({run['hold']})"
    if run["paused"] and run["queueStatus"] in ("queued", "parked"):
        return "paused"
    return str(run["status"])


def tone(run: dict[str, Any]) -> str:
    """The CSS class of a run's state."""
    word = state(run)
    if word.startswith("held"):
        return "held"
    return {"completed": "ok", "failed": "bad", "timed_out": "bad", "cancelled": "off", "waiting": "wait",
            "paused": "wait", "running": "busy"}.get(word, "idle")


ACTIONS = {
    "cancel": ("Cancel", "End the run as cancelled: its worker's processes are killed and its open requests "
                         "closed. It cannot be undone (a cancelled run is not retried)."),
    "pause": ("Pause", "Park the run at its next node boundary; it stays parked until resumed."),
    "resume": ("Resume", "Let the paused or held run continue (a held one goes on with its workflow file as it "
                         "is now)."),
    "retry": ("Retry", "Continue the failed or timed-out run as the same run from the node that failed: its "
                       "accepted steps and applied effects are kept; effects whose apply() raised are applied "
                       "again."),
}
CONFIRMED = ("cancel", "retry")  # asked again before they are sent: they cannot be taken back


def actions(run: dict[str, Any]) -> list[str]:
    """The actions that apply to the run as it stands."""
    ended = run["queueStatus"] in ENDED_QUEUE
    found = []
    if not ended:
        found.append("cancel")
        if not run["paused"]:
            found.append("pause")
    if not ended and (run["paused"] or held(run)) and run.get("hold") != "effect":
        found.append("resume")  # a run held on an ambiguous effect goes on once it is resolved: the host refuses resume
    if run["status"] in ("failed", "timed_out"):
        found.append("retry")
    return found


def said(action: str, run_id: str, receipt: dict[str, Any]) -> str:
    """What the CLI prints for the action's receipt."""
    if action == "retry":
        where = f"from node {receipt['node']}" if receipt.get("node") else "from where it stopped"
        line = (f"{run_id}: retried ({receipt['retriedFrom']} → queued, generation {receipt['generation']}); "
                f"it continues {where}")
        if receipt.get("reopenedEffects"):
            line += f"; effects applied again: {', '.join(receipt['reopenedEffects'])}"
        return line
    return f"{run_id}: {action} accepted"


NODE_STATES = ("accepted", "running", "failed", "waiting", "not reached")
