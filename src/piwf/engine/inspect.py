"""``python -m piwf.engine.inspect PROJECT NAME``: load and validate a workflow in a
throwaway process, printing ``{"name", "digest", "startAt", "nodes"}`` or ``{"error"}`` as JSON.

The host uses it so user code never runs inside the supervisor.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import PiwfError
from ..wire import canonical_json
from .loader import load_workflow


def inspect_workflow(project: str, name: str) -> dict[str, Any]:
    try:
        workflow = load_workflow(project, name)
    except PiwfError as exc:
        return {"error": str(exc)}
    return {"name": workflow.name, "digest": workflow.digest(), "startAt": workflow.start_at,
            "nodes": sorted(workflow.nodes)}


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: python -m piwf.engine.inspect PROJECT NAME", file=sys.stderr)
        return 2
    result = inspect_workflow(sys.argv[1], sys.argv[2])
    sys.stdout.buffer.write(canonical_json(result) + b"\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
