"""Partitions and frozen hosts on one PostgreSQL (DESIGN.md §11, host/fence.py): a host whose
database connection is cut, and a host frozen with SIGSTOP. Their workers stop before the
run's claim can expire, no other host runs the step meanwhile, and the run finishes once on
another host; the cut-off host joins again with a new epoch once the store is back.

The step is a shell loop that appends a line tagged with its pid every 50 ms to a file: the
lines of two executions would interleave if they overlapped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from piwf.paths import StatePaths

from .conftest import HostProcess, pg_store_url, piwf, wait_for, write_workflow
from .test_lifecycle import call, start
from .test_store_postgres_faults import server_socket

LEASE = "4"  # seconds: the fence stops a host's work 2.7 s after its last renewal began
STEPS = """
    from piwf import Workflow, shell

    SCRIPT = ('echo "begin $$" >> steps.log; while [ ! -e gate ]; do echo "tick $$" >> steps.log; sleep 0.05; '
              'done; echo "end $$" >> steps.log')

    workflow = Workflow(name="steps", start_at="work", nodes={"work": shell(["sh", "-c", SCRIPT])})
"""


class PartitionProxy:
    """A Unix-socket proxy in front of PostgreSQL that a host connects through. ``cut()``
    is a partition as the host sees it: ``refuse`` drops every connection and refuses new
    ones; ``stall`` keeps them open but passes nothing either way (nor for new ones: a
    black hole, where a call waits with no answer). ``heal()`` lets connections through
    again; a stalled one is reset then, as a healed network resets what it had lost."""

    def __init__(self, server: Path) -> None:
        self.server = server
        self.directory = Path(tempfile.mkdtemp(prefix="piwf-cut-"))  # short: a socket path has ~100 bytes
        self.passing = threading.Event()
        self.passing.set()
        self.mode = "refuse"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.directory / ".s.PGSQL.5432"))
        self.listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self) -> str:
        return f"postgresql://piwf@/postgres?host={self.directory}&port=5432&connect_timeout=2"

    def cut(self, mode: str = "refuse") -> None:
        self.mode = mode
        self.passing.clear()
        if mode == "refuse":
            self._drop_all()

    def heal(self) -> None:
        self._drop_all()
        self.passing.set()

    def close(self) -> None:
        self._drop_all()
        self.listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _drop_all(self) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.passing.is_set():
                if self.mode == "refuse":
                    client.close()
                else:
                    with self._lock:
                        self._sockets.append(client)  # held open, never answered
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.server))
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self.passing.is_set():
                    sink.sendall(data)  # while cut, what either side sends is lost
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(postgres: Any) -> Iterator[PartitionProxy]:
    if not hasattr(postgres, "socket_dir"):
        pytest.skip("a partition needs the tests' own PostgreSQL server (its socket), not PIWF_TEST_STORE")
    cut = PartitionProxy(server_socket(postgres))
    yield cut
    cut.close()


def executions(log: Path) -> list[str]:
    """The pids of the step's executions in the order they began; AssertionError if the
    lines of two of them interleave (they ran at the same time)."""
    pids = [line.split()[1] for line in log.read_text().splitlines()]
    runs = [pid for i, pid in enumerate(pids) if i == 0 or pids[i - 1] != pid]
    assert len(runs) == len(set(runs)), f"two executions of the step overlapped: {runs}"
    return runs


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def claimed_epochs(paths: StatePaths, run_id: str) -> list[int]:
    events = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
    return [e["epoch"] for e in events if e["type"] == "claimed"]


async def first_worker(host: HostProcess, run_id: str, says: str) -> dict[str, Any] | None:
    """The run's first worker record, once it is recorded ended with ``says`` in it."""
    worker = (await call(host.paths, "run.status", run_id=run_id))["workers"][0]
    return worker if worker["status"] == "claimLost" and says in (worker["diagnostic"] or "") else None


async def run_begun_on_first(project: Path, first: HostProcess, second: HostProcess) -> tuple[str, int]:
    """A run started on ``first`` and its step begun there, then ``second`` started; the
    run's id and the pid of its step."""
    write_workflow(project, "steps", STEPS)
    await first.start()
    run_id = await start(first.paths, project, "steps")
    log = project / "steps.log"
    await wait_for(lambda: log.exists() and log.read_text().startswith("begin"))
    await second.start()
    return run_id, int(executions(log)[0])


async def finished_once_on_second(project: Path, second: HostProcess, run_id: str, pid: int) -> None:
    """The step runs again on ``second`` (only once the first execution has gone), and
    the run completes there, once."""
    log = project / "steps.log"
    await wait_for(lambda: len(executions(log)) == 2, timeout=30)
    (project / "gate").touch()
    done = await call(second.paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    runs = executions(log)
    assert runs[0] == str(pid) and len(runs) == 2
    ends = [line for line in log.read_text().splitlines() if line.startswith("end")]
    assert ends == [f"end {runs[1]}"]  # the step's end: once, by the second execution


@pytest.mark.parametrize("cut", ["refuse", "stall"])
async def test_a_host_cut_off_from_postgresql_stops_its_worker_before_the_claim_expires(
    postgres: Any, proxy: PartitionProxy, project: Path, tmp_path: Path,
    host_process: Callable[..., HostProcess], cut: str,
) -> None:
    """``refuse``: every store call fails at once; ``stall``: the host's calls wait for
    answers that never come (its renewals included), so only its own clock can tell."""
    schema = pg_store_url(postgres).rsplit("schema=", 1)[1]
    cut_off = host_process("--store", f"{proxy.url()}&schema={schema}", "--lease", LEASE)
    other = HostProcess(StatePaths.resolve(tmp_path / "state-b"), tmp_path / "host-b.log",
                        "--store", pg_store_url(postgres, schema), "--lease", LEASE)
    try:
        run_id, pid = await run_begun_on_first(project, cut_off, other)
        proxy.cut(cut)
        await wait_for(lambda: not alive(pid), timeout=15)
        # its host says so, whether its fence or the worker's own deadline stopped it first
        await wait_for(lambda: "could not be renewed" in cut_off.log.read_text(), timeout=15)
        await finished_once_on_second(project, other, run_id, pid)
        proxy.heal()
        await wait_for(lambda: "joined again at epoch" in cut_off.log.read_text(), timeout=30)
        # the end its host could not record during the cut, recorded once it is back: why it stopped
        await wait_for(lambda: first_worker(other, run_id, "could not be renewed for"), timeout=30)
        first, second = await claimed_epochs(other.paths, run_id)
        assert first != second
        assert (await call(cut_off.paths, "host.status"))["epoch"] not in (first, second)  # a new epoch
    finally:
        other.signal(signal.SIGTERM)
        await other.wait()


async def test_the_worker_of_a_frozen_host_stops_itself_before_the_claim_expires(
    postgres: Any, project: Path, tmp_path: Path, host_process: Callable[..., HostProcess],
) -> None:
    url = pg_store_url(postgres)
    frozen = host_process("--store", url, "--lease", LEASE)
    other = HostProcess(StatePaths.resolve(tmp_path / "state-b"), tmp_path / "host-b.log",
                        "--store", url, "--lease", LEASE)
    try:
        run_id, pid = await run_begun_on_first(project, frozen, other)
        frozen.signal(signal.SIGSTOP)  # the host alone: its worker is in a process group of its own
        try:
            await wait_for(lambda: not alive(pid), timeout=15)  # the worker killed its step, and itself
            await finished_once_on_second(project, other, run_id, pid)
        finally:
            frozen.signal(signal.SIGCONT)
        await wait_for(lambda: "joined again at epoch" in frozen.log.read_text(), timeout=30)
        await wait_for(lambda: first_worker(other, run_id, "has not vouched for this worker's claim"), timeout=30)
        assert (await call(frozen.paths, "host.status"))["epoch"] not in await claimed_epochs(other.paths, run_id)
    finally:
        other.signal(signal.SIGTERM)
        await other.wait()
