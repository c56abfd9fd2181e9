"""Workflow lookup for ``run.start``: validate and digest in a throwaway process.

User code never runs inside the host. Results are cached by the file's content hash, and
the file is not read again while its size, mtime and inode stay as they were.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from piwf.engine.loader import workflow_path
from piwf.errors import PiwfError, Rejected
from piwf.wire import canonical_json, decode_json, sha256_hex

INSPECT_TIMEOUT_S = 30


@dataclass(frozen=True)
class WorkflowInfo:
    name: str
    digest: str
    source: bytes
    start_at: str
    settings: dict[str, Any] | None = None  # {"defaults", "mutable"} when the workflow declares settings


class Catalog:
    def __init__(self) -> None:
        # (path, source hash) -> (digest, start node, settings declaration)
        self._cache: dict[tuple[str, str], tuple[str, str, Any]] = {}
        self._seen: dict[str, tuple[tuple[int, int, int], WorkflowInfo]] = {}  # path -> (stat key, info)

    async def inspect(self, project: str, name: str) -> WorkflowInfo:
        try:
            path = workflow_path(project, name)
            stat = path.stat()
            stat_key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            seen = self._seen.get(str(path))
            if seen is not None and seen[0] == stat_key:  # unchanged since the last start
                return seen[1]
            source = await trio.Path(path).read_bytes()
        except PiwfError as exc:
            raise Rejected(str(exc)) from exc
        except OSError as exc:
            raise Rejected(f"no workflow {name!r} in {project}: {path} {(exc.strerror or str(exc)).lower()}") from exc
        key = (str(path), sha256_hex(source))
        if key not in self._cache:
            self._cache[key] = await self._digest(project, name)
        digest, start_at, settings = self._cache[key]
        info = WorkflowInfo(name, digest, source, start_at, settings)
        self._seen[str(path)] = (stat_key, info)
        return info

    async def _digest(self, project: str, name: str) -> tuple[str, str, Any]:
        result = await _inspect(project, name)
        return result["digest"], result["startAt"], result.get("settings")

    async def resolve_settings(self, project: str, name: str, *, current: Any, patch: Any,
                               mutable_only: bool) -> tuple[str, Any]:
        """(digest, settings): ``patch`` merged into ``current`` and checked against the
        workflow's settings type (and, with ``mutable_only``, its mutable paths) in a
        throwaway process, with the workflow file as it is now."""
        request = canonical_json({"current": current, "patch": patch, "mutableOnly": mutable_only})
        result = await _inspect(project, name, settings=request)
        return result["digest"], result["settings"]


async def _inspect(project: str, name: str, settings: bytes | None = None) -> dict[str, Any]:
    """One ``python -m piwf.engine.inspect`` run; its one JSON result, or ``Rejected``."""
    mode = [] if settings is None else ["--settings"]
    return await run_isolated(["piwf.engine.inspect", *mode, project, name], project, f"workflow {name!r}",
                              "inspected", stdin=settings or b"")


async def run_isolated(module_args: list[str], project: str, what: str, verb: str,
                       stdin: bytes = b"") -> dict[str, Any]:
    """``python -m MODULE ARGS`` in a throwaway process in ``project`` (user code never runs
    in the host), within INSPECT_TIMEOUT_S: the one JSON line it prints last, or
    ``Rejected`` saying why ``what`` could not be ``verb``."""
    try:
        with trio.move_on_after(INSPECT_TIMEOUT_S) as timeout:
            done = await trio.run_process(
                [sys.executable, "-m", *module_args], stdin=stdin,
                capture_stdout=True, capture_stderr=True, check=False, cwd=Path(project),
            )
    except OSError as exc:
        raise Rejected(f"{what} could not be {verb}: {exc}") from None
    if timeout.cancelled_caught:
        raise Rejected(f"{what} took over {INSPECT_TIMEOUT_S} s to load")
    try:
        result: dict[str, Any] = decode_json(done.stdout.strip().splitlines()[-1])
    except (PiwfError, IndexError):
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise Rejected(f"{what} could not be {verb}: {tail[0]}") from None
    if "error" in result:
        raise Rejected(result["error"])
    return result
