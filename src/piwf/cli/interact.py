"""``piwf inbox``, ``piwf decide``, ``piwf answer``: people in the loop from a terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from piwf.cli.text import shown
from piwf.errors import ExitCode


def cmd_inbox(args: argparse.Namespace) -> int:
    from piwf.cli import deliver as cli_deliver
    from piwf.cli.common import _client, _ok, _print

    if args.follow:
        return cli_deliver.follow(args)
    payload: dict[str, Any] = {"open": not args.all, "limit": args.limit + 1}  # one more: are there more?
    if args.session:
        payload["sessionId"] = args.session
    if args.run:
        payload["runId"] = args.run
    with _client(args) as client:
        page = _ok(client.call("interaction.list", payload=payload))
        page["more"] = len(page["requests"]) > args.limit
        page["requests"] = page["requests"][:args.limit]
        cli_deliver.add_delivery(client, args, page)  # undelivered notifications, unresolved turns
    _print(args, page, lambda p: "\n".join([*(format_request(r) for r in p["requests"]), *_more(p, args.limit),
                                            *cli_deliver.format_delivery(p)]) or "nothing waits for you")
    return 0


def _more(page: dict[str, Any], limit: int) -> list[str]:
    if not page["more"]:
        return []
    return [f"… more requests than these {limit} (oldest first): piwf inbox --limit {min(limit * 10, 999)}, "
            "or answer these first"]


def format_request(r: dict[str, Any]) -> str:
    """A request in a few lines: what is asked, how to answer it (while it is open), and
    its state."""
    head = f"{r['requestId']}  {r['kind']:8} {r['status']:10} run {r['runId']} ({r['workflow']}/{r['nodeId']})"
    lines = [head, f"    {shown(r['title'], 2000)}"]
    is_open = r["status"] in ("pending", "presenting")
    if r["choices"]:
        choices = ", ".join(f"{key} = {shown(c['label'])}" + (" (+text)" if c.get("input") else "")
                            for key, c in r["choices"].items())
        lines.append(f"    choices: {choices}")
        if is_open:
            lines.append(f"    answer:  piwf decide {r['requestId']} CHOICE")
    else:
        lines.append(f"    expects: {shown(json.dumps(r['schema']))}")
        if is_open:
            lines.append(f"    answer:  piwf answer {r['requestId']} --value JSON"
                         + (f" --session {r['originSessionId']}" if r["originSessionId"] else ""))
    if r["deadline"]:
        default = r.get("default")
        lines.append(f"    deadline {r['deadline']}" + (f", then {default['choice']}" if default else ""))
    last = r.get("lastSubmission")
    if last:
        lines.append(f"    last submission: {last['status']}" + (f" ({shown(last['error'])})" if last["error"] else ""))
    if r.get("resolution"):
        res = r["resolution"]
        got = res.get("choice") or shown(json.dumps(res.get("value")))
        lines.append(f"    resolved: {got} ({res['provenance']}, by {res['answeredBy'] or 'its deadline'})")
    return "\n".join(lines)


def cmd_decide(args: argparse.Namespace) -> int:
    from piwf.cli.common import _client, _ok, _print

    payload: dict[str, Any] = {"requestId": args.request_id, "choice": args.choice}
    if args.input is not None:
        payload["input"] = args.input
    with _client(args) as client:
        receipt = _ok(client.call("decision.answer", payload=payload, request_id=args.command_id))
    _print(args, receipt, lambda r: f"{r['requestId']}: answered {r['choice']} (run {r['runId']})")
    return 0


def cmd_answer(args: argparse.Namespace) -> int:
    from piwf.cli import waiting
    from piwf.cli.common import _client, _json_arg, _ok, _print

    if args.wait_timeout is not None and not args.wait:
        from piwf.errors import UsageError

        raise UsageError("--wait-timeout goes with --wait")
    value = _json_arg(_read_value(args.value), "--value")
    payload: dict[str, Any] = {"requestId": args.request_id, "value": value}
    if args.session:
        payload["sessionId"] = args.session
    with _client(args) as client:
        receipt = _ok(client.call("interaction.submit", payload=payload, request_id=args.command_id))
        if not args.wait:
            _print(args, receipt, lambda r: f"{r['submissionId']}: submitted; the workflow validates it")
            return 0
        try:
            submission, end = waiting.submission_ending(client, receipt, waiting.Deadline(args.wait_timeout),
                                                        say=waiting.shows_progress(args))
        except KeyboardInterrupt:
            print(f"piwf: stopped waiting; submission {receipt['submissionId']} stays and is validated all the "
                  f"same: piwf inbox --run {receipt['runId']}", file=sys.stderr)
            return ExitCode.INTERRUPTED
    if end is not None:  # held, paused or ended before the submission was validated; or the wait's limit
        _print(args, {**submission, "wait": end.as_json()}, lambda s: f"{s['submissionId']}: {s['status']}")
        sys.stdout.flush()
        if end.reason:
            print(f"piwf: {end.reason}", file=sys.stderr)
        return int(end.code)
    _print(args, submission, lambda s: f"{s['submissionId']}: {s['status']}"
           + (f": {s['error']}" if s.get("error") else ""))
    return 0 if submission["status"] == "accepted" else ExitCode.ERROR


def _read_value(text: str) -> str:
    from piwf.errors import UsageError

    if text != "-" and not text.startswith("@"):
        return text
    try:
        if text == "-":
            return sys.stdin.read()
        return Path(text[1:]).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--value {text}: cannot read it: {exc}") from None
