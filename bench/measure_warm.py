"""Warm workers against a fresh process per run, side by side in one run (issue 24).

    python bench/measure_warm.py            # the table (a few minutes)
    python bench/measure_warm.py --quick    # smaller counts
    python bench/measure_warm.py --json     # the same figures as one JSON document
    python bench/measure_warm.py --tree PATH [--rounds 6] [--probes 30]
        # only the saturated claim-to-ready probe, this tree and PATH's src/ in turns

- end to end: N one-node runs on a real `piwf serve --max-workers 8 --durability normal`,
  a fresh process per run (the plain workflow) and warm workers (the same workflow with
  ``reuse_worker=True``), each against the goal, with Huey (in-process, no step
  durability, `synchronous=NORMAL`) beside them;
- claim to ready while 8 workers saturate both cores: 8 runs whose node spins the CPU
  hold 8 of the host's 10 worker slots; one-node probe runs, fresh and warm in turn, are
  started one at a time, and each probe's claim (its worker record written) to its
  ``worker.ready`` is read from the host's worker records (1 ms resolution); the same
  probes on the idle host beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from claim_throughput import machine, peer
from piwf.client import Client
from piwf.paths import StatePaths
from piwf.store.sqlite import Database

GOALS = {"warm_runs_per_s": 1000.0, "fresh_ready_saturated_ms": 10.0, "warm_ready_saturated_ms": 1.0}
COUNTS = {"e2e": (150, 2000), "huey": (2000, 20000), "probes": (6, 60)}  # (quick, full)
SPINNERS = 8

WORKFLOWS = {
    "noop_warm": """
        from piwf import Workflow, compute

        workflow = Workflow(name="noop_warm", start_at="only", nodes={"only": compute(lambda ctx: {})},
                            reuse_worker=True)
    """,
    "spin": """
        import time
        from piwf import Workflow, compute

        def spin(ctx):
            end = time.monotonic() + ctx.input["seconds"]
            while time.monotonic() < end:
                pass
            return {}

        workflow = Workflow(name="spin", start_at="spin", nodes={"spin": compute(spin)})
    """,
}


def add_workflows(project: Path) -> None:
    for name, source in WORKFLOWS.items():
        (project / ".piwf" / "workflows" / f"{name}.py").write_text(textwrap.dedent(source))


def idle_host_cpu_s() -> float:
    """The CPU of a host's start, one run and stop, with no more runs: taken off the
    end-to-end figures' whole-tree CPU."""
    before = _children_cpu_s()
    with measure_host.running_host("normal", 8) as (paths, project, _):
        add_workflows(project)
        with Client(paths, timeout=120) as client:
            first = client.call("run.start", payload={"workflow": "noop", "projectPath": str(project)})
            client.call("run.wait", run_id=first.receipt["runId"])
    return _children_cpu_s() - before


def end_to_end(workflow: str, n: int, idle_cpu_s: float = 0.0) -> dict[str, Any]:
    """N runs of ``workflow`` submitted at once, then waited for (as measure_host.end_to_end).
    Beside the host's own CPU, the CPU of every piwf process (host, fork server, workers:
    this process's reaped descendants, from its rusage) per run, less ``idle_cpu_s`` (a
    host's start and stop): a figure the other load on the machine moves less than wall
    time, and 2 CPUs over it is the most runs/s two cores could give."""
    tree_before = _children_cpu_s()
    with measure_host.running_host("normal", 8) as (paths, project, host):
        add_workflows(project)
        payload = {"workflow": workflow, "projectPath": str(project)}
        with Client(paths, timeout=120) as client:
            first = client.call("run.start", payload=payload).receipt["runId"]  # the catalog caches the workflow
            client.call("run.wait", run_id=first)
            cpu_before = measure_host._cpu_s(host.pid)
            ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(n)]
            finished = [client.call("run.wait", run_id=run_id).receipt for run_id in ids]
            host_cpu_ms = (measure_host._cpu_s(host.pid) - cpu_before) * 1000 / n
        processes = _worker_processes(paths, set(ids))
    tree_ms = (_children_cpu_s() - tree_before - idle_cpu_s) * 1000 / n
    assert all(run["status"] == "completed" for run in finished)
    created = [measure_host._iso_ms(run["createdAt"]) for run in finished]
    ended = [measure_host._iso_ms(run["finishedAt"]) for run in finished]
    return {"per_s": n / ((max(ended) - min(created)) / 1000), "n": n, "host_cpu_ms_per_run": host_cpu_ms,
            "piwf_cpu_ms_per_run": tree_ms, "cpu_bound_per_s": 2000 / tree_ms, "processes": processes}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _worker_processes(paths: StatePaths, run_ids: set[str]) -> int:
    """How many worker processes executed these runs (distinct pids of their records)."""
    db = Database.open_readonly(paths.db)
    try:
        return len({pid for run_id, pid in db.execute("SELECT run_id, pid FROM run_workers") if run_id in run_ids})
    finally:
        db.close()


def claim_to_ready(probes: int, saturated: bool, worker_nice: int = 10) -> dict[str, Any]:
    """Probes one at a time, fresh and warm in turn, with 8 spinning workers beside them or
    not, on a host started with ``--worker-nice`` (10 is the default, 0 the host's priority)."""
    extra = ("--worker-nice", str(worker_nice))
    with measure_host.running_host("normal", SPINNERS + 2, extra=extra) as (paths, project, _):
        add_workflows(project)
        with Client(paths, timeout=120) as client:
            spinning = [client.call("run.start", payload={"workflow": "spin", "projectPath": str(project),
                                                          "input": {"seconds": 600}}).receipt["runId"]
                        for _ in range(SPINNERS if saturated else 0)]
            _wait_running(client, spinning)
            ids: dict[str, list[str]] = {"noop": [], "noop_warm": []}
            for i in range(probes + 1):
                for workflow in ids:
                    run_id = client.call("run.start", payload={"workflow": workflow,
                                                               "projectPath": str(project)}).receipt["runId"]
                    client.call("run.wait", run_id=run_id)
                    if i:  # the first of each warms the catalog (and starts the warm worker)
                        ids[workflow].append(run_id)
            for run_id in spinning:
                client.call("run.cancel", run_id=run_id)
        figures = {workflow: measure_host._claim_to_ready(paths, set(run_ids)) for workflow, run_ids in ids.items()}
        values = {workflow: _ready_values(paths, set(run_ids)) for workflow, run_ids in ids.items()}
    return {"fresh": figures["noop"], "warm": figures["noop_warm"], "probes": probes, "spinners": len(spinning),
            "worker_nice": worker_nice, "fresh_ms": values["noop"], "warm_ms": values["noop_warm"]}


def _ready_values(paths: StatePaths, run_ids: set[str]) -> list[float]:
    db = Database.open_readonly(paths.db)
    try:
        rows = db.execute("SELECT run_id, ready_at - started_at FROM run_workers WHERE ready_at IS NOT NULL")
        return [float(delta) for run_id, delta in rows if run_id in run_ids]
    finally:
        db.close()


def _wait_running(client: Client, run_ids: list[str]) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = [client.call("run.status", run_id=run_id).receipt for run_id in run_ids]
        if all(any(w["status"] == "running" for w in run["workers"]) for run in runs):
            return
        time.sleep(0.05)
    raise RuntimeError("the spinning runs did not start")


def measure(quick: bool) -> dict[str, Any]:
    pick = 0 if quick else 1
    n = COUNTS["e2e"][pick]
    with tempfile.TemporaryDirectory(prefix="piwf-bench-huey-") as tmp:
        huey = peer("huey", COUNTS["huey"][pick], Path(tmp), "normal")
    idle = idle_host_cpu_s()
    results: dict[str, Any] = {
        "machine": machine(),
        "end_to_end": {"fresh": end_to_end("noop", n, idle), "warm": end_to_end("noop_warm", n, idle), "huey": huey,
                       "idle_host_cpu_s": idle},
        "claim_to_ready": {"saturated": claim_to_ready(COUNTS["probes"][pick], saturated=True),
                           "saturated_nice0": claim_to_ready(COUNTS["probes"][pick], saturated=True, worker_nice=0),
                           "idle": claim_to_ready(COUNTS["probes"][pick], saturated=False)},
    }
    e2e = results["end_to_end"]
    if "per_s" in huey:
        for kind in ("fresh", "warm"):
            e2e[kind]["vs_huey"] = e2e[kind]["per_s"] / huey["per_s"]
    e2e["warm"]["vs_fresh"] = e2e["warm"]["per_s"] / e2e["fresh"]["per_s"]
    saturated = results["claim_to_ready"]["saturated"]
    results["goals"] = {
        "warm_runs_per_s": _goal(e2e["warm"]["per_s"], GOALS["warm_runs_per_s"], higher=True),
        **{f"{kind}_ready_saturated_ms": _goal(saturated[kind]["claim_to_ready_p50_ms"],
                                               GOALS[f"{kind}_ready_saturated_ms"]) for kind in ("fresh", "warm")},
    }
    return results


def _goal(value: float, goal: float, *, higher: bool = False) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": value >= goal if higher else value <= goal}


def table(results: dict[str, Any]) -> str:
    e2e, ready = results["end_to_end"], results["claim_to_ready"]
    huey = e2e["huey"].get("per_s")
    lines = ["measure                                               figure      goal",
             f"end to end, 8 workers, normal: fresh process per run  {e2e['fresh']['per_s']:8,.0f} /s",
             f"  host CPU per run                                    {e2e['fresh']['host_cpu_ms_per_run']:8.2f} ms",
             f"  CPU per run, all piwf processes                     {e2e['fresh']['piwf_cpu_ms_per_run']:8.2f} ms"
             f"  (two cores: at most {e2e['fresh']['cpu_bound_per_s']:,.0f} /s)",
             f"  worker processes                                    {e2e['fresh']['processes']:8d}",
             f"end to end, 8 workers, normal: warm workers           {e2e['warm']['per_s']:8,.0f} /s  ≥ 1,000 /s",
             f"  host CPU per run                                    {e2e['warm']['host_cpu_ms_per_run']:8.2f} ms",
             f"  CPU per run, all piwf processes                     {e2e['warm']['piwf_cpu_ms_per_run']:8.2f} ms"
             f"  (two cores: at most {e2e['warm']['cpu_bound_per_s']:,.0f} /s)",
             f"  worker processes                                    {e2e['warm']['processes']:8d}",
             f"  ratio to a fresh process per run                    {e2e['warm']['vs_fresh']:8.2f}x"]
    if huey:
        lines += [f"Huey SqliteHuey (in-process, no step durability)    {huey:8,.0f} /s",
                  f"  fresh : Huey                                        {e2e['fresh']['vs_huey']:8.3f}x",
                  f"  warm  : Huey                                        {e2e['warm']['vs_huey']:8.3f}x"]
    else:
        lines.append(f"Huey: {e2e['huey']}")
    for label, key in (("8 workers saturating both cores", "saturated"),
                       ("the same, --worker-nice 0", "saturated_nice0"), ("idle host", "idle")):
        section = ready[key]
        for kind, goal in (("fresh", "≤ 10 ms"), ("warm", "≤ 1 ms")):
            fig = section[kind]
            lines.append(f"claim to ready, {kind:5s}, {label:31s} p50 {fig['claim_to_ready_p50_ms']:5.1f} ms  p99 "
                         f"{fig['claim_to_ready_p99_ms']:5.1f}" + (f"  {goal}" if key == "saturated" else ""))
    lines.append("goals: " + ", ".join(f"{name} {'met' if g['met'] else 'NOT met'}"
                                       for name, g in results["goals"].items()))
    return "\n".join(lines)


PROBE = """
import json, sys
sys.path.insert(0, {bench!r})
import measure_warm
result = measure_warm.claim_to_ready({probes}, saturated=True)
if {cpu_runs}:
    fresh = measure_warm.end_to_end("noop", {cpu_runs}, measure_warm.idle_host_cpu_s())
    result["outside_host_cpu_ms_per_run"] = fresh["piwf_cpu_ms_per_run"] - fresh["host_cpu_ms_per_run"]
print(json.dumps(result))
"""


def _probe_tree(tree: Path, probes: int, cpu_runs: int) -> dict[str, Any]:
    """One saturated claim-to-ready probe in a child process whose piwf (and so the host's,
    the fork server's and the workers') is ``tree``'s src/; this bench's code either way.
    With ``cpu_runs``, then that many fresh one-node runs end to end, for the CPU per run
    of every piwf process but the host (the fork server and the workers: a figure other
    load moves far less than wall time)."""
    bench = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run([sys.executable, "-c", PROBE.format(bench=bench, probes=probes, cpu_runs=cpu_runs)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare_trees(other: Path, rounds: int, probes: int, cpu_runs: int = 0) -> dict[str, Any]:
    """The saturated claim-to-ready probe, this tree and ``other`` in turns (this, other,
    other, this, ...): p50 and p99 over every probe of each side's rounds."""
    this = Path(__file__).resolve().parents[1]
    values: dict[str, dict[str, list[float]]] = {"this": {"fresh": [], "warm": []}, "other": {"fresh": [], "warm": []}}
    outside: dict[str, list[float]] = {"this": [], "other": []}
    for round_ in range(rounds):
        order = (("this", this), ("other", other)) if round_ % 2 == 0 else (("other", other), ("this", this))
        for side, tree in order:
            result = _probe_tree(tree, probes, cpu_runs)
            if cpu_runs:
                outside[side].append(result["outside_host_cpu_ms_per_run"])
            for kind in ("fresh", "warm"):
                values[side][kind] += result[f"{kind}_ms"]
            print(f"round {round_ + 1}/{rounds} {side}: fresh p50 {result['fresh']['claim_to_ready_p50_ms']} "
                  f"p99 {result['fresh']['claim_to_ready_p99_ms']}", file=sys.stderr)
    summary = {side: {kind: {"p50_ms": measure_host.percentile(v, 0.5), "p99_ms": measure_host.percentile(v, 0.99),
                             "n": len(v)} for kind, v in kinds.items()} for side, kinds in values.items()}
    for side, figures in outside.items():
        if figures:
            summary[side]["outside_host_cpu_ms_per_run"] = {"median": statistics.median(figures), "rounds": figures}
    return {"this_tree": str(this), "other_tree": str(other), "rounds": rounds, "probes": probes, **summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tree", type=Path, help="compare the saturated claim to ready with this tree's src/")
    parser.add_argument("--rounds", type=int, default=6, help="with --tree: rounds per side")
    parser.add_argument("--probes", type=int, default=30, help="with --tree: probes of each kind per round")
    parser.add_argument("--cpu-runs", type=int, default=0,
                        help="with --tree: also this many fresh runs per round, for the CPU outside the host")
    args = parser.parse_args(argv)
    if args.tree is not None:
        print(json.dumps(compare_trees(args.tree.resolve(), args.rounds, args.probes, args.cpu_runs), indent=2))
        return 0
    results = measure(args.quick)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
