"""Several hosts on one PostgreSQL (issue 21): runs/s with 1, 2 and 3 hosts x --max-workers,
DBOS on the same server in the same run.

    python bench/measure_hosts.py [--runs N] [--rounds N] [--hosts 1,2,3] [--workers 2,4,8]
                                  [--plot FILE.png] [--json] [--quick]

Starts a throwaway PostgreSQL (tests/postgres_server.py, fsync on) unless PIWF_TEST_STORE
names one. Each configuration (H hosts, W workers each) gets a fresh schema and H `piwf
serve --store URL --max-workers W` hosts, each with a state directory of its own. One
client starts N one-node runs, spread in turn over the hosts' sockets, then waits for each.
Runs/s is N over the span from the first run's creation to the last one's completion, as
stamped in the store. CPU per run, from the processes' own counters: the hosts (summed),
every piwf process (hosts, fork servers, workers), the PostgreSQL server (all its
processes; not known for a PIWF_TEST_STORE server), and this client. The spread is which
host ran each run (its worker's host epoch). Every configuration and DBOS run once per
round, the order turning each round (the machine's load falls on all alike); the table
shows medians; "cores used" is runs/s times all that CPU per run (how much of the machine the
runs got), "cores cap/s" the runs/s the machine's cores would give at that CPU per run.
Every figure is from this one run on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from measure_host import NOOP, percentile
from piwf.client import Client
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths
from tests.postgres_server import start_server

QUICK = {"runs": 12, "rounds": 1, "hosts": "1,2", "workers": "2"}
FULL = {"runs": 300, "rounds": 3, "hosts": "1,2,3", "workers": "2,4,8"}
DBOS = "dbos"


# --- CPU of process trees ------------------------------------------------------------------------


def tree_cpu_s(pid: int) -> float:
    """CPU (user + system) of a process and its descendants: each live one's own, plus what
    each has reaped of its children (a fork server's ended workers, a postmaster's backends)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def postmaster_pid(server: Any) -> int | None:
    """The throwaway server's postmaster (its data directory's postmaster.pid); None for a
    server PIWF_TEST_STORE names."""
    data = getattr(server, "data", None)
    if data is None:
        return None
    return int((Path(data) / "postmaster.pid").read_text().split()[0])


# --- hosts -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def running_hosts(url: str, count: int, workers: int, root: Path, extra: tuple[str, ...] = ()
                  ) -> Iterator[list[tuple[subprocess.Popen[bytes], StatePaths]]]:
    """``count`` hosts on the store ``url``, each on a state directory of its own, started at
    once; yielded once every one answers."""
    hosts: list[tuple[subprocess.Popen[bytes], StatePaths]] = []
    try:
        for i in range(count):
            state = root / f"host-{i}"
            state.mkdir(parents=True)
            with open(root / f"host-{i}.log", "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "piwf", "serve", "--state-dir", str(state), "--store", url,
                     "--max-workers", str(workers), *extra], stdout=log, stderr=log, start_new_session=True)
            hosts.append((process, StatePaths.resolve(state)))
        for process, paths in hosts:
            _wait_answering(process, paths)
        yield hosts
    finally:
        for process, _ in hosts:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in hosts:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_answering(process: subprocess.Popen[bytes], paths: StatePaths) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = paths.root.with_suffix(".log")
            raise RuntimeError(f"piwf serve exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with Client(paths, timeout=5) as client:
                if client.call("host.status").outcome == "accepted":
                    return
        except (HostUnavailable, OSError):
            time.sleep(0.02)
    raise RuntimeError("piwf serve did not answer within 60 s")


def configuration(base: str, postmaster: int | None, hosts: int, workers: int, n: int,
                  extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """N one-node runs through ``hosts`` hosts of ``workers`` workers each, on a fresh schema."""
    schema = f"hosts_{secrets.token_hex(4)}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with tempfile.TemporaryDirectory(prefix="piwf-bench-hosts-") as tmp:
        root = Path(tmp)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "noop.py").write_text(textwrap.dedent(NOOP))
        payload = {"workflow": "noop", "projectPath": str(project)}
        with running_hosts(url, hosts, workers, root, extra) as running, contextlib.ExitStack() as stack:
            clients = [stack.enter_context(Client(paths, timeout=300)) for _, paths in running]
            warm = [client.call("run.start", payload=payload).receipt["runId"] for client in clients]
            for client, run_id in zip(clients, warm, strict=True):  # each catalog has the workflow
                client.call("run.wait", run_id=run_id)
            epochs = [client.call("host.status").receipt["epoch"] for client in clients]
            cpu = _cpu_sample(running, postmaster)
            ids = [clients[i % hosts].call("run.start", payload=payload).receipt["runId"] for i in range(n)]
            finished = [clients[i % hosts].call("run.wait", run_id=run_id).receipt for i, run_id in enumerate(ids)]
            cpu = {name: (after - cpu[name]) * 1000 / n for name, after in _cpu_sample(running, postmaster).items()}
        spread = _spread(url, ids, epochs)
    assert all(run["status"] == "completed" for run in finished), [r["status"] for r in finished]
    created = [measure_host._iso_ms(run["createdAt"]) for run in finished]
    ended = [measure_host._iso_ms(run["finishedAt"]) for run in finished]
    latency = [e - c for c, e in zip(created, ended, strict=True)]
    total = cpu["piwf"] + cpu.get("postgres", 0.0) + cpu["client"]
    return {"hosts": hosts, "workers": workers, "n": n, "per_s": n / ((max(ended) - min(created)) / 1000),
            "latency_p50_ms": percentile(latency, 0.5), "host_cpu_ms_per_run": cpu["hosts"],
            "piwf_cpu_ms_per_run": cpu["piwf"], "postgres_cpu_ms_per_run": cpu.get("postgres"),
            "client_cpu_ms_per_run": cpu["client"], "cpu_ms_per_run": total,
            "cores_bound_per_s": (os.cpu_count() or 1) * 1000 / total, "spread": spread}


def _cpu_sample(running: list[tuple[subprocess.Popen[bytes], StatePaths]], postmaster: int | None
                ) -> dict[str, float]:
    own = [measure_host._cpu_s(process.pid) for process, _ in running]
    sample = {"hosts": sum(own), "piwf": sum(tree_cpu_s(process.pid) for process, _ in running),
              "client": time.process_time()}
    if postmaster is not None:
        sample["postgres"] = tree_cpu_s(postmaster)
    return sample


def _spread(url: str, run_ids: list[str], epochs: list[int]) -> list[int]:
    """How many of the runs each host ran (by its epoch on their workers' records)."""
    base, schema = url.rsplit("&schema=", 1) if "&schema=" in url else url.rsplit("?schema=", 1)
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {schema}")
        rows = conn.execute("SELECT host_epoch, count(DISTINCT run_id) FROM run_workers WHERE run_id = ANY(%s) "
                            "GROUP BY host_epoch", (run_ids,)).fetchall()
    ran = dict(rows)
    return [int(ran.get(epoch, 0)) for epoch in epochs]


# --- rounds ------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, base: str, postmaster: int | None) -> dict[str, Any]:
    import measure_pg

    sides: dict[str, Callable[[], Any]] = {
        f"{h}x{w}": (lambda h=h, w=w: configuration(base, postmaster, h, w, args.runs, args.serve))
        for h in args.hosts for w in args.workers}
    sides[DBOS] = lambda: measure_pg._dbos(base, args.runs)
    got: dict[str, list[Any]] = {side: [] for side in sides}
    order = list(sides)
    for round_ in range(args.rounds):
        turn = round_ * len(order) // args.rounds
        for side in order[turn:] + order[:turn]:
            progress(f"round {round_ + 1}/{args.rounds}: {side}")
            got[side].append(sides[side]())
    dbos_rounds = got.pop(DBOS)
    failed = [value for value in dbos_rounds if isinstance(value, str)]
    dbos: dict[str, Any] = ({"not_measured": failed[0]} if failed else
                            {"per_s": statistics.median(dbos_rounds), "per_s_rounds": dbos_rounds})
    rows = [_median_row(rounds) for rounds in got.values()]
    if "per_s" in dbos:
        for row in rows:
            row["vs_dbos"] = row["per_s"] / dbos["per_s"]
    return {"runs": args.runs, "rounds": args.rounds, "cpus": os.cpu_count(), "configurations": rows,
            "dbos": dbos, "serve_options": list(args.serve),
            "load_average": {"before": args.load_before, "after": list(os.getloadavg())},
            "postgres": "throwaway (tests/postgres_server.py, fsync on)" if postmaster else "PIWF_TEST_STORE"}


def _median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"hosts": rounds[0]["hosts"], "workers": rounds[0]["workers"], "n": rounds[0]["n"]}
    for key in ("per_s", "latency_p50_ms", "host_cpu_ms_per_run", "piwf_cpu_ms_per_run", "postgres_cpu_ms_per_run",
                "client_cpu_ms_per_run", "cpu_ms_per_run", "cores_bound_per_s"):
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    row["per_s_rounds"] = [r["per_s"] for r in rounds]
    row["spread_rounds"] = [r["spread"] for r in rounds]
    return row


# --- output --------------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    load = results["load_average"]
    lines = [f"{results['runs']} one-node runs per configuration, {results['rounds']} rounds (medians), "
             f"{results['cpus']} cpus, load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after; "
             f"PostgreSQL: {results['postgres']}"
             + (f"; hosts started with {' '.join(results['serve_options'])}" if results.get("serve_options") else ""),
             "",
             f"{'hosts':>5} {'workers':>7} {'runs/s':>8} {'vs DBOS':>8} {'p50 ms':>7} "
             f"{'CPU ms per run: hosts':>22} {'piwf':>6} {'postgres':>9} {'client':>7} {'all':>6} {'cores used':>10} "
             f"{'cores cap/s':>11}  runs each host ran (round 1)"]
    for row in results["configurations"]:
        lines.append(f"{row['hosts']:5d} {row['workers']:7d} {row['per_s']:8.1f} {_num(row.get('vs_dbos'), 'x'):>8} "
                     f"{row['latency_p50_ms']:7.0f} {row['host_cpu_ms_per_run']:22.2f} "
                     f"{row['piwf_cpu_ms_per_run']:6.2f} {_num(row['postgres_cpu_ms_per_run'], ''):>9} "
                     f"{row['client_cpu_ms_per_run']:7.2f} {row['cpu_ms_per_run']:6.2f} "
                     f"{row['per_s'] * row['cpu_ms_per_run'] / 1000:10.2f} {row['cores_bound_per_s']:11.0f}  "
                     f"{'/'.join(map(str, row['spread_rounds'][0]))}")
    dbos = results["dbos"]
    lines += ["", "DBOS on the same PostgreSQL server (a database of its own; one-step workflows): "
              + (f"{dbos['per_s']:.1f} runs/s" if "per_s" in dbos else dbos["not_measured"])]
    if "plot" in results:
        lines.append(f"plot: {results['plot']}")
    return "\n".join(lines)


def _num(value: float | None, unit: str) -> str:
    return "—" if value is None else f"{value:.2f}{unit}"


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configurations"]
    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for hosts in sorted({row["hosts"] for row in rows}):
        mine = [row for row in rows if row["hosts"] == hosts]
        rate.plot([r["workers"] for r in mine], [r["per_s"] for r in mine], marker="o",
                  label=f"{hosts} host{'s' if hosts > 1 else ''}")
    if "per_s" in results["dbos"]:
        rate.axhline(results["dbos"]["per_s"], color="grey", linestyle="--", label="DBOS, same server")
    workers = sorted({row["workers"] for row in rows})
    rate.set_ylim(bottom=0)
    rate.set_xscale("log", base=2)
    rate.set_xticks(workers, [str(w) for w in workers])
    rate.set_xlabel("--max-workers per host")
    rate.set_ylabel("one-node runs completed per second")
    rate.set_title(f"piwf hosts on one PostgreSQL ({results['cpus']} cores)")
    rate.legend()
    rate.grid(alpha=0.3)
    labels = [f"{r['hosts']}x{r['workers']}" for r in rows]
    hosts = [r["host_cpu_ms_per_run"] for r in rows]
    rest = [r["piwf_cpu_ms_per_run"] - r["host_cpu_ms_per_run"] for r in rows]
    postgres = [r["postgres_cpu_ms_per_run"] or 0.0 for r in rows]
    cpu.bar(labels, hosts, label="hosts")
    cpu.bar(labels, rest, bottom=hosts, label="fork servers + workers")
    cpu.bar(labels, postgres, bottom=[a + b for a, b in zip(hosts, rest, strict=True)], label="PostgreSQL")
    cpu.set_xlabel("hosts x --max-workers")
    cpu.set_ylabel("CPU ms per run")
    cpu.set_title("where the CPU of a run goes")
    cpu.legend()
    cpu.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, help=f"runs per configuration (default {FULL['runs']})")
    parser.add_argument("--rounds", type=int, help=f"rounds, their order turning (default {FULL['rounds']})")
    parser.add_argument("--hosts", type=_counts, help=f"host counts (default {FULL['hosts']})")
    parser.add_argument("--workers", type=_counts, help=f"--max-workers of each host (default {FULL['workers']})")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw runs/s and CPU per run")
    parser.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    parser.add_argument("--poll-only", dest="serve", action="store_const", const=("--poll-only",), default=(),
                        help="start the hosts with --poll-only (no wake-ups from the others: what they cost)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small counts: {QUICK['runs']} runs, hosts {QUICK['hosts']}, workers {QUICK['workers']}, "
                             "1 round")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name in ("runs", "rounds"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    for name in ("hosts", "workers"):
        if getattr(args, name) is None:
            setattr(args, name, _counts(str(defaults[name])))
    args.load_before = list(os.getloadavg())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    server = None
    base = os.environ.get("PIWF_TEST_STORE")
    if not base:
        server = start_server(fsync=True)
        if server is None:
            raise SystemExit("no PostgreSQL here: apt-get install postgresql, or set PIWF_TEST_STORE")
        base = server.url()
    try:
        results = measure(args, base, postmaster_pid(server))
    finally:
        if server is not None:
            server.stop("fast")
            server.remove()
    if args.plot:
        plot(results, args.plot)
        results["plot"] = str(args.plot)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
