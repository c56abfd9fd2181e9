"""``python -m piwf.engine.inspect PROJECT NAME``: load and validate a workflow in a
throwaway process, printing ``{"name", "digest", "startAt", "nodes", "settings", "graph"}`` (``graph``: the
``WorkflowGraph`` a run records, ``piwf.engine.graph``) or
``{"error"}`` as JSON.

``python -m piwf.engine.inspect --settings PROJECT NAME`` reads ``{"current", "patch",
"mutableOnly"}`` from stdin and prints ``{"digest", "settings"}`` (the settings after the
merge patch, checked against the workflow's own settings type) or ``{"error"}``: how the
host checks ``run.start`` settings and ``workflow.changeSettings`` without running user code.

The host (``host/catalog.py``) and ``piwf workflows list`` (``inspect_isolated`` below) use
it so user code never runs inside the supervisor or the CLI: an import that hangs is
killed after a timeout, and one that exits or prints cannot touch their output. Whatever
the workflow prints while loading goes to this process's stderr; stdout carries only the
one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from piwf.errors import PiwfError
from piwf.wire import canonical_json
from piwf.engine import settings as run_settings
from piwf.engine.graph import workflow_graph
from piwf.engine.loader import load_workflow

PARALLEL = 8  # workflows loaded at once by inspect_all


def inspect_workflow(project: str, name: str) -> dict[str, Any]:
    try:
        workflow = load_workflow(project, name)
    except PiwfError as exc:
        return {"error": str(exc)}
    declared = None if workflow.settings is None else {
        "defaults": run_settings.defaults(workflow.settings), "mutable": list(workflow.mutable)}
    return {"name": workflow.name, "digest": workflow.digest(), "startAt": workflow.start_at,
            "nodes": sorted(workflow.nodes), "settings": declared, "graph": _graph(workflow)}


def _graph(workflow: Any) -> Any:
    """The graph a run records, or None: a graph that cannot be made never keeps a run from
    starting (its ``run.graph`` then says the graph is unknown)."""
    try:
        return msgspec.to_builtins(workflow_graph(workflow))
    except Exception as exc:  # whatever went wrong, the run starts without its graph
        print(f"piwf: the graph of workflow {workflow.name!r} could not be made: {exc!r}", file=sys.stderr)
        return None


def resolve_settings(project: str, name: str, request: dict[str, Any]) -> dict[str, Any]:
    """The settings after ``request["patch"]`` for workflow ``name`` as its file is now."""
    try:
        workflow = load_workflow(project, name)
        settings = run_settings.resolve(name, workflow.settings, workflow.mutable, request.get("current"),
                                        request.get("patch"), mutable_only=bool(request.get("mutableOnly")))
    except PiwfError as exc:
        return {"error": str(exc)}
    return {"digest": workflow.digest(), "settings": settings}


def main() -> int:
    args = sys.argv[1:]
    settings_mode = args[:1] == ["--settings"]
    if settings_mode:
        args = args[1:]
    if len(args) != 2:
        print("usage: python -m piwf.engine.inspect [--settings] PROJECT NAME", file=sys.stderr)
        return 2
    request = json.loads(sys.stdin.buffer.read() or b"{}") if settings_mode else {}
    result_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # from here on, fd 1 (and so sys.stdout) is stderr: user code prints there
    project, name = args
    result = resolve_settings(project, name, request) if settings_mode else inspect_workflow(project, name)
    sys.stdout.flush()
    result_out.write(canonical_json(result) + b"\n")
    result_out.close()
    return 1 if "error" in result else 0


# --- the parent's side -------------------------------------------------------------------------


def inspect_all(project: Path, names: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """``inspect_isolated`` for each name, a few at a time, in order."""
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(names))) as pool:
        return list(pool.map(lambda name: inspect_isolated(project, name, timeout_s), names))


def inspect_isolated(project: Path, name: str, timeout_s: float) -> dict[str, Any]:
    """Load one workflow in a child process (its own process group, cwd the project) and
    return what it printed, or ``{"error": one line}`` when it failed, hung or died."""
    child = subprocess.Popen(
        [sys.executable, "-m", "piwf.engine.inspect", str(project), name], cwd=project,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(child)
        return {"error": f"workflow {name!r} took over {timeout_s:g} s to load (killed)"}
    return _result(name, child.returncode, stdout, stderr)


def _kill(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group and reap it; give up on its pipes if a process
    that left the group still holds them."""
    with contextlib.suppress(ProcessLookupError):  # already gone: only the reaping is left
        os.killpg(child.pid, signal.SIGKILL)
    try:
        child.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
        child.wait()


def _result(name: str, status: int, stdout: bytes, stderr: bytes) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        result = None
    if isinstance(result, dict) and ("error" in result or "digest" in result):
        return result
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    tail = stderr.decode(errors="replace").strip().splitlines()[-1:]
    said = f": {' '.join(tail[0].split())}" if tail else ""
    return {"error": f"loading workflow {name!r} {how} before reporting{said}"}


if __name__ == "__main__":
    sys.exit(main())
