"""``piwf run settings RUN [--set PATH=JSON ...] [--expect N]``: show or change a run's settings."""

from __future__ import annotations

import argparse
import json
from typing import Any

from piwf.errors import UsageError


def build_patch(assignments: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=\"x\""]`` as the merge patch ``{"a": {"b": 1}, "c": "x"}``."""
    from piwf.cli.common import _json_arg

    patch: dict[str, Any] = {}
    for assignment in assignments:
        path, sep, text = assignment.partition("=")
        parts = path.split(".")
        if not sep or not all(parts):
            raise UsageError(f"--set {assignment!r}: expected PATH=JSON, like budget=5 or model='\"small\"'")
        value = _json_arg(text, f"--set {path}")
        node = patch
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {path}: {part!r} is set to a value and changed below in one command")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise UsageError(f"--set {path}: a path below it is set in the same command")
        node[parts[-1]] = value
    return patch


def cmd_run_settings(args: argparse.Namespace) -> int:
    from piwf.cli.common import _client, _ok, _print

    if args.expect is not None and not args.assignments:
        raise UsageError("--expect goes with --set: it guards a change")
    payload: dict[str, Any] = {}
    if args.scope:
        payload["scopeId"] = args.scope
    with _client(args) as client:
        if not args.assignments:
            shown = _ok(client.call("workflow.settings", run_id=args.run_id, payload=payload))
            _print(args, shown, format_settings)
            return 0
        payload["patch"] = build_patch(args.assignments)
        if args.expect is not None:
            payload["expectedChangeNumber"] = args.expect
        receipt = _ok(client.call("workflow.changeSettings", run_id=args.run_id, payload=payload,
                                  request_id=args.command_id))
    _print(args, receipt, lambda r: f"change {r['changeNumber']}: {json.dumps(r['settings'], sort_keys=True)}")
    return 0


def format_settings(s: dict[str, Any]) -> str:
    lines = [f"run:      {s['runId']} (scope {s['scopeId']})",
             f"change:   {s['changeNumber']}",
             f"settings: {json.dumps(s['settings'], sort_keys=True)}",
             f"mutable:  {', '.join(s['mutable']) or 'nothing'}"]
    for c in s["changes"]:
        by = c["actor"] + (f" {c['actorId']}" if c["actorId"] else "")
        lines.append(f"  change {c['changeNumber']} by {by} at {c['at']}: {json.dumps(c['patch'], sort_keys=True)}")
    return "\n".join(lines)
