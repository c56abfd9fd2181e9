"""Claim throughput, side by side in one run: the SQLite limit, piwf's store, piwf end to
end, and peers (Huey, DBOS), under both durability settings.

    python bench/claim_throughput.py            # the full table (a few minutes)
    python bench/claim_throughput.py --quick    # smaller counts, within 60 s
    python bench/claim_throughput.py --json     # the same figures as one JSON document
    python bench/claim_throughput.py --plot throughput.png   # runs/s against --max-workers

Every figure comes from this run on this machine; ratios compare figures of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
import measure_store
import measure_takeover

DURABILITIES = ("normal", "full")
COUNTS = {  # (quick, full)
    "store": (2000, 20000),
    "e2e": (150, 1000),
    "huey": (2000, 20000),
    "dbos": (100, 500),
    "status": (500, 5000),
    "single": (30, 200),
    "cli": (3, 10),
    "takeover": (3, 10),
}
BATCH = 100
CLIENTS = 4  # the extra end-to-end row: runs started over this many connections at once
TARGETS = {
    "store_vs_limit": 0.5,
    "e2e_vs_dbos": 3.0,
    "e2e_runs_per_s": 500.0,
    "claim_to_ready_p50_ms": 15.0,
    "status_p50_us": 150.0,
    "cli_status_ms": 150.0,
    "e2e_full_vs_normal": 0.9,
    "host_cpu_ms_per_run": 1.0,
    "rtt_vs_echo": 1.2,
    "takeover_standby_ms": 50.0,
}
UPPER = {"claim_to_ready_p50_ms", "status_p50_us", "cli_status_ms", "host_cpu_ms_per_run", "rtt_vs_echo",
         "takeover_standby_ms"}


def count(name: str, quick: bool) -> int:
    return COUNTS[name][0 if quick else 1]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "max_workers": args.max_workers,
                               "durability": {}}
    with tempfile.TemporaryDirectory(prefix="piwf-bench-") as tmp:
        root = Path(tmp)
        for durability in DURABILITIES:
            progress(f"durability {durability}")
            results["durability"][durability] = measure_durability(root / durability, durability, args)
    progress("run.status round trip, piwf status")
    results["status_round_trip"] = measure_host.status_round_trip("normal", count("status", args.quick))
    results["cli_status"] = measure_host.cli_status(count("cli", args.quick))
    progress("takeover: standby and cold")
    results["takeover"] = measure_takeover.takeover("full", count("takeover", args.quick))
    results.update(headline(results))
    results["targets"] = check_targets(results, args.max_workers)
    return results


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The issue-13 figures, each from this run."""
    durabilities = results["durability"]
    e2e = {d: durabilities[d]["end_to_end"] for d in DURABILITIES}
    return {
        "e2e_full_vs_normal": e2e["full"]["per_s"] / e2e["normal"]["per_s"],
        "host_cpu_ms_per_run": {d: e2e[d]["host_cpu_ms_per_run"] for d in DURABILITIES},
        "e2e_vs_dbos": {d: e2e[d].get("vs_dbos") for d in DURABILITIES},
        "rtt_vs_echo": results["status_round_trip"]["vs_echo"],
        "takeover_standby_ms": results["takeover"]["standby_p50_ms"],
        "takeover_cold_ms": results["takeover"]["cold_p50_ms"],
    }


def measure_durability(root: Path, durability: str, args: argparse.Namespace) -> dict[str, Any]:
    root.mkdir()
    n = count("store", args.quick)
    figures: dict[str, Any] = {
        "limit_raw_claim": measure_store.raw_claims(root / "raw.db", durability, n),
        "store_claim": measure_store.store_claims(root / "claims.db", durability, n),
        "store_path": measure_store.store_path(root / "store.db", durability, n),
        "store_path_batched": measure_store.store_path(root / "batched.db", durability, n, batch=BATCH),
        "end_to_end": measure_host.end_to_end(durability, args.max_workers, count("e2e", args.quick)),
        "end_to_end_clients": measure_host.end_to_end(durability, args.max_workers, count("e2e", args.quick),
                                                      clients=CLIENTS),
        "one_at_a_time": measure_host.one_at_a_time(durability, count("single", args.quick)),
        "huey": peer("huey", count("huey", args.quick), root, durability),
        "dbos": peer("dbos", count("dbos", args.quick), root, durability),
    }
    limit = figures["limit_raw_claim"]["per_s"]
    for name in ("store_claim", "store_path", "store_path_batched"):
        figures[name]["vs_limit"] = figures[name]["per_s"] / limit
    for e2e in (figures["end_to_end"], figures["end_to_end_clients"]):
        for name in ("huey", "dbos"):
            if "per_s" in figures[name]:
                e2e[f"vs_{name}"] = e2e["per_s"] / figures[name]["per_s"]
    return figures


def peer(name: str, n: int, root: Path, durability: str) -> dict[str, Any]:
    """A peer in a child process of its own; absent peers are reported, not fatal."""
    workdir = root / name
    workdir.mkdir()
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "measure_peers.py"), name, str(n),
                           str(workdir), durability], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        if "ModuleNotFoundError" in last:
            return {"missing": f"{name} is not installed (pip install -e '.[bench]')"}
        return {"error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_targets(results: dict[str, Any], max_workers: int) -> dict[str, Any]:
    normal, full = results["durability"]["normal"], results["durability"]["full"]
    e2e = normal["end_to_end"]
    checks = {
        "store_vs_limit": min(normal["store_path_batched"]["vs_limit"], full["store_path_batched"]["vs_limit"]),
        "e2e_vs_dbos": min(d["end_to_end"].get("vs_dbos", float("nan")) for d in (normal, full)),
        "e2e_runs_per_s": e2e["per_s"] if max_workers == 8 else float("nan"),
        "claim_to_ready_p50_ms": max(normal["end_to_end"]["claim_to_ready_p50_ms"],
                                     full["end_to_end"]["claim_to_ready_p50_ms"]),
        "status_p50_us": results["status_round_trip"]["p50_us"],
        "cli_status_ms": results["cli_status"]["p50_ms"],
        "e2e_full_vs_normal": results["e2e_full_vs_normal"],
        "host_cpu_ms_per_run": max(results["host_cpu_ms_per_run"].values()),
        "rtt_vs_echo": results["rtt_vs_echo"],
        "takeover_standby_ms": results["takeover_standby_ms"],
    }
    return {name: {"value": value, "target": TARGETS[name],
                   "met": (value <= TARGETS[name]) if name in UPPER else (value >= TARGETS[name])}
            for name, value in checks.items()}


def machine() -> dict[str, Any]:
    import apsw

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "sqlite": apsw.sqlite_lib_version(), "processor": platform.processor() or platform.machine()}


def table(results: dict[str, Any]) -> str:
    lines = [f"machine: {results['machine']['cpus']} cpus, {results['machine']['platform']}, "
             f"Python {results['machine']['python']}, SQLite {results['machine']['sqlite']}"
             + (" (quick)" if results["quick"] else ""), ""]
    lines.append(f"{'measure':44} {'normal':>14} {'full':>14}")
    rows = [
        ("limit: raw apsw claim, 1/txn", "limit_raw_claim", "per_s", "/s"),
        ("piwf store: claim only, 1/txn", "store_claim", "per_s", "/s"),
        ("  ratio to the limit", "store_claim", "vs_limit", "x"),
        ("piwf store: claim+running+complete, 1/txn", "store_path", "per_s", "/s"),
        ("  ratio to the limit", "store_path", "vs_limit", "x"),
        (f"piwf store: same, {BATCH} runs per txn", "store_path_batched", "per_s", "/s"),
        ("  ratio to the limit", "store_path_batched", "vs_limit", "x"),
        (f"piwf end to end, {results['max_workers']} workers: runs", "end_to_end", "per_s", "/s"),
        ("  start to completed p50", "end_to_end", "latency_p50_ms", "ms"),
        ("  start to completed p99", "end_to_end", "latency_p99_ms", "ms"),
        ("  worker claim to ready p50", "end_to_end", "claim_to_ready_p50_ms", "ms"),
        ("  worker claim to ready p99", "end_to_end", "claim_to_ready_p99_ms", "ms"),
        ("  host CPU per run", "end_to_end", "host_cpu_ms_per_run", "ms"),
        ("  ratio to Huey", "end_to_end", "vs_huey", "x"),
        ("  ratio to DBOS", "end_to_end", "vs_dbos", "x"),
        (f"extra: the same, started by {CLIENTS} clients at once", "end_to_end_clients", "per_s", "/s"),
        ("  host CPU per run", "end_to_end_clients", "host_cpu_ms_per_run", "ms"),
        ("  ratio to DBOS (DBOS: one caller)", "end_to_end_clients", "vs_dbos", "x"),
        ("piwf one run at a time: start to completed", "one_at_a_time", "start_to_completed_p50_ms", "ms"),
        ("  worker claim to ready p50", "one_at_a_time", "claim_to_ready_p50_ms", "ms"),
        ("Huey SqliteHuey: dequeue + execute", "huey", "per_s", "/s"),
        ("DBOS on SQLite: workflows", "dbos", "per_s", "/s"),
    ]
    for label, section, key, unit in rows:
        cells = [_cell(results["durability"][d][section], key, unit) for d in DURABILITIES]
        lines.append(f"{label:44} {cells[0]:>14} {cells[1]:>14}")
    status = results["status_round_trip"]
    takeover = results["takeover"]
    lines += ["", f"end to end, full against normal: {results['e2e_full_vs_normal']:.2f}x",
              f"run.status round trip: p50 {status['p50_us']:.0f} µs, p99 {status['p99_us']:.0f} µs",
              f"  raw client: piwf p50 {status['raw_p50_us']:.0f} µs, bare trio echo server p50 "
              f"{status['echo_p50_us']:.0f} µs: {status['vs_echo']:.2f}x",
              f"piwf status, whole process: p50 {results['cli_status']['p50_ms']:.0f} ms",
              f"takeover after SIGKILL, to host.status answered: standby p50 {takeover['standby_p50_ms']:.0f} ms "
              f"(max {takeover['standby_max_ms']:.0f}), cold start p50 {takeover['cold_p50_ms']:.0f} ms "
              f"(max {takeover['cold_max_ms']:.0f})"]
    if "scaling" in results:
        lines += ["", f"{'runs/s against --max-workers':44} {'normal':>14} {'full':>14}"]
        for workers, rates in sorted(results["scaling"].items(), key=lambda item: int(item[0])):
            lines.append(f"{workers:>44} {rates['normal']:>12,.0f} /s {rates['full']:>11,.0f} /s")
    lines += ["", "targets:"]
    for name, check in results["targets"].items():
        mark = "met" if check["met"] else "NOT met"
        lines.append(f"  {name:24} {check['value']:10.2f}  (target {check['target']:g})  {mark}")
    return "\n".join(lines)


def _cell(section: dict[str, Any], key: str, unit: str) -> str:
    if "missing" in section or "error" in section:
        return "n/a"
    value = section.get(key)
    if value is None:
        return "n/a"
    return f"{value:.2f}x" if unit == "x" else f"{value:,.0f} {unit}" if unit == "/s" else f"{value:.1f} {unit}"


def plot(path: Path, quick: bool) -> dict[str, dict[str, float]]:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [1, 2, 4, 8, 16]
    fig, ax = plt.subplots(figsize=(6, 4))
    scaling: dict[str, dict[str, float]] = {str(w): {} for w in workers}
    for durability in DURABILITIES:
        rates = []
        for w in workers:
            progress(f"plot: {w} workers, {durability}")
            rates.append(measure_host.end_to_end(durability, w, count("e2e", quick))["per_s"])
            scaling[str(w)][durability] = rates[-1]
        ax.plot(workers, rates, marker="o", label=f"durability {durability}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("--max-workers")
    ax.set_ylabel("one-node runs completed per second")
    ax.set_title("piwf end to end")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return scaling


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: finishes within 60 s")
    parser.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    parser.add_argument("--max-workers", type=int, default=8, help="workers for the end-to-end figure (default 8)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw runs/s against --max-workers")
    args = parser.parse_args(argv)
    results = measure(args)
    if args.plot:
        results["scaling"] = plot(args.plot, args.quick)
        results["plot"] = str(args.plot)
    print(json.dumps(results, indent=2, sort_keys=True) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
