"""piwf: a durable workflow host for one machine."""

from .engine.definition import Route, Workflow, compute, shell
from .engine.executor import Context
from .errors import PiwfError

__all__ = ["Context", "PiwfError", "Route", "Workflow", "compute", "shell"]
__version__ = "0.1.0"
