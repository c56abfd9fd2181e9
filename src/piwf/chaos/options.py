"""The options of ``python -m piwf.chaos``, checked together: a bad combination is one
line from argparse, before anything starts."""

from __future__ import annotations

import argparse
import random

DESCRIPTION = "``python -m piwf.chaos``: run workflows and controllers while killing the host and its workers."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m piwf.chaos", description=DESCRIPTION)
    parser.add_argument("--runs", type=int, default=50, help="workflow runs to submit (default 50)")
    parser.add_argument("--kills", type=int, default=20, help="host and worker kills (default 20)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--durability", choices=("full", "normal"), default="full")
    parser.add_argument("--resources", type=int, default=10,
                        help="controller resources to apply, half of them changed once (default 10; 0: none)")
    parser.add_argument("--hostile-every", type=int, default=5, metavar="K",
                        help="one run in K is a hostile workflow (default 5; 0: none)")
    parser.add_argument("--loop-every", type=int, default=4, metavar="K",
                        help="one run in K waits for a decision and an ask, answered by a simulated person "
                             "(default 4; 0: none)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait, after the last kill, for every run to settle (default: 300, or 3 per "
                             "run when that is more: the hostile runs' crash loops take the fork server down again "
                             "and again, and each time starting workers waits for it)")
    parser.add_argument("--standby", action="store_true",
                        help="keep a `piwf serve --standby` waiting: it replaces each killed host")
    parser.add_argument("--power-cuts", type=int, default=0, metavar="N",
                        help="N of the host kills are power cuts: writes not yet synced are lost (default 0; "
                             "needs --durability full)")
    parser.add_argument("--warm-workers", action="store_true",
                        help="every workflow declares reuse_worker=True: runs share warm worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (path on stderr)")
    parser.add_argument("--store", metavar="URL", default=None,
                        help="run the hosts on this PostgreSQL store (piwf serve --store; use a fresh ?schema=)")
    parser.add_argument("--hosts", type=int, default=1, metavar="N",
                        help="N hosts on the --store they share, each on a state directory of its own; the kills "
                             "then also SIGKILL any of them and SIGSTOP (then SIGCONT) hosts and workers (default 1)")
    parser.add_argument("--freezes", type=int, default=0, metavar="N",
                        help="with --hosts: N of the kills are a SIGSTOP of a host for one to two leases "
                             "(then SIGCONT) (default 0; other kills freeze some too)")
    parser.add_argument("--lease", type=float, default=3.0, metavar="S",
                        help="with --hosts: each host's --lease (default 3 s, so frozen hosts are taken over)")
    args = parser.parse_args(argv)
    if (args.runs < 1 or args.kills < 0 or args.max_workers < 1 or args.hostile_every < 0 or args.loop_every < 0
            or args.resources < 0):
        parser.error("--runs and --max-workers must be at least 1, --kills, --hostile-every, --loop-every and "
                     "--resources at least 0")
    if args.hosts < 1 or (args.hosts > 1 and not args.store) or args.lease <= 0:
        parser.error("--hosts must be at least 1, and more than 1 needs --store (the store they share); "
                     "--lease must be positive")
    if not 0 <= args.freezes <= args.kills - args.power_cuts or (args.freezes and args.hosts < 2):
        parser.error("--freezes needs --hosts 2 or more, and at most --kills less --power-cuts")
    if not 0 <= args.power_cuts <= args.kills:
        parser.error("--power-cuts must be between 0 and --kills")
    if args.power_cuts and args.durability != "full":
        parser.error("--power-cuts needs --durability full: at normal a power cut may take back acknowledged "
                     "commits (docs/guarantees.md), which this harness would count as lost")
    if args.seed is None:
        args.seed = random.randrange(2**32)
    if args.timeout is None:
        args.timeout = max(300.0, 3.0 * args.runs)
    return args
