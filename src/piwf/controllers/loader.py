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

from piwf.engine.loader import import_user_file
from piwf.errors import ControllerLoadError, PiwfError
from piwf.wire import canonical_json
from piwf.controllers import Controller

CONTROLLER_DIR = Path(".piwf") / "controllers"


def controller_path(project: str | Path, name: str) -> Path:
    if not name or "/" in name or name.startswith(".") or not name.replace("-", "_").isidentifier():
        raise ControllerLoadError(f"{name!r} is not a controller name")
    return Path(project) / CONTROLLER_DIR / f"{name}.py"


def load_controller(project: str | Path, name: str) -> Controller:
    path = controller_path(project, name)
    if not path.is_file():
        raise ControllerLoadError(f"no controller {name!r}: {path} does not exist")
    module = import_user_file(path, f"piwf_controller_{name.replace('-', '_')}", ControllerLoadError)
    controller = getattr(module, "controller", None)
    if not isinstance(controller, Controller):
        raise ControllerLoadError(f"{path} defines no module-level `controller = Controller(...)`")
    if controller.name != name:
        raise ControllerLoadError(f"{path} defines controller {controller.name!r}; the file name says {name!r}")
    return controller


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
