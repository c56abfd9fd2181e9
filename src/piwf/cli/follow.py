"""``piwf run events RUN --follow``, ``piwf run logs RUN --follow`` and ``piwf followup``.

Following is a ``run.watch`` long poll on the one run (no request is sent while nothing
changes), from the last event already printed; it ends when the run has ended (its queue
status final), and outlives host restarts as ``piwf watch`` does, saying so on stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Callable, Iterator
from typing import Any

from piwf.cli.common import WAIT_S, _client, _ok, _print
from piwf.cli.text import terminal_text
from piwf.client import Client
from piwf.errors import HostReplied, HostUnavailable
from piwf.status import ENDED

POLL_MS = 30_000


def _changes(client: Client, run_id: str, after: int) -> Iterator[list[dict[str, Any]]]:
    """The run's new events, a batch per ``run.watch`` answer, from event ``after`` on, until
    the run has ended and is at rest (its worker's end recorded), and every event up to then
    was yielded."""
    client.timeout = WAIT_S + (client.timeout or 0)  # a run.watch may take its own limit
    ended = _ok(client.call("run.status", run_id=run_id))["queueStatus"] in ENDED
    while not ended:
        page = _watch(client, run_id, after, POLL_MS)
        after = page["cursor"]
        yield [item["event"] for item in page["events"]]
        ended = not page["more"] and any(r["runId"] == run_id and r["queueStatus"] in ENDED for r in page["runs"])
    _ok(client.call("run.wait", run_id=run_id, payload={"timeoutMs": WAIT_S * 1000}))
    while True:  # what was recorded up to rest: the worker's end
        page = _watch(client, run_id, after, 0)
        after = page["cursor"]
        yield [item["event"] for item in page["events"]]
        if not page["more"]:
            return


def _watch(client: Client, run_id: str, after: int, timeout_ms: int) -> dict[str, Any]:
    """One ``run.watch`` of the run after ``after``; a lost host (stopped, restarting) is
    waited for, saying so on stderr, and the watch is sent again."""
    from piwf.cli.deliver import lost_host, until_host_is_back

    while True:
        try:
            page: dict[str, Any] = _ok(client.watch(after=after, run_id=run_id, timeout_ms=timeout_ms, limit=1000))
            return page
        except (HostUnavailable, HostReplied) as exc:
            if not lost_host(exc):
                raise
            until_host_is_back(client, exc)


def cmd_run_events(args: argparse.Namespace) -> int:
    """``run events``: the run's trace; with ``--follow``, then each new event until it ends."""
    from piwf.cli import run

    return follow_events(args) if args.follow else run.cmd_run_events(args)


def cmd_run_logs(args: argparse.Namespace) -> int:
    """``run logs``: its workers' output; with ``--follow``, then each worker's until it ends."""
    from piwf.cli import run

    return follow_logs(args) if args.follow else run.cmd_run_logs(args)


def follow_events(args: argparse.Namespace) -> int:
    """Every event of the run so far, then each new one as it comes, until the run ends."""
    from piwf.cli.run import all_events, event_line

    with _client(args) as client:
        events = all_events(client, args.run_id)
        _show(args, events, event_line)
        for batch in _changes(client, args.run_id, events[-1]["eventId"] if events else 0):
            _show(args, batch, event_line)
    return 0


def follow_logs(args: argparse.Namespace) -> int:
    """Each worker's output: as ``run logs`` prints it for a worker that had ended, and as
    it comes (``run.output``) for a live one; then the next worker's, until the run ends."""
    from piwf.cli.run import all_events

    shown: dict[str, bool] = {}  # worker -> its end printed too
    with _client(args) as client:
        events = all_events(client, args.run_id)
        after = events[-1]["eventId"] if events else 0
        _print_workers(client, args, shown)
        for _ in _changes(client, args.run_id, after):
            _print_workers(client, args, shown)
    if not shown and not args.json:
        print(f"{args.run_id}: no worker has run")
    return 0


def _print_workers(client: Client, args: argparse.Namespace, shown: dict[str, bool]) -> None:
    """Print what is new of each worker of the run, oldest first: a live one's output as
    it comes until it exits, an ended one's end (and, if it was not followed, its output)."""
    from piwf.cli.run import _end, _format_logs

    run = _ok(client.call("run.status", run_id=args.run_id))
    for worker in run["workers"]:
        epoch, live = worker["workerEpoch"], worker["status"] in ("starting", "running")
        if shown.get(epoch):
            continue
        if live and epoch not in shown:
            shown[epoch] = False
            _stream(client, args, worker)
        elif not live and epoch in shown:  # followed: its end is recorded now
            shown[epoch] = True
            if not args.json:
                print(f"== worker {epoch}: {worker['status']} ({_end(worker)})", flush=True)
        elif not live:
            shown[epoch] = True
            logs = {"runId": run["runId"], "workers": [{key: worker[key] for key in (
                "workerEpoch", "generation", "pid", "status", "exitCode", "signal", "diagnostic")}]}
            _show(args, [logs], _format_logs)


def _stream(client: Client, args: argparse.Namespace, worker: dict[str, Any]) -> None:
    """A live worker's output as it comes, until the host reads no more of it."""
    epoch = worker["workerEpoch"]
    if not args.json:
        print(f"== generation {worker['generation']}, worker {epoch}: {worker['status']}", flush=True)
    after, live = 0, True
    while live:
        out = _ok(client.call("run.output", run_id=args.run_id,
                              payload={"workerEpoch": epoch, "after": after, "timeoutMs": POLL_MS}))
        after, live = out["next"], out["live"]
        if out["dropped"] and not args.json:
            print(f"[piwf] {out['dropped']} bytes of output not kept", flush=True)
        if out["text"]:
            if args.json:
                print(json.dumps(out, sort_keys=True), flush=True)
            else:
                sys.stdout.write(terminal_text(out["text"]))
                sys.stdout.flush()


def _show(args: argparse.Namespace, items: list[dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> None:
    """Each item as one JSON line with --json, else as ``line`` prints it; at once."""
    for item in items:  # workflow text is shown escaped (cli/text.py)
        print(json.dumps(item, sort_keys=True) if args.json else terminal_text(line(item)), flush=True)


def cmd_followup_add(args: argparse.Namespace) -> int:
    key = args.request_key or f"cli-{secrets.token_hex(8)}"
    with _client(args) as client:
        receipt = _ok(client.call("followup.queue", run_id=args.run_id,
                                  payload={"requestKey": key, "prompt": args.text}))
    _print(args, receipt, lambda r: f"{r['followUpId']}: follow-up {r['order']} of run {r['runId']}, {r['state']}"
           + (" (already queued under this key)" if r["adopted"] else ""))
    return 0


def cmd_followup_remove(args: argparse.Namespace) -> int:
    with _client(args) as client:
        receipt = _ok(client.call("followup.remove", run_id=args.run_id,
                                  payload={"followUpId": args.followup_id}))
    _print(args, receipt, lambda r: f"{r['followUpId']}: {r['state']}")
    return 0
