"""piwf: a durable workflow host for one machine."""

from .engine.definition import Choice, Route, TextInput, Workflow, ask, compute, decision, shell
from .engine.executor import Context, EffectRejected
from .errors import Invalid, PiwfError

__all__ = ["Choice", "Context", "EffectRejected", "Invalid", "PiwfError", "Route", "TextInput", "Workflow", "ask",
           "compute", "decision", "shell"]
__version__ = "0.2.0"
