"""A recording proxy over the store interface: which interface methods the tests called.

``Recording(target, protocol, record)`` stands for ``target`` as ``protocol`` (a
``typing.Protocol`` of the store interface) and lets through only what the protocol
declares: an attribute the protocol does not name raises ``AttributeError``, so a
conformance test cannot reach past the interface into a backend. Each method call is
recorded as ``(defining protocol, method)`` before it runs; attributes and results whose
declared type is another interface protocol (``store.runs``, the unit of work a
``transaction()`` yields) are wrapped the same way, so a call through any path counts.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

Method = tuple[str, str]  # (protocol name, method name)
Record = Callable[[Method], None]

_CONTEXT_MANAGERS = {
    contextlib.AbstractAsyncContextManager, collections.abc.AsyncIterator, collections.abc.AsyncGenerator,
    contextlib.AbstractContextManager, collections.abc.Iterator, collections.abc.Generator,
}
_CONTEXT_MANAGER_NAMES = {klass.__name__ for klass in _CONTEXT_MANAGERS}


def is_protocol(obj: object) -> bool:
    return isinstance(obj, type) and bool(getattr(obj, "_is_protocol", False)) and obj is not typing.Protocol


def protocols_of(modules: Iterable[Any]) -> list[type]:
    """Every Protocol class defined (not merely imported) in ``modules``."""
    found: dict[str, type] = {}
    for module in modules:
        for value in vars(module).values():
            if is_protocol(value) and value.__module__ == module.__name__:
                found[value.__qualname__] = value
    return list(found.values())


def _own_members(protocol: type) -> dict[str, Any]:
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def methods_of(protocol: type) -> set[str]:
    """The methods ``protocol`` itself declares (inherited ones count for their own protocol)."""
    return {name for name, value in _own_members(protocol).items()
            if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))}


def interface_methods(protocols: Iterable[type]) -> set[Method]:
    return {(p.__name__, m) for p in protocols for m in methods_of(p)}


def _owner(protocol: type, name: str) -> type | None:
    """The protocol in ``protocol``'s MRO that declares ``name``, if any does."""
    for klass in protocol.__mro__:
        if not is_protocol(klass):
            continue
        if name in vars(klass) or name in vars(klass).get("__annotations__", {}):
            return klass
    return None


@functools.cache
def _hints(protocol: type) -> dict[str, Any]:
    """Attribute annotations of ``protocol`` and its bases, resolved where they can be."""
    hints: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if not is_protocol(klass):
            continue
        try:
            hints.update(typing.get_type_hints(klass))
        except Exception:  # an annotation only importable under TYPE_CHECKING: keep the string
            hints.update(vars(klass).get("__annotations__", {}))
    return hints


@functools.cache
def _return_hint(protocol: type, name: str) -> Any:
    owner = _owner(protocol, name) or protocol
    function = inspect.getattr_static(owner, name)
    if isinstance(function, property):
        function = function.fget
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    try:
        return typing.get_type_hints(function).get("return")
    except Exception:
        return getattr(function, "__annotations__", {}).get("return")


def _resolve_string(hint: str, protocol: type) -> Any:
    """A string annotation's interface protocol, found by name in the protocol's module."""
    namespace = vars(sys.modules[protocol.__module__])
    names = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", hint)
    for name in reversed(names):  # the innermost name: AbstractAsyncContextManager[Unit] -> Unit
        candidate = namespace.get(name)
        if is_protocol(candidate):
            if any(n in _CONTEXT_MANAGER_NAMES for n in names):
                return contextlib.AbstractAsyncContextManager[candidate]  # type: ignore[index]
            return candidate
    return None


def wrap(value: Any, hint: Any, record: Record, protocol: type) -> Any:
    """``value`` wrapped for what ``hint`` declares it is; unchanged if that is no protocol."""
    if isinstance(hint, str):
        hint = _resolve_string(hint, protocol)
    if hint is None or value is None:
        return value
    if is_protocol(hint):
        return Recording(value, hint, record)
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(hint):
            if is_protocol(arg):
                return Recording(value, arg, record)
        return value
    if origin in _CONTEXT_MANAGERS:
        args = typing.get_args(hint)
        inner = args[0] if args else None
        if is_protocol(inner):
            return _RecordingContext(value, inner, record)
    return value


class Recording:
    """``target`` seen only through ``protocol``, every method call recorded."""

    __slots__ = ("_protocol", "_record", "_target")

    def __init__(self, target: Any, protocol: type, record: Record) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_protocol", protocol)
        object.__setattr__(self, "_record", record)

    def __repr__(self) -> str:
        return f"<recording {self._protocol.__name__} of {self._target!r}>"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._protocol.__name__} is used through its interface: cannot set {name!r}")

    def __getattr__(self, name: str) -> Any:
        protocol = self._protocol
        owner = _owner(protocol, name)
        if owner is None or name.startswith("_"):
            raise AttributeError(f"{name!r} is not part of the store interface {protocol.__name__}")
        declared = inspect.getattr_static(owner, name, None)
        value = getattr(self._target, name)
        if isinstance(declared, property):
            return wrap(value, _return_hint(owner, name), self._record, owner)
        if inspect.isfunction(declared) or isinstance(declared, (staticmethod, classmethod)):
            return self._method(owner, name, value)
        return wrap(value, _hints(protocol).get(name), self._record, owner)

    def _method(self, owner: type, name: str, bound: Callable[..., Any]) -> Callable[..., Any]:
        record, hint = self._record, _return_hint(owner, name)
        key = (owner.__name__, name)
        if inspect.iscoroutinefunction(inspect.getattr_static(owner, name)):
            async def call_async(*args: Any, **kwargs: Any) -> Any:
                record(key)
                return wrap(await bound(*args, **kwargs), hint, record, owner)

            return functools.update_wrapper(call_async, bound)

        def call(*args: Any, **kwargs: Any) -> Any:
            record(key)
            result = bound(*args, **kwargs)
            if inspect.isawaitable(result):  # declared ``def f() -> Awaitable[T]``
                return _awaited(result, hint, record, owner)
            return wrap(result, hint, record, owner)

        return functools.update_wrapper(call, bound)


async def _awaited(awaitable: Any, hint: Any, record: Record, owner: type) -> Any:
    if typing.get_origin(hint) in (collections.abc.Awaitable, collections.abc.Coroutine):
        hint = typing.get_args(hint)[-1]
    return wrap(await awaitable, hint, record, owner)


class _RecordingContext:
    """A context manager whose entered value is seen through ``protocol``."""

    def __init__(self, target: Any, protocol: type, record: Record) -> None:
        self._target, self._protocol, self._record = target, protocol, record

    async def __aenter__(self) -> Any:
        return wrap(await self._target.__aenter__(), self._protocol, self._record, self._protocol)

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._target.__aexit__(*exc)

    def __enter__(self) -> Any:
        return wrap(self._target.__enter__(), self._protocol, self._record, self._protocol)

    def __exit__(self, *exc: Any) -> Any:
        return self._target.__exit__(*exc)


class Coverage:
    """The interface methods called, per backend, over a test session."""

    def __init__(self) -> None:
        self.calls: dict[str, set[Method]] = {}

    def recorder(self, backend: str) -> Record:
        seen = self.calls.setdefault(backend, set())
        return seen.add

    def missing(self, required: set[Method]) -> dict[str, list[Method]]:
        """For each backend that was exercised at all, the required methods it never saw."""
        return {backend: sorted(required - seen) for backend, seen in self.calls.items() if seen and required - seen}


COVERAGE = Coverage()
