"""Finding and importing workflow files: ``<project>/.piwf/workflows/<name>.py``.

How a project's named file is found, imported and checked (``user_file_path``,
``import_user_file``, ``load_named``) is written once here; ``piwf.controllers.loader``
loads controller files with the same functions."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeVar

from piwf.errors import DefinitionError, PiwfError, WorkflowLoadError
from piwf.engine.definition import Workflow

WORKFLOW_DIR = Path(".piwf") / "workflows"


def user_file_path(project: str | Path, directory: Path, name: str, kind: str, error: type[PiwfError]) -> Path:
    """``<project>/<directory>/<name>.py`` of a project's ``kind`` (``workflow``,
    ``controller``); a name that is not one (empty, a path, a dotfile) is refused as ``error``."""
    if not name or "/" in name or name.startswith(".") or not name.replace("-", "_").isidentifier():
        raise error(f"{name!r} is not a {kind} name")
    return Path(project) / directory / f"{name}.py"


def workflow_path(project: str | Path, name: str) -> Path:
    return user_file_path(project, WORKFLOW_DIR, name, "workflow", WorkflowLoadError)


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


class Named(Protocol):
    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)


def load_named(path: Path, name: str, kind: str, cls: type[N], error: type[PiwfError], *,
               definitions: bool = False) -> N:
    """The ``kind`` (``workflow``, ``controller``) called ``name`` that the project's file
    ``path`` defines: its module-level ``<kind> = <cls>(...)``, with that name."""
    if not path.is_file():
        raise error(f"no {kind} {name!r}: {path} does not exist")
    module = import_user_file(path, f"piwf_{kind}_{name.replace('-', '_')}", error, definitions=definitions)
    found = getattr(module, kind, None)
    if not isinstance(found, cls):
        raise error(f"{path} defines no module-level `{kind} = {cls.__name__}(...)`")
    if found.name != name:
        raise error(f"{path} defines {kind} {found.name!r}; the file name says {name!r}")
    return found


def load_workflow(project: str | Path, name: str) -> Workflow:
    return load_named(workflow_path(project, name), name, "workflow", Workflow, WorkflowLoadError, definitions=True)
