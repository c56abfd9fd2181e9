"""What the chaos harness's parts share: the tally of what happened and the harness as the
people in the loop (``people``) and the controllers (``controllers``) see it.

``harness`` builds on these; ``people`` and ``controllers`` import only this module, so the
harness's parts import no one in a circle.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from piwf.client import Reply
from piwf.wire import HostRequest


@dataclass
class Tally:
    takeover_ms: list[float] = field(default_factory=list)
    host_kills: int = 0
    worker_kills: int = 0
    fault_exits: int = 0
    accepted: dict[int, str] = field(default_factory=dict)  # submission index -> run id
    hostile: dict[str, str] = field(default_factory=dict)  # run id -> kind
    unexpected_host_exits: int = 0  # the host exited with no kill and no fault armed
    ambiguous_runs: set[str] = field(default_factory=set)
    loop_runs: set[str] = field(default_factory=set)
    standby_takeovers: int = 0
    power_cuts: int = 0
    power_cut_failures: int = 0  # asked for a cut, the host did not die of it within 10 s


class Harness(Protocol):
    """The part of ``harness.Chaos`` that the people and the controllers use."""

    args: argparse.Namespace
    root: Path
    project: Path
    tally: Tally
    settled: threading.Event  # every run settled: the person stops

    def call(self, operation: str, **kwargs: Any) -> Any:
        """Send until answered; the receipt, or RuntimeError when refused."""
        ...

    def request(self, request: HostRequest, deadline_s: float = 120.0) -> Reply:
        """Send until answered, retrying the same request across host deaths."""
        ...
