"""The shapes of the host protocol's handlers, by request type (``operations.READS`` and
``operations.WRITES``, gathered from the modules that define them).

A read is answered from the store and never logged. A write runs in the unit of work
``operations`` opens with the command log (``tx``), after its optional ``prepare`` step
(which may await anything, outside that unit of work); inside it, an ``Apply`` awaits only
``tx``'s methods, and what must happen after the commit it appends to ``after``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from piwf.protocol import Request
    from piwf.store.api import UnitOfWork
    from piwf.wire import HostResponse
    from piwf.host.state import HostState

After = list[Callable[[], None]]
Read = Callable[["HostState", Any], Awaitable[Any]]
Prepare = Callable[["HostState", Any], Awaitable[Any]] | None
Apply = Callable[["HostState", "UnitOfWork", Any, Any, After], Awaitable["HostResponse"]]
Reads = dict[type["Request"], Read]
Writes = dict[type["Request"], tuple[Prepare, Apply]]
