"""piwf: a durable workflow host for one machine.

What a workflow or controller file imports (``from piwf import Workflow, compute``) is
loaded on first use, so the command line, which imports ``piwf.cli``, starts without the
engine.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the CLI imports this package)
if TYPE_CHECKING:
    from typing import Any

    from piwf.controllers import Controller, Result
    from piwf.engine.definition import Choice, Route, TextInput, Workflow, ask, compute, decision, shell
    from piwf.engine.executor import Context, EffectRejected
    from piwf.errors import Invalid, PermanentError, PiwfError, TemporaryError

_EXPORTS = {
    "piwf.engine.definition": ("Choice", "Route", "TextInput", "Workflow", "ask", "compute", "decision", "shell"),
    "piwf.engine.executor": ("Context", "EffectRejected"),
    "piwf.controllers": ("Controller", "Result"),
    "piwf.errors": ("Invalid", "PermanentError", "PiwfError", "TemporaryError"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["Choice", "Context", "Controller", "EffectRejected", "Invalid", "PermanentError", "PiwfError", "Result",
           "Route", "TemporaryError", "TextInput", "Workflow", "ask", "compute", "decision", "shell"]
__version__ = "0.3.0"


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'piwf' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
