"""A real host: end-to-end runs, worker claim-to-ready, run.status round trip, `piwf status`."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import psutil

import measure_echo
from piwf.client import Client, make_request
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from piwf.store.sqlite import Database
from piwf.wire import encode_line

NOOP = """
    from piwf import Workflow, compute

    workflow = Workflow(name="noop", start_at="only", nodes={"only": compute(lambda ctx: {})})
"""
# The same one-node workflow run by warm workers (issue 24's reuse_worker=True): one
# worker process runs run after run instead of a fresh fork per run.
NOOP_WARM = """
    from piwf import Workflow, compute

    workflow = Workflow(name="noop_warm", start_at="only", nodes={"only": compute(lambda ctx: {})},
                        reuse_worker=True)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@contextmanager
def running_host(durability: str, max_workers: int, worker_start: str = "fork", extra: tuple[str, ...] = ()
                 ) -> Iterator[tuple[StatePaths, Path, subprocess.Popen[bytes]]]:
    """A `piwf serve` on a fresh state directory, with a one-node project beside it."""
    with tempfile.TemporaryDirectory(prefix="piwf-bench-") as tmp:
        root = Path(tmp)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "noop.py").write_text(textwrap.dedent(NOOP))
        (project / ".piwf" / "workflows" / "noop_warm.py").write_text(textwrap.dedent(NOOP_WARM))
        paths = StatePaths.resolve(root / "state")
        host = subprocess.Popen(
            [sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root), "--durability", durability,
             "--max-workers", str(max_workers), "--worker-start", worker_start, *extra],
            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            _wait_serving(paths, host)
            yield paths, project, host
        finally:
            host.terminate()
            host.wait(timeout=60)


def _wait_serving(paths: StatePaths, host: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if host.poll() is not None:
            raise RuntimeError(f"piwf serve exited with {host.returncode}")
        try:
            with Client(paths, timeout=5) as client:
                if client.call("host.status").outcome == "accepted":
                    return
        except HostUnavailable:
            time.sleep(0.01)
    raise RuntimeError("piwf serve did not answer within 30 s")


def _iso_ms(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000


def end_to_end(durability: str, max_workers: int, n: int, worker_start: str = "fork",
               extra: tuple[str, ...] = (), workflow: str = "noop", clients: int = 1) -> dict[str, Any]:
    """N one-node runs started over the socket and completed by workers (``workflow``:
    ``noop``, a fresh process per run, or ``noop_warm``, warm workers).

    Throughput is N over the span from the first run's creation to the last one's
    completion, both stamped by the host; latency is each run's creation to completion.
    One client (the default) sends each ``run.start`` after the reply to the one before;
    ``clients`` > 1 starts the runs over that many connections at once, each starting its
    share one after another (as several agents would), so starts can share an fsync.
    """
    with running_host(durability, max_workers, worker_start, extra) as (paths, project, host):
        payload = {"workflow": workflow, "projectPath": str(project)}
        with Client(paths, timeout=120) as client:
            warm = client.call("run.start", payload=payload).receipt["runId"]  # the catalog caches the workflow
            client.call("run.wait", run_id=warm)
            cpu_before = _cpu_s(host.pid)
            ids = _start_runs(paths, payload, n, clients, client)
            finished = [client.call("run.wait", run_id=run_id).receipt for run_id in ids]
            host_cpu_ms = (_cpu_s(host.pid) - cpu_before) * 1000 / n
        claim_to_ready = {} if extra else _claim_to_ready(paths, set(ids))  # from the SQLite file
    assert all(run["status"] == "completed" for run in finished)
    created = [_iso_ms(run["createdAt"]) for run in finished]
    ended = [_iso_ms(run["finishedAt"]) for run in finished]
    latency = [e - c for c, e in zip(created, ended, strict=True)]
    span_s = (max(ended) - min(created)) / 1000
    return {"per_s": n / span_s, "n": n, "max_workers": max_workers, "clients": clients,
            "latency_p50_ms": percentile(latency, 0.5), "latency_p99_ms": percentile(latency, 0.99),
            "host_cpu_ms_per_run": host_cpu_ms, **claim_to_ready}


def _start_runs(paths: StatePaths, payload: dict[str, Any], n: int, clients: int, client: Client) -> list[str]:
    if clients <= 1:
        return [client.call("run.start", payload=payload).receipt["runId"] for _ in range(n)]

    def share(count: int) -> list[str]:
        with Client(paths, timeout=120) as own:
            return [own.call("run.start", payload=payload).receipt["runId"] for _ in range(count)]

    counts = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return [run_id for ids in pool.map(share, counts) for run_id in ids]


def _cpu_s(pid: int) -> float:
    """The process's own CPU time (user + system), not its children's: the host alone."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def one_at_a_time(durability: str, n: int) -> dict[str, Any]:
    """Runs started one after another on an otherwise idle host: what a single run waits."""
    with running_host(durability, 8) as (paths, project, _):
        payload = {"workflow": "noop", "projectPath": str(project)}
        latencies, ids = [], []
        with Client(paths, timeout=120) as client:
            for _ in range(n + 1):
                began = time.perf_counter()
                run_id = client.call("run.start", payload=payload).receipt["runId"]
                assert client.call("run.wait", run_id=run_id).receipt["status"] == "completed"
                latencies.append((time.perf_counter() - began) * 1000)
                ids.append(run_id)
        figures = _claim_to_ready(paths, set(ids[1:]))  # the first one warms the catalog
    return {"start_to_completed_p50_ms": percentile(latencies[1:], 0.5), "n": n, **figures}


def _claim_to_ready(paths: StatePaths, run_ids: set[str]) -> dict[str, float]:
    """From the host's worker records: claimed (worker record written) to worker.ready.
    The records keep milliseconds, so these figures have 1 ms resolution."""
    db = Database.open_readonly(paths.db)
    try:
        rows = db.execute("SELECT run_id, ready_at - started_at FROM run_workers WHERE ready_at IS NOT NULL")
        values = [float(delta) for run_id, delta in rows if run_id in run_ids]
    finally:
        db.close()
    return {"claim_to_ready_p50_ms": percentile(values, 0.5), "claim_to_ready_p99_ms": percentile(values, 0.99)}


def status_round_trip(durability: str, n: int) -> dict[str, Any]:
    """`run.status` of one completed run, one client, sequential requests; beside it, in
    interleaved blocks, the same raw client against piwf and against a bare trio echo
    server (the floor: what any trio server on a Unix socket costs)."""
    with running_host(durability, 2) as (paths, project, _), Client(paths) as client:
        run_id = client.call("run.start", payload={"workflow": "noop", "projectPath": str(project)}).receipt["runId"]
        client.call("run.wait", run_id=run_id)
        times = []
        for _ in range(n):
            began = time.perf_counter()
            client.call("run.status", run_id=run_id)
            times.append((time.perf_counter() - began) * 1e6)
        line = encode_line(make_request("run.status", client_id="bench", run_id=run_id, request_id="rtt"))
        raw, echo = _raw_and_echo(str(paths.socket), line, n, paths.root.parent / "echo.sock")
    return {"p50_us": percentile(times, 0.5), "p99_us": percentile(times, 0.99), "n": n,
            "raw_p50_us": percentile(raw, 0.5), "echo_p50_us": percentile(echo, 0.5),
            "echo_p99_us": percentile(echo, 0.99), "vs_echo": percentile(raw, 0.5) / percentile(echo, 0.5)}


def _raw_and_echo(host_socket: str, line: bytes, n: int, echo_socket: Path) -> tuple[list[float], list[float]]:
    server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "measure_echo.py"), str(echo_socket)],
                              stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        raw: list[float] = []
        echo: list[float] = []
        block = max(1, n // 10)
        for _ in range(10):
            raw += measure_echo.round_trips(host_socket, line, block)
            echo += measure_echo.round_trips(str(echo_socket), line, block)
    finally:
        server.kill()
        server.wait()
    return raw, echo


def cli_status(n: int) -> dict[str, Any]:
    """`piwf status` as a whole process, host running."""
    with running_host("normal", 2) as (paths, _, _):
        times = []
        for _ in range(n):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "piwf", "status", "--state-dir", str(paths.root)],
                           check=True, capture_output=True)
            times.append((time.perf_counter() - began) * 1000)
    return {"p50_ms": statistics.median(times), "n": n}
