"""``piwf run retry`` (a failed or timed-out run continues) and ``piwf prune`` (ended runs
deleted, as ``piwf serve --retain`` does on its own)."""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

from piwf.cli.common import _client, _ok, _print
from piwf.errors import ExitCode, HostTimeout

SAMPLE = 20  # run ids a prune's answer names (as each receipt does)
BUDGET_MS = 5_000  # a request's budget at most: piwf.protocol.maintenance.DEFAULT_BUDGET_MS (a test checks)


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
    """One ``run.prune`` request after another until nothing remains: each is answered
    within its budget (a third of ``--timeout``), so a long prune never times out while the
    host goes on deleting; a terminal is shown how many so far. Ctrl-C stops between two
    requests, saying how many were deleted. With ``--request-id ID`` the requests are
    ``ID``, ``ID.2``, ...: the same command again is answered from the log, then goes on."""
    payload: dict[str, Any] = {"olderThanMs": args.older_than, "dryRun": bool(args.dry_run)}
    with _client(args) as client:
        payload["budgetMs"] = min(BUDGET_MS, int((client.timeout or 30) * 1000 / 3))
        total: dict[str, Any] | None = None
        try:
            for n in itertools.count(1):
                request_id = args.command_id if n == 1 or args.command_id is None else f"{args.command_id}.{n}"
                try:
                    receipt = _ok(client.call("run.prune", payload=payload, request_id=request_id))
                except HostTimeout as exc:
                    raise type(exc)(f"{exc}; it may still be deleting{_so_far(total)}: piwf prune goes on "
                                    "where it stopped") from None
                total = _added(total, receipt)
                if not receipt.get("more"):
                    break
                payload["sweepAfter"] = receipt.get("sweepAfter")
                if sys.stderr.isatty() and not args.json:
                    print(f"piwf: deleted {_runs(total['runs'])} so far; going on", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            print(f"piwf: stopped{_so_far(total)}; the rest remain: piwf prune goes on where it stopped",
                  file=sys.stderr)
            return ExitCode.INTERRUPTED
    assert total is not None  # the loop ran at least once
    _print(args, {**total, "more": False, "sweepAfter": None}, _format_prune)
    return 0


def _added(total: dict[str, Any] | None, receipt: dict[str, Any]) -> dict[str, Any]:
    """The receipts of a prune's requests as one: counts added, the first ids kept."""
    if total is None:
        return receipt
    return {**receipt, "runs": total["runs"] + receipt["runs"], "blobs": total["blobs"] + receipt["blobs"],
            "runIds": (total["runIds"] + receipt["runIds"])[:SAMPLE]}


def _so_far(total: dict[str, Any] | None) -> str:
    return "" if total is None else f" ({_runs(total['runs'])} and {total['blobs']} stored value(s) deleted so far)"


def _runs(n: int) -> str:
    return f"{n} run{'' if n == 1 else 's'}"


def _format_prune(r: dict[str, Any]) -> str:
    runs = _runs(r["runs"])
    if r["dryRun"]:
        text = f"would delete {runs} that ended before {r['endedBefore']} (nothing was deleted)"
    else:
        text = f"deleted {runs} that ended before {r['endedBefore']}, and {r['blobs']} unused stored value(s)"
    if r["runIds"]:
        more = r["runs"] - len(r["runIds"])
        text += "\n" + "\n".join(f"  {run_id}" for run_id in r["runIds"]) + (f"\n  ... and {more} more" if more > 0
                                                                               else "")
    return text
