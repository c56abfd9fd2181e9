"""piwf: a durable workflow host for one machine."""

from .engine.definition import Route, Workflow, compute, shell
from .engine.executor import Context, EffectRejected
from .errors import PiwfError

__all__ = ["Context", "EffectRejected", "PiwfError", "Route", "Workflow", "compute", "shell"]
__version__ = "0.2.0"
