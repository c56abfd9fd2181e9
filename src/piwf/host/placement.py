"""Placement, this host's part (the rules are the store's: store/sql/placement.py).

A run this host could not load (its workflow file missing here, unloadable, or of another
digest) was released at once by the worker's ready message and recorded as not loadable
here; this host's claims pass it over. At start and on every poll this task

- looks again at the workflow file of each run it recorded: once the file at that path is
  not the one its worker found (restored, edited, replaced), the record is forgotten and
  the run may be claimed here again;
- settles placement for every host sharing the store: a held run that a live host of its
  queue has not tried (one that joined) is released; a run that no live host of its queue
  can load any more (the hosts that could have left) is held with that reason.

Released runs wake the dispatchers (this host's and, through the store, the others').
"""

from __future__ import annotations

import contextlib

import trio_util

from piwf.engine.loader import workflow_path
from piwf.errors import PiwfError, StorageUnavailable
from piwf.host.isolated import StatKey
from piwf.host.state import HostState, log
from piwf.wire import sha256_hex

Seen = dict[str, tuple[StatKey | None, str]]  # a workflow file's path -> (its stat key, the sha256 of its bytes)


async def serve_placement(host: HostState) -> None:
    seen: Seen = {}
    async with contextlib.aclosing(trio_util.periodic(host.config.poll_s)) as ticks:
        async for _ in ticks:
            await settle_placement(host, seen)


async def settle_placement(host: HostState, seen: Seen) -> None:
    """One round: forget this host's records of runs whose file changed here, then settle."""
    store = host.store.placement
    try:
        records = await store.own_records(host.host_id)
        changed = []
        for run_id, project, workflow, recorded in records:
            found = await _file_hash(host, project, workflow, seen)
            if found is not None and found != (recorded or ""):
                changed.append(run_id)
        if changed:
            await store.forget(host.host_id, changed)
            log.info("workflow files changed here: %d run(s) this host could not load may be tried again",
                     len(changed))
        released = await store.settle(host.now())
    except PiwfError as exc:
        log.warning("could not settle placement: %s; will retry", exc)
        return
    for run_id in released:
        log.info("run %s: released: a live host of its queue has not tried to load its workflow", run_id)
    if changed or released:
        host.wake()
        host.changed()


async def _file_hash(host: HostState, project: str, workflow: str, seen: Seen) -> str | None:
    """The sha256 of the workflow file at the run's path as it is now ('' when there is none
    to read); None when it cannot be told now (a file system that does not answer)."""
    try:
        path = workflow_path(project, workflow)
    except PiwfError:
        return ""
    key = str(path)
    known = seen.get(key)
    try:
        stat_key, content = await host.catalog.isolation.read_user_file(path, None if known is None else known[0])
    except StorageUnavailable:
        return None
    except (OSError, PiwfError):
        seen.pop(key, None)
        return ""
    if content is None and known is not None:  # unchanged since the last look
        return known[1]
    digest = sha256_hex(content or b"")
    seen[key] = (stat_key, digest)
    return digest
