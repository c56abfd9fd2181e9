"""The store interface under test: every Protocol the interface module(s) define."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from .recording import Method, interface_methods, protocols_of

INTERFACE_MODULE = "piwf.store.api"


def interface_modules(name: str = INTERFACE_MODULE) -> list[ModuleType]:
    """The interface module, or, if it is a package, it and every module in it."""
    root = importlib.import_module(name)
    modules = [root]
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=name + "."):
        modules.append(importlib.import_module(info.name))
    return modules


def protocols() -> dict[str, type]:
    return {p.__name__: p for p in protocols_of(interface_modules())}


def store_protocol() -> type:
    """The protocol of the whole store (``store.runs``, ``store.transaction()``, ...)."""
    return protocols()["Store"]


def required_methods() -> set[Method]:
    return interface_methods(protocols().values())
