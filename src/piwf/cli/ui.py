"""``piwf ui``: the web console (docs/ui.md). It needs the optional dependencies
(``pip install 'piwf[ui]'``); without them the command says so in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

from piwf.errors import UsageError


def cmd_ui(args: argparse.Namespace) -> int:
    from piwf.cli.common import _paths

    try:
        from piwf.ui.console import UiConfig, run
    except ImportError as exc:
        raise UsageError(f"piwf ui needs its optional dependencies: pip install 'piwf[ui]' ({exc})") from None
    socket = Path(args.socket).absolute() if args.socket else None
    return run(UiConfig(_paths(args), port=args.port or 0, socket=socket, answer_as=args.answer_as,
                        session=args.session))
