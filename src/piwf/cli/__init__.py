"""``piwf``: argument parsing and printing; talks to the host through ``client``.

Heavy modules (trio, the host, the engine) are imported only by the commands that use
them, so ``piwf status`` stays quick. Every failure is one line on stderr (``piwf: ...``)
and an exit code from ``errors.ExitCode``; with ``--json`` also one JSON document on stdout,
``{"outcome", "error", "exitCode"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from piwf.cli.common import _emit
from piwf.cli.parser import build_parser
from piwf.errors import ExitCode, HostReplied, InternalError, PiwfError, UsageError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv  # until the arguments are parsed: a usage error has no args
    try:
        args = build_parser(argv).parse_args(argv)
        as_json = args.json
        _check_text(args)
        return run_handler(args) or 0
    except PiwfError as exc:
        return fail(exc, as_json)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `piwf ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushed at exit without a second error
        return 0
    except OSError as exc:  # a file or socket piwf did not expect to be refused
        return fail(PiwfError(str(exc)), as_json)
    except Exception as exc:  # a bug: one line all the same, and an exit code of its own
        return fail(InternalError(f"internal error: {type(exc).__name__}: {exc}"), as_json)


def run_handler(args: argparse.Namespace) -> int:
    """Import the command's module (``"module:function"``, a module of ``piwf.cli``) and run it."""
    module, function = args.handler.split(":")
    handler = getattr(importlib.import_module(f"piwf.cli.{module}"), function)
    return int(handler(args) or 0)


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
    from piwf.cli.text import terminal_text

    print(terminal_text(f"piwf: {exc}"), file=sys.stderr)
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


