"""Workflow definitions and execution; knows nothing of hosts."""

from piwf.engine.definition import Compute, Route, Shell, Workflow, compute, shell
from piwf.engine.executor import Context

__all__ = ["Compute", "Context", "Route", "Shell", "Workflow", "compute", "shell"]
