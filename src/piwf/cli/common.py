"""What every ``piwf`` command shares: the client, its timeout and identity, printing,
and argument parsing helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from piwf.cli.text import terminal_text
from piwf.client import Client, Reply
from piwf.errors import HostReplied, ProtocolError, UsageError
from piwf.paths import StatePaths

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: one-shot commands start without it
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

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


def _lease(text: str) -> float:
    """A lease: renewed every sixth of it and its work fenced at two thirds, so at least a
    second (less would have the host renew in a loop and fence its work in milliseconds)."""
    value = _seconds(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1 second")
    return value


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}


def _duration_ms(text: str) -> int:
    """A length of time such as ``30d``, ``12h``, ``90m``, ``45s`` (ms, s, m, h, d, w), in ms:
    at least one second."""
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or None
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS_MS or not value > 0 or value * _UNITS_MS[unit] > 100 * 365 * 86_400_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length of time such as 30d, 12h, 90m or 45s")
    ms = int(value * _UNITS_MS[unit])
    if ms < 1000:
        raise argparse.ArgumentTypeError("must be at least 1s")
    return ms



def _json_arg(text: str, option: str) -> Any:
    """A JSON option value, read as the host reads frames (nesting bounded). A bare word
    (``three``) is refused with what to type instead: a JSON string has its quotes."""
    from piwf.wire import decode_json

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
    import threading

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


def _ok(response: Reply) -> Any:
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
