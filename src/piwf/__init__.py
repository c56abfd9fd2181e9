"""piwf: a durable workflow host for one machine."""

from .engine.definition import Choice, Route, TextInput, Workflow, ask, compute, decision, shell
from .engine.executor import Context, EffectRejected
from .controllers import Controller, Result
from .errors import Invalid, PermanentError, PiwfError, TemporaryError

__all__ = ["Choice", "Context", "Controller", "EffectRejected", "Invalid", "PermanentError", "PiwfError", "Result",
           "Route", "TemporaryError", "TextInput", "Workflow", "ask", "compute", "decision", "shell"]
__version__ = "0.2.0"
