"""``piwf run ...``: starting runs, showing them, and an operator's controls."""

from __future__ import annotations

import argparse
import json
import shlex
import time

from piwf.cli import runview
from piwf.cli.common import (DEFAULT_TIMEOUT_S, LOAD_LIMIT_S, _client, _json_arg, _ok, _paths, _print, _timeout,
                             client_id, slow_notice)
from piwf.cli.text import shown
from piwf.client import Client, new_id
from piwf.errors import HostTimeout, PiwfError, UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: one-shot commands start without it
if TYPE_CHECKING:
    from typing import Any

STATUS_PROBE_S = 2.0  # after a start timed out: does the host answer at once (loading) or not (frozen)?


def cmd_run_start(args: argparse.Namespace) -> int:
    from pathlib import Path

    run_input = _json_arg(args.input, "--input")
    payload: dict[str, Any] = {"workflow": args.name, "projectPath": str(Path(args.project).absolute()),
                               "input": run_input}
    if args.session:
        payload["originSessionId"] = args.session
    if args.settings is not None:
        payload["settings"] = _json_arg(args.settings, "--settings")
    if args.queue is not None:
        payload["queue"] = args.queue
    if args.wait_timeout is not None and not args.wait:
        raise UsageError("--wait-timeout goes with --wait")
    # Loading the workflow may take the host up to LOAD_LIMIT_S: by default the CLI waits for
    # the host's own answer (its reason), a --timeout or $PIWF_TIMEOUT bounds the wait.
    # The request id is chosen here, so that a start whose answer did not come in time can be
    # retried with it: the host adopts the retry (the same run), it starts no second run.
    request_id = args.command_id or new_id()
    with _client(args, default_timeout=LOAD_LIMIT_S + DEFAULT_TIMEOUT_S) as client:
        try:
            with slow_notice(f"waiting for the host to load workflow {args.name} (its import may take up to "
                             f"{LOAD_LIMIT_S} s; --timeout S waits less)"):
                receipt = _ok(client.call("run.start", run_id=args.run_id, payload=payload, request_id=request_id))
        except HostTimeout as exc:
            raise HostTimeout(_start_timed_out(args, exc, request_id)) from exc
        run_id = receipt["runId"]
        if not args.wait:
            _print(args, {"runId": run_id}, lambda r: run_id)
            return 0
        from piwf.cli import waiting

        return waiting.attend(args, client, run_id, format_run, announce=True)


def _start_timed_out(args: argparse.Namespace, exc: HostTimeout, request_id: str) -> str:
    """Why ``run start`` got no answer in time, and how to go on without starting the run
    twice. A host that answers ``host.status`` at once is loading the workflow (its import
    runs in a child process of its own), not frozen."""
    try:
        with Client(_paths(args), timeout=STATUS_PROBE_S, client_id=client_id()) as probe:
            _ok(probe.call("host.status"))
    except PiwfError:
        head = str(exc)  # frozen or overloaded: the request may have been received all the same
    else:
        waited = _timeout(args, LOAD_LIMIT_S + DEFAULT_TIMEOUT_S)
        head = (f"the host answers, but did not start the run within {waited:g} s: workflow {args.name} is "
                f"still loading (its import may take up to {LOAD_LIMIT_S} s)")
    return (f"{head}; the run may start all the same: see piwf run list --workflow {shlex.quote(args.name)}, "
            f"or retry with the same request id (adopted, not a second run): {_retry_command(args, request_id)}")


def _retry_command(args: argparse.Namespace, request_id: str) -> str:
    """This ``run start`` again, word for word, with its request id (and without its
    ``--timeout``: the retry waits for the host's own answer)."""
    from pathlib import Path

    words = ["piwf", "run", "start", args.name, "--project", str(Path(args.project).absolute())]
    for flag, value in (("--input", None if args.input == "{}" else args.input), ("--session", args.session),
                        ("--run-id", args.run_id), ("--settings", args.settings),
                        ("--state-dir", args.state_dir and str(Path(args.state_dir).absolute()))):
        if value is not None:
            words += [flag, value]
    if args.wait:
        words.append("--wait")
    if args.wait_timeout is not None:
        words += ["--wait-timeout", f"{args.wait_timeout}ms" if args.wait_timeout % 1000 else
                  f"{args.wait_timeout // 1000}s"]
    if args.json:
        words.append("--json")
    return shlex.join([*words, "--request-id", request_id])


def cmd_run_wait(args: argparse.Namespace) -> int:
    """``piwf run wait RUN``: attach to a run and wait for it as ``run start --wait`` does."""
    from piwf.cli import waiting

    with _client(args) as client:
        return waiting.attend(args, client, args.run_id, format_run)


def cmd_run_list(args: argparse.Namespace) -> int:
    """Runs newest first, filtered; a header row, and after a full page the command that
    shows the next one (``--after`` the last run shown)."""
    payload: dict[str, Any] = {"limit": min(args.limit + 1, 1000)}  # one more: is there a next page?
    for key, value in (("status", args.status), ("workflow", args.workflow), ("originSessionId", args.session),
                       ("since", args.since), ("after", args.after)):
        if value is not None:
            payload[key] = value
    if args.held:
        payload["held"] = True
    with _client(args) as client:
        rows = _ok(client.call("run.list", payload=payload))
    more = len(rows) > args.limit or len(rows) == 1000
    rows = rows[:args.limit]
    _print(args, rows, lambda rs: format_list(rs, _next_page(args, rs) if more else None))
    return 0


def format_list(rows: list[dict[str, Any]], next_page: str | None) -> str:
    if not rows:
        return "no runs"
    table = [("RUN", "WORKFLOW", "STATE", "QUEUE", "CREATED")]
    table += [(r["runId"], shown(r["workflow"], 40), runview.state(r) + (" (paused)" if r["paused"] and
              runview.state(r) != "paused" else ""), _queue_cell(r), r["createdAt"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
             for row in table]
    lines += [f"{r['runId']} is held ({r['hold']}): {runview.release(r)}" for r in rows if runview.held(r)]
    if next_page:
        lines.append(f"more: {next_page}")
    return "\n".join(lines)


def _queue_cell(r: dict[str, Any]) -> str:
    """The queue status, and the named queue when it is not the default one: ``queued on gpu``."""
    queue = r.get("queue", "default")
    return str(r["queueStatus"]) + ("" if queue == "default" else f" on {shown(queue)}")


def iso_time(ms: int) -> str:
    """``2026-12-02T09:30:00.000Z``: a time the next page's ``--since`` reads back exactly."""
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _next_page(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """The command that lists the next page: this one's filters, after the last run shown."""
    words = ["piwf", "run", "list"]
    for flag, value in (("--status", args.status), ("--workflow", args.workflow), ("--session", args.session),
                        ("--since", None if args.since is None else iso_time(args.since))):
        if value is not None:
            words += [flag, shlex.quote(shown(value))]
    if args.held:
        words.append("--held")
    if args.limit != 50:
        words += ["--limit", str(args.limit)]
    return " ".join([*words, "--after", rows[-1]["runId"]])


def cmd_run_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = _ok(client.call("run.status", run_id=args.run_id))
    _print(args, run, format_run)
    return 0


def cmd_run_graph(args: argparse.Namespace) -> int:
    with _client(args) as client:
        graph = _ok(client.call("run.graph", run_id=args.run_id))
    _print(args, graph, format_graph)
    return 0


def format_graph(graph: dict[str, Any]) -> str:
    """Each node on a line (state, kind, title, where its exits lead), then the path."""
    lines = [f"{graph['runId']}  {graph['workflow']}  {graph['status']}  ({graph['definitionDigest']})"]
    lines.append(f"start: {graph['startAt']}" if graph["known"] else str(graph["reason"]))
    leads = {(e["node"], e["exit"]): e["to"] for e in graph["edges"]}
    width = max((len(shown(n["id"])) for n in graph["nodes"]), default=0)
    for node in graph["nodes"]:
        state = node["state"].replace("_", " ") + (f" ({node['requestId']})" if node["requestId"] else "")
        exits = ", ".join(f"{shown(x)} -> {shown(leads[(node['id'], x)])}" if (node["id"], x) in leads
                          else f"{shown(x)} -> end" for x in node["exits"])
        title = f'  "{shown(node["title"], 60)}"' if node["title"] else ""
        lines.append(f"  {shown(node['id']):{width}}  {node['kind']:8}  {state:12}{title}  [{exits}]")
    steps = [f"{shown(s['node'])}({shown(s['exit']) if s['exit'] else s['status']})" for s in graph["path"]]
    lines.append("path: " + (" -> ".join(steps) if steps else "(not started)"))
    return "\n".join(lines)


def cmd_run_events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        events = all_events(client, args.run_id)
    _print(args, events, lambda es: "\n".join(event_line(e) for e in es))
    return 0


def event_line(e: dict[str, Any]) -> str:
    """One event as `run events` prints it (`--follow` too)."""
    fields = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("eventId", "at", "type"))
    return f"{e['at']} {e['type']:18} {fields}"


def cmd_run_logs(args: argparse.Namespace) -> int:
    """The output the host kept of each worker of the run (its last 64 KiB), oldest first."""
    with _client(args) as client:
        run = _ok(client.call("run.status", run_id=args.run_id))
    workers = [{key: w[key] for key in ("workerEpoch", "generation", "pid", "status", "exitCode", "signal",
                                        "diagnostic")} for w in run["workers"]]
    _print(args, {"runId": run["runId"], "workers": workers}, _format_logs)
    return 0


def _format_logs(logs: dict[str, Any]) -> str:
    if not logs["workers"]:
        return f"{logs['runId']}: no worker has run yet"
    parts = []
    for w in logs["workers"]:
        parts.append(f"== generation {w['generation']}, worker {w['workerEpoch']}: {w['status']} ({_end(w)})")
        text = (w["diagnostic"] or "").rstrip("\n")
        parts.append(text or "(no output)")
    return "\n".join(parts)


def _end(worker: dict[str, Any]) -> str:
    if worker["signal"] is not None:
        return f"signal {worker['signal']}"
    if worker["exitCode"] is not None:
        return f"exit {worker['exitCode']}"
    return "still running" if worker["status"] in ("starting", "running") else "exit status unknown"


def all_events(client: Client, run_id: str) -> list[dict[str, Any]]:
    """Every event of the run, a page (at most 1,000) per request."""
    events: list[dict[str, Any]] = []
    after: int | None = 0
    while after is not None:
        page = _ok(client.call("run.events", run_id=run_id, payload={"after": after}))
        events += page["events"]
        after = page["nextAfter"]
    return events


def cmd_run_resolve_effect(args: argparse.Namespace) -> int:
    if args.result is not None and not args.applied:
        raise UsageError("--result goes with --applied")
    result = None if args.result is None else _json_arg(args.result, "--result")
    payload = {"key": args.key, "applied": bool(args.applied), "result": result}
    with _client(args) as client:
        receipt = _ok(client.call("effect.resolve", run_id=args.run_id, payload=payload))
    _print(args, receipt, lambda r: f"{args.run_id}: effect {args.key} resolved as {r['status']}"
           + (f"; still ambiguous: {', '.join(r['ambiguous'])}" if r["ambiguous"] else ""))
    return 0


def cmd_run_control(args: argparse.Namespace) -> int:
    operation = f"run.{args.sub}"
    with _client(args) as client:
        receipt = _ok(client.call(operation, run_id=args.run_id))
    _print(args, receipt, lambda r: f"{args.run_id}: {args.sub} accepted")
    return 0


def format_run(r: dict[str, Any]) -> str:
    """``piwf run show``: the run, its steps, effects, open requests, output or error."""
    lines = [f"run:      {r['runId']} ({r['workflow']})",
             f"status:   {_status(r)}",
             f"created:  {r['createdAt']}" + (f", finished {r['finishedAt']}" if r["finishedAt"] else "")]
    if r.get("queue", "default") != "default":
        lines.append(f"queue:    {shown(r['queue'])}")
    if r.get("statusDetail"):
        lines.append(f"detail:   {shown(r['statusDetail'], 2000)}")
    if r.get("placement"):
        lines.append(f"waiting:  {shown(r['placement'], 2000)}")
    if runview.held(r) or runview.state(r) == "paused":
        lines.append(f"release:  {runview.release(r)}")
    for w in r.get("workers", []):
        if w.get("stopped"):
            lines.append(f"worker:   {w['workerEpoch']} (pid {w['pid']}) is stopped (SIGSTOP or a debugger): "
                         f"no progress until it is continued (kill -CONT {w['pid']})")
    for step in r.get("steps", []):
        change = "" if step.get("settingsChange") is None else f", settings change {step['settingsChange']}"
        lines.append(f"  step {step['seq']}: {step['node']:16} {step['status']} "
                     f"(generation {step['generation']}{change})")
    for effect in r.get("effects", []):
        lines.append(f"  effect {shown(effect['key'])}: {effect['status']} (node {effect['node']})")
    for request in r.get("waitingFor", []):
        from piwf.cli import interact as cli_interact

        lines.append("waiting for:\n" + cli_interact.format_request(request))
    if r.get("output") is not None:
        lines.append("output:   " + shown(json.dumps(r["output"]), 2000))
    if r.get("error"):
        lines += runview.format_error(r["error"])
    return "\n".join(lines)


def _status(r: dict[str, Any]) -> str:
    """``failed / failed``; a held or paused run says so first: ``held (crashed): running / parked``."""
    both = f"{r['status']} / {r['queueStatus']}"
    word = runview.state(r)
    if word != r["status"]:
        return f"{word}: {both}"
    return both + (" (paused)" if r["paused"] else "")
