"""Where the host's CPU goes: a real `piwf serve` under cProfile, driven by one client.

    python bench/profile_host.py e2e [N]       # N one-node runs started, then waited for
    python bench/profile_host.py status [N]    # N sequential run.status of one run

Prints the top functions by own time and by cumulative time, and the host's CPU per
operation measured from its rusage (the profiler's own cost included, so read the
shares, not the absolute figures).
"""

from __future__ import annotations

import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from piwf.client import Client

SERVE = """
import cProfile, signal, sys, time
from piwf.cli import main
profiler = cProfile.Profile(time.process_time)
profiler.enable()
try:
    main(["serve", "--state-dir", sys.argv[1], "--durability", sys.argv[2], "--max-workers", "8"])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[3])
"""


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300
    durability = os.environ.get("DURABILITY", "full")
    with tempfile.TemporaryDirectory(prefix="piwf-profile-") as tmp:
        keep = os.environ.get("PROFILE_OUT")
        root = Path(tmp)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "noop.py").write_text(measure_host.textwrap.dedent(measure_host.NOOP))
        paths = measure_host.StatePaths.resolve(root / "state")
        out = root / "host.prof"
        host = subprocess.Popen([sys.executable, "-c", SERVE, str(paths.root), durability, str(out)],
                                stderr=subprocess.DEVNULL)
        measure_host._wait_serving(paths, host)
        payload = {"workflow": "noop", "projectPath": str(project)}
        with Client(paths, timeout=120) as client:
            warm = client.call("run.start", payload=payload).receipt["runId"]
            client.call("run.wait", run_id=warm)
            cpu = measure_host._cpu_s(host.pid)
            began = time.perf_counter()
            if mode == "e2e":
                ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(n)]
                for run_id in ids:
                    client.call("run.wait", run_id=run_id)
            else:
                for _ in range(n):
                    client.call("run.status", run_id=warm)
            elapsed = time.perf_counter() - began
            cpu = measure_host._cpu_s(host.pid) - cpu
        host.send_signal(signal.SIGTERM)
        host.wait(timeout=60)
        print(f"{mode}: {n} in {elapsed:.2f} s; host CPU {cpu * 1000 / n:.3f} ms per operation (profiled)")
        if keep:
            Path(keep).write_bytes(out.read_bytes())
        stats = pstats.Stats(str(out))
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats("piwf|trio_util|msgspec|psutil", 70)


if __name__ == "__main__":
    main()
