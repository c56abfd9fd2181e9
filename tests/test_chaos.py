"""The chaos harness: runs with shell nodes and effects while host and workers are killed."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from .conftest import pg_store_url


def chaos(*args: str, timeout_s: float = 900) -> dict:
    done = subprocess.run([sys.executable, "-m", "piwf.chaos", *args], capture_output=True, timeout=timeout_s,
                          check=False)
    assert done.stdout.count(b"\n") == 1, done.stderr.decode()[-3000:]
    summary = json.loads(done.stdout)
    assert done.returncode == 0, summary
    return summary


def check(summary: dict) -> None:
    seed = summary["seed"]
    assert summary["runs_lost"] == 0, seed
    assert summary["runs_duplicated"] == 0, seed
    assert summary["effects_applied_twice"] == 0, seed
    assert summary["runs_stuck"] == 0, seed
    assert summary["runs_failed"] == 0, seed
    hostile = sum(summary["hostile_runs"].values())
    assert summary["runs_completed"] == summary["runs"] - hostile, seed
    assert summary["hostile_held"] + summary["hostile_failed"] == hostile, seed  # each with its reason
    assert summary["unexpected_host_exits"] == 0, seed  # no hostile workflow took the host down
    loop = summary["loop_runs"]  # waiting for a decision and an ask: no effects
    assert summary["effects_applied"] == 2 * (summary["runs"] - hostile - loop), seed  # each effect exactly once
    assert loop >= 1 and summary["decisions_answered"] == loop, seed
    assert summary["asks_submitted"] >= 2 * loop, seed  # an odd value refused, then an even one
    assert (summary["answers_lost"], summary["answered_twice"], summary["answers_refused"]) == (0, 0, 0), seed
    delivery = ("notifications_missing", "notifications_duplicated", "turns_missing", "turns_duplicated")
    assert [summary[key] for key in delivery] == [0, 0, 0, 0], seed  # once each, whatever was killed
    assert summary["lifecycle_contradictions"] == 0, seed
    assert summary["integrity_check"] == "ok", seed
    strikes = ("host_kills", "worker_kills", "power_cuts", "peer_kills", "host_freezes", "worker_freezes",
               "peer_worker_kills", "strikes_skipped")  # the last five with --hosts (skipped: all frozen)
    assert sum(summary.get(key, 0) for key in strikes) >= summary["kills"], seed
    assert summary["power_cut_failures"] == 0, seed
    # controllers under the same kills: every resource converges, no reconcile effect twice
    assert summary["resources_converged"] == summary["resources"], seed
    assert summary["resource_effects_applied_twice"] == 0, seed
    assert summary["resources_missing_effect"] == 0, seed


def test_a_small_chaos_run_loses_nothing_and_repeats_no_effect() -> None:
    summary = chaos("--runs", "10", "--kills", "5", "--hostile-every", "2", "--loop-every", "3", "--resources", "6")
    check(summary)
    assert sorted(summary["hostile_runs"]) == ["exit0", "exit3", "oversized", "parricide"]
    assert summary["takeover_ms"]["count"] >= 1


def test_a_small_chaos_run_on_postgresql_loses_nothing_and_repeats_no_effect(postgres: Any) -> None:
    """The same run with the hosts keeping their store in PostgreSQL (a fresh schema)."""
    summary = chaos("--runs", "10", "--kills", "5", "--hostile-every", "2", "--loop-every", "3", "--resources", "6",
                    "--store", pg_store_url(postgres))
    check(summary)
    assert sorted(summary["hostile_runs"]) == ["exit0", "exit3", "oversized", "parricide"]
    assert summary["takeover_ms"]["count"] >= 1


def test_a_small_chaos_run_with_three_hosts_on_postgresql_loses_nothing_and_repeats_no_effect(
        postgres: Any) -> None:
    """Three hosts share one store; the kills SIGKILL any of them and SIGSTOP hosts and
    workers (then SIGCONT): a frozen host's workers stop themselves, the others take its
    runs, and it joins again with a new epoch."""
    summary = chaos("--runs", "10", "--kills", "6", "--hostile-every", "2", "--loop-every", "3", "--resources", "6",
                    "--hosts", "3", "--freezes", "2", "--store", pg_store_url(postgres))
    check(summary)
    assert summary["hosts"] == 3 and summary["unexpected_peer_exits"] == 0, summary["seed"]
    assert summary["host_freezes"] >= 2, summary["seed"]


@pytest.mark.soak
def test_a_long_chaos_run_with_three_hosts_on_postgresql(postgres: Any) -> None:
    summary = chaos("--runs", "1000", "--kills", "500", "--hosts", "3", "--freezes", "100",
                    "--store", pg_store_url(postgres),
                    timeout_s=7200)
    check(summary)


def test_a_chaos_run_with_power_cuts_loses_no_acknowledged_commit() -> None:
    """4 of the 6 kills are power cuts at full durability: writes not yet synced are thrown
    away (all, some, or torn) as the host and its workers die; nothing acknowledged is lost."""
    summary = chaos("--runs", "10", "--kills", "6", "--power-cuts", "4", "--hostile-every", "2", "--loop-every", "3",
                    "--resources", "4")
    check(summary)
    assert summary["power_cuts"] == 4, summary["seed"]
    assert summary["power_cut_blocks_dropped"] > 0, summary["seed"]  # the cuts took unsynced writes with them
    assert summary["acknowledged_lost"] == 0, summary["seed"]


def test_power_cuts_need_full_durability() -> None:
    done = subprocess.run([sys.executable, "-m", "piwf.chaos", "--kills", "2", "--power-cuts", "1",
                           "--durability", "normal"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--power-cuts needs --durability full" in done.stderr


def test_a_chaos_run_with_a_standby_loses_nothing_and_repeats_no_effect() -> None:
    """Each killed host (or one a fault point ended) is replaced by a waiting standby."""
    summary = chaos("--runs", "10", "--kills", "5", "--hostile-every", "2", "--loop-every", "3", "--standby")
    check(summary)
    assert summary["standby_takeovers"] >= 1


def test_a_chaos_run_with_warm_workers_loses_nothing_and_repeats_no_effect() -> None:
    """Every workflow declares reuse_worker=True: runs share worker processes while hosts and
    workers are killed, hostile runs crash theirs; the guarantees stay those of fresh workers."""
    summary = chaos("--runs", "12", "--kills", "4", "--hostile-every", "4", "--loop-every", "3", "--resources", "0",
                    "--warm-workers")
    check(summary)
    assert summary["warm_reuses"] >= 1, summary["seed"]  # runs were handed to warm workers


@pytest.mark.soak
def test_the_documented_chaos_run() -> None:
    summary = chaos("--runs", "50", "--kills", "20")
    check(summary)  # takeover times are figures to read (docs/guarantees.md), not to assert
