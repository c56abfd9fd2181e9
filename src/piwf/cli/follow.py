"""``piwf run events RUN --follow``, ``piwf run logs RUN --follow`` and ``piwf followup``.

Following is a ``run.watch`` long poll on the one run (no request is sent while nothing
changes), from the last event already printed; it ends when the run has ended (exit 0),
or when nothing more happens to it without someone acting — held, paused, waiting for an
answer: then one line on stderr says so with the command that releases it, and the exit
code is the one ``--wait`` gives (``runview.ending``). It outlives host restarts as
``piwf watch`` does, saying so on stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Callable, Iterator
from typing import Any

from piwf.cli import runview
from piwf.cli.common import WAIT_S, _client, _ok, _print
from piwf.cli.text import shown, terminal_text
from piwf.client import Client, Reply
from piwf.errors import HostReplied, HostUnavailable, UsageError
from piwf.status import ENDED

POLL_MS = 30_000


class _Follow:
    """The run's new events, batch by batch (``changes``), until it has ended or is at rest
    for someone to act; ``end`` is then how ``--wait`` would have ended (None: it ended)."""

    def __init__(self, client: Client, run_id: str) -> None:
        client.timeout = WAIT_S + (client.timeout or 0)  # a run.watch may take its own limit
        self.client, self.run_id = client, run_id
        self.end: runview.Ending | None = None

    def changes(self, after: int) -> Iterator[list[dict[str, Any]]]:
        """A batch per ``run.watch`` answer, from event ``after`` on, until the run is at rest
        (ended, held, paused, waiting; its worker's end recorded) and every event up to then
        was yielded."""
        while (run := self._at_rest()) is None:
            page = _watch(self.client, self.run_id, after, POLL_MS)
            after = page["cursor"]
            yield [item["event"] for item in page["events"]]
        while True:  # what was recorded up to rest: the worker's end
            page = _watch(self.client, self.run_id, after, 0)
            after = page["cursor"]
            yield [item["event"] for item in page["events"]]
            if not page["more"]:
                break
        if run["queueStatus"] not in ENDED:
            self.end = runview.ending(run)

    def _at_rest(self) -> dict[str, Any] | None:
        """The run if nothing more happens to it without someone acting, as ``run wait``
        ends: once the way it stands ends a wait, its worker's end is waited for too."""
        run = self._wait(0)
        if not run["atRest"] and (run["queueStatus"] in ENDED or runview.ending(run) is not None):
            run = self._wait(WAIT_S * 1000)
        return run if run["atRest"] and (run["queueStatus"] in ENDED or runview.ending(run)) else None

    def _wait(self, timeout_ms: int) -> dict[str, Any]:
        return _again(self.client, lambda: self.client.call("run.wait", run_id=self.run_id,
                                                            payload={"timeoutMs": timeout_ms}))

    def ended(self) -> int:
        """0 when the run ended; else say why the follow stopped, and the wait's exit code."""
        if self.end is None:
            return 0
        print(f"piwf: {self.end.reason}", file=sys.stderr, flush=True)
        return int(self.end.code)


def _watch(client: Client, run_id: str, after: int, timeout_ms: int) -> dict[str, Any]:
    """One ``run.watch`` of the run after ``after``."""
    return _again(client, lambda: client.watch(after=after, run_id=run_id, timeout_ms=timeout_ms, limit=1000))


def _again(client: Client, request: Callable[[], Reply]) -> dict[str, Any]:
    """The request's receipt; a lost host (stopped, restarting) is waited for, saying so on
    stderr, and the request is sent again."""
    from piwf.cli.deliver import lost_host, until_host_is_back

    while True:
        try:
            receipt: dict[str, Any] = _ok(request())
            return receipt
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
        follow = _Follow(client, args.run_id)
        for batch in follow.changes(events[-1]["eventId"] if events else 0):
            _show(args, batch, event_line)
    return follow.ended()


def follow_logs(args: argparse.Namespace) -> int:
    """Each worker's output: as ``run logs`` prints it for a worker that had ended, and as
    it comes (``run.output``) for a live one; then the next worker's, until the run ends."""
    from piwf.cli.run import all_events

    shown: dict[str, bool] = {}  # worker -> its end printed too
    with _client(args) as client:
        events = all_events(client, args.run_id)
        after = events[-1]["eventId"] if events else 0
        _print_workers(client, args, shown)
        follow = _Follow(client, args.run_id)
        for _ in follow.changes(after):
            _print_workers(client, args, shown)
    if not shown and not args.json:
        print(f"{args.run_id}: no worker has run", flush=True)
    return follow.ended()


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
    """Queue TEXT for the run's session; the receipt line ends with the command that takes
    it back."""
    if not args.text.strip():
        raise UsageError("TEXT must not be empty")
    key = args.request_key or f"cli-{secrets.token_hex(8)}"
    with _client(args) as client:
        receipt = _ok(client.call("followup.queue", run_id=args.run_id,
                                  payload={"requestKey": key, "prompt": args.text}))
    _print(args, receipt, lambda r: f"{r['followUpId']}: follow-up {r['order']} of run {r['runId']}, {r['state']}"
           + (" (already queued under this key)" if r["adopted"] else "")
           + (f"; take it back with: piwf followup remove {r['followUpId']}"
              if r["state"] == "queued" else ""))
    return 0


def cmd_followup_remove(args: argparse.Namespace) -> int:
    """``remove FOLLOWUP_ID`` (found by its own id) or ``remove RUN_ID FOLLOWUP_ID`` (which
    must be that run's)."""
    run_id, followup_id = (None, args.run_id) if args.followup_id is None else (args.run_id, args.followup_id)
    with _client(args) as client:
        receipt = _ok(client.call("followup.remove", run_id=run_id, payload={"followUpId": followup_id}))
    _print(args, receipt, lambda r: f"{r['followUpId']}: {r['state']}")
    return 0


def cmd_followup_list(args: argparse.Namespace) -> int:
    payload = {"limit": args.limit, **({"sessionId": args.session} if args.session else {}),
               **({"runId": args.run} if args.run else {})}
    with _client(args) as client:
        page = _ok(client.call("followup.list", payload=payload))
    _print(args, page, _format_followups)
    return 0


def _format_followups(page: dict[str, Any]) -> str:
    if not page["followUps"]:
        return "no follow-ups queued"
    lines = [f"{f['followUpId']}  {f['runId']} #{f['order']} for {f['sessionId']}"
             + (" (handed out with its run's turn)" if f["handedOut"] else "") + f": {shown(f['prompt'], 200)}"
             for f in page["followUps"]]
    if page["more"]:
        lines.append(f"... and more: --limit {min(999, 2 * len(page['followUps']))} shows more")
    return "\n".join(lines)
