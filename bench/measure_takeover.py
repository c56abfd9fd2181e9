"""Takeover after SIGKILL of the live host: a waiting standby against a cold start.

Both are timed from the SIGKILL to the first `host.status` the new host answers (the
client polls every 0.5 ms). Cold: a new `piwf serve` is started right after the kill, as
a service manager would. Standby: `piwf serve --standby` was started earlier and said
it is standing by (its imports done, its fork server up).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure_host import percentile
from piwf.client import Client
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths

POLL_S = 0.0005


def takeover(durability: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="piwf-bench-takeover-") as tmp:
        root = Path(tmp)
        paths = StatePaths.resolve(root / "state")
        cold, standby = [], []
        live = _serve(paths, durability, root / "live.log")
        try:
            _wait_pid(paths, live.pid, time.perf_counter())
            for i in range(n):
                spare = _serve(paths, durability, root / f"standby-{i}.log", "--standby")
                _wait_standing_by(root / f"standby-{i}.log", spare)
                began = _kill(live)
                standby.append(_wait_pid(paths, spare.pid, began))
                live = spare
                began = _kill(live)
                live = _serve(paths, durability, root / f"cold-{i}.log")
                cold.append(_wait_pid(paths, live.pid, began))
        finally:
            live.kill()
            live.wait()
    return {"standby_p50_ms": percentile(standby, 0.5), "standby_max_ms": max(standby),
            "cold_p50_ms": percentile(cold, 0.5), "cold_max_ms": max(cold), "n": n}


def _serve(paths: StatePaths, durability: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root),
                                 "--durability", durability, *extra], stdout=handle, stderr=handle)


def _kill(process: subprocess.Popen[bytes]) -> float:
    began = time.perf_counter()
    process.send_signal(signal.SIGKILL)
    process.wait()
    return began


def _wait_standing_by(log: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while b"standing by" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the standby did not stand by: {log.read_text()[-2000:]}")
        time.sleep(0.01)
    time.sleep(0.3)  # its fork server starting beside it (~200 ms) is not on the clock


def _wait_pid(paths: StatePaths, pid: int, began: float) -> float:
    """Milliseconds from ``began`` until the host with ``pid`` answers ``host.status``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with Client(paths, timeout=5) as client:
                if client.call("host.status").receipt["pid"] == pid:
                    return (time.perf_counter() - began) * 1000
        except (HostUnavailable, OSError):
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"host {pid} did not answer within 30 s")
