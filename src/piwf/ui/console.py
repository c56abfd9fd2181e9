"""``piwf ui``'s process: the web app, its one host connection and one watch, served by
hypercorn's trio worker on 127.0.0.1 (or a Unix socket) behind the guard.

At start it makes a random token, writes the console's address with it to a file only
the user can read (``<state dir>/ui/console-PORT.json``, mode 0600: the token never goes
on a command line) and prints the address; the file is removed when the console stops.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import secrets
import socket
import stat
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette

from piwf.errors import PiwfError, StateDirError, UsageError
from piwf.paths import StatePaths, check_private_dir
from piwf.ui.feed import Feed
from piwf.ui.guard import Guard, new_token
from piwf.ui.hostlink import HostLink
from piwf.wire import check_id

log = logging.getLogger("piwf.ui")
NOTICES_KEPT = 200


@dataclass(frozen=True)
class UiConfig:
    paths: StatePaths
    port: int = 0  # 0: any free port
    socket: Path | None = None  # a Unix socket instead of a port
    answer_as: str | None = None  # the client id answers are recorded under (default ui:<user>)
    session: str | None = None  # the origin session whose requests the console may answer


class Notices:
    """What an action said (its receipt line, or the host's refusal), shown once on the
    page it leads to: the page's address names it by a random id, so no link can make a
    page say what it did not."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, ok: bool, text: str, **extra: Any) -> str:
        """Keep a notice; ``extra``: for an ask's form, ``request``, ``errors`` by field and
        what was ``typed``, so the form shows them again."""
        key = secrets.token_urlsafe(9)
        self._kept[key] = {"ok": ok, "text": text, "request": None, "errors": {}, "typed": {}, **extra}
        while len(self._kept) > NOTICES_KEPT:
            self._kept.popitem(last=False)
        return key

    def pop(self, key: str, default: Any = None) -> Any:
        return self._kept.pop(key, default)


@dataclass
class Console:
    """What every page and action reaches through ``request.app.state.console``."""

    config: UiConfig
    link: HostLink
    feed: Feed
    csrf: str
    notices: Notices = field(default_factory=Notices)

    @property
    def answers_as(self) -> str:
        return self.link.client_id

    def may_answer(self, request: dict[str, Any]) -> bool:
        """A request of a run started by a session is answered here only by a console
        started for that session (``--session``); any other is read-only."""
        origin = request.get("originSessionId")
        return origin is None or origin == self.config.session


def default_client_id() -> str:
    """``ui:<user>``: answers are recorded as the person the console runs as (the CLI
    records ``cli:<user>``)."""
    try:
        return f"ui:{getpass.getuser()}"
    except (KeyError, OSError):
        return f"ui:uid-{os.getuid()}"


def build_app(console: Console, *, token: str, hosts: list[str], cookie: str) -> Guard:
    from piwf.ui import actions, pages

    app = Starlette(routes=[*pages.ROUTES, *actions.ROUTES])
    app.state.console = console
    return Guard(app, token=token, hosts=hosts, cookie=cookie)


def _token_file(paths: StatePaths, name: str) -> Path:
    directory = paths.root / "ui"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"cannot create {directory}: {exc.strerror}") from exc
    check_private_dir(directory)
    return directory / f"console-{name}.json"


def _write_private(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON in a file only the user can read, replacing any earlier one."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.write("\n")
    os.replace(temp, path)


def _listen(config: UiConfig) -> HypercornConfig:
    """Hypercorn's settings with the socket it serves, bound here, so a port in use or a
    socket path taken is one clear line before anything starts (hypercorn owns it then)."""
    hc = HypercornConfig()
    hc.accesslog = None
    hc.errorlog = logging.getLogger("piwf.ui.server")
    hc.graceful_timeout = 2.0
    hc.keep_alive_timeout = 30.0
    sock = _unix_socket(config.socket) if config.socket is not None else _tcp_socket(config.port)
    hc.bind = [f"fd://{sock.detach()}"]
    return hc


def _tcp_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # never another interface
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror} (choose another --port)") from None
    return sock


def _unix_socket(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise UsageError(f"--socket {path}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by a console that is gone
        else:
            raise UsageError(f"--socket {path}: another process listens on it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket: the user's alone (0600) from the moment it exists
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise UsageError(f"--socket {path}: cannot listen there: {exc.strerror}") from None
    finally:
        os.umask(old)
    return sock


async def serve_console(config: UiConfig, *,
                        task_status: trio.TaskStatus[tuple[str, Path]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the console until cancelled; started with its address (token included) and
    the file that holds it."""
    client_id = config.answer_as or default_client_id()
    try:
        check_id(client_id, "--as")
        if config.session is not None:
            check_id(config.session, "--session")
    except Exception as exc:
        raise UsageError(str(exc)) from None
    token = new_token()
    link = HostLink(config.paths, client_id)
    feed = Feed(config.paths, f"{client_id}:watch-{os.getpid()}")
    hc = _listen(config)
    kind = "socket" if config.socket is not None else ""
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.serve)
        await nursery.start(feed.watch_resources)
        guard_holder: list[Guard] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":  # before the guard exists: the app needs no start-up
                await _lifespan(receive, send)
            else:
                await guard_holder[0](scope, receive, send)

        binds = await nursery.start(_serve_http, app, hc)
        hosts, url, name = _addresses(config, kind, binds, token)
        cookie = f"piwf_ui_{name}"
        console = Console(config, link, feed, csrf="")
        guard = build_app(console, token=token, hosts=hosts, cookie=cookie)
        console.csrf = guard.csrf
        guard_holder.append(guard)
        record = _token_file(config.paths, name)
        _write_private(record, {"url": url, "token": token, "pid": os.getpid(), "answersAs": client_id})
        try:
            task_status.started((url, record))
            await trio.sleep_forever()
        finally:
            record.unlink(missing_ok=True)
            if config.socket is not None:
                config.socket.unlink(missing_ok=True)
            with trio.CancelScope(shield=True):
                await link.aclose()


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _addresses(config: UiConfig, kind: str, binds: list[str], token: str) -> tuple[list[str], str, str]:
    """The Host header values to answer to, the address to print, the console's name."""
    if kind == "socket":
        return ["localhost"], f"http://localhost/?token={token}", "socket"
    port = int(binds[0].rsplit(":", 1)[1])
    return [f"127.0.0.1:{port}", f"localhost:{port}"], f"http://127.0.0.1:{port}/?token={token}", str(port)


async def _serve_http(app: Any, hc: HypercornConfig, *,
                      task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn_serve(app, hc, task_status=task_status)  # stopped by cancellation


def run(config: UiConfig) -> int:
    """``piwf ui``: serve until Ctrl-C or SIGTERM; the address goes to stdout."""
    import signal

    logging.basicConfig(level=logging.WARNING, format="piwf ui: %(message)s", stream=sys.stderr)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url, record = await nursery.start(serve_console, config)
            where = f" (on the Unix socket {config.socket})" if config.socket else ""
            print(f"piwf ui: open {url}{where}\n"
                  f"piwf ui: answers as {config.answer_as or default_client_id()}; the address is also in {record}",
                  flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except BaseExceptionGroup as group:  # a refusal at start (port in use, ...) is one line, as for any command
        raise _first_refusal(group) or group from None
    return 0


def _first_refusal(error: BaseException) -> PiwfError | None:
    if isinstance(error, PiwfError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (found := _first_refusal(inner)) is not None:
                return found
    return None
