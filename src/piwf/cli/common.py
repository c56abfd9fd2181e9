"""What every ``piwf`` command shares: the client, its timeout and identity, printing,
and argument parsing helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from piwf.cli.text import terminal_text
from piwf.client import Client
from piwf.errors import HostReplied, ProtocolError, UsageError
from piwf.paths import StatePaths
from piwf.wire import HostResponse, decode_json

DEFAULT_TIMEOUT_S = 30.0  # how long the host has to answer one request (--timeout, $PIWF_TIMEOUT)
WAIT_S = 600  # one run.wait request's own limit (the host's maximum)
LOAD_LIMIT_S = 30  # the host's limit on loading a workflow (piwf.host.catalog.INSPECT_TIMEOUT_S; a test checks)
NOTICE_AFTER_S = 0.5  # a wait this long on a terminal is explained (slow_notice)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("must be more than 0 and at most 3600 seconds")
    return value


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def _duration(text: str) -> float:
    """A length of time: seconds (``90``, ``1.5``) or with a unit (``90s``, ``10m``, ``2h``, ``7d``)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in DURATION_UNITS else (text, "s")
    try:
        value = float(number) * DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (like 90, 90s, 10m, 2h or 7d)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be more than 0")
    return value


def _json_arg(text: str, option: str) -> Any:
    """A JSON option value, read as the host reads frames (nesting bounded). A bare word
    (``three``) is refused with what to type instead: a JSON string has its quotes."""
    try:
        return decode_json(text.encode())
    except ProtocolError as exc:
        reason = str(exc).removeprefix("line is not valid JSON: ").removeprefix("JSON is malformed: ")
        bare = text.strip()[:1] not in ("", *'{["-0123456789')
        hint = f"; a JSON string needs its quotes: {_shell_quote(json.dumps(text))}" if bare else ""
        raise UsageError(f"{option} is not valid JSON ({reason}){hint}") from None


def _shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _paths(args: argparse.Namespace) -> StatePaths:
    return StatePaths.resolve(args.state_dir)


def _client(args: argparse.Namespace, default_timeout: float = DEFAULT_TIMEOUT_S) -> Client:
    return Client(_paths(args), timeout=_timeout(args, default_timeout), client_id=client_id())


@contextlib.contextmanager
def slow_notice(text: str, after_s: float = NOTICE_AFTER_S) -> Iterator[None]:
    """On a terminal, say ``text`` on stderr if what the block waits for takes over
    ``after_s``; into a pipe or a file, nothing."""
    if not sys.stderr.isatty():
        yield
        return
    timer = threading.Timer(after_s, lambda: print(f"piwf: {text}", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def client_id() -> str:
    """Who this CLI is to the host: ``$PIWF_CLIENT_ID``, else ``cli:<user>``. It is stable,
    so a command repeated with the same ``--request-id`` is a retry (``adopted``), and a
    decision records a person, not a process, as who answered."""
    given = os.environ.get("PIWF_CLIENT_ID")
    if given:
        return given
    try:
        import getpass

        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return f"cli:uid-{os.getuid()}"



def _timeout(args: argparse.Namespace, default: float = DEFAULT_TIMEOUT_S) -> float:
    if args.timeout is not None:
        return float(args.timeout)
    if not (text := os.environ.get("PIWF_TIMEOUT")):
        return default
    try:
        return _seconds(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"PIWF_TIMEOUT: {exc}") from None


def _ok(response: HostResponse) -> Any:
    if response.outcome not in ("accepted", "adopted"):
        raise HostReplied(response.outcome, response.error)
    return response.receipt


def _print(args: argparse.Namespace, value: Any, human: Any) -> None:
    if args.json:
        _emit(value)
    else:
        text = human(value)
        if text:
            print(terminal_text(text))  # workflow text within it is shown escaped


def _emit(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
