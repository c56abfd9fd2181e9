"""``piwf``: argument parsing and printing; talks to the host through ``client``.

Heavy modules (trio, the host, the engine) are imported only by the commands that use
them, so ``piwf status`` stays quick. Every failure is one line on stderr (``piwf: ...``)
and an exit code from ``errors.ExitCode``; with ``--json`` also one JSON document on stdout,
``{"outcome", "error", "exitCode"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from . import cli_controller, cli_interact, cli_service, cli_settings, cli_watch
from .cli_common import (  # noqa: F401 - the shared helpers, also imported from here by the cli_* modules
    DEFAULT_TIMEOUT_S, WAIT_S, _client, _emit, _json_arg, _ok, _paths, _print, _seconds, _timeout, client_id,
)
from .cli_run import (
    cmd_run_control, cmd_run_events, cmd_run_list, cmd_run_logs, cmd_run_resolve_effect, cmd_run_show, cmd_run_start,
)
from .errors import (ExitCode, HostReplied, HostTimeout, HostUnavailable, InternalError, PiwfError,
                     UsageError)
from .host.lock import read_record
from .paths import StatePaths



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv  # until the arguments are parsed: a usage error has no args
    try:
        args = build_parser().parse_args(argv)
        as_json = args.json
        _check_text(args)
        return args.handler(args) or 0
    except PiwfError as exc:
        return fail(exc, as_json)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `piwf ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushed at exit without a second error
        return 0
    except OSError as exc:  # a file or socket piwf did not expect to be refused
        return fail(PiwfError(str(exc)), as_json)
    except Exception as exc:  # a bug: one line all the same, and an exit code of its own
        return fail(InternalError(f"internal error: {type(exc).__name__}: {exc}"), as_json)


def _check_text(args: argparse.Namespace) -> None:
    """Arguments are text the host reads as UTF-8: bytes that are not (the shell passes
    them through as surrogate escapes) are a usage error, not a crash later on."""
    for name, value in vars(args).items():
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                option = "--" + name.replace("_", "-") if name not in ("request_id", "choice", "name", "run_id",
                                                                        "key") else name.upper()
                raise UsageError(f"{option} is not valid UTF-8 text") from None


def fail(exc: PiwfError, as_json: bool) -> int:
    """Report ``exc``: one line on stderr and, with ``--json``, one document on stdout."""
    print(f"piwf: {exc}", file=sys.stderr)
    if as_json:
        if isinstance(exc, HostReplied):
            outcome, error = exc.outcome, " ".join((exc.error or "").split())
        else:
            outcome, error = _exit_outcome(exc.exit_code), str(exc)
        _emit({"outcome": outcome, "error": error, "exitCode": int(exc.exit_code)})
    return int(exc.exit_code)


def _exit_outcome(code: int) -> str:
    try:
        return ExitCode(code).outcome
    except ValueError:
        return "error"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors one line long and reported like every other failure."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="piwf", description="A durable workflow host for one machine.")
    _add_common(parser, defaults=True)
    common = Parser(add_help=False)
    _add_common(common, defaults=False)  # on subcommands too, without overriding the top level
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", parents=[common], help="run the host in the foreground")
    serve.add_argument("--max-workers", type=_positive, default=4, metavar="N", help="concurrent runs (default 4)")
    serve.add_argument("--durability", choices=("full", "normal"), default="full",
                       help="SQLite synchronous setting (default full)")
    serve.add_argument("--worker-startup-timeout", type=_seconds, default=15.0, metavar="S",
                       help="seconds a worker has to report ready (default 15)")
    serve.add_argument("--drain-timeout", type=_seconds, default=15.0, metavar="S",
                       help="seconds a stop may take to stop workers and park their runs (default 15)")
    serve.add_argument("--kill-grace", type=_seconds, default=2.0, metavar="S",
                       help="seconds between SIGTERM and SIGKILL when stopping a worker (default 2)")
    serve.add_argument("--request-timeout", type=_seconds, default=10.0, metavar="S",
                       help="seconds a client has to send a whole request once it began (default 10)")
    serve.add_argument("--reply-timeout", type=_seconds, default=10.0, metavar="S",
                       help="seconds a client has to take a reply before it is disconnected (default 10)")
    serve.add_argument("--presentation-lease", type=_seconds, default=10.0, metavar="S",
                       help="seconds a client presenting a decision or ask holds it (default 10)")
    serve.add_argument("--max-controller-workers", type=_positive, default=4, metavar="N",
                       help="concurrent reconciles (default 4)")
    serve.add_argument("--delivery-lease", type=_seconds, default=10.0, metavar="S",
                       help="seconds a client delivering a notification or turn holds it (default 10)")
    serve.add_argument("--worker-start", choices=("fork", "spawn"), default="fork",
                       help="fork workers from a preloaded template process (default; Linux) "
                            "or spawn a new interpreter for each")
    serve.add_argument("--log-format", choices=("auto", "text", "json"), default="auto",
                       help="text, JSON lines (ts, level, msg, epoch, runId), or auto: text on a terminal, "
                            "JSON lines otherwise (default)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="the least severe records logged (default info)")
    serve.add_argument("--standby", action="store_true",
                       help="start, load everything, and wait: take over at once when the live host stops or dies")
    serve.set_defaults(handler=cmd_serve)
    commands.add_parser("status", parents=[common], help="host state and counts").set_defaults(handler=cmd_status)
    commands.add_parser("stop", parents=[common], help="ask the host to drain and exit").set_defaults(handler=cmd_stop)

    workflows = commands.add_parser("workflows", parents=[common], help="workflow files").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    wf_list = workflows.add_parser("list", parents=[common], help="list and validate a project's workflows")
    wf_list.add_argument("--project", default=".", metavar="DIR")
    wf_list.set_defaults(handler=cmd_workflows_list)

    run = commands.add_parser("run", parents=[common], help="start and manage runs").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    start = run.add_parser("start", parents=[common], help="start a run of workflow NAME")
    start.add_argument("name", metavar="NAME")
    start.add_argument("--input", default="{}", metavar="JSON", help="run input as JSON (default {})")
    start.add_argument("--project", default=".", metavar="DIR", help="project directory (default .)")
    start.add_argument("--session", metavar="ID", help="origin session id (one queued or running run per session)")
    start.add_argument("--run-id", metavar="ID", help="choose the run id (default: the host makes one)")
    start.add_argument("--wait", action="store_true", help="wait until the run ends or waits")
    start.add_argument("--settings", metavar="JSON", help="initial settings (merged over the workflow's defaults)")
    start.set_defaults(handler=cmd_run_start)
    listing = run.add_parser("list", parents=[common], help="recent runs")
    listing.add_argument("--limit", type=_run_list_limit, default=50, metavar="N", help="1 to 1000 (default 50)")
    listing.add_argument("--status", help="only runs with this engine status")
    listing.set_defaults(handler=cmd_run_list)
    for name, handler, text in (
        ("show", cmd_run_show, "one run in detail"),
        ("events", cmd_run_events, "a run's trace"),
        ("cancel", cmd_run_control, "cancel a run (its worker's processes are killed)"),
        ("pause", cmd_run_control, "park a run at its next node boundary"),
        ("resume", cmd_run_control, "let a paused or held run continue"),
    ):
        sub = run.add_parser(name, parents=[common], help=text)
        sub.add_argument("run_id", metavar="RUN_ID")
        sub.set_defaults(handler=handler)
    logs = run.add_parser("logs", parents=[common], help="what the run's workers printed, per worker")
    logs.add_argument("run_id", metavar="RUN_ID")
    logs.set_defaults(handler=cmd_run_logs)
    resolve = run.add_parser("resolve-effect", parents=[common],
                             help="say whether an ambiguous effect was applied, releasing its run")
    resolve.add_argument("run_id", metavar="RUN_ID")
    resolve.add_argument("key", metavar="KEY")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--applied", action="store_true", help="it was applied: the run goes on with --result")
    outcome.add_argument("--not-applied", action="store_true", help="it was not applied: the run applies it again")
    resolve.add_argument("--result", metavar="JSON", help="the effect's result as JSON, with --applied (default null)")
    resolve.set_defaults(handler=cmd_run_resolve_effect)
    cli_settings.add_parsers(run, common)
    cli_interact.add_parsers(commands, common)
    cli_service.add_parsers(commands, common)
    cli_controller.add_parsers(commands, common)
    cli_watch.add_parsers(commands, common)
    return parser


def _add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    extra = {} if defaults else {"default": argparse.SUPPRESS}
    parser.add_argument("--state-dir", metavar="DIR", help="state directory (default: $PIWF_STATE_DIR, "
                        "$XDG_STATE_HOME/piwf or ~/.local/state/piwf)", **extra)
    parser.add_argument("--json", action="store_true", help="print one JSON document and nothing else", **extra)
    parser.add_argument("--timeout", type=_seconds, metavar="S", help="seconds the host (or, for `workflows list`, "
                        f"each workflow's import) has to answer (default: $PIWF_TIMEOUT or {DEFAULT_TIMEOUT_S:g})",
                        **extra)


def _run_list_limit(text: str) -> int:
    value = _positive(text)
    if value > 1000:
        raise argparse.ArgumentTypeError("must be at most 1000")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


# --- commands --------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from .host.host import Host
    from .host.state import HostConfig

    from . import faults, logs

    faults.configure()
    logs.configure(args.log_format, args.log_level)
    config = HostConfig(StatePaths.resolve(args.state_dir), max_workers=args.max_workers,
                        durability=args.durability, worker_startup_s=args.worker_startup_timeout,
                        kill_grace_s=args.kill_grace, worker_start=args.worker_start,
                        drain_timeout_s=args.drain_timeout, request_timeout_s=args.request_timeout,
                        reply_timeout_s=args.reply_timeout, standby=args.standby,
                        max_controller_workers=args.max_controller_workers,
                        presentation_lease_ms=max(1, int(args.presentation_lease * 1000)),
                        delivery_lease_ms=max(1, int(args.delivery_lease * 1000)),
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
    from .host.notify import Notifier
    from .host.server import inherited_listener_fd

    environ = {name: os.environ.pop(name) for name in SERVICE_MANAGER_VARIABLES if name in os.environ}
    notifier = Notifier.from_env(environ, os.getpid())
    return {"listen_fd": inherited_listener_fd(environ, os.getpid()), "notify_socket": notifier.address,
            "watchdog_s": notifier.watchdog_s}


def cmd_status(args: argparse.Namespace) -> int:
    paths = _paths(args)
    try:
        with _client(args) as client:
            receipt = _ok(client.call("host.status"))
    except HostTimeout:
        receipt = offline_status(paths, waited_s=_timeout(args))
    except HostUnavailable:
        receipt = offline_status(paths)
    _print(args, receipt, _format_status)
    return 0


def offline_status(paths: StatePaths, waited_s: float | None = None) -> dict[str, Any]:
    """What the state directory says when no host answers (read-only; nothing is written).

    ``stale``: a host process still holds the state directory (its lock record names a
    process that is still running: frozen, hung, or starting) or its lease has not yet
    expired (it has just died), yet it did not answer. ``stopped``: neither.
    """
    status: dict[str, Any] = {"state": "uninitialized", "stateDir": str(paths.root), "socketAvailable": False}
    if paths.db.exists():
        status.update(_stored_status(paths))
    if (holder := _live_holder(paths)) is not None:
        waited = f" within {waited_s:g} s" if waited_s is not None else " on its socket"
        status.update(state="stale", detail=f"the host (pid {holder}) does not answer{waited}")
    return status


def _stored_status(paths: StatePaths) -> dict[str, Any]:
    from .clock import WallClock
    from .store import Database, runs
    from .store.hosts import read_lease

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


def _live_holder(paths: StatePaths) -> int | None:
    """The pid of the host process holding the state directory, if that process still runs."""
    from .processes import alive

    record = read_record(paths)
    if not record or not isinstance(record.get("pid"), int):
        return None
    return record["pid"] if alive(record["pid"], str(record.get("identity"))) else None


def cmd_stop(args: argparse.Namespace) -> int:
    paths = _paths(args)
    try:
        with _client(args) as client:
            holder = read_record(paths)
            _ok(client.call("host.stop"))
        stopped = True
    except HostTimeout:
        raise  # a host is there, but it did not answer: it was not asked to stop
    except HostUnavailable:
        stopped = False
    if stopped and holder:
        _wait_for_exit(int(holder["pid"]), str(holder.get("identity")))
    _print(args, {"stopped": stopped}, lambda r: "host stopped" if stopped else "no host was running")
    return 0


def _wait_for_exit(pid: int, identity: str, timeout_s: float = 60.0) -> None:
    """Return once the host process (that very process, not a reuse of its pid) is gone."""
    import time

    from .processes import alive

    deadline = time.monotonic() + timeout_s
    while alive(pid, identity):
        if time.monotonic() > deadline:
            raise HostTimeout(f"the host (pid {pid}) is still draining after {timeout_s:.0f} s")
        time.sleep(0.02)


def cmd_workflows_list(args: argparse.Namespace) -> int:
    """Each workflow is loaded in a child process of its own, with a time limit."""
    from .engine.inspect import inspect_all
    from .engine.loader import WORKFLOW_DIR, workflow_names

    project = Path(args.project).absolute()
    names = workflow_names(project)
    rows = [_workflow_row(name, result) for name, result in zip(names, inspect_all(project, names, _timeout(args)),
                                                                    strict=True)]
    _print(args, rows, lambda rs: "\n".join(
        f"{r['name']:20} " + (f"ERROR {r['error']}" if r["error"] else f"{r['nodes']} nodes, starts at {r['startAt']}")
        for r in rs) or f"no workflows in {project / WORKFLOW_DIR}")
    failed = [r["name"] for r in rows if r["error"]]
    if failed:
        print(f"piwf: {len(failed)} of {len(rows)} workflows did not load: {', '.join(failed)}", file=sys.stderr)
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
    if s.get("detail"):
        lines.append(f"detail:    {s['detail']}")
    if "queuedRuns" in s:
        lines.append(f"runs:      {s['queuedRuns']} queued, {s['runningRuns']} running, {s['parkedRuns']} parked, "
                     f"{s['waitingRuns']} waiting, {s['completedRuns']} completed, {s['failedRuns']} failed, "
                     f"{s['cancelledRuns']} cancelled")
        if s.get("pendingInteractions"):
            lines.append(f"inbox:     {s['pendingInteractions']} open request(s): piwf inbox")
        if s.get("undeliveredNotifications") or s.get("unresolvedTurns"):
            lines.append(f"sessions:  {s['undeliveredNotifications']} undelivered notification(s), "
                         f"{s['unresolvedTurns']} unresolved turn(s): piwf inbox --session ID")
        lines.append(f"workers:   {s.get('activeWorkers', 0)} active")
        if "pendingControllers" in s:
            lines.append(f"resources: {s['pendingControllers']} queued, {s.get('activeControllerWorkers', 0)} "
                         f"reconciling, {s['heldControllers']} held")
        if s["lifecycleContradictions"]:
            lines.append(f"WARNING:   {s['lifecycleContradictions']} lifecycle contradictions")
    return "\n".join(lines)



if __name__ == "__main__":
    sys.exit(main())
