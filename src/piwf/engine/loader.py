"""Finding and importing workflow files: ``<project>/.piwf/workflows/<name>.py``."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from piwf.errors import DefinitionError, PiwfError, WorkflowLoadError
from piwf.engine.definition import Workflow

WORKFLOW_DIR = Path(".piwf") / "workflows"


def workflow_path(project: str | Path, name: str) -> Path:
    if not name or "/" in name or name.startswith(".") or not name.replace("-", "_").isidentifier():
        raise WorkflowLoadError(f"{name!r} is not a workflow name")
    return Path(project) / WORKFLOW_DIR / f"{name}.py"


def workflow_names(project: str | Path) -> list[str]:
    directory = Path(project) / WORKFLOW_DIR
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.py") if not p.name.startswith("_"))


def import_user_file(path: Path, module_name: str, error: type[PiwfError], *,
                     definitions: bool = False) -> ModuleType:
    """Import a project's file (a workflow or a controller) as ``module_name``; whatever it
    raises on import (``sys.exit()`` too) becomes one ``error`` line naming the file. With
    ``definitions``, a ``DefinitionError`` stays one, prefixed with the file."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        if definitions and isinstance(exc, DefinitionError):
            raise DefinitionError(f"{path}: {exc}") from exc
        tail = traceback.format_exception_only(exc)[-1].strip()
        raise error(f"{path} failed to import: {tail}") from exc
    finally:
        sys.modules.pop(module_name, None)
    return module


def load_workflow(project: str | Path, name: str) -> Workflow:
    path = workflow_path(project, name)
    if not path.is_file():
        raise WorkflowLoadError(f"no workflow {name!r}: {path} does not exist")
    module = import_user_file(path, f"piwf_workflow_{name.replace('-', '_')}", WorkflowLoadError, definitions=True)
    workflow = getattr(module, "workflow", None)
    if not isinstance(workflow, Workflow):
        raise WorkflowLoadError(f"{path} defines no module-level `workflow = Workflow(...)`")
    if workflow.name != name:
        raise WorkflowLoadError(f"{path} defines workflow {workflow.name!r}; the file name says {name!r}")
    return workflow
