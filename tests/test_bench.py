"""The claim throughput harness runs and prints one JSON document (figures are not asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench" / "claim_throughput.py"


def test_quick_json_prints_every_figure_as_one_document() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)  # nothing else on stdout
    for durability in ("normal", "full"):
        figures = results["durability"][durability]
        for name in ("limit_raw_claim", "store_claim", "store_path", "store_path_batched", "end_to_end"):
            assert figures[name]["per_s"] > 0, (durability, name)
        assert figures["end_to_end"]["latency_p50_ms"] > 0
        assert figures["end_to_end"]["claim_to_ready_p50_ms"] >= 0
        several = figures["end_to_end_clients"]  # the extra row: the same runs started over 4 connections
        assert several["per_s"] > 0 and several["clients"] == 4 and figures["end_to_end"]["clients"] == 1
        assert ("vs_dbos" in several) == (importlib.util.find_spec("dbos") is not None)
        assert figures["one_at_a_time"]["start_to_completed_p50_ms"] > 0
        for peer, module in (("huey", "huey"), ("dbos", "dbos")):
            installed = importlib.util.find_spec(module) is not None
            assert ("per_s" in figures[peer]) == installed, figures[peer]
    assert results["status_round_trip"]["p50_us"] > 0
    assert results["cli_status"]["p50_ms"] > 0
    # The performance round's figures (issue 13), each measured side by side in this run.
    assert results["e2e_full_vs_normal"] > 0
    assert set(results["host_cpu_ms_per_run"]) == {"normal", "full"}
    assert all(value > 0 for value in results["host_cpu_ms_per_run"].values())
    dbos = importlib.util.find_spec("dbos") is not None
    assert set(results["e2e_vs_dbos"]) == {"normal", "full"}
    assert all((value is not None and value > 0) == dbos for value in results["e2e_vs_dbos"].values())
    assert results["rtt_vs_echo"] > 0 and results["status_round_trip"]["echo_p50_us"] > 0
    assert results["takeover_standby_ms"] > 0 and results["takeover_cold_ms"] > 0
    assert set(results["targets"]) == {"store_vs_limit", "e2e_vs_dbos", "e2e_runs_per_s", "claim_to_ready_p50_ms",
                                       "status_p50_us", "cli_status_ms", "e2e_full_vs_normal", "host_cpu_ms_per_run",
                                       "rtt_vs_echo", "takeover_standby_ms"}


def test_the_warm_worker_bench_prints_its_figures_against_their_goals() -> None:
    done = subprocess.run([sys.executable, str(BENCH.parent / "measure_warm.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    e2e = results["end_to_end"]
    assert e2e["fresh"]["per_s"] > 0 and e2e["warm"]["per_s"] > 0
    assert e2e["fresh"]["processes"] == e2e["fresh"]["n"]  # a process per run ...
    assert e2e["warm"]["processes"] < e2e["warm"]["n"] / 4  # ... against a few, each serving many runs
    assert ("vs_huey" in e2e["warm"]) == (importlib.util.find_spec("huey") is not None)
    for section in ("saturated", "saturated_nice0", "idle"):
        for kind in ("fresh", "warm"):
            assert results["claim_to_ready"][section][kind]["claim_to_ready_p50_ms"] >= 0, (section, kind)
    assert results["claim_to_ready"]["saturated"]["spinners"] == 8
    assert set(results["goals"]) == {"warm_runs_per_s", "fresh_ready_saturated_ms", "warm_ready_saturated_ms"}


def test_the_warm_worker_bench_compares_the_saturated_claim_to_ready_with_another_tree() -> None:
    """--tree: the same probe with another tree's src/ (here this one's), side by side."""
    root = BENCH.parent.parent
    done = subprocess.run([sys.executable, str(BENCH.parent / "measure_warm.py"), "--tree", str(root),
                           "--rounds", "1", "--probes", "2", "--cpu-runs", "5"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["other_tree"] == str(root.resolve())
    for side in ("this", "other"):
        assert results[side]["fresh"]["n"] == results[side]["warm"]["n"] == 2
        assert results[side]["fresh"]["p50_ms"] >= 0
        assert len(results[side]["outside_host_cpu_ms_per_run"]["rounds"]) == 1


def test_the_several_hosts_bench_prints_every_configuration_beside_dbos(tmp_path: Path) -> None:
    """bench/measure_hosts.py --quick: 1 and 2 hosts on one throwaway PostgreSQL, DBOS on
    the same server, the table's figures as JSON and, where matplotlib is installed (the
    `bench` extra; CI installs `test` only), the plot drawn (shape only, no speed)."""
    from tests.conftest import no_postgres
    from tests.postgres_server import find_bindir

    if find_bindir() is None and not os.environ.get("PIWF_TEST_STORE"):
        no_postgres(os.environ)
    image = tmp_path / "hosts.png"
    drawn = importlib.util.find_spec("matplotlib") is not None
    command = [sys.executable, str(BENCH.parent / "measure_hosts.py"), "--quick", "--json"]
    done = subprocess.run(command + (["--plot", str(image)] if drawn else []),
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    rows = results["configurations"]
    assert [(row["hosts"], row["workers"]) for row in rows] == [(1, 2), (2, 2)]
    for row in rows:
        assert row["per_s"] > 0 and row["n"] == results["runs"]
        assert row["host_cpu_ms_per_run"] > 0 and row["piwf_cpu_ms_per_run"] >= row["host_cpu_ms_per_run"]
        (spread,) = row["spread_rounds"]  # one round: the runs each host ran, every run counted once
        assert len(spread) == row["hosts"] and sum(spread) == row["n"]
        assert (row["postgres_cpu_ms_per_run"] is None) == bool(os.environ.get("PIWF_TEST_STORE"))
    dbos = importlib.util.find_spec("dbos") is not None
    assert ("per_s" in results["dbos"]) == dbos
    assert all(("vs_dbos" in row) == dbos for row in rows)
    assert image.read_bytes().startswith(b"\x89PNG") if drawn else not image.exists()
