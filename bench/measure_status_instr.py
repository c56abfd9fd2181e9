"""Instructions per `run.status` round trip, the host's against a bare trio echo server's,
counted by valgrind's callgrind: a figure the machine's load does not move.

    python bench/measure_status_instr.py [--before REV] [--calls 500]

Each server runs under `valgrind --tool=callgrind`: a host of this tree (and, with
``--before``, one of REV exported with ``git archive``), serving a completed one-node run
made by an ordinary host first, and bench/measure_echo.py's echo server. After 50 warm-up
round trips the counters are zeroed and dumped twice: over 3 s idle (what the server's own
timers cost a second) and over ``--calls`` round trips (measure_echo.round_trips, the same
raw client measure_cli.py uses). Printed per round trip: the instructions counted, and the
same less the idle rate times the window's length (valgrind runs about 50 times slower, so
the host's timers fall on each request more than they would unobserved).
"""

from __future__ import annotations

import argparse
import glob
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_cli
import measure_echo
import measure_host
from measure_status import export
from piwf.client import Client, make_request
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from piwf.wire import encode_line

ROOT = Path(__file__).resolve().parents[1]


def _callgrind(argv: list[str], out: Path, **popen: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", *argv],
                            stderr=subprocess.DEVNULL, **popen)


def _windows(pid: int, socket_path: str, line: bytes, calls: int, out: Path) -> dict[str, float]:
    measure_echo.round_trips(socket_path, line, 50)

    def window(name: str, act: Any) -> float:
        subprocess.run(["callgrind_control", "--zero", str(pid)], check=True, capture_output=True)
        began = time.monotonic()
        act()
        took = time.monotonic() - began
        subprocess.run(["callgrind_control", f"--dump={name}", str(pid)], check=True, capture_output=True)
        return took

    seconds = {"idle": window("idle", lambda: time.sleep(3)),
               "busy": window("busy", lambda: measure_echo.round_trips(socket_path, line, calls))}
    totals = {}
    for name in glob.glob(f"{out}.*"):
        text = Path(name).read_text(errors="replace")
        for kind in seconds:
            if f"Trigger: dump {kind}" in text[:4000]:
                found = re.search(r"^summary: (\d+)", text, re.M)
                assert found is not None
                totals[kind] = int(found.group(1))
    rate = totals["idle"] / seconds["idle"]
    return {"instr_k": totals["busy"] / calls / 1000,
            "less_idle_k": (totals["busy"] - rate * seconds["busy"]) / calls / 1000, "window_s": seconds["busy"]}


def host_figures(src: Path, root: Path, calls: int) -> dict[str, float]:
    project = root / "project"
    (project / ".piwf" / "workflows").mkdir(parents=True, exist_ok=True)
    (project / ".piwf" / "workflows" / "noop.py").write_text(textwrap.dedent(measure_host.NOOP))
    state = StatePaths.resolve(root / f"state-{abs(hash(src))}")
    plain = measure_cli.start_host(src, state)
    try:
        run_id = measure_cli.completed_run(state, project)
    finally:
        plain.terminate()
        plain.wait(timeout=60)
    out = root / f"host-{abs(hash(src))}.cg"
    host = _callgrind([sys.executable, "-m", "piwf", "serve", "--state-dir", str(state.root), "--durability",
                       "normal", "--max-workers", "2"], out, env=measure_cli.env_for(src), stdout=subprocess.DEVNULL)
    try:
        while True:
            try:
                with Client(state, timeout=120) as client:
                    if client.call("host.status").outcome == "accepted":
                        break
            except HostUnavailable:
                time.sleep(0.5)
        line = encode_line(make_request("run.status", client_id="bench", run_id=run_id, request_id="rtt"))
        return _windows(host.pid, str(state.socket), line, calls, out)
    finally:
        host.terminate()
        host.wait(timeout=300)


def echo_figures(root: Path, calls: int) -> dict[str, float]:
    socket_path, out = root / "echo.sock", root / "echo.cg"
    echo = _callgrind([sys.executable, str(Path(__file__).parent / "measure_echo.py"), str(socket_path)], out,
                      stdout=subprocess.PIPE)
    try:
        assert echo.stdout is not None and echo.stdout.readline() == b"ready\n"
        line = encode_line(make_request("run.status", client_id="bench", run_id="run-0123456789abcdef",
                                        request_id="rtt"))  # the same length as the host's
        return _windows(echo.pid, str(socket_path), line, calls, out)
    finally:
        echo.terminate()
        echo.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="also count the host of this commit")
    parser.add_argument("--calls", type=int, default=500, help="round trips counted per server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="piwf-instr-") as tmp:
        root = Path(tmp)
        figures = {"bare trio echo": echo_figures(root, args.calls)}
        if args.before:
            figures[f"piwf {args.before}"] = host_figures(export(args.before, root), root, args.calls)
        figures["piwf this tree"] = host_figures(ROOT / "src", root, args.calls)
    echo = figures["bare trio echo"]
    print(f"run.status, instructions per round trip (callgrind), {args.calls} per server")
    print(f"{'':22} {'k instr':>8} {'x echo':>7} {'less idle':>10} {'x echo':>7} {'window s':>9}")
    for name, f in figures.items():
        print(f"{name:22} {f['instr_k']:8.1f} {f['instr_k'] / echo['instr_k']:6.2f}x {f['less_idle_k']:10.1f} "
              f"{f['less_idle_k'] / echo['less_idle_k']:6.2f}x {f['window_s']:9.2f}")


if __name__ == "__main__":
    main()
