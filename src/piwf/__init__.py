"""piwf: a durable workflow host for one machine."""

from .engine.definition import Route, Workflow, compute, shell
from .engine.executor import Context, EffectRejected
from .controllers import Controller, Result
from .errors import PermanentError, PiwfError, TemporaryError

__all__ = ["Context", "Controller", "EffectRejected", "PermanentError", "PiwfError", "Result", "Route",
           "TemporaryError", "Workflow", "compute", "shell"]
__version__ = "0.2.0"
