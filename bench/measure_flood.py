"""What a node writing to stdout as fast as it can costs the host (issue 22, point 8).

    python bench/measure_flood.py                   # 5 s per side, this tree and BEFORE
    python bench/measure_flood.py --seconds 3 --before REF

A real ``piwf serve`` runs one workflow whose compute node prints 64 KiB lines without
end; once the node has started, the host process's CPU time (user + system, psutil) and
its voluntary context switches (its wake-ups) are sampled over ``--seconds``, then the
run is cancelled. "Before" is the code of ``--before`` (default: the commit before the
host paced its reads of worker output), exported with ``git archive`` and run from its
own ``src``; "after" is this tree. A bench, not a timed test: the figures depend on the
machine; the point is the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "7eac5c9"  # before the reads of worker output were paced

FLOOD = '''
import sys
from pathlib import Path
from piwf import Workflow, compute

def flood(ctx):
    Path(ctx.project_path, "flooding").touch()
    line = "x" * 65535 + "\\n"
    while True:
        sys.stdout.write(line)

workflow = Workflow(name="flood", start_at="flood", nodes={"flood": compute(flood)})
'''


def measure(src: Path, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "flood.py").write_text(FLOOD)
        state = root / "state"
        env = {**os.environ, "PYTHONPATH": str(src)}
        cli = [sys.executable, "-m", "piwf"]
        host = subprocess.Popen([*cli, "serve", "--state-dir", str(state)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _until(lambda: b'"running"' in subprocess.run([*cli, "status", "--json", "--state-dir", str(state)],
                                                          env=env, capture_output=True).stdout)
            started = subprocess.run([*cli, "run", "start", "flood", "--project", str(project), "--json",
                                      "--state-dir", str(state)], env=env, capture_output=True)
            if started.returncode:
                raise SystemExit(f"run start failed: {started.stderr.decode()}")
            run_id = json.loads(started.stdout)["runId"]
            _until(lambda: (project / "flooding").exists())
            process = psutil.Process(host.pid)
            cpu0, ctx0, t0 = process.cpu_times(), process.num_ctx_switches(), time.monotonic()
            time.sleep(seconds)
            cpu1, ctx1, t1 = process.cpu_times(), process.num_ctx_switches(), time.monotonic()
            subprocess.run([*cli, "run", "cancel", run_id, "--state-dir", str(state)], env=env, capture_output=True)
        finally:
            host.terminate()
            host.wait(30)
    elapsed = t1 - t0
    used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {"host_cpu_percent": round(100 * used / elapsed, 1),
            "host_wakeups_per_s": round((ctx1.voluntary - ctx0.voluntary) / elapsed)}


def _until(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the host")
        time.sleep(0.05)


def export(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--before", default=BEFORE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = measure(export(args.before, Path(tmp)), args.seconds)
    after = measure(ROOT / "src", args.seconds)
    print(json.dumps({"before": before, "after": after, "seconds": args.seconds}, indent=2))


if __name__ == "__main__":
    main()
