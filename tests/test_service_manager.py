"""``piwf serve`` under a service manager (DESIGN.md §10, issue 12), with real processes:
sd_notify on a test datagram socket, socket activation from a socket this test holds, JSON
log lines, and ``piwf run logs``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from piwf.client import AsyncClient
from piwf.errors import ExitCode, ServiceError
from piwf.host.notify import Notifier
from piwf.host.server import inherited_listener_fd
from piwf.logs import Context, JsonFormatter
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for, write_workflow

WATCHDOG_USEC = 200_000  # pings every 100 ms


async def launch(host: HostProcess, argv: list[str] | None = None, **options: object) -> HostProcess:
    """Start ``host`` without waiting for it to answer (the fixture still cleans it up)."""
    argv = argv or [sys.executable, "-m", "piwf", "serve", "--state-dir", str(host.paths.root), *host.extra]
    with open(host.log, "ab") as log:
        host.proc = await trio.lowlevel.open_process(argv, stdout=log, stderr=log, start_new_session=True,
                                                     env=host.env, **options)
    return host


# --- sd_notify ------------------------------------------------------------------------------------


def notify_socket(tmp_path: Path, kind: str) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    if kind == "abstract":
        name = f"piwf-test-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name.encode())
        return sock, "@" + name
    sock.bind(str(tmp_path / "notify"))
    return sock, str(tmp_path / "notify")


async def receive(sock: socket.socket, timeout: float) -> list[str] | None:
    """The fields of the next datagram, or None if none came within ``timeout``."""
    with trio.move_on_after(timeout):
        await trio.lowlevel.wait_readable(sock)
        return sock.recv(4096).decode().split("\n")
    return None


async def receive_until(sock: socket.socket, field: str, timeout: float = 20) -> list[list[str]]:
    """Every datagram up to and including the first carrying ``field``."""
    seen: list[list[str]] = []
    with trio.fail_after(timeout):
        while not seen or field not in seen[-1]:
            await trio.lowlevel.wait_readable(sock)
            seen.append(sock.recv(4096).decode().split("\n"))
    return seen


def drain(sock: socket.socket) -> None:
    try:
        while True:
            sock.recv(4096)
    except BlockingIOError:
        pass


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("kind", ["path", "abstract"])
async def test_sd_notify_ready_watchdog_and_stopping(host_process: Callable[..., HostProcess],
                                                     tmp_path: Path, kind: str) -> None:
    sock, address = notify_socket(tmp_path, kind)
    with sock:
        host = await launch(host_process(env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}))
        before = await receive_until(sock, "READY=1")
        assert await host.answers(), "READY=1 came before the socket accepted"
        assert any(f.startswith("STATUS=serving at epoch 1") for f in before[-1])
        assert not any(f.startswith("STATUS=") for message in before[:-1] for f in message)

        pings = []
        while len(pings) < 11:
            message = await receive(sock, 5)
            assert message is not None, "the watchdog pings stopped"
            if "WATCHDOG=1" in message:
                pings.append(trio.current_time())
        mean = (pings[-1] - pings[0]) / 10
        assert 0.07 <= mean <= 0.3, f"WATCHDOG=1 every {mean:.3f} s, not every 0.1 s"

        assert host.proc is not None
        host.signal(signal.SIGSTOP)
        await wait_for(lambda: process_state(host.proc.pid) == "T")
        drain(sock)  # sent before the stop took hold
        assert await receive(sock, 3 * WATCHDOG_USEC / 1e6) is None, "a stopped host still pinged"
        host.signal(signal.SIGCONT)
        assert "WATCHDOG=1" in (await receive_until(sock, "WATCHDOG=1"))[-1]

        host.signal(signal.SIGTERM)
        stopping = (await receive_until(sock, "STOPPING=1"))[-1]
        assert any(f.startswith("STATUS=draining") for f in stopping)
        assert await host.wait() == 0


async def test_serve_without_notify_socket_sends_nothing_and_serves(host_process: Callable[..., HostProcess],
                                                                    paths: StatePaths) -> None:
    host = await host_process(env={"WATCHDOG_USEC": str(WATCHDOG_USEC)}).start()
    assert (await piwf(paths, "status", "--json")).returncode == 0
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0


# --- socket activation -------------------------------------------------------------------------

# As systemd starts a socket-activated service: the socket at fd 3, LISTEN_PID the
# process's own pid (the exec keeps it), LISTEN_FDS=1.
ACTIVATE = """import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
os.execv(sys.executable, [sys.executable, "-m", "piwf", "serve", *sys.argv[2:]])
"""


async def activate(host: HostProcess, sock: socket.socket) -> HostProcess:
    argv = [sys.executable, "-c", ACTIVATE, str(sock.fileno()), "--state-dir", str(host.paths.root)]
    return await launch(host, argv, pass_fds=(sock.fileno(),))


def bound_listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(16)
    return sock


async def test_socket_activation_keeps_clients_across_a_host_restart(
        host_process: Callable[..., HostProcess], paths: StatePaths) -> None:
    paths.ensure()
    with bound_listener(paths.socket) as listener:
        first = await activate(host_process(), listener)
        await wait_for(first.answers)
        status = json.loads((await piwf(paths, "status", "--json")).stdout)
        assert status["state"] == "running" and status["epoch"] == 1
        assert "on the inherited socket" in first.log.read_text()

        first.kill_group()  # SIGKILL: nothing is cleaned up
        await first.wait()
        assert stat.S_ISSOCK(os.lstat(paths.socket).st_mode)
        async with AsyncClient(paths) as waiting:  # lands in the backlog of the socket this test holds
            second = await activate(host_process(), listener)
            with trio.fail_after(20):
                answer = await waiting.call("host.status")
        assert answer.outcome == "accepted" and answer.receipt["epoch"] == 2

        second.signal(signal.SIGTERM)
        assert await second.wait() == 0
        assert stat.S_ISSOCK(os.lstat(paths.socket).st_mode), "the host removed a socket it did not create"


async def test_an_inherited_socket_that_is_not_a_stream_listener_is_refused(
        host_process: Callable[..., HostProcess], paths: StatePaths) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as datagram:
        host = await activate(host_process(), datagram)
        assert await host.wait() == ExitCode.SERVICE
    [line] = [line for line in host.log.read_text().splitlines() if line.startswith("piwf:")]
    assert "not a listening Unix stream socket" in line


# --- logs -----------------------------------------------------------------------------------------

LOUD = """
    from piwf import Workflow, compute, shell

    def speak(ctx):
        print("compute node says hello", flush=True)
        return {"said": ctx.outputs["echo"]["stdout"].strip()}

    workflow = Workflow(
        name="loud",
        start_at="echo",
        nodes={"echo": shell(["echo", "shell node says hello"]), "speak": compute(speak)},
        edges=[("echo", "speak")],
    )
"""


async def test_json_log_lines_carry_run_id_and_run_logs_prints_worker_output(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "loud", LOUD)
    host = await host_process().start()  # stderr is a file: --log-format auto means JSON lines
    run = json.loads((await piwf(paths, "run", "start", "loud", "--wait", "--json", cwd=project)).stdout)
    assert run["output"] == {"said": "shell node says hello"}

    entries = [json.loads(line) for line in host.log.read_text().splitlines() if line.strip()]
    assert all({"ts", "level", "msg", "epoch", "runId"} <= entry.keys() for entry in entries)
    claimed = [e for e in entries if e["runId"] == run["runId"]]
    assert claimed and claimed[0]["msg"].startswith(f"run {run['runId']}: claimed") and claimed[0]["epoch"] == 1

    text = (await piwf(paths, "run", "logs", run["runId"])).stdout.decode()
    assert text.splitlines()[0].startswith("== generation 1, worker ") and "exited (exit 0)" in text
    assert "shell node says hello" in text and "compute node says hello" in text
    logs = json.loads((await piwf(paths, "run", "logs", run["runId"], "--json")).stdout)
    [worker] = logs["workers"]
    assert worker["diagnostic"] == "shell node says hello\ncompute node says hello\n" and worker["exitCode"] == 0
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0


async def test_text_log_format_and_log_level(host_process: Callable[..., HostProcess], paths: StatePaths) -> None:
    host = await host_process("--log-format", "text", "--log-level", "warning").start()
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0
    assert host.log.read_text() == ""  # every line of a clean start and stop is info
    host = await host_process("--log-format", "text").start()
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0
    assert " INFO serving " in host.log.read_text() and not host.log.read_text().startswith("{")



def _old_json_line(record: logging.LogRecord) -> str:
    """The JSON line as the formatter first wrote it: json.dumps of the entry."""
    created = record.created
    entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z",
             "level": record.levelname.lower(), "msg": record.getMessage(), "epoch": getattr(record, "epoch", None),
             "runId": getattr(record, "runId", None), "logger": record.name, "pid": record.process}
    if record.exc_info:
        entry["exc"] = JsonFormatter().formatException(record.exc_info)
    return json.dumps(entry, ensure_ascii=False, default=str)


def test_json_log_lines_are_those_of_json_dumps_byte_for_byte() -> None:
    try:
        raise ValueError("caf\u00e9 \"quoted\"")
    except ValueError:
        exc_info = sys.exc_info()
    formatter = JsonFormatter()
    cases: list[tuple[str, tuple[object, ...], object]] = [
        ("run %s: claimed (generation %d)", ("run-1", 2), None),
        ("tabs\tnewlines\n\x00\x1f\x7f quotes \" \\ caf\u00e9 \u2028 \U0001f600", (), None),
        ("a lone surrogate \udc80 from a file name", (), None),  # json.dumps keeps it; msgspec cannot encode it
        ("failed: %s", ("x",), exc_info),
    ]
    # one second's last millisecond, then the next second's first: each formatted once, never mixed up
    for created in (1_700_000_000.9995, 1_700_000_001.0004, 1_700_000_001.5, 1_700_000_000.25, 0.001):
        for epoch, run_id in ((None, None), (7, None), (True, uuid.UUID(int=5)), ("e", b"bytes")):
            for message, args, exc in cases:
                record = logging.LogRecord("piwf.host", logging.INFO, __file__, 1, message, args, exc)  # type: ignore[arg-type]
                record.created, record.epoch, record.runId = created, epoch, run_id
                assert formatter.format(record) == _old_json_line(record)


# --- what piwf serve reads from a service manager ---------------------------------------------------


def test_watchdog_is_for_this_process_only() -> None:
    mine = Notifier.from_env({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "42"}, 42)
    assert (mine.address, mine.watchdog_s) == ("@x", 0.2)
    other = Notifier.from_env({"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "7"}, 42)
    assert other.watchdog_s is None and not Notifier.from_env({}, 42).enabled


def test_listen_fds_are_for_this_process_and_one_socket_only() -> None:
    assert inherited_listener_fd({"LISTEN_PID": "42", "LISTEN_FDS": "1"}, 42) == 3
    assert inherited_listener_fd({"LISTEN_PID": "7", "LISTEN_FDS": "1"}, 42) is None
    assert inherited_listener_fd({}, 42) is None
    with pytest.raises(ServiceError, match="exactly one socket"):
        inherited_listener_fd({"LISTEN_PID": "42", "LISTEN_FDS": "2"}, 42)


def test_a_run_event_names_its_run_in_the_log_record() -> None:
    record = logging.LogRecord("piwf.host", logging.INFO, __file__, 1, "run %s: claimed (generation %d)",
                               ("run-1", 2), None)
    Context().filter(record)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["runId"] == "run-1" and entry["msg"] == "run run-1: claimed (generation 2)"
    other = logging.LogRecord("piwf.host", logging.INFO, __file__, 1, "serving %s", ("x",), None)
    Context().filter(other)
    assert json.loads(JsonFormatter().format(other))["runId"] is None
