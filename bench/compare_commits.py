"""Two commits of piwf side by side: end-to-end runs/s, host CPU per run and the
`run.status` round trip, measured in interleaved rounds (old, new, old, new, ...) so that
a change in the machine's load falls on both alike; medians and new/old ratios.

    python bench/compare_commits.py OLD_REV [NEW_REV] [--rounds 5] [--runs 150]

Each commit is checked out into a temporary worktree and measured with its own
bench/measure_host.py, imported with that worktree's src/ first on the path, so each
side runs its own host. NEW_REV defaults to the working tree itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys
import measure_host
e2e = measure_host.end_to_end({durability!r}, {workers}, {runs})
rtt = measure_host.status_round_trip("normal", {calls})
print(json.dumps({{"runs_per_s": e2e["per_s"], "host_cpu_ms_per_run": e2e["host_cpu_ms_per_run"],
                  "status_p50_us": rtt["p50_us"], "status_raw_p50_us": rtt["raw_p50_us"]}}))
"""
FIGURES = ("runs_per_s", "host_cpu_ms_per_run", "status_p50_us", "status_raw_p50_us")


def measure(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'bench'}"}
    code = PROBE.format(durability=args.durability, workers=args.max_workers, runs=args.runs, calls=args.calls)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    return where


def compare(old: Path, new: Path, args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for round_ in range(args.rounds):
        for side, tree in (("old", old), ("new", new)) if round_ % 2 == 0 else (("new", new), ("old", old)):
            samples[side].append(measure(tree, args))
            print(f"round {round_ + 1}/{args.rounds} {side}: {samples[side][-1]}", file=sys.stderr)
    medians = {side: {f: statistics.median(s[f] for s in runs) for f in FIGURES} for side, runs in samples.items()}
    ratios = {f: medians["new"][f] / medians["old"][f] for f in FIGURES}
    return {"rounds": args.rounds, "runs": args.runs, "durability": args.durability, "medians": medians,
            "new_over_old": ratios, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", help="a revision (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=150, help="end-to-end runs per round")
    parser.add_argument("--calls", type=int, default=500, help="run.status calls per round")
    parser.add_argument("--durability", choices=("full", "normal"), default="normal")
    parser.add_argument("--max-workers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="piwf-compare-") as tmp:
        old = worktree(args.old, Path(tmp) / "old")
        new = worktree(args.new, Path(tmp) / "new") if args.new else ROOT
        try:
            print(json.dumps(compare(old, new, args), indent=2))
        finally:
            for tree in (old, new):
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
