"""``piwf watch [RUN] [--once]``: a live terminal view of the host's runs.

Runs with their current node and latest updates (active ones, and ended ones until
``RUNS_KEPT`` newer runs push them out), the requests waiting for an answer, and the
latest events, drawn with ``rich``. It only talks to the host's socket:
a ``run.watch`` snapshot, then one ``run.watch`` long poll after another, redrawing on
each answer. On a terminal the view is redrawn in place; into a pipe or a file each
change prints the whole view again, after a line naming the cursor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from piwf.cli.text import terminal_text

EVENTS_SHOWN = 12
RUNS_KEPT = 30  # ended runs stay in view until this many newer ones push them out
POLL_MS = 30_000
PIPE_WIDTH = 10_000  # into a pipe or a file: wide enough that nothing wraps
ENDED = ("done", "failed", "cancelled")


@dataclass
class View:
    """What the screen shows, kept up to date from ``run.watch`` answers."""

    cursor: int = 0
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    updates: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    requests: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=EVENTS_SHOWN))

    def apply(self, page: dict[str, Any]) -> None:
        self.cursor = page["cursor"]
        for run in page["runs"]:
            self.runs[run["runId"]] = run
            self.requests[run["runId"]] = [r for r in page["requests"] if r["runId"] == run["runId"]]
        for update in page["updates"]:
            self.updates[(update["runId"], update["type"], update["key"])] = update
        self.events.extend(page["events"])
        self.trim()

    def trim(self) -> None:
        for run_id in sorted(self.runs, key=lambda r: self.runs[r]["createdAt"])[:-RUNS_KEPT]:
            self._forget(run_id)

    def _forget(self, run_id: str) -> None:
        del self.runs[run_id]
        self.requests.pop(run_id, None)
        for key in [k for k in self.updates if k[0] == run_id]:
            del self.updates[key]


def _add_recent(client: Any, view: View) -> None:
    """The runs that ended lately, beside the snapshot's active ones: the view keeps ended
    runs until ``RUNS_KEPT`` newer ones push them out, from the first screen on."""
    from piwf.cli.common import _ok

    for run in _ok(client.call("run.list", payload={"limit": RUNS_KEPT})):
        if run["runId"] not in view.runs:
            view.runs[run["runId"]] = {**run, "currentNode": None}
            view.requests.setdefault(run["runId"], [])
    view.trim()


def render(view: View, *, expand: bool = True) -> Any:
    """The view as rich renderables: runs, waiting requests, recent events; ``expand``
    fills the terminal's width (else each table is as wide as its content)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    runs = Table(title=f"runs (cursor {view.cursor})", title_justify="left", expand=expand)
    for name, style in (("run", "cyan"), ("workflow", ""), ("status", ""), ("node", "bold"), ("latest updates", "")):
        runs.add_column(name, style=style, overflow="fold")
    for run in sorted(view.runs.values(), key=lambda r: r["createdAt"]):
        runs.add_row(*_cells(run["runId"], run["workflow"], _status(run), run["currentNode"] or "-",
                             _updates(view, run)))
    if not view.runs:
        runs.add_row("-", "no runs", "", "", "")
    parts: list[Any] = [runs]
    if (held := _held_table(view, expand)) is not None:
        parts.append(held)
    waiting = [r for requests in view.requests.values() for r in requests]
    if waiting:
        table = Table(title="waiting for an answer", title_justify="left", expand=expand)
        for name in ("request", "kind", "run", "asks"):
            table.add_column(name, overflow="fold")
        for request in waiting:
            table.add_row(*_cells(request["requestId"], request["kind"], request["runId"], request["title"]))
        parts.append(table)
    parts.append(Text("recent events", style="bold"))
    parts += [Text(terminal_text(_event_line(e)), no_wrap=True, overflow="ellipsis")
              for e in view.events] or [Text("  (none)")]
    return Group(*parts)


def _cells(*values: str) -> list[Any]:
    """Table cells as plain text, never markup, workflow text in them escaped."""
    from rich.text import Text

    return [Text(terminal_text(value)) for value in values]


def _status(run: dict[str, Any]) -> str:
    """``running``, ``waiting``, ``paused``, ``held (crashed)`` (never ``running`` for a held run)."""
    from piwf.cli.runview import state

    word = state(run)
    return word + (" paused" if run["paused"] and word != "paused" else "")


def _held_table(view: View, expand: bool) -> Any:
    """Runs held for a person: why, and the command that releases each; None when there are none."""
    from rich.table import Table
    from rich.text import Text

    from piwf.cli.runview import held, release
    from piwf.cli.text import shown

    runs = [run for run in view.runs.values() if held(run)]
    if not runs:
        return None
    table = Table(title="held: someone must act", title_justify="left", expand=expand)
    for name in ("run", "why", "release"):
        table.add_column(name, overflow="fold")
    for run in sorted(runs, key=lambda r: r["createdAt"]):
        table.add_row(*(Text(cell) for cell in (  # Text: no rich markup read in what a workflow wrote
            run["runId"], f"{run['hold']}: {shown(run['statusDetail'] or '', 300)}", release(run))))
    return table


def _updates(view: View, run: dict[str, Any]) -> str:
    mine = sorted((u for (r, _, _), u in view.updates.items() if r == run["runId"]), key=lambda u: -u["seq"])
    return "\n".join(f"{u['type']}/{u['key']} = {json.dumps(u['data'])[:80]}" for u in mine[:3])


def _event_line(item: dict[str, Any]) -> str:
    event = item["event"]
    fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("eventId", "at", "type"))
    return f"  {event['at'][11:23]} {item['runId']} {event['type']} {fields}"[:200]


def cmd_watch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from piwf.cli.common import WAIT_S, _client, _emit

    view = View()
    with _client(args) as client:
        client.timeout = WAIT_S + (client.timeout or 0)  # a run.watch may take its own limit
        page = snapshot(client, args.run_id)
        view.apply(page)
        if args.run_id is None:
            _add_recent(client, view)
        # Into a pipe or a file nothing is wrapped (a run id stays whole for grep): tables
        # as wide as their content, on a console wide enough for them.
        terminal = sys.stdout.isatty()
        console = Console(highlight=False, width=None if terminal else PIPE_WIDTH)
        live = terminal and not args.json and not args.once
        if args.json and args.once:
            _emit(page)
        elif args.json:  # one JSON document per line, this one and each change's
            print(json.dumps(page, sort_keys=True), flush=True)
        elif not live:
            console.print(render(view, expand=terminal))
        if args.once:
            return 0
        if live:
            return _live(client, args, view, console)
        while True:  # into a pipe or a file: every change prints the whole view again
            page = _next_page(client, args, view)
            if not page["events"]:
                continue
            view.apply(page)
            if args.json:
                print(json.dumps(page, sort_keys=True), flush=True)
            else:
                console.print(f"── cursor {view.cursor} ──")
                console.print(render(view, expand=terminal))
                console.file.flush()


SNAPSHOT_PAGE = 200  # active runs per run.watch snapshot page


def snapshot(client: Any, run_id: str | None) -> dict[str, Any]:
    """The whole snapshot, one page of active runs after another (each a short request
    for the host), as one page: the first page's cursor, every run, the latest events."""
    from piwf.cli.common import _ok

    first: dict[str, Any] = _ok(client.watch(run_id=run_id, limit=SNAPSHOT_PAGE))
    page = first
    while page.get("nextRunsAfter"):
        page = _ok(client.watch(run_id=run_id, limit=SNAPSHOT_PAGE, runs_after=page["nextRunsAfter"]))
        for key in ("runs", "updates", "requests"):
            first[key] += page[key]
    first["events"] = first["events"][-EVENTS_SHOWN:]
    first["nextRunsAfter"] = None
    return first


def _next_page(client: Any, args: argparse.Namespace, view: View) -> dict[str, Any]:
    """The next ``run.watch`` answer after the view's cursor; a lost host (stopped,
    restarting) is waited for, saying so on stderr, and the watch goes on from the cursor."""
    from piwf.cli.common import _ok
    from piwf.cli.deliver import lost_host, until_host_is_back
    from piwf.errors import HostReplied, HostUnavailable

    while True:
        try:
            updates: dict[str, Any] = _ok(client.watch(after=view.cursor, run_id=args.run_id, timeout_ms=POLL_MS,
                                                       limit=500))
            return updates
        except (HostUnavailable, HostReplied) as exc:
            if not lost_host(exc):
                raise
            until_host_is_back(client, exc)


def _live(client: Any, args: argparse.Namespace, view: View, console: Any) -> int:
    """Redraw the view in place on each change until `q` is pressed (or Ctrl-C). The long
    polls run in a thread of their own, so a key is read while one is outstanding."""
    from rich.live import Live

    failed: list[BaseException] = []
    wake_read, wake_write = os.pipe()

    def follow(live: Any) -> None:
        try:
            while True:
                view.apply(_next_page(client, args, view))
                live.update(_with_hint(view), refresh=True)
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)
            os.write(wake_write, b"!")

    with Live(_with_hint(view), console=console, auto_refresh=False, screen=False) as live, _keys() as stdin:
        threading.Thread(target=follow, args=(live,), daemon=True).start()
        _until_quit(stdin, wake_read)
    if failed:
        raise failed[0]
    return 0


def _with_hint(view: View) -> Any:
    from rich.console import Group
    from rich.text import Text

    return Group(render(view), Text("q quits", style="dim"))


def _until_quit(stdin: int | None, wake: int) -> None:
    """Return once `q` is typed on ``stdin`` (a terminal in cbreak mode) or ``wake`` is readable."""
    while True:
        readable, _, _ = select.select([wake] if stdin is None else [stdin, wake], [], [])
        if wake in readable:
            return
        if stdin is not None:
            key = os.read(stdin, 1)
            if key in (b"q", b"Q"):
                return
            if not key:  # end of input: only the watch can end it now
                stdin = None


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """Standard input, one key at a time without echo while the view is up (restored after);
    None when it is not a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
