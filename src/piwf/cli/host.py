"""The host's own commands: ``serve``, ``status``, ``stop`` and ``workflows list``."""

from __future__ import annotations

import argparse
import os
import sys

from piwf.cli.common import _paths, _print, _timeout, _client, _ok
from piwf.cli.text import shown
from piwf.errors import ExitCode, HostTimeout, HostUnavailable, InternalError, PiwfError, StateDirError
from piwf.host.lock import read_record
from piwf.paths import StatePaths

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: one-shot commands start without it
if TYPE_CHECKING:
    from typing import Any



def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from piwf.host.host import Host
    from piwf.host.state import HostConfig
    from piwf.status import DEFAULT_QUEUE

    from piwf import faults, logs

    faults.configure()
    logs.configure(args.log_format, args.log_level)
    config = HostConfig(StatePaths.resolve(args.state_dir), max_workers=args.max_workers,
                        queues=tuple(dict.fromkeys(args.queue or [DEFAULT_QUEUE])),
                        durability=args.durability, store_url=args.store or os.environ.get("PIWF_STORE") or None,
                        store_listen=not args.poll_only,
                        worker_startup_s=args.worker_startup_timeout,
                        kill_grace_s=args.kill_grace, worker_start=args.worker_start, worker_nice=args.worker_nice,
                        drain_timeout_s=args.drain_timeout, request_timeout_s=args.request_timeout,
                        reply_timeout_s=args.reply_timeout, standby=args.standby,
                        max_controller_workers=args.max_controller_workers,
                        presentation_lease_ms=max(1, int(args.presentation_lease * 1000)),
                        delivery_lease_ms=max(1, int(args.delivery_lease * 1000)), retain_ms=args.retain,
                        host_lease_ms=max(1, int(args.lease * 1000)), run_lease_ms=max(1, int(args.lease * 1000)),
                        node_time_limit_s=args.node_time_limit, socket_check_s=args.socket_check,
                        **service_manager_settings())
    try:
        trio.run(Host(config).serve)
    except PiwfError:
        raise
    except Exception as exc:  # the traceback goes to the log; the last line stays one line
        logging.getLogger("piwf").exception("the host stopped on an unexpected error")
        raise InternalError(f"internal error: {type(exc).__name__}: {exc}") from exc
    return 0


# What a service manager passes in the environment; taken out of it so that no worker or
# shell node inherits them (sd_listen_fds(3) and sd_notify(3) with unset_environment).
SERVICE_MANAGER_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC",
                             "WATCHDOG_PID")


def service_manager_settings() -> dict[str, Any]:
    """``HostConfig`` fields from systemd's variables: the inherited socket, sd_notify."""
    from piwf.host.notify import Notifier
    from piwf.host.server import inherited_listener_fd

    environ = {name: os.environ.pop(name) for name in SERVICE_MANAGER_VARIABLES if name in os.environ}
    notifier = Notifier.from_env(environ, os.getpid())
    return {"listen_fd": inherited_listener_fd(environ, os.getpid()), "notify_socket": notifier.address,
            "watchdog_s": notifier.watchdog_s}


def _shape(row: dict[str, Any]) -> str:
    count = row["nodes"]
    return f"{count} node{'' if count == 1 else 's'}, starts at {row['startAt']}"


def cmd_status(args: argparse.Namespace) -> int:
    paths = _paths(args)
    try:
        with _client(args) as client:
            receipt = _ok(client.call("host.status"))
    except HostTimeout:
        receipt = offline_status(paths, waited_s=_timeout(args), store=getattr(args, "store", None))
    except HostUnavailable:
        receipt = offline_status(paths, store=getattr(args, "store", None))
    receipt["standbys"] = [{"pid": r["pid"], "since": r.get("since")} for r in _standbys(paths)]
    _print(args, receipt, _format_status)
    return 0


def _standbys(paths: StatePaths) -> list[dict[str, object]]:
    """The `piwf serve --standby` processes waiting for this state directory's lock."""
    from piwf.host.lock import read_standbys

    return read_standbys(paths)


def offline_status(paths: StatePaths, waited_s: float | None = None, store: str | None = None) -> dict[str, Any]:
    """What the state directory says when no host answers (read-only; nothing is written).

    ``stale``: a host process still holds the state directory (its lock record names a
    process that is still running: frozen, hung, or starting) or its lease has not yet
    expired (it has just died), yet it did not answer. ``stopped``: neither.
    """
    if paths.root.exists() and not paths.root.is_dir():
        raise StateDirError(f"state directory {paths.root} is not a directory")
    status: dict[str, Any] = {"state": "uninitialized", "stateDir": str(paths.root), "socketAvailable": False}
    url = _store_url(paths, store)
    if url is not None:
        status.update(_postgres_status(paths, url))
    elif paths.db.exists():
        status.update(_stored_status(paths))
    if (holder := _live_holder(paths)) is not None:
        waited = f" within {waited_s:g} s" if waited_s is not None else " on its socket"
        status.update(state="stale", detail=f"the host (pid {holder}) does not answer{waited}")
    return status


def _stored_status(paths: StatePaths) -> dict[str, Any]:
    from piwf.clock import WallClock
    from piwf.store.sql import runs
    from piwf.store.sqlite import Database
    from piwf.store.sqlite.hosts import read_lease

    db = Database.open_readonly(paths.db)
    try:
        now = WallClock().now_ms()
        lease = read_lease(db)
        status = {"state": "stopped", **lease.as_json(now), "activeWorkers": 0, **runs.status_counts(db, now)}
    finally:
        db.close()
    if lease.live(now):
        status.update(state="stale", detail=f"the host (pid {lease.pid}) is gone; its lease expires in "
                      f"{((lease.expires_at or now) - now) / 1000:.0f} s, or at once when a new `piwf serve` starts")
    return status


def _store_url(paths: StatePaths, given: str | None) -> str | None:
    """The store to read: ``--store``, else ``$PIWF_STORE``, else what the host recorded."""
    from piwf.store.api import record

    return given or os.environ.get("PIWF_STORE") or record.read(paths)


def _postgres_status(paths: StatePaths, url: str) -> dict[str, Any]:
    from piwf.clock import WallClock
    from piwf.store.postgres.backend import read_status

    now = WallClock().now_ms()
    lease, counts, where, live = read_status(paths.root, url, now)
    status = {"state": "stopped", **lease.as_json(now), "activeWorkers": 0, "store": where, **counts,
              "hosts": [h.as_json(now) for h in live]}  # the others serve on without this one
    if lease.live(now):
        status.update(state="stale", detail=f"the host (pid {lease.pid}) has not renewed its lease; it expires in "
                      f"{((lease.expires_at or now) - now) / 1000:.0f} s")
    return status


def _live_holder(paths: StatePaths) -> int | None:
    """The pid of the host process holding the state directory, if that process still runs."""
    from piwf.processes import alive

    holder = _holder(read_record(paths))
    return holder[0] if holder and alive(*holder) else None


def _holder(record: dict[str, object] | None) -> tuple[int, str] | None:
    """The pid and identity a lock record names, if it names a pid."""
    pid = record.get("pid") if record else None
    return (pid, str(record.get("identity"))) if record and isinstance(pid, int) else None


def cmd_stop(args: argparse.Namespace) -> int:
    paths = _paths(args)
    said = "host stopped"
    try:
        with _client(args) as client:
            holder = read_record(paths)
            standbys = _standbys(paths)
            _ok(client.call("host.stop"))
        stopped = True
    except HostTimeout:
        raise  # a host is there, but it did not answer: it was not asked to stop
    except HostUnavailable:
        holder = read_record(paths)
        standbys = _standbys(paths)
        stopped = _signal_unreachable(paths, holder)
        if stopped:
            said = (f"host stopped (pid {holder and holder.get('pid')} could not be reached on its socket: "
                    "it was sent SIGTERM)")
    successor = None
    if stopped and (pid_identity := _holder(holder)):
        _wait_for_exit(*pid_identity)
        successor = _successor(paths, standbys)
    _print(args, {"stopped": stopped, "takenOverBy": successor}, lambda r: _format_stop(r, said))
    return 0


def _format_stop(r: dict[str, Any], said: str = "host stopped") -> str:
    if not r["stopped"]:
        return "no host was running"
    if r["takenOverBy"] is None:
        return said
    return (f"{said}; a standby (pid {r['takenOverBy']}) took over and serves the state directory "
            "(`piwf stop` again stops it)")


def _successor(paths: StatePaths, standbys: list[dict[str, object]], timeout_s: float = 10.0) -> int | None:
    """The pid of the standby that took the lock after the host stopped, if one was waiting:
    one of them takes it at once, and writes the lock record as it does; returned once it
    serves (answers on the socket), so "took over and serves" is true when it is said."""
    import time

    from piwf.processes import alive

    waiting = {int(str(r["pid"])): str(r.get("identity")) for r in standbys}
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        holder = _holder(read_record(paths))
        if holder is not None and holder[0] in waiting:
            _until_serving(paths, deadline)
            return holder[0]
        waiting = {pid: ident for pid, ident in waiting.items() if alive(pid, ident)}
        time.sleep(0.02)
    return None


def _until_serving(paths: StatePaths, deadline: float) -> None:
    """Wait (until ``deadline``) for the host holding the lock to answer ``host.status``."""
    import time

    from piwf.client import Client

    while time.monotonic() < deadline:
        try:
            with Client(paths, timeout=max(0.1, deadline - time.monotonic())) as client:
                if client.call("host.status").outcome == "accepted":
                    return
        except (HostUnavailable, HostTimeout, OSError):
            pass
        time.sleep(0.02)


def _signal_unreachable(paths: StatePaths, holder: dict[str, object] | None) -> bool:
    """A host that holds the lock but cannot be reached on its socket (deleted, or
    something else at its path) is sent SIGTERM: it drains as on ``host.stop``. Only the
    very process the lock record names, while the lock is held."""
    import signal

    from piwf.host.lock import is_held
    from piwf.processes import alive

    pid_identity = _holder(holder)
    if pid_identity is None or not is_held(paths):
        return False
    try:
        pidfd = os.pidfd_open(pid_identity[0])  # names that process from here on, whatever reuses its pid
    except OSError:
        return False
    try:
        if not alive(*pid_identity):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)
    return True


def _wait_for_exit(pid: int, identity: str, timeout_s: float = 60.0) -> None:
    """Return once the host process (that very process, not a reuse of its pid) is gone."""
    import time

    from piwf.processes import alive

    deadline = time.monotonic() + timeout_s
    while alive(pid, identity):
        if time.monotonic() > deadline:
            raise HostTimeout(f"the host (pid {pid}) is still draining after {timeout_s:.0f} s")
        time.sleep(0.02)


def cmd_workflows_list(args: argparse.Namespace) -> int:
    """Each workflow is loaded in a child process of its own, with a time limit."""
    from piwf.engine.inspect import inspect_all
    from piwf.engine.loader import WORKFLOW_DIR, workflow_names

    from pathlib import Path

    project = Path(args.project).absolute()
    names = workflow_names(project)
    rows = [_workflow_row(name, result) for name, result in zip(names, inspect_all(project, names, _timeout(args)),
                                                                    strict=True)]
    _print(args, rows, lambda rs: "\n".join(
        f"{r['name']:20} " + (f"ERROR {r['error']}" if r["error"] else _shape(r))
        for r in rs) or f"no workflows in {project / WORKFLOW_DIR}")
    failed = [r["name"] for r in rows if r["error"]]
    if failed:
        print(f"piwf: {len(failed)} of {len(rows)} workflows did not load: {', '.join(map(shown, failed))}",
              file=sys.stderr)  # file names: a careless one may hold escapes
        return ExitCode.WORKFLOW_INVALID
    return 0


def _workflow_row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        return {"name": name, "error": " ".join(str(result["error"]).split())}
    return {"name": name, "nodes": len(result["nodes"]), "startAt": result["startAt"], "digest": result["digest"],
            "error": None}


# --- printing ---------------------------------------------------------------------------------


def _format_status(s: dict[str, Any]) -> str:
    lines = [f"host:      {s['state']}" + (f" (pid {s['pid']}, epoch {s['epoch']})" if s.get("pid") else ""),
             f"state dir: {s['stateDir']}"]
    if s.get("store"):
        lines.append(f"store:     {s['store']}")
    if s.get("detail"):
        lines.append(f"detail:    {s['detail']}")
    for standby in s.get("standbys", []):
        lines.append(f"standby:   pid {standby['pid']}, waiting to take over (since {standby['since']})")
    if s.get("store") and s.get("hosts"):  # SQLite's one host is the line above
        lines += _host_lines(s["hosts"])
    if "queuedRuns" in s:
        lines.append(f"runs:      {s['queuedRuns']} queued, {s['runningRuns']} running, {s['parkedRuns']} parked, "
                     f"{s['waitingRuns']} waiting, {s['completedRuns']} completed, {s['failedRuns']} failed, "
                     f"{s['cancelledRuns']} cancelled")
        if s.get("heldRuns"):
            lines.append(f"held:      {s['heldRuns']} held — piwf run list --held")
        if s.get("pendingInteractions"):
            lines.append(f"inbox:     {s['pendingInteractions']} open request(s): piwf inbox")
        if s.get("ambiguousEffects") or s.get("ambiguousControllerEffects"):
            lines.append(f"effects:   {s.get('ambiguousEffects', 0)} of runs and "
                         f"{s.get('ambiguousControllerEffects', 0)} of resources ambiguous: "
                         "piwf run resolve-effect / piwf controller resolve-effect")
        if s.get("undeliveredNotifications") or s.get("unresolvedTurns"):
            lines.append(f"sessions:  {s['undeliveredNotifications']} undelivered notification(s), "
                         f"{s['unresolvedTurns']} unresolved turn(s): piwf inbox --session ID")
        lines.append(f"workers:   {s.get('activeWorkers', 0)} active")
        if s.get("queues"):
            lines.append(f"queues:    {', '.join(map(shown, s['queues']))} (this host claims runs of these)")
        if "pendingControllers" in s:
            lines.append(f"resources: {s['pendingControllers']} queued, {s.get('activeControllerWorkers', 0)} "
                         f"reconciling, {s['heldControllers']} held")
        if s["lifecycleContradictions"]:
            lines.append(f"WARNING:   {s['lifecycleContradictions']} lifecycle contradictions")
    return "\n".join(lines)


def _host_lines(hosts: list[dict[str, Any]]) -> list[str]:
    """One line per live host sharing the store: the one that answered marked ``*``."""
    waiting = [h for h in hosts if h.get("standby")]
    lines = [f"hosts:     {len(hosts) - len(waiting)} live sharing the store"
             + (f", {len(waiting)} standby(s)" if waiting else "")]
    for h in hosts:
        if h.get("standby"):
            continue
        # how long its lease has left, by the answering host's clock (its heartbeat's age is its own)
        now = (h["heartbeatAt"] or 0) + (h["heartbeatAgeMs"] or 0)
        left = "" if h["expiresAt"] is None else f", lease {max(0, h['expiresAt'] - now) / 1000:.0f} s left"
        age = "" if h["heartbeatAgeMs"] is None else f", heartbeat {h['heartbeatAgeMs'] / 1000:.1f} s ago"
        machine = (h.get("hostname") or "") + (f" boot {h['machine'][:8]}" if h.get("machine") else "")
        lines.append(f"  {'*' if h['this'] else ' '} {h['hostId']}  epoch {h['epoch']}  pid {h['pid']}  "
                     f"{machine.strip() or 'machine unknown'}{age}{left}; {h['activeRuns']} run(s), "
                     f"{h['activeReconciles']} reconcile(s)")
    for h in waiting:
        machine = f"boot {h['machine'][:8]}" if h.get("machine") else "machine unknown"
        lines.append(f"    standby  pid {h['pid']}  {machine}, waiting for its state directory's lock")
    return lines
