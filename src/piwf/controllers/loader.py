"""Finding and importing controller files: ``<project>/.piwf/controllers/<name>.py``.

``python -m piwf.controllers.loader PROJECT NAME`` loads one in a throwaway process and
prints ``{"name", "timeoutS", "initialStatus"}`` or ``{"error"}`` as one JSON line: the host
checks a controller this way on ``controller.apply``, so user code never runs inside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from piwf.engine.loader import load_named, user_file_path
from piwf.errors import ControllerLoadError, PiwfError
from piwf.wire import canonical_json
from piwf.controllers import Controller

CONTROLLER_DIR = Path(".piwf") / "controllers"


def controller_path(project: str | Path, name: str) -> Path:
    return user_file_path(project, CONTROLLER_DIR, name, "controller", ControllerLoadError)


def load_controller(project: str | Path, name: str) -> Controller:
    return load_named(controller_path(project, name), name, "controller", Controller, ControllerLoadError)


def inspect_controller(project: str, name: str) -> dict[str, Any]:
    try:
        controller = load_controller(project, name)
        canonical_json(controller.initial_status)
    except PiwfError as exc:
        return {"error": str(exc)}
    except TypeError as exc:
        return {"error": f"controller {name!r}: initial_status is not JSON: {exc}"}
    return {"name": controller.name, "timeoutS": controller.timeout, "initialStatus": controller.initial_status}


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: python -m piwf.controllers.loader PROJECT NAME", file=sys.stderr)
        return 2
    result_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # user code prints to stderr; stdout carries only the one JSON line
    result = inspect_controller(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    result_out.write(canonical_json(result) + b"\n")
    result_out.close()
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
