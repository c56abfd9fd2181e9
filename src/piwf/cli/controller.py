"""``piwf controller apply|get|list|delete|reconcile|resolve-effect`` (DESIGN.md §9).

The project defaults to the current directory, as for runs; every command takes
``--json`` (one document on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from piwf.errors import UsageError


def _target(args: argparse.Namespace) -> dict[str, Any]:
    return {"projectPath": str(Path(args.project).absolute()), "controller": args.name, "key": args.key}


def _call(args: argparse.Namespace, operation: str, payload: dict[str, Any]) -> Any:
    from piwf.cli.common import _client, _ok

    with _client(args) as client:
        return _ok(client.call(operation, payload=payload))


def _show(args: argparse.Namespace, value: Any, human: Any) -> int:
    from piwf.cli.common import _print

    _print(args, value, human)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from piwf.cli.common import _json_arg

    payload = {**_target(args), "spec": _json_arg(_spec_text(args.spec), "--spec")}
    if args.resource_version is not None:
        payload["expectedResourceVersion"] = args.resource_version
    receipt = _call(args, "controller.apply", payload)
    return _show(args, receipt, lambda r: f"{args.name}/{args.key}: generation {r['generation']}, resourceVersion "
                 f"{r['resourceVersion']}" + ("" if r["changed"] else " (unchanged)"))


def _spec_text(value: str) -> str:
    """``--spec JSON``, ``--spec @FILE`` or ``--spec -`` (standard input). A spec is at most
    1 MiB as canonical JSON, and the request carrying it at most 1 MiB too."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--spec {value}: cannot read it: {exc}") from None
    return value


def cmd_get(args: argparse.Namespace) -> int:
    return _show(args, _call(args, "controller.get", _target(args)), format_resource)


def cmd_delete(args: argparse.Namespace) -> int:
    payload = {**_target(args), **({"force": True} if args.force else {})}
    receipt = _call(args, "controller.delete", payload)
    return _show(args, receipt, lambda r: f"{args.name}/{args.key}: "
                 + (("deleted by force (finalizers not run)" if args.force else "deleted") if r["deleted"]
                    else "deletion requested; its finalizers run next"))


def cmd_reconcile(args: argparse.Namespace) -> int:
    receipt = _call(args, "controller.reconcile", _target(args))
    return _show(args, receipt, lambda r: f"{args.name}/{args.key}: reconcile queued")


def cmd_list(args: argparse.Namespace) -> int:
    payload: dict[str, Any] = {}
    if args.name:
        payload["controller"] = args.name
    if args.project:
        payload["projectPath"] = str(Path(args.project).absolute())
    rows = _call(args, "controller.list", payload)
    return _show(args, rows, lambda rs: "\n".join(
        f"{r['controller']:16} {r['key']:24} gen {r['generation']:<4} observed {r['observedGeneration']:<4} "
        f"ready {r['ready'] or '-':7} errors {r['consecutiveErrors']}" + (f" held ({r['hold']})" if r["hold"] else "")
        for r in rs) or "no resources")


def cmd_resolve(args: argparse.Namespace) -> int:
    from piwf.cli.common import _json_arg

    if args.result is not None and not args.applied:
        raise UsageError("--result goes with --applied")
    result = None if args.result is None else _json_arg(args.result, "--result")
    payload = {**_target(args), "effectKey": args.effect_key, "applied": bool(args.applied), "result": result}
    receipt = _call(args, "controller.resolve", payload)
    return _show(args, receipt, lambda r: f"{args.name}/{args.key}: effect {args.effect_key} resolved as "
                 f"{r['status']}" + (f"; still ambiguous: {', '.join(r['ambiguous'])}" if r["ambiguous"] else ""))


def format_resource(r: dict[str, Any]) -> str:
    status = r["status"]
    lines = [f"resource:   {r['controller']}/{r['key']} ({r['uid']}) in {r['projectPath']}",
             f"version:    resourceVersion {r['resourceVersion']}, generation {r['generation']}, "
             f"observed {status.get('observedGeneration', 0)}",
             "spec:       " + json.dumps(r["spec"]),
             "status:     " + json.dumps(status.get("controllerStatus"))]
    for c in status.get("conditions", []):
        lines.append(f"  {c['type']}={c['status']} {c.get('reason') or ''} {c.get('message') or ''}".rstrip()
                     + f" (since {c.get('lastTransitionTime')})")
    if status.get("workflowRun"):
        lines.append("child run:  " + json.dumps(status["workflowRun"]))
    children = r.get("children") or []
    if children:
        lines.append(f"children:   {len(children)} run(s) its reconciles started")
    for child in children:
        lines.append(f"  {child['runId']} {child['workflow']} {child['state']}, attempt {child['attempt']}"
                     f" (key {child['requestKey']})")
    if r["finalizers"]:
        lines.append("finalizers: " + ", ".join(r["finalizers"]))
    if r["deletionTimestamp"]:
        lines.append(f"deleting:   since {r['deletionTimestamp']}")
    queue = "reconciling now" if r["reconciling"] else (f"next attempt {r['availableAt']}" if r["availableAt"]
                                                        else "nothing queued")
    lines.append(f"queue:      {queue}; {r['consecutiveErrors']} error(s) in a row"
                 + (f"; held ({r['hold']})" if r["hold"] else ""))
    if r["lastError"]:
        lines.append("last error: " + r["lastError"].splitlines()[0])
    for e in r["events"]:
        lines.append(f"  {e['at']} {e['type']:20} " + " ".join(f"{k}={_first_line(v)}"
                                                            for k, v in e.get("detail", {}).items()))
    return "\n".join(lines)


def _first_line(value: Any) -> Any:
    """An event's value on one line: a traceback shows its first line (the whole of it is
    in ``--json``)."""
    if not isinstance(value, str):
        return value
    lines = value.splitlines() or [""]
    return lines[0] + (" …" if len(lines) > 1 else "")
