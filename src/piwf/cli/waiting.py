"""Waiting for a run from a terminal: ``run start --wait``, ``run wait RUN`` and
``answer --wait``.

A wait ends when nothing more happens to the run without someone acting — it ended, it
waits for an answer, it is paused or held — and each way it ends has its own exit code
(``runview.ending``); ``--wait-timeout`` bounds it (``WAIT_TIMEOUT``, the run goes on).
On a terminal (stderr), and without ``--json``, a line of progress shows the node running,
the steps done and the time waited, drawn with rich and erased at the end; anywhere else
nothing is drawn. Ctrl-C stops the wait, not the run, and says how to follow it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from piwf.cli import runview
from piwf.cli.text import shown
from piwf.cli.common import WAIT_S, _emit, _ok, _print
from piwf.cli.deliver import RECONNECT_BACKOFF_S, lost_host
from piwf.client import Client
from piwf.errors import ExitCode, HostReplied, HostTimeout, HostUnavailable

POLL_MS = 30_000  # one run.watch long poll while progress is shown
HOST_AWAY_S = 60.0  # without --wait-timeout: how long a wait lets the host be away (a restart, an upgrade)
T = TypeVar("T")
ENDED = ("completed", "failed", "timed_out", "cancelled")


class Deadline:
    """The wait's own limit (``--wait-timeout``, ms), or none."""

    def __init__(self, limit_ms: int | None) -> None:
        self.seconds = None if limit_ms is None else limit_ms / 1000
        self.at = None if self.seconds is None else time.monotonic() + self.seconds

    def left_ms(self, most: int) -> int:
        if self.at is None:
            return most
        return max(0, min(most, int((self.at - time.monotonic()) * 1000)))

    def left_s(self) -> float:
        return 0.0 if self.at is None else max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def long_polls(client: Client) -> None:
    """Give each request the host's own wait limit on top of ``--timeout``."""
    client.timeout = WAIT_S + (client.timeout or 0)
    if client._sock is not None:
        client._sock.settimeout(client.timeout)


def shows_progress(args: argparse.Namespace) -> bool:
    return not args.json and sys.stderr.isatty()


def attend(args: argparse.Namespace, client: Client, run_id: str, show: Callable[[dict[str, Any]], str], *,
           announce: bool = False) -> int:
    """Wait for the run, print it (and, for a wait that did not end in success, one line
    on stderr saying why and what to do), and return the wait's exit code. Ctrl-C stops
    only the wait. ``announce``: print the run id first, at once (not with ``--json``)."""
    deadline = Deadline(args.wait_timeout)
    try:
        if announce and not args.json:
            print(run_id, flush=True)  # the run can be followed from here, whatever happens next
        run = wait_for_run(client, run_id, deadline, progress=shows_progress(args), say=shows_progress(args))
    except HostUnavailable as exc:  # the run exists: say which, so it can be followed up
        what = (f"run {run_id} was started, but waiting for it failed" if announce
                else f"waiting for run {run_id} failed")
        raise type(exc)(f"{what}: {exc}; follow it with piwf run wait {run_id}") from exc
    except KeyboardInterrupt:
        print(f"piwf: stopped waiting; run {run_id} goes on. Follow it with: piwf run wait {run_id} "
              f"(or piwf watch {run_id})", file=sys.stderr)
        return ExitCode.INTERRUPTED
    end = runview.ending(run) if run.pop("atRest") else None
    if end is None:  # the wait's own limit passed first
        after = "" if deadline.seconds is None else f" after {deadline.seconds:g} s"
        end = runview.Ending(ExitCode.WAIT_TIMEOUT, f"run {run_id} is still {runview.state(run)}{after}; "
                                                    f"it goes on: piwf run wait {run_id}")
    if args.json:
        _emit({**run, "wait": end.as_json()})
    else:
        _print(args, run, show)
        if end.reason:
            sys.stdout.flush()  # the run first, then why the wait ended, into one pipe too
            print(f"piwf: {end.reason}", file=sys.stderr)
    return end.code


def wait_for_run(client: Client, run_id: str, deadline: Deadline, *, progress: bool = False,
                 say: bool = False) -> dict[str, Any]:
    """The run once it is at rest (``atRest`` true), or as it stands when the deadline
    passed (``atRest`` false). A host that goes away meanwhile is waited for
    (``through_restarts``); ``say``: say so on stderr."""
    long_polls(client)
    if progress:
        return through_restarts(client, deadline, lambda: _with_progress(client, run_id, deadline), say=say)
    return through_restarts(client, deadline, lambda: _plain_wait(client, run_id, deadline), say=say)


def _plain_wait(client: Client, run_id: str, deadline: Deadline) -> dict[str, Any]:
    while True:
        run: dict[str, Any] = _ok(client.call("run.wait", run_id=run_id,
                                              payload={"timeoutMs": deadline.left_ms(WAIT_S * 1000)}))
        if run["atRest"] or deadline.passed():
            return run


def through_restarts(client: Client, deadline: Deadline, body: Callable[[], T], *, say: bool) -> T:
    """``body()``; when the host goes away meanwhile (stopped, restarting, killed; not a
    host that does not answer), reconnect with a short back-off and call it again — the
    host serves the same state directory when it is back, and a wait asks afresh. The host
    may stay away until the wait's own limit passes, or ``HOST_AWAY_S`` without one: then
    HostUnavailable (exit 9). ``say``: one line on stderr when it is lost, one when back.
    No host at all to begin with is not waited for: HostUnavailable at once; a client
    answered a moment ago (``run start --wait``) waits through a restart that came since."""
    if client._sock is None:
        client.connect()
    while True:
        try:
            return body()
        except (HostUnavailable, HostReplied) as exc:
            if isinstance(exc, HostTimeout) or not lost_host(exc):
                raise
            _until_back(client, deadline, exc, say=say)


def _until_back(client: Client, deadline: Deadline, lost: Exception, *, say: bool) -> None:
    limit_s = deadline.left_s() if deadline.at is not None else HOST_AWAY_S
    give_up = time.monotonic() + limit_s
    within = (f"before the wait's limit ({deadline.seconds:g} s) passed" if deadline.seconds is not None
              else f"within {HOST_AWAY_S:g} s")
    long_timeout = client.timeout
    if say:
        print(f"piwf: lost the host ({lost}); reconnecting", file=sys.stderr, flush=True)
    try:
        for attempt in itertools.count():
            client.close()
            left = give_up - time.monotonic()
            if left <= 0:
                raise HostUnavailable(f"the host went away ({lost}) and did not come back {within}")
            time.sleep(min(RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)], left))
            client.timeout = max(0.1, min(left, long_timeout or left))  # a try may not outlast the limit
            try:
                _ok(client.call("host.status"))
            except (HostUnavailable, HostReplied) as again:  # a host that answers "stopping" is not back
                if not lost_host(again):
                    raise
                continue
            if say:
                print("piwf: reconnected to the host", file=sys.stderr, flush=True)
            return
    finally:
        client.close()  # the next request connects with the long polls' own timeout
        client.timeout = long_timeout


def _with_progress(client: Client, run_id: str, deadline: Deadline) -> dict[str, Any]:
    """Wait on ``run.watch`` (each change redraws the progress line), asking ``run.wait``
    without waiting after every change whether the run is at rest."""
    cursor = _ok(client.watch(run_id=run_id, limit=1))["cursor"]
    with _Progress() as bar:
        while True:
            run: dict[str, Any] = _ok(client.call("run.wait", run_id=run_id, payload={"timeoutMs": 0}))
            if run["atRest"] or deadline.passed():
                return run
            bar.show(run)
            if runview.ending(run) is not None:  # at rest, but its worker's end not yet recorded
                run = _ok(client.call("run.wait", run_id=run_id, payload={"timeoutMs": deadline.left_ms(5_000)}))
                if run["atRest"]:
                    return run
                continue
            cursor = _ok(client.watch(after=cursor, run_id=run_id, timeout_ms=deadline.left_ms(POLL_MS),
                                      limit=100))["cursor"]


class _Progress:
    """One transient line on stderr: a spinner, the run, its node and steps, time elapsed."""

    def __enter__(self) -> _Progress:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                             console=Console(stderr=True, highlight=False), transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task("waiting", total=None)
        return self

    def show(self, run: dict[str, Any]) -> None:
        steps = run.get("steps", [])
        done = sum(step["status"] == "accepted" for step in steps)
        running = [step["node"] for step in steps if step["status"] in ("running", "waiting")]
        node = f"node {running[-1]}" if running else runview.state(run)
        text = f"{run['runId']} ({run['workflow']}): {node}, {done} step{'' if done == 1 else 's'} done"
        self._bar.update(self._task, description=shown(text, 300))

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)


def submission_ending(client: Client, receipt: dict[str, Any], deadline: Deadline,
                      *, say: bool = False) -> tuple[dict[str, Any], Any]:
    """``answer --wait``: wait until the submission is validated, or its run is held,
    paused or ended meanwhile. Returns (the submission as last seen, the run's Ending or
    None when the submission was decided). A host restart meanwhile is waited for, as in
    ``wait_for_run``."""
    long_polls(client)
    return through_restarts(client, deadline, lambda: _submission_ending(client, receipt, deadline), say=say)


def _submission_ending(client: Client, receipt: dict[str, Any], deadline: Deadline) -> tuple[dict[str, Any], Any]:
    run_id = receipt["runId"]
    cursor = _ok(client.watch(run_id=run_id, limit=1))["cursor"]
    while True:
        last = _submission(client, receipt)
        if last is not None and last["status"] != "validating":
            return last, None
        run = _ok(client.call("run.status", run_id=run_id))
        end = runview.held_ending(run)
        if end is None and run["status"] in ENDED:
            end = runview.ending(run)
        if end is not None:  # the run moved on: its submission may have been decided just before
            last = _submission(client, receipt) or last
            if last is not None and last["status"] != "validating":
                return last, None
        pending = last or {"submissionId": receipt["submissionId"], "status": "validating"}
        if end is not None:
            return pending, end
        if deadline.passed():
            return pending, runview.Ending(
                ExitCode.WAIT_TIMEOUT, f"submission {receipt['submissionId']} is still being validated after "
                                       f"{deadline.seconds:g} s; see piwf inbox --run {run_id}")
        cursor = _ok(client.watch(after=cursor, run_id=run_id, timeout_ms=deadline.left_ms(POLL_MS),
                                  limit=100))["cursor"]


def _submission(client: Client, receipt: dict[str, Any]) -> dict[str, Any] | None:
    page = _ok(client.call("interaction.list", payload={"runId": receipt["runId"], "open": False, "limit": 1000}))
    for request in page["requests"]:
        last: dict[str, Any] | None = request["lastSubmission"]
        if request["requestId"] == receipt["requestId"] and last and last["submissionId"] == receipt["submissionId"]:
            return last
    return None

