"""The ``piwf`` command line: every command's arguments, and the handler each one runs.

A handler is named ``"module:function"`` (a module of ``piwf.cli``) and imported only when
its command runs, so building the parser imports no command's module: ``piwf status``
does not pay for trio, the host or the engine. Given the arguments, ``build_parser``
builds only the command they name (argparse spends about 1 ms on each subcommand's
parser, most of it looking for translations): the others are ``SKIPPED``.
"""

from __future__ import annotations

import argparse

from piwf import __version__
from piwf.cli.common import DEFAULT_TIMEOUT_S, _duration_ms, _lease, _seconds
from piwf.errors import UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: one-shot commands start without it
if TYPE_CHECKING:
    from typing import Any, NoReturn

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


class Skipped:
    """A command's parser that is not built, the arguments naming another command: every
    call that would add to it does nothing."""

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_defaults(self, **kwargs: Any) -> None:
        pass

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Skipped:
        return self

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Skipped:
        return self

    def add_subparsers(self, **kwargs: Any) -> Skipped:
        return self

    def add_parser(self, name: str, **kwargs: Any) -> Skipped:
        return self


SKIPPED = Skipped()


class Only:
    """A subparsers action that builds the subcommand ``name`` alone (every one when
    ``name`` is None); ``found`` says whether ``name`` was among them."""

    def __init__(self, action: Any, name: str | None) -> None:
        self.action, self.name, self.found = action, name, False

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self.name is not None and name != self.name:
            return SKIPPED
        self.found = True
        return self.action.add_parser(name, **kwargs)


# The options every parser takes: the ones with a value, and the flag.
_VALUED = ("--state-dir", "--timeout")
_FLAGS = ("--json",)


def _words(argv: list[str]) -> list[str | None]:
    """The command and subcommand words ``argv`` names, skipping the options every parser
    takes; None from the first word that is not plainly one (``--help``, ``--version``, an
    abbreviated or unknown option): that parser is built whole."""
    words: list[str | None] = []
    i = 0
    while i < len(argv) and len(words) < 2:
        word = argv[i]
        if word in _VALUED:
            i += 2
        elif word in _FLAGS or word.startswith(tuple(f"{option}=" for option in _VALUED)):
            i += 1
        elif word.startswith("-"):
            break
        else:
            words.append(word)
            i += 1
    return words + [None] * (2 - len(words))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command, or (given ``argv``) only the command and
    subcommand ``argv`` names, which parses ``argv`` exactly as the whole parser does."""
    if argv is not None:
        command, sub = _words(argv)
        if command is not None:
            parser, reached = _build(command, sub)
            if all(only.found for only in reached):
                return parser
    return _build(None, None)[0]


def _build(command: str | None, sub: str | None) -> tuple[argparse.ArgumentParser, list[Only]]:
    parser = Parser(prog="piwf", description="A durable workflow host for one machine.")
    parser.add_argument("--version", action="version", version=f"piwf {__version__}")
    _add_common(parser, defaults=True)
    common = Parser(add_help=False)
    _add_common(common, defaults=False)  # on subcommands too, without overriding the top level
    commands = Only(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), command)
    reached = [commands]

    def group(name: str, text: str) -> Any:
        """The subcommands of command ``name``, built as ``sub`` says when it is the one named."""
        found = commands.add_parser(name, parents=[common], help=text).add_subparsers(
            dest="sub", required=True, metavar="SUBCOMMAND")
        if found is SKIPPED:
            return found
        reached.append(Only(found, sub))
        return reached[-1]

    _add_commands(commands, common, group)
    return parser, reached


def _add_commands(commands: Any, common: argparse.ArgumentParser, group: Any) -> None:

    _add_serve(commands, common)
    status = commands.add_parser("status", parents=[common], help="host state and counts")
    _add_store(status)
    status.set_defaults(handler="host:cmd_status")
    commands.add_parser("stop", parents=[common], help="ask the host to drain and exit").set_defaults(
        handler="host:cmd_stop")

    workflows = group("workflows", "workflow files")
    wf_list = workflows.add_parser("list", parents=[common], help="list and validate a project's workflows")
    wf_list.add_argument("--project", default=".", metavar="DIR")
    wf_list.set_defaults(handler="host:cmd_workflows_list")

    run = group("run", "start and manage runs")
    start = run.add_parser("start", parents=[common], help="start a run of workflow NAME")
    start.add_argument("name", metavar="NAME")
    start.add_argument("--input", default="{}", metavar="JSON", help="run input as JSON (default {})")
    start.add_argument("--project", default=".", metavar="DIR", help="project directory (default .)")
    start.add_argument("--session", metavar="ID", help="origin session id (one queued or running run per session)")
    start.add_argument("--run-id", metavar="ID", help="choose the run id (default: the host makes one)")
    start.add_argument("--queue", type=_queue, default=None, metavar="Q",
                       help="the named queue to run on: only a host serving it (serve --queue) claims the run "
                            "(default: default)")
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
    _add_run_list(run, common)
    for name, handler, text in (
        ("show", "run:cmd_run_show", "one run in detail"),
        ("graph", "run:cmd_run_graph", "a run's workflow graph: each node's state and exits, and the path taken"),
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
    _add_followup(group, common)
    _add_service(group, common)
    _add_controller(group, common)
    _add_watch(commands, common)
    _add_ui(commands, common)
    completion = commands.add_parser("completion", parents=[common],
                                     help="print a completion script for bash, zsh or fish")
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")
    completion.set_defaults(handler="completion:cmd_completion")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return port


def _add_ui(commands: Any, common: argparse.ArgumentParser) -> None:
    """``piwf ui``: the web console (docs/ui.md), on 127.0.0.1 or a Unix socket."""
    ui = commands.add_parser("ui", parents=[common], help="the web console: runs, their graphs, the inbox, "
                             "controllers (needs pip install 'piwf[ui]')")
    where = ui.add_mutually_exclusive_group()
    where.add_argument("--port", type=_port, metavar="N", help="listen on 127.0.0.1:N (default: a free port)")
    where.add_argument("--socket", metavar="PATH", help="listen on this Unix socket instead")
    ui.add_argument("--as", dest="answer_as", metavar="NAME",
                    help="the name answers are recorded under (default ui:<your user name>)")
    ui.add_argument("--session", metavar="ID", help="also answer requests of runs this origin session started "
                    "(without it they are shown read-only)")
    ui.set_defaults(handler="ui:cmd_ui")


def _add_serve(commands: Any, common: argparse.ArgumentParser) -> None:
    serve = commands.add_parser("serve", parents=[common], help="run the host in the foreground")
    _add_host_options(serve, service=False)
    serve.add_argument("--log-format", choices=("auto", "text", "json"), default="auto",
                       help="text, JSON lines (ts, level, msg, epoch, runId), or auto: text on a terminal, "
                            "JSON lines otherwise (default)")
    serve.add_argument("--standby", action="store_true",
                       help="start, load everything, and wait: take over at once when the live host stops or dies")
    serve.set_defaults(handler="host:cmd_serve")


def _add_host_options(parser: argparse.ArgumentParser, *, service: bool) -> None:
    """``serve``'s options that change how the host behaves: every one but ``--log-format``
    (a service logs JSON lines) and ``--standby`` (a service is the live host, restarted by
    its manager). ``service``: for ``service install``, which carries those given into the
    unit as given (checked as ``serve`` checks them; absent ones stay the host's default);
    their flags are ``args.serve_flags``."""
    flags: list[str] = []
    group = parser.add_argument_group("how the service runs piwf serve (as serve takes them)") if service else parser

    def add(flag: str, **kwargs: Any) -> None:
        if service:
            kwargs["default"] = argparse.SUPPRESS
            if "type" in kwargs:
                kwargs["type"] = _as_given(kwargs["type"])
        group.add_argument(flag, **kwargs)
        flags.append(flag)

    add("--max-workers", type=_positive, default=4, metavar="N", help="concurrent runs (default 4)")
    add("--queue", type=_queue, action="append", default=None, metavar="Q",
        help="claim only runs of named queue Q; repeat for several (default: default)")
    add("--durability", choices=("full", "normal"), default="full",
        help="SQLite's synchronous setting, PostgreSQL's synchronous_commit on/off (default full)")
    add("--store", metavar="URL", help="a postgresql:// URL (libpq's form, ?schema=NAME) to keep the state in "
        "instead of the state directory's SQLite (default: $PIWF_STORE" + (
            "; a password is refused: put it in ~/.pgpass)" if service else ")"))
    add("--poll-only", action="store_true", help="with --store: no LISTEN/NOTIFY wake-ups from other "
        "hosts, only polls (for a connection pooler in transaction mode)")
    for flag, default, text in (
        ("--worker-startup-timeout", 15.0, "a worker has to report ready"),
        ("--drain-timeout", 15.0, "a stop may take to stop workers and park their runs"),
        ("--kill-grace", 2.0, "between SIGTERM and SIGKILL when stopping a worker"),
        ("--request-timeout", 10.0, "a client has to send a whole request once it began"),
        ("--reply-timeout", 10.0, "a client has to take a reply before it is disconnected"),
        ("--presentation-lease", 10.0, "a client presenting a decision or ask holds it"),
        ("--socket-check", 1.0, "between looks at the socket's path (a deleted socket is bound again)"),
        ("--delivery-lease", 10.0, "a client delivering a notification or turn holds it"),
        ("--lease", 30.0, "the host's lease and its runs' claims last past each renewal (without one its "
         "work stops at 2/3 of it; a dead host on another machine is taken over once they expire)"),
    ):
        add(flag, type=_lease if flag == "--lease" else _seconds, default=default, metavar="S",
            help=f"seconds {text} (default {default:g})")
    add("--max-controller-workers", type=_positive, default=4, metavar="N", help="concurrent reconciles (default 4)")
    add("--node-time-limit", type=_seconds, default=None, metavar="S",
        help="stop any node's worker after S seconds in one attempt, whatever the node's own time_limit "
             "(default: none; at most 3600)")
    add("--worker-start", choices=("fork", "spawn"), default="fork",
        help="fork workers from a preloaded template process (default; Linux) or spawn a new interpreter for each")
    add("--worker-nice", type=_nice, default=10, metavar="N",
        help="run workers execute their nodes N nicer than the host (0-19, default 10): on cores "
             "busy with runs, the host and starting workers go first")
    add("--log-level", choices=("debug", "info", "warning", "error"), default="info",
        help="the least severe records logged (default info)")
    add("--retain", type=_duration_ms, metavar="DUR",
        help="delete runs this long after they ended (30d, 12h, 90m, 45s; default: keep them)")
    if service:
        parser.set_defaults(serve_flags=tuple(flags))


def _as_given(check: Any) -> Any:
    """An argument type that checks the text as ``check`` does and keeps the text."""
    def given(text: str) -> str:
        check(text)
        return text

    given.__name__ = getattr(check, "__name__", "value")
    return given


def _add_run_list(run: Any, common: argparse.ArgumentParser) -> None:
    """``run list``: recent runs, filtered."""
    listing = run.add_parser("list", parents=[common], help="recent runs")
    if listing is SKIPPED:
        return  # its --status choices are the status words (piwf.status): loaded for this command alone
    from piwf.status import RunStatus

    statuses = tuple(status.value for status in RunStatus)
    listing.add_argument("--limit", type=_run_list_limit, default=50, metavar="N", help="1 to 1000 (default 50)")
    listing.add_argument("--status", choices=statuses, metavar="STATUS",
                         help=f"only runs with this engine status: {', '.join(statuses)}")
    listing.add_argument("--workflow", metavar="NAME", help="only this workflow's runs")
    listing.add_argument("--session", metavar="ID", help="only runs this origin session started")
    listing.add_argument("--since", type=_since, metavar="WHEN", help="only runs created since WHEN: a duration "
                         "ago (30m, 2h, 7d) or a date or time (2026-12-01, 2026-12-01T09:30, local unless it "
                         "gives Z or an offset)")
    listing.add_argument("--held", action="store_true", help="only runs held for a person (crashes, an "
                         "ambiguous effect, a changed workflow)")
    listing.add_argument("--after", metavar="RUN_ID", help="the next page: runs after this one (the last one shown)")
    listing.set_defaults(handler="run:cmd_run_list")


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


def _queue(text: str) -> str:
    from piwf.status import queue_problem

    problem = queue_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


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


def _add_controller(subcommands: Any, common: argparse.ArgumentParser) -> None:
    group = subcommands("controller", "controller resources")
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


def _add_followup(subcommands: Any, common: argparse.ArgumentParser) -> None:
    group = subcommands("followup", "prompts for a run's origin session, delivered with the run's next turn")
    add = group.add_parser("add", parents=[common], help="queue a follow-up for the run's session")
    add.add_argument("run_id", metavar="RUN_ID")
    add.add_argument("text", metavar="TEXT", help="what to tell the session with the run's turn")
    add.add_argument("--request-key", metavar="KEY", help="the same key again is the same follow-up "
                     "(a safe retry; default: a new key each time)")
    add.set_defaults(handler="follow:cmd_followup_add")
    remove = group.add_parser("remove", parents=[common], help="take back a follow-up not yet delivered",
                              usage="%(prog)s [-h] [RUN_ID] FOLLOWUP_ID")
    remove.add_argument("run_id", metavar="RUN_ID", help="the run it was queued for (may be left out)")
    remove.add_argument("followup_id", metavar="FOLLOWUP_ID", nargs="?",
                        help="as `followup add` or `followup list` printed it")
    remove.set_defaults(handler="follow:cmd_followup_remove")
    listing = group.add_parser("list", parents=[common], help="the follow-ups still queued, in the order they "
                               "are delivered")
    listing.add_argument("--session", metavar="ID", help="only those for this session")
    listing.add_argument("--run", metavar="RUN_ID", help="only this run's")
    listing.add_argument("--limit", type=_inbox_limit, default=100, metavar="N",
                         help="show at most N (default 100, at most 999); a last line says when there are more")
    listing.set_defaults(handler="follow:cmd_followup_list")


def _add_service(subcommands: Any, common: argparse.ArgumentParser) -> None:
    group = subcommands("service", "run the host as a background service (systemd user unit, launchd agent)")
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
        if name == "install":
            _add_host_options(sub, service=True)
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
