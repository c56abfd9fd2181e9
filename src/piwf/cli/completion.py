"""``piwf completion SHELL``: a completion script for bash, zsh or fish, generated from the
parser by shtab. The script is static: the shell completes without running piwf."""

from __future__ import annotations

import argparse
import sys

SHELLS = ("bash", "zsh", "fish")  # what `piwf completion` offers (shtab has more)


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    from piwf.cli.parser import build_parser

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0
