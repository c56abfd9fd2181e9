"""Controllers, the user side (DESIGN.md §9): ``Controller``, ``Result``, and what a
reconcile function gets as ``ctx``.

A project keeps controllers in ``<project>/.piwf/controllers/<name>.py``; each module
defines a module-level ``controller = Controller(name, reconcile, initial_status)``. The
reconcile function runs in a worker process, never in the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Result:
    """What a reconcile returns. Build one with ``settled``, ``requeue`` or ``requeue_after``."""

    kind: str  # settled | requeue
    status: Any = None
    keep_status: bool = True
    conditions: tuple[dict[str, Any], ...] = ()
    finalizers: list[str] | None = None
    requeue_after_ms: int = 0

    @classmethod
    def settled(cls, status: Any = None, conditions: Sequence[dict[str, Any]] = (),
                finalizers: Sequence[str] | None = None) -> Result:
        """Done until something changes. ``status=None`` keeps the controller status;
        conditions not returned are kept; ``finalizers=None`` keeps them, a list replaces them."""
        return cls("settled", status, status is None, _conditions(conditions), _finalizers(finalizers))

    @classmethod
    def requeue(cls, status: Any = None, conditions: Sequence[dict[str, Any]] = (),
                finalizers: Sequence[str] | None = None) -> Result:
        """Reconcile again soon: after 1 s, the shortest requeue delay (requeues are
        rate-limited, so a controller that always requeues runs a pass a second)."""
        return cls("requeue", status, status is None, _conditions(conditions), _finalizers(finalizers))

    @classmethod
    def requeue_after(cls, ms: int, status: Any = None, conditions: Sequence[dict[str, Any]] = (),
                      finalizers: Sequence[str] | None = None) -> Result:
        """Reconcile again after ``ms`` milliseconds, at least 1000 (earlier if the
        resource changes or a reconcile is requested)."""
        if not isinstance(ms, int) or ms < 0:
            raise ValueError(f"requeue_after needs a non-negative whole number of milliseconds, not {ms!r}")
        return cls("requeue", status, status is None, _conditions(conditions), _finalizers(finalizers), ms)


def _conditions(conditions: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    checked = tuple(dict(c) for c in conditions)
    kinds = [c.get("type") for c in checked]
    duplicated = {k for k in kinds if kinds.count(k) > 1}
    if duplicated:
        raise ValueError(f"condition type {sorted(map(str, duplicated))[0]!r} given twice")
    return checked


def _finalizers(finalizers: Sequence[str] | None) -> list[str] | None:
    if finalizers is None:
        return None
    if isinstance(finalizers, str) or not all(isinstance(f, str) and f for f in finalizers):
        raise ValueError("finalizers must be a list of non-empty strings")
    return list(finalizers)


@dataclass(frozen=True)
class Controller:
    name: str
    reconcile: Callable[[Any], Result]
    initial_status: Any = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT_S  # seconds one reconcile may take before it is stopped

    def __post_init__(self) -> None:
        if not callable(self.reconcile):
            raise TypeError("Controller(reconcile=...) must be callable")
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout <= 86_400):
            raise ValueError("Controller(timeout=...) must be seconds, more than 0 and at most 86400")


@dataclass(frozen=True)
class Resource:
    """What the reconcile is driving: as the host had it when this pass began."""

    uid: str
    key: str
    controller: str
    spec: Any
    status: dict[str, Any]
    generation: int
    resource_version: int
    finalizers: list[str]
    deletion_timestamp: str | None  # None unless deletion was requested

    @property
    def resourceVersion(self) -> int:
        return self.resource_version


__all__ = ["DEFAULT_TIMEOUT_S", "Controller", "Resource", "Result"]
