"""The claim throughput harness runs and prints one JSON document (figures are not asserted)."""

from __future__ import annotations

import importlib.util
import json
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
        assert figures["one_at_a_time"]["start_to_completed_p50_ms"] > 0
        for peer, module in (("huey", "huey"), ("dbos", "dbos")):
            installed = importlib.util.find_spec(module) is not None
            assert ("per_s" in figures[peer]) == installed, figures[peer]
    assert results["status_round_trip"]["p50_us"] > 0
    assert results["cli_status"]["p50_ms"] > 0
    assert set(results["targets"]) == {"store_vs_limit", "e2e_vs_dbos", "e2e_runs_per_s", "claim_to_ready_p50_ms",
                                       "status_p50_us", "cli_status_ms"}
