"""The ``piwf`` command line: every command's arguments, and the handler each one runs.

A handler is named ``"module:function"`` (a module of ``piwf.cli``) and imported only when
its command runs, so building the parser imports no command's module: ``piwf status``
does not pay for trio, the host or the engine.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from piwf import __version__
from piwf.cli.common import DEFAULT_TIMEOUT_S, _duration_ms, _seconds
from piwf.errors import UsageError
from piwf.status import RunStatus

SHELLS = ("bash", "zsh", "fish")  # piwf.cli.completion.SHELLS, without importing it
PLATFORMS = ("linux", "macos")  # piwf.service.PLATFORMS, without importing it (a test checks)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors one line long and reported like every other failure."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """An unknown flag points to the help of the subcommand it was given to (argparse
        reports it from the top level, where `piwf --help` does not list it)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            words = [self.prog, getattr(parsed, "command", None), getattr(parsed, "sub", None)]
            prog = " ".join(word for word in words if word)
            raise UsageError(f"unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="piwf", description="A durable workflow host for one machine.")
    parser.add_argument("--version", action="version", version=f"piwf {__version__}")
    _add_common(parser, defaults=True)
    common = Parser(add_help=False)
    _add_common(common, defaults=False)  # on subcommands too, without overriding the top level
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_serve(commands, common)
    status = commands.add_parser("status", parents=[common], help="host state and counts")
    _add_store(status)
    status.set_defaults(handler="host:cmd_status")
    commands.add_parser("stop", parents=[common], help="ask the host to drain and exit").set_defaults(
        handler="host:cmd_stop")

    workflows = commands.add_parser("workflows", parents=[common], help="workflow files").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    wf_list = workflows.add_parser("list", parents=[common], help="list and validate a project's workflows")
    wf_list.add_argument("--project", default=".", metavar="DIR")
    wf_list.set_defaults(handler="host:cmd_workflows_list")

    run = commands.add_parser("run", parents=[common], help="start and manage runs").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    start = run.add_parser("start", parents=[common], help="start a run of workflow NAME")
    start.add_argument("name", metavar="NAME")
    start.add_argument("--input", default="{}", metavar="JSON", help="run input as JSON (default {})")
    start.add_argument("--project", default=".", metavar="DIR", help="project directory (default .)")
    start.add_argument("--session", metavar="ID", help="origin session id (one queued or running run per session)")
    start.add_argument("--run-id", metavar="ID", help="choose the run id (default: the host makes one)")
    start.add_argument("--wait", action="store_true", help="print the run id, then wait until the run ends, "
                       "waits, or is paused or held; the exit code says which (docs/operations.md)")
    _add_wait_timeout(start)
    start.add_argument("--settings", metavar="JSON", help="initial settings (merged over the workflow's defaults)")
    _add_request_id(start)
    start.set_defaults(handler="run:cmd_run_start")
    wait = run.add_parser("wait", parents=[common], help="wait for a run as `run start --wait` does")
    wait.add_argument("run_id", metavar="RUN_ID")
    _add_wait_timeout(wait)
    wait.set_defaults(handler="run:cmd_run_wait")
    listing = run.add_parser("list", parents=[common], help="recent runs")
    listing.add_argument("--limit", type=_run_list_limit, default=50, metavar="N", help="1 to 1000 (default 50)")
    listing.add_argument("--status", choices=RUN_STATUSES, metavar="STATUS",
                         help=f"only runs with this engine status: {', '.join(RUN_STATUSES)}")
    listing.add_argument("--workflow", metavar="NAME", help="only this workflow's runs")
    listing.add_argument("--session", metavar="ID", help="only runs this origin session started")
    listing.add_argument("--since", type=_since, metavar="WHEN", help="only runs created since WHEN: a duration "
                         "ago (30m, 2h, 7d) or a date or time (2026-12-01, 2026-12-01T09:30, local unless it "
                         "gives Z or an offset)")
    listing.add_argument("--held", action="store_true", help="only runs held for a person (crashes, an "
                         "ambiguous effect, a changed workflow)")
    listing.add_argument("--after", metavar="RUN_ID", help="the next page: runs after this one (the last one shown)")
    listing.set_defaults(handler="run:cmd_run_list")
    for name, handler, text in (
        ("show", "run:cmd_run_show", "one run in detail"),
        ("cancel", "run:cmd_run_control", "cancel a run (its worker's processes are killed)"),
        ("pause", "run:cmd_run_control", "park a run at its next node boundary"),
        ("resume", "run:cmd_run_control", "let a paused or held run continue"),
    ):
        sub = run.add_parser(name, parents=[common], help=text)
        sub.add_argument("run_id", metavar="RUN_ID")
        sub.set_defaults(handler=handler)
    for name, text, follow in (
        ("events", "a run's trace", "then print each new event as it comes, until the run ends"),
        ("logs", "what the run's workers printed, per worker",
         "then print a live worker's output as it comes, and the next worker's, until the run ends"),
    ):
        sub = run.add_parser(name, parents=[common], help=text)
        sub.add_argument("run_id", metavar="RUN_ID")
        sub.add_argument("--follow", "-f", action="store_true", help=follow + " or is held, paused or waiting "
                         "(then exit as --wait does: 24, 23, 25); with --json a JSON line each")
        sub.set_defaults(handler=f"follow:cmd_run_{name}")
    resolve = run.add_parser("resolve-effect", parents=[common],
                             help="say whether an ambiguous effect was applied, releasing its run")
    resolve.add_argument("run_id", metavar="RUN_ID")
    resolve.add_argument("key", metavar="KEY")
    _add_outcome(resolve, applied="it was applied: the run goes on with --result",
                 not_applied="it was not applied: the run applies it again",
                 result="the effect's result as JSON, with --applied (default null)")
    resolve.set_defaults(handler="run:cmd_run_resolve_effect")
    _add_settings(run, common)
    _add_retention(run, commands, common)
    _add_interact(commands, common)
    _add_followup(commands, common)
    _add_service(commands, common)
    _add_controller(commands, common)
    _add_watch(commands, common)
    completion = commands.add_parser("completion", parents=[common],
                                     help="print a completion script for bash, zsh or fish")
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")
    completion.set_defaults(handler="completion:cmd_completion")
    return parser


def _add_serve(commands: Any, common: argparse.ArgumentParser) -> None:
    serve = commands.add_parser("serve", parents=[common], help="run the host in the foreground")
    serve.add_argument("--max-workers", type=_positive, default=4, metavar="N", help="concurrent runs (default 4)")
    serve.add_argument("--durability", choices=("full", "normal"), default="full",
                       help="SQLite's synchronous setting, PostgreSQL's synchronous_commit on/off (default full)")
    _add_store(serve)
    serve.add_argument("--poll-only", action="store_true", help="with --store: no LISTEN/NOTIFY wake-ups from other "
                       "hosts, only polls (for a connection pooler in transaction mode)")
    for flag, default, text in (
        ("--worker-startup-timeout", 15.0, "a worker has to report ready"),
        ("--drain-timeout", 15.0, "a stop may take to stop workers and park their runs"),
        ("--kill-grace", 2.0, "between SIGTERM and SIGKILL when stopping a worker"),
        ("--request-timeout", 10.0, "a client has to send a whole request once it began"),
        ("--reply-timeout", 10.0, "a client has to take a reply before it is disconnected"),
        ("--presentation-lease", 10.0, "a client presenting a decision or ask holds it"),
        ("--socket-check", 1.0, "between looks at the socket's path (a deleted socket is bound again)"),
    ):
        _add_seconds(serve, flag, default, text)
    serve.add_argument("--max-controller-workers", type=_positive, default=4, metavar="N",
                       help="concurrent reconciles (default 4)")
    _add_seconds(serve, "--delivery-lease", 10.0, "a client delivering a notification or turn holds it")
    serve.add_argument("--node-time-limit", type=_seconds, default=None, metavar="S",
                       help="stop any node's worker after S seconds in one attempt, whatever the node's own "
                            "time_limit (default: none; at most 3600)")
    serve.add_argument("--worker-start", choices=("fork", "spawn"), default="fork",
                       help="fork workers from a preloaded template process (default; Linux) "
                            "or spawn a new interpreter for each")
    serve.add_argument("--worker-nice", type=_nice, default=10, metavar="N",
                       help="run workers execute their nodes N nicer than the host (0-19, default 10): on cores "
                            "busy with runs, the host and starting workers go first")
    serve.add_argument("--log-format", choices=("auto", "text", "json"), default="auto",
                       help="text, JSON lines (ts, level, msg, epoch, runId), or auto: text on a terminal, "
                            "JSON lines otherwise (default)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="the least severe records logged (default info)")
    serve.add_argument("--retain", type=_duration_ms, metavar="DUR",
                       help="delete runs this long after they ended (30d, 12h, 90m, 45s; default: keep them)")
    serve.add_argument("--standby", action="store_true",
                       help="start, load everything, and wait: take over at once when the live host stops or dies")
    serve.set_defaults(handler="host:cmd_serve")


def _add_wait_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait-timeout", type=_duration_ms, metavar="DUR",
                        help="stop waiting after DUR (90s, 10m, 2h): exit 26, the run goes on (default: no limit)")


def _add_seconds(parser: argparse.ArgumentParser, flag: str, default: float, text: str) -> None:
    """A duration option: ``flag`` S, the seconds ``text`` (``default`` when absent)."""
    parser.add_argument(flag, type=_seconds, default=default, metavar="S", help=f"seconds {text} (default {default:g})")


def _add_request_id(parser: argparse.ArgumentParser) -> None:
    """``--request-id``: the id of the command's request, so that running it again is a retry."""
    parser.add_argument("--request-id", dest="command_id", metavar="ID",
                        help="this command's request id: the same id again is a safe retry")


def _add_outcome(parser: argparse.ArgumentParser, *, applied: str, not_applied: str, result: str) -> None:
    """``resolve-effect``'s answer: ``--applied`` (with ``--result``) or ``--not-applied``."""
    outcome = parser.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--applied", action="store_true", help=applied)
    outcome.add_argument("--not-applied", action="store_true", help=not_applied)
    parser.add_argument("--result", metavar="JSON", help=result)


def _add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="URL", help="a postgresql:// URL (libpq's form, ?schema=NAME) to keep "
                        "the state in instead of the state directory's SQLite (default: $PIWF_STORE; for status: "
                        "also what the host recorded)")


def _add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    extra: dict[str, Any] = {} if defaults else {"default": argparse.SUPPRESS}
    parser.add_argument("--state-dir", metavar="DIR", help="state directory (default: $PIWF_STATE_DIR, "
                        "$XDG_STATE_HOME/piwf or ~/.local/state/piwf)", **extra)
    parser.add_argument("--json", action="store_true", help="print one JSON document and nothing else", **extra)
    parser.add_argument("--timeout", type=_seconds, metavar="S", help="seconds the host (or, for `workflows list`, "
                        f"each workflow's import) has to answer (default: $PIWF_TIMEOUT or {DEFAULT_TIMEOUT_S:g})",
                        **extra)


RUN_STATUSES = tuple(status.value for status in RunStatus)


def _since(text: str) -> int:
    """``--since``: a duration ago, or a date or a time (ISO 8601; local unless zoned)."""
    import datetime
    import time

    try:
        ago_ms = _duration_ms(text)
    except argparse.ArgumentTypeError:
        try:
            when = datetime.datetime.fromisoformat(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither a duration (30m, 2h, 7d) nor a date or time "
                                             "(2026-12-01, 2026-12-01T09:30)") from None
        ms = int(when.timestamp() * 1000)  # a naive time is local time
    else:
        ms = int(time.time() * 1000) - ago_ms
    return max(ms, 0)


def _run_list_limit(text: str) -> int:
    value = _positive(text)
    if value > 1000:
        raise argparse.ArgumentTypeError("must be at most 1000")
    return value


def _positive(text: str) -> int:
    return _whole(text, noun="a whole number", least=1, too_small="must be at least 1")


def _nice(text: str) -> int:
    value = _whole(text, noun="a nice increment", least=0, too_small="must be between 0 and 19")
    if value > 19:
        raise argparse.ArgumentTypeError("must be between 0 and 19")
    return value


def _change_number(text: str) -> int:
    return _whole(text, noun="a change number", least=0, too_small="a change number is 0 or more")


def _whole(text: str, *, noun: str, least: int, too_small: str) -> int:
    """An integer option value of at least ``least``; refused as ``not <noun>`` or ``too_small``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if value < least:
        raise argparse.ArgumentTypeError(too_small)
    return value


def _add_controller(commands: Any, common: argparse.ArgumentParser) -> None:
    group = commands.add_parser("controller", parents=[common], help="controller resources").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    apply = _keyed(group, common, "apply", "create a resource or change its spec", "controller:cmd_apply")
    apply.add_argument("--spec", required=True, metavar="JSON",
                       help="the resource's spec as JSON; @FILE reads it from FILE, - from standard input")
    apply.add_argument("--resource-version", type=int, metavar="N",
                       help="refuse (conflict) unless the resource is at this resourceVersion")
    _keyed(group, common, "get", "a resource: spec, status, conditions, errors, next attempt, events",
           "controller:cmd_get")
    delete = _keyed(group, common, "delete", "request deletion (finalizers run first)", "controller:cmd_delete")
    delete.add_argument("--force", action="store_true",
                        help="remove it now with its finalizers, without a reconcile: nothing is cleaned up")
    _keyed(group, common, "reconcile", "queue a reconcile now", "controller:cmd_reconcile")
    listing = group.add_parser("list", parents=[common], help="resources, of one controller or all")
    listing.add_argument("name", nargs="?", metavar="NAME")
    listing.add_argument("--project", metavar="DIR", help="only this project's (default: every project)")
    listing.set_defaults(handler="controller:cmd_list")
    resolve = _keyed(group, common, "resolve-effect", "say whether an ambiguous effect was applied",
                     "controller:cmd_resolve")
    resolve.add_argument("effect_key", metavar="EFFECT_KEY")
    _add_outcome(resolve, applied="it was applied (its result: --result)",
                 not_applied="it was not: the next pass applies it",
                 result="the effect's result as JSON, with --applied")


def _keyed(group: Any, common: argparse.ArgumentParser, name: str, text: str, handler: Any) -> Any:
    sub = group.add_parser(name, parents=[common], help=text)
    sub.add_argument("name", metavar="NAME", help="the controller (.piwf/controllers/NAME.py)")
    sub.add_argument("key", metavar="KEY", help="the resource's key")
    sub.add_argument("--project", default=".", metavar="DIR", help="project directory (default .)")
    sub.set_defaults(handler=handler)
    return sub


def _inbox_limit(text: str) -> int:
    value = _positive(text)
    if value > 999:
        raise argparse.ArgumentTypeError(f"{value} is over 999")
    return value


def _add_interact(commands: Any, common: argparse.ArgumentParser) -> None:
    inbox = commands.add_parser("inbox", parents=[common], help="decisions and asks waiting for an answer")
    inbox.add_argument("--session", metavar="ID", help="only requests of runs started by this session")
    inbox.add_argument("--run", metavar="RUN_ID", help="only this run's requests")
    inbox.add_argument("--all", action="store_true", help="closed requests too (settled, expired, cancelled)")
    inbox.add_argument("--limit", type=_inbox_limit, default=100, metavar="N",
                       help="show at most N requests, oldest first (default 100, at most 999); a last line says "
                            "when there are more")
    inbox.add_argument("--follow", action="store_true", help="with --session: print the session's notifications "
                       "and turns as they arrive, delivering each (the reference client, docs/sessions.md)")
    inbox.set_defaults(handler="interact:cmd_inbox")
    decide = commands.add_parser("decide", parents=[common], help="answer a decision; the first answer wins")
    decide.add_argument("request_id", metavar="REQUEST_ID")
    decide.add_argument("choice", metavar="CHOICE", help="one of the decision's choice ids")
    decide.add_argument("--input", metavar="TEXT", help="the text a choice with input takes (kept exactly)")
    _add_request_id(decide)
    decide.set_defaults(handler="interact:cmd_decide")
    answer = commands.add_parser("answer", parents=[common], help="submit a value to an ask; the workflow "
                                 "validates it")
    answer.add_argument("request_id", metavar="REQUEST_ID")
    answer.add_argument("--value", required=True, metavar="JSON", help="the value, as JSON; `-` reads it from "
                        "stdin, `@FILE` from FILE (a JSON string needs its quotes: '\"text\"')")
    answer.add_argument("--session", metavar="ID", help="the submitting session (the run's origin session, if any)")
    answer.add_argument("--wait", action="store_true", help="wait until it is validated; exit 1 with the reason "
                        "when it is rejected (and as `run wait` does when the run is held meanwhile)")
    _add_wait_timeout(answer)
    _add_request_id(answer)
    answer.set_defaults(handler="interact:cmd_answer")


def _add_followup(commands: Any, common: argparse.ArgumentParser) -> None:
    group = commands.add_parser("followup", parents=[common], help="prompts for a run's origin session, "
                                "delivered with the run's next turn").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    add = group.add_parser("add", parents=[common], help="queue a follow-up for the run's session")
    add.add_argument("run_id", metavar="RUN_ID")
    add.add_argument("text", metavar="TEXT", help="what to tell the session with the run's turn")
    add.add_argument("--request-key", metavar="KEY", help="the same key again is the same follow-up "
                     "(a safe retry; default: a new key each time)")
    add.set_defaults(handler="follow:cmd_followup_add")
    remove = group.add_parser("remove", parents=[common], help="take back a follow-up not yet delivered")
    remove.add_argument("run_id", metavar="RUN_ID", help="the run it was queued for")
    remove.add_argument("followup_id", metavar="FOLLOWUP_ID", nargs="?",
                        help="as `followup add` printed it (with the whole command)")
    remove.set_defaults(handler="follow:cmd_followup_remove")


def _add_service(commands: Any, common: argparse.ArgumentParser) -> None:
    group = commands.add_parser("service", parents=[common], help="run the host as a background service "
                                "(systemd user unit, launchd agent)").add_subparsers(
        dest="sub", required=True, metavar="SUBCOMMAND")
    for name, handler, text in (
        ("install", "service:cmd_install", "write the service files and start the service"),
        ("uninstall", "service:cmd_uninstall", "stop the service and remove the files install wrote"),
        ("status", "service:cmd_status", "the service files and what the service manager says"),
    ):
        sub = group.add_parser(name, parents=[common], help=text)
        if name != "status":
            sub.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
        sub.add_argument("--name", metavar="NAME", help="the units' name, piwf-NAME (default: the name this "
                         "state directory's units have, else one made from the directory)")
        sub.add_argument("--platform", choices=PLATFORMS, help=argparse.SUPPRESS)  # for tests: files only
        sub.set_defaults(handler=handler)


def _add_settings(run: Any, common: argparse.ArgumentParser) -> None:
    sub = run.add_parser("settings", parents=[common], help="show a run's settings, or change them with --set")
    sub.add_argument("run_id", metavar="RUN_ID")
    sub.add_argument("--set", dest="assignments", action="append", default=[], metavar="PATH=JSON",
                     help="set a mutable path (dotted, like limits.max) to a JSON value; null removes it "
                          "(back to its default); repeat for several")
    sub.add_argument("--expect", type=_change_number, metavar="N",
                     help="refuse (conflict) unless the settings are at change N")
    sub.add_argument("--scope", metavar="ID", help="the settings scope (default: the run's)")
    _add_request_id(sub)
    sub.set_defaults(handler="settings:cmd_run_settings")


def _add_retention(run: Any, commands: Any, common: argparse.ArgumentParser) -> None:
    """``run retry`` and ``prune``: ended runs continued, or deleted."""
    retry = run.add_parser("retry", parents=[common], help="continue a failed or timed-out run from the node "
                           "that failed (its accepted steps and applied effects are kept)")
    retry.add_argument("run_id", metavar="RUN_ID")
    _add_request_id(retry)
    retry.set_defaults(handler="maintenance:cmd_run_retry")
    prune = commands.add_parser("prune", parents=[common], help="delete runs that ended long enough ago, with "
                                "their steps, events and stored values")
    prune.add_argument("--older-than", type=_duration_ms, required=True, metavar="DUR",
                       help="runs that ended at least this long ago (30d, 12h, 90m, 45s)")
    prune.add_argument("--dry-run", action="store_true", help="say how many would be deleted; delete nothing")
    _add_request_id(prune)
    prune.set_defaults(handler="maintenance:cmd_prune")


def _add_watch(commands: Any, common: argparse.ArgumentParser) -> None:
    watch = commands.add_parser("watch", parents=[common], help="a live view of runs: current nodes, latest "
                                "updates, waiting requests, recent events")
    watch.add_argument("run_id", nargs="?", metavar="RUN", help="only this run")
    watch.add_argument("--once", action="store_true", help="print one snapshot and exit (with --json: the "
                       "run.watch receipt; without --once, --json prints one receipt per line as changes come)")
    watch.set_defaults(handler="watch:cmd_watch")
