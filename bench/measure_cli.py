"""The CLI's start and a `run.status` round trip (issue 24), before and after, in one run.

    python bench/measure_cli.py                       # against main's c33341d (before this round)
    python bench/measure_cli.py --before REF --rounds 30 --calls 2000 --callgrind

Whole processes, interleaved round by round (bare, before, after, ...): `python -c pass`,
`piwf status` and `piwf run show RUN` against one real `piwf serve` (this tree's; the
protocol is the same), each its wall time and its own CPU time (rusage), medians, and
each against the bare interpreter. ``--callgrind``: the instructions each process
executes (`valgrind --tool=callgrind`, once each), the steadiest figure on a shared
machine. "Before" is ``--before`` exported with ``git archive`` and run from its own
``src`` (``PYTHONPATH``), its bytecode compiled first, as an installed piwf's is.

Then `run.status` of one completed run: the same raw client (bench/measure_echo.py)
against a bare trio echo server, the before host and the after host, in interleaved
blocks; each its round trip p50 and the server's own CPU time per request.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_echo
import measure_host
from measure_status import export
from piwf.client import Client, make_request
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from piwf.wire import encode_line

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "c33341d"  # main before issue 24


def cli_commands(state: StatePaths, run_id: str) -> dict[str, list[str]]:
    piwf = [sys.executable, "-m", "piwf"]
    return {"status": [*piwf, "status", "--state-dir", str(state.root)],
            "run show": [*piwf, "run", "show", run_id, "--state-dir", str(state.root)]}


def env_for(src: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(src)}


def one_process(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and own CPU milliseconds of one whole process (it must succeed)."""
    began = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, argv
    return (time.perf_counter() - began) * 1000, (usage.ru_utime + usage.ru_stime) * 1000


def instructions(argv: list[str], env: dict[str, str]) -> float:
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv], env=env,
                          capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found, done.stderr
    return int(found.group(1)) / 1e6


def measure_processes(variants: dict[str, Path], state: StatePaths, run_id: str, rounds: int,
                      callgrind: bool) -> dict[str, dict[str, Any]]:
    cases = {"python -c pass": ([sys.executable, "-c", "pass"], env_for(ROOT / "src"))}
    for name, src in variants.items():
        for command, argv in cli_commands(state, run_id).items():
            cases[f"piwf {command} ({name})"] = (argv, env_for(src))
    samples: dict[str, list[tuple[float, float]]] = {case: [] for case in cases}
    for _ in range(rounds):
        for case, (argv, env) in cases.items():
            samples[case].append(one_process(argv, env))
    figures = {}
    for case, (argv, env) in cases.items():
        figures[case] = {"wall_ms": statistics.median(w for w, _ in samples[case]),
                         "cpu_ms": statistics.median(c for _, c in samples[case])}
        if callgrind:
            figures[case]["minstr"] = instructions(argv, env)
    return figures


def start_host(src: Path, state: StatePaths) -> subprocess.Popen[bytes]:
    host = subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(state.root),
                             "--durability", "normal", "--max-workers", "2"], env=env_for(src),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(state, timeout=5) as client:
                if client.call("host.status").outcome == "accepted":
                    return host
        except HostUnavailable:
            time.sleep(0.02)
    host.kill()
    raise RuntimeError("piwf serve did not answer within 60 s")


def completed_run(state: StatePaths, project: Path) -> str:
    with Client(state, timeout=120) as client:
        run_id: str = client.call("run.start", payload={"workflow": "noop", "projectPath": str(project)}
                                  ).receipt["runId"]
        client.call("run.wait", run_id=run_id)
    return run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of whole processes")
    parser.add_argument("--calls", type=int, default=2000, help="run.status round trips per server")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions (valgrind)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="piwf-cli-") as tmp:
        root = Path(tmp)
        variants = {"before": export(args.before, root), "after": ROOT / "src"}
        for src in variants.values():
            compileall.compile_dir(str(src), quiet=1)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "noop.py").write_text(measure_host.textwrap.dedent(measure_host.NOOP))
        states = {name: StatePaths.resolve(root / f"state-{name}") for name in variants}
        hosts = {name: start_host(src, states[name]) for name, src in variants.items()}
        echo_socket = root / "echo.sock"
        echo = subprocess.Popen([sys.executable, str(Path(__file__).parent / "measure_echo.py"), str(echo_socket)],
                                stdout=subprocess.PIPE)
        try:
            assert echo.stdout is not None and echo.stdout.readline() == b"ready\n"
            run_ids = {name: completed_run(states[name], project) for name in variants}
            processes = measure_processes(variants, states["after"], run_ids["after"], args.rounds, args.callgrind)
            line = encode_line(make_request("run.status", client_id="bench", run_id=run_ids["after"],
                                            request_id="rtt"))  # the echo server's
            lines = {name: encode_line(make_request("run.status", client_id="bench", run_id=run_ids[name],
                                                    request_id="rtt")) for name in variants}
            assert len({len(v) for v in lines.values()}) == 1  # the same request, byte for byte but the id
            servers = {"bare trio echo": (str(echo_socket), echo.pid),
                       **{f"piwf {name}": (str(states[name].socket), hosts[name].pid) for name in variants}}
            trips = _interleaved(servers, lines, line, args.calls)
        finally:
            echo.kill()
            for host in hosts.values():
                host.terminate()
                host.wait(timeout=60)
    report(args, processes, trips)


def _interleaved(servers: dict[str, tuple[str, int]], lines: dict[str, bytes], line: bytes,
                 calls: int) -> dict[str, dict[str, Any]]:
    """Each server its own run's request (the same bytes but the run id), blocks interleaved."""
    times: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, float] = dict.fromkeys(servers, 0.0)
    block = max(1, calls // 20)
    for name, (socket_path, _) in servers.items():  # warm: the statement cache, the first pages
        measure_echo.round_trips(socket_path, lines.get(name.removeprefix("piwf "), line), 50)
    for _ in range(20):
        for name, (socket_path, pid) in servers.items():
            own = lines.get(name.removeprefix("piwf "), line)
            before = measure_host._cpu_s(pid)
            times[name] += measure_echo.round_trips(socket_path, own, block)
            cpu[name] += measure_host._cpu_s(pid) - before
    return {name: {"p50_us": measure_host.percentile(times[name], 0.5),
                   "cpu_us": cpu[name] * 1e6 / len(times[name])} for name in servers}


def report(args: argparse.Namespace, processes: dict[str, dict[str, Any]], trips: dict[str, dict[str, Any]]) -> None:
    bare = processes["python -c pass"]
    load = os.getloadavg()[0]
    print(f"whole processes, median of {args.rounds} interleaved rounds (load average {load:.1f}); "
          f"before = {args.before}")
    head = f"{'':34} {'wall ms':>8} {'x bare':>7} {'CPU ms':>7} {'x bare':>7}"
    print(head + (f" {'Minstr':>7} {'x bare':>7}" if args.callgrind else ""))
    for case, f in processes.items():
        row = (f"{case:34} {f['wall_ms']:8.1f} {f['wall_ms'] / bare['wall_ms']:6.2f}x {f['cpu_ms']:7.1f} "
               f"{f['cpu_ms'] / bare['cpu_ms']:6.2f}x")
        if args.callgrind:
            row += f" {f['minstr']:7.1f} {f['minstr'] / bare['minstr']:6.2f}x"
        print(row)
    echo = trips["bare trio echo"]
    print(f"\nrun.status round trip, raw client, {args.calls} per server in 20 interleaved blocks")
    print(f"{'':20} {'p50 µs':>8} {'x echo':>7} {'server CPU µs':>14} {'x echo':>7}")
    for name, f in trips.items():
        print(f"{name:20} {f['p50_us']:8.1f} {f['p50_us'] / echo['p50_us']:6.2f}x {f['cpu_us']:14.1f} "
              f"{f['cpu_us'] / echo['cpu_us']:6.2f}x")


if __name__ == "__main__":
    main()
