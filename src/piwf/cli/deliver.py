"""``piwf inbox --session S [--follow]``: a session's notifications and turns.

``--follow`` is the reference client of delivery to sessions (docs/sessions.md): it
claims the session's oldest notification, prints it, delivers it; then its oldest turn,
prints it with its follow-ups, resolves it; and when nothing is left it waits on
``run.watch`` (a long poll: no request is sent while nothing changes) until something
changes or a claim held by another client expires. It claims only what ``delivery.list``
shows free, so an idle follower writes nothing. It is a client of its own per process
(``cli:<user>:follow-<pid>-<random>``), and it outlives host restarts: it reconnects with
a short back-off, saying so on stderr.
"""

from __future__ import annotations

import argparse
import calendar
import itertools
import json
import os
import secrets
import sys
import time
from typing import Any

from piwf.errors import HostReplied, HostUnavailable, UsageError

IDLE_WAIT_MS = 60_000  # one run.watch while nothing is claimable and no claim is due to expire
RACED_WAIT_MS = 1_000  # look again this soon when what looked free could not be claimed
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # between tries to reach a lost host, the last repeated


def add_delivery(client: Any, args: argparse.Namespace, page: dict[str, Any]) -> None:
    """The session's (or run's) undelivered notifications and unresolved turns, into ``page``."""
    from piwf.cli.common import _ok

    found = _ok(client.list_delivery(session_id=args.session, run_id=args.run))
    page["notifications"], page["turns"] = found["notifications"], found["turns"]


def format_delivery(page: dict[str, Any]) -> list[str]:
    lines = [format_notification(n) for n in page.get("notifications", [])]
    return lines + [format_turn(t) for t in page.get("turns", [])]


def format_notification(n: dict[str, Any]) -> str:
    return f"[{n['kind']}] {n['runId']} ({n['workflow']}/{n['nodeId']}) #{n['index']}: {n['content']}"


def format_turn(t: dict[str, Any]) -> str:
    facts = t["facts"]
    lines = [f"[turn] {t['runId']} ({t['workflow']}): {t['cause']}, status {facts['status']}"]
    for key in ("error", "hold", "detail", "output"):
        if facts.get(key):
            lines.append(f"    {key}: {facts[key][:500]}")
    if t.get("instructions"):
        lines.append(f"    present: {t['instructions']}")
    lines += [f"    follow-up {f['order']}: {f['prompt']}" for f in t.get("followUps", [])]
    return "\n".join(lines)


def follow(args: argparse.Namespace) -> int:
    """Deliver the session's notifications and turns as they arrive, until interrupted."""
    from piwf.cli.common import WAIT_S, _ok, _paths, _timeout, client_id
    from piwf.client import Client

    if not args.session:
        raise UsageError("--follow needs --session ID: it delivers one session's notifications and turns")
    # Its own client id per process: two followers of one session are two clients, so one
    # never takes over (and prints again) what the other has claimed.
    me = f"{client_id()}:follow-{os.getpid()}-{secrets.token_hex(3)}"
    with Client(_paths(args), timeout=_timeout(args), client_id=me) as client:
        client.timeout = WAIT_S + (client.timeout or 0)  # a run.watch may take its own limit
        cursor = _ok(client.watch(limit=1))["cursor"]
        while True:
            try:
                due_in = deliver_available(client, args.session, args.json)
                if due_in == 0:
                    continue
                wait_ms = IDLE_WAIT_MS if due_in is None else max(1, min(due_in, IDLE_WAIT_MS))
                cursor = _ok(client.watch(after=cursor, timeout_ms=wait_ms, limit=1000))["cursor"]
            except (HostUnavailable, HostReplied) as exc:
                if not lost_host(exc):
                    raise
                until_host_is_back(client, exc)


def lost_host(exc: Exception) -> bool:
    """The host went away (stopped, restarting, killed) rather than refusing a request."""
    return isinstance(exc, HostUnavailable) or (isinstance(exc, HostReplied) and exc.outcome == "unavailable")


def until_host_is_back(client: Any, exc: Exception) -> None:
    """A long-running client's answer to a lost host: one line to stderr, then try again
    with a short back-off until the host answers, and one line when it does."""
    from piwf.cli.common import _ok

    print(f"piwf: lost the host ({exc}); reconnecting", file=sys.stderr, flush=True)
    for attempt in itertools.count():
        client.close()
        time.sleep(RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)])
        try:
            _ok(client.watch(limit=1))
        except (HostUnavailable, HostReplied) as again:
            if not lost_host(again):
                raise
            continue
        print("piwf: reconnected to the host", file=sys.stderr, flush=True)
        return


def deliver_available(client: Any, session: str, as_json: bool) -> int | None:
    """Deliver the oldest notification, then the oldest turn, if free. 0 when one was
    delivered (look again at once); else ms until a claim held elsewhere expires, or None.
    It claims nothing that the listing shows cannot be had, so while another client holds
    what comes first it sends no writes."""
    from piwf.cli.common import _ok

    page = _ok(client.list_delivery(session_id=session, limit=1))
    waits = []
    notes, turns = page["notifications"], page["turns"]
    if notes and notes[0]["claimExpiresAt"] is not None:
        waits.append(_ms_until(notes[0]["claimExpiresAt"]))
    elif notes:
        if _deliver_one(client, "notification", session, as_json):
            return 0
        waits.append(RACED_WAIT_MS)  # another client claimed it first
    if turns and turns[0]["claimExpiresAt"] is not None:
        waits.append(_ms_until(turns[0]["claimExpiresAt"]))
    elif turns and not _ok(client.list_delivery(session_id=session, run_id=turns[0]["runId"],
                                                limit=1))["notifications"]:
        if _deliver_one(client, "turn", session, as_json):
            return 0
        waits.append(RACED_WAIT_MS)  # another client claimed it first
    # else the turn waits for its run's notifications, claimed elsewhere: their expiry is waited for
    return min(waits) if waits else None


def _deliver_one(client: Any, kind: str, session: str, as_json: bool) -> bool:
    """Claim, print, deliver (resolve); False when another client claimed it first. A
    ``conflict`` on delivering (the claim expired, or the turn changed under it: a later
    end of its run) is no error: the item is handed out again, as at least once means."""
    from piwf.cli.common import _ok

    if kind == "notification":
        claim = _ok(client.claim_notification(session))
        item = claim["notification"]
        if item is None:
            return False
        _show(kind, item, format_notification(item), as_json)
        _accepted_or_conflict(client.deliver_notification(item["notificationId"], claim["claimId"]))
        return True
    claim = _ok(client.claim_turn(session))
    item = claim["turn"]
    if item is None:
        return False
    _show(kind, item, format_turn(item), as_json)
    _accepted_or_conflict(client.resolve_turn(item["turnId"], claim["claimId"], "presented"))
    return True


def _accepted_or_conflict(response: Any) -> None:
    from piwf.cli.common import _ok

    if response.outcome != "conflict":
        _ok(response)


def _show(kind: str, item: dict[str, Any], text: str, as_json: bool) -> None:
    """Printed before it is delivered: a follower killed in between prints it again later
    (at least once), never loses it."""
    from piwf.cli.text import terminal_text

    sys.stdout.write((json.dumps({"type": kind, kind: item}, sort_keys=True) if as_json else terminal_text(text))
                     + "\n")
    sys.stdout.flush()


def _ms_until(stamp: str) -> int:
    """Milliseconds from now until ``stamp`` (ISO 8601 UTC, as receipts carry it)."""
    seconds = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
    at_ms = seconds * 1000 + int(stamp[20:23])
    return max(1, at_ms - int(time.time() * 1000))
