"""What recording and serving run graphs costs, measured side by side in one run (CPU time).

    python bench/measure_graph.py            # about a minute
    python bench/measure_graph.py --quick --json

1. ``runs.create_run`` on SQLite (durability normal, one transaction per run, as
   ``run.start`` does), without a graph and with a 12-node workflow's graph, in
   alternating rounds: what recording the graph adds to a run's start.
2. ``runs.run_graph`` beside ``runs.get_run`` (what ``run.status`` reads) for one run of
   ten attempts, in a database of N runs and of 20·N runs: neither grows with the runs
   stored.

CPU time (``time.process_time``) of this process, medians of the rounds; nothing here is
asserted by the test suite (tests/test_run_graph.py checks the query plans).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def graph_bytes() -> bytes:
    import msgspec

    from piwf.protocol import GraphEdge, NodeDefinition, WorkflowGraph
    from piwf.wire import canonical_json

    nodes = [NodeDefinition(id=f"step{i:02}", kind="compute", title=f"do_step_{i}", exits=["next"])
             for i in range(11)] + [NodeDefinition(id="approve", kind="decision", title="Ship it?",
                                                   exits=["yes", "no"])]
    edges = [GraphEdge(node=f"step{i:02}", exit="next", to=f"step{i + 1:02}") for i in range(10)]
    edges += [GraphEdge(node="step10", exit="next", to="approve"), GraphEdge(node="approve", exit="no", to="step00")]
    return canonical_json(msgspec.to_builtins(WorkflowGraph(name="w", startAt="step00", nodes=nodes, edges=edges)))


def start_cost(db: Any, rounds: int, per_round: int) -> dict[str, float]:
    from piwf.store.sql import runs

    graph, made, took = graph_bytes(), 0, {"without_graph_us": [], "with_graph_us": []}
    for _ in range(rounds):
        for name, recorded in (("without_graph_us", None), ("with_graph_us", graph)):
            began = time.process_time()
            for _ in range(per_round):
                made += 1
                runs.create_run(db, run_id=f"start-{made}", workflow="w", project_path="/p", source=b"s" * 2000,
                                digest="d", input={"n": made}, origin_session_id=None, now=made, graph=recorded)
            took[name].append((time.process_time() - began) / per_round * 1e6)
    return {name: statistics.median(values) for name, values in took.items()}


def fill(db: Any, count: int, first: int) -> None:
    from piwf.store.sql import runs

    graph = graph_bytes()
    with db.write():
        for i in range(first, first + count):
            runs.create_run(db, run_id=f"fill-{i}", workflow="w", project_path="/p", source=b"s", digest="d",
                            input={}, origin_session_id=None, now=i, graph=graph)


def one_run_of_ten_steps(db: Any) -> str:
    from piwf.store.sql import queue, runs

    runs.create_run(db, run_id="shown", workflow="w", project_path="/p", source=b"s", digest="d", input={},
                    origin_session_id=None, now=0, graph=graph_bytes())
    queue.claim_run(db, "shown", runner_id="bench", token="t", lease_ms=10**12, now=0, epoch=0)
    for seq in range(10):
        attempt, _ = runs.start_attempt(db, "shown", "t", seq=seq, node=f"step{seq:02}", generation=0, now=1)
        runs.accept_attempt(db, "shown", "t", attempt_id=attempt, output={"seq": seq}, exit_name="next", now=1)
    return "shown"


def read_cost(db: Any, run_id: str, calls: int) -> dict[str, float]:
    from piwf.store.sql import graph, runs

    took: dict[str, list[float]] = {"run_graph_us": [], "get_run_us": []}
    for _ in range(5):
        for name, read in (("run_graph_us", lambda: graph.run_graph(db, run_id)),
                           ("get_run_us", lambda: runs.get_run(db, run_id, 0))):
            began = time.process_time()
            for _ in range(calls):
                read()
            took[name].append((time.process_time() - began) / calls * 1e6)
    return {name: statistics.median(values) for name, values in took.items()}


def measure(quick: bool) -> dict[str, Any]:
    from piwf.store.sqlite import Database

    base = 1000 if quick else 5000
    with tempfile.TemporaryDirectory() as tmp:
        db = Database.open(Path(tmp) / "state.db", durability="normal")
        starts = start_cost(db, rounds=3 if quick else 7, per_round=100 if quick else 300)
        shown = one_run_of_ten_steps(db)
        fill(db, base, 0)
        small = read_cost(db, shown, 50 if quick else 300)
        fill(db, base * 19, base)
        large = read_cost(db, shown, 50 if quick else 300)
        db.close()
    return {"create_run": {**starts, "graph_adds_us": starts["with_graph_us"] - starts["without_graph_us"]},
            "reads": {f"{base} runs": small, f"{base * 20} runs": large}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    results = measure(args.quick)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    start = results["create_run"]
    print(f"create_run CPU per run: {start['without_graph_us']:.0f} µs without a graph, "
          f"{start['with_graph_us']:.0f} µs with one (+{start['graph_adds_us']:.0f} µs)")
    print("| runs stored | run_graph (µs CPU) | get_run (µs CPU) |\n| --- | --- | --- |")
    for stored, reads in results["reads"].items():
        print(f"| {stored} | {reads['run_graph_us']:.0f} | {reads['get_run_us']:.0f} |")


if __name__ == "__main__":
    main()
