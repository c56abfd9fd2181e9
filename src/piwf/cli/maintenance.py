"""``piwf run retry`` (a failed or timed-out run continues) and ``piwf prune`` (ended runs
deleted, as ``piwf serve --retain`` does on its own)."""

from __future__ import annotations

import argparse
from typing import Any

from piwf.cli.common import _client, _ok, _print


def cmd_run_retry(args: argparse.Namespace) -> int:
    with _client(args) as client:
        receipt = _ok(client.call("run.retry", run_id=args.run_id, request_id=args.command_id))
    _print(args, receipt, _format_retry)
    return 0


def _format_retry(r: dict[str, Any]) -> str:
    where = f"from node {r['node']}" if r["node"] else "from where it stopped"
    line = f"{r['runId']}: retried ({r['retriedFrom']} → queued, generation {r['generation']}); it continues {where}"
    if r["reopenedEffects"]:
        line += f"; effects applied again: {', '.join(r['reopenedEffects'])}"
    return line


def cmd_prune(args: argparse.Namespace) -> int:
    payload = {"olderThanMs": args.older_than, "dryRun": bool(args.dry_run)}
    with _client(args) as client:
        receipt = _ok(client.call("run.prune", payload=payload, request_id=args.command_id))
    _print(args, receipt, _format_prune)
    return 0


def _format_prune(r: dict[str, Any]) -> str:
    runs = f"{r['runs']} run{'' if r['runs'] == 1 else 's'}"
    if r["dryRun"]:
        text = f"would delete {runs} that ended before {r['endedBefore']} (nothing was deleted)"
    else:
        text = f"deleted {runs} that ended before {r['endedBefore']}, and {r['blobs']} unused stored value(s)"
    if r["runIds"]:
        more = r["runs"] - len(r["runIds"])
        text += "\n" + "\n".join(f"  {run_id}" for run_id in r["runIds"]) + (f"\n  ... and {more} more" if more > 0
                                                                               else "")
    return text
