"""Workflow definitions and execution; knows nothing of hosts."""

from .definition import Compute, Route, Shell, Workflow, compute, shell
from .executor import Context

__all__ = ["Compute", "Context", "Route", "Shell", "Workflow", "compute", "shell"]
