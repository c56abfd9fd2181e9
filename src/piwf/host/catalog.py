"""Workflow lookup for ``run.start``: validate and digest in a throwaway process.

User code never runs inside the host. Results are cached by the file's content hash, and
the file is not read again while one ``stat`` finds its times, size and inode as they were
(``isolated.StatKey``); where a project's workflow file is, is worked out once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from piwf.engine.loader import workflow_path
from piwf.errors import PiwfError, Rejected, StorageUnavailable
from piwf.protocol import WorkflowGraph
from piwf.store.api.types import Definition
from piwf.wire import canonical_json, sha256_hex
from piwf.host.isolated import Isolation, StatKey

Check = Callable[[], Awaitable[None]]
log = logging.getLogger("piwf.host")
SETTINGS_CACHED = 256  # settings checks remembered (by file content and request), newest kept
PATHS_CACHED = 1024  # (project, workflow name) -> its file's path, forgotten all at once beyond this


@dataclass(frozen=True)
class WorkflowInfo:
    name: str
    digest: str
    source: bytes
    start_at: str
    settings: dict[str, Any] | None = None  # {"defaults", "mutable"} when the workflow declares settings
    graph: bytes | None = None  # the WorkflowGraph a run records (canonical JSON), made where the file was loaded

    def definition(self) -> Definition:
        """What a run adopts of it (``runs.resume_run``, ``retry_run``)."""
        return Definition(self.digest, self.source, self.start_at, self.graph)


Seen = tuple[StatKey | None, WorkflowInfo]


class Catalog:
    def __init__(self) -> None:
        self.isolation = Isolation()  # bounds the file reads and throwaway processes below
        # (path, source hash) -> (digest, start node, settings declaration, graph)
        self._cache: dict[tuple[str, str], tuple[str, str, Any, bytes | None]] = {}
        self._seen: dict[str, Seen] = {}  # path -> (stat key, info)
        self._paths: dict[tuple[str, str], tuple[Path, str]] = {}  # (project, name) -> its file's path, as str
        self._settings: OrderedDict[tuple[str, str, bytes], tuple[str, Any]] = OrderedDict()

    async def inspect(self, project: str, name: str) -> WorkflowInfo:
        path_key, seen, source = await self._source(project, name)
        if source is None:  # unchanged since the last start
            assert seen is not None
            return seen[1]
        stat_key, path = path_key
        key = (path, sha256_hex(source))
        if key not in self._cache:
            self._cache[key] = await self._digest(project, name)
        digest, start_at, settings, graph = self._cache[key]
        info = WorkflowInfo(name, digest, source, start_at, settings, graph)
        self._seen[path] = (stat_key, info)
        return info

    async def _source(self, project: str, name: str) -> tuple[tuple[StatKey | None, str], Seen | None, bytes | None]:
        """((stat key, path), what was seen there last, the file's bytes or None when
        unchanged since then), read within the host's bounds; ``Rejected`` saying what
        the file is when it cannot be a workflow file."""
        try:
            path, where = self._path(project, name)
            seen = self._seen.get(where)
            stat_key, source = await self.isolation.read_user_file(path, None if seen is None else seen[0])
        except (Rejected, StorageUnavailable):
            raise
        except PiwfError as exc:
            raise Rejected(str(exc)) from exc
        except OSError as exc:
            raise Rejected(f"no workflow {name!r} in {project}: {path} {(exc.strerror or str(exc)).lower()}") from exc
        return (stat_key, where), seen, source

    def _path(self, project: str, name: str) -> tuple[Path, str]:
        """``workflow_path`` (a pure function of its arguments: a name it refuses is not kept)."""
        known = self._paths.get((project, name))
        if known is None:
            path = workflow_path(project, name)
            if len(self._paths) >= PATHS_CACHED:
                self._paths.clear()
            known = self._paths[(project, name)] = (path, str(path))
        return known

    async def _digest(self, project: str, name: str) -> tuple[str, str, Any, bytes | None]:
        result = await self._inspect(project, name)
        return result["digest"], result["startAt"], result.get("settings"), _graph(name, result.get("graph"))

    async def resolve_settings(self, project: str, name: str, *, current: Any, patch: Any,
                               mutable_only: bool, check: Check | None = None) -> tuple[str, Any]:
        """(digest, settings): ``patch`` merged into ``current`` and checked against the
        workflow's settings type (and, with ``mutable_only``, its mutable paths) in a
        throwaway process, with the workflow file as it is now (the same check of the same
        file is answered from memory). ``check`` runs just before a process would be
        started: what it raises refuses the request without one."""
        request = canonical_json({"current": current, "patch": patch, "mutableOnly": mutable_only})
        (_, path), _, source = await self._source(project, name)
        if source is None:
            source = self._seen[path][1].source
        key = (path, sha256_hex(source), request)
        if (known := self._settings.get(key)) is not None:  # the same check of the same file: no process
            self._settings.move_to_end(key)
            return known
        result = await self._inspect(project, name, settings=request, check=check)
        self._settings[key] = answer = (result["digest"], result["settings"])
        while len(self._settings) > SETTINGS_CACHED:
            self._settings.popitem(last=False)
        return answer

    async def _inspect(self, project: str, name: str, settings: bytes | None = None,
                       check: Check | None = None) -> dict[str, Any]:
        """One ``python -m piwf.engine.inspect`` run; its one JSON result, or ``Rejected``."""
        mode = [] if settings is None else ["--settings"]
        return await self.isolation.run(["piwf.engine.inspect", *mode, project, name], project,
                                        f"workflow {name!r}", "inspected", stdin=settings or b"", check=check)



def _graph(name: str, made: Any) -> bytes | None:
    """The graph the inspecting process made (it loaded user code: checked here before a run
    records it), as canonical JSON; None when it made none or a malformed one (logged): the
    run starts all the same, its graph unknown."""
    if made is None:
        return None
    try:
        graph = msgspec.convert(made, WorkflowGraph)
    except msgspec.ValidationError as exc:
        log.warning("workflow %r: its graph is malformed (%s); its runs record none", name, exc)
        return None
    return canonical_json(msgspec.to_builtins(graph))
