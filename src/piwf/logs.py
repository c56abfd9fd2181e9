"""How ``piwf serve`` logs: text for a person at a terminal, JSON lines for a journal.

Every record carries ``epoch`` (the host's lease epoch, once taken) and ``runId``: given
with ``extra={"runId": ...}``, or read from a message that starts ``"run %s: "``, as
every run event in ``host/`` does, so no call site has to say it twice.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

FORMATS = ("auto", "text", "json")
LEVELS = ("debug", "info", "warning", "error")
RUN_PREFIX = "run %s:"
TEXT_FORMAT = "%(asctime)s piwf[%(process)d] %(levelname)s %(message)s"

_epoch: int | None = None  # one host per process: set once it holds the lease


def set_epoch(epoch: int | None) -> None:
    global _epoch
    _epoch = epoch


class Context(logging.Filter):
    """Adds ``epoch`` and ``runId`` to every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.epoch = _epoch
        if getattr(record, "runId", None) is None:
            record.runId = run_id_of(record)
        return True


def run_id_of(record: logging.LogRecord) -> str | None:
    if isinstance(record.msg, str) and record.msg.startswith(RUN_PREFIX) and record.args:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return str(args[0])
    return None


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ms), ``level``, ``msg``, ``epoch``, ``runId``,
    ``logger``, ``pid``, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _utc(record.created),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
            "epoch": getattr(record, "epoch", None),
            "runId": getattr(record, "runId", None),
            "logger": record.name,
            "pid": record.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def configure(log_format: str = "auto", level: str = "info", stream: TextIO | None = None) -> str:
    """Send piwf's logs to ``stream`` (stderr) in ``log_format``; returns the format chosen."""
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "text" if _is_tty(stream) else "json"
    handler = logging.StreamHandler(stream)
    handler.addFilter(Context())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return log_format


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
