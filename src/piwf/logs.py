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

import msgspec

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
    ``logger``, ``pid``, and ``exc`` (the traceback) when there is one.

    The line is ``json.dumps(entry, ensure_ascii=False, default=str)``'s, byte for byte
    (tests/test_service_manager.py holds them equal), put together from msgspec's encoding
    of each value (the same escapes, a tenth of the time) when every value is a plain
    ``str``, ``int`` or None; anything else goes through ``json.dumps``."""

    def format(self, record: logging.LogRecord) -> str:
        ts, level, msg = _utc(record.created), record.levelname.lower(), record.getMessage()
        epoch, run_id = getattr(record, "epoch", None), getattr(record, "runId", None)
        name, pid = record.name, record.process
        exc = self.formatException(record.exc_info) if record.exc_info else None
        if (type(epoch) in _PLAIN and type(run_id) in _PLAIN and type(pid) in _PLAIN and type(name) is str
                and type(exc) in _PLAIN):
            e = _encode
            try:
                line = _LINE % (e(ts), e(level), e(msg), e(epoch), e(run_id), e(name), e(pid))
                return (line if exc is None else line[:-1] + b', "exc": ' + e(exc) + b"}").decode()
            except UnicodeEncodeError:  # a lone surrogate: json.dumps writes it as it is
                pass
        entry = {"ts": ts, "level": level, "msg": msg, "epoch": epoch, "runId": run_id, "logger": name, "pid": pid}
        if exc is not None:
            entry["exc"] = exc
        return json.dumps(entry, ensure_ascii=False, default=str)


_LINE = b'{"ts": %s, "level": %s, "msg": %s, "epoch": %s, "runId": %s, "logger": %s, "pid": %s}'
_PLAIN = (str, int, type(None))
_encode = msgspec.json.Encoder().encode


_second: tuple[int, str] = (-1, "")  # the last second formatted, and its text


def _utc(created: float) -> str:
    """``created`` as ``YYYY-MM-DDTHH:MM:SS.mmmZ``; each second formatted once."""
    global _second
    whole = int(created)
    second = _second  # read once: a store thread may log at the same time
    if second[0] != whole:
        second = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)))
    return second[1] + f".{int(created % 1 * 1000):03d}Z"


def configure(log_format: str = "auto", level: str = "info", stream: TextIO | None = None) -> str:
    """Send piwf's logs to ``stream`` (stderr) in ``log_format``; returns the format chosen."""
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "text" if _is_tty(stream) else "json"
    handler = logging.StreamHandler(stream)
    handler.addFilter(Context())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    # What neither format shows is not gathered for each record (the logging HOWTO's
    # "Optimization"): the calling frame (file, line, function), the thread, the process name.
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return log_format


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
