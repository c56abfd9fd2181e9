"""Controllers (DESIGN.md §9): resources, their reconcile queue, their effects and child runs.

Every method may also raise StorageUnavailable and StoreError (see ``piwf.store.api``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from piwf.protocol.resources import ApplyReceipt, ResourceDetail, ResourceRef, ResourceSummary
    from piwf.store.api.types import ControllerClaim, Delay


class ControllersStore(Protocol):
    """Controller resources: apply, delete, reconcile requests, reads."""

    async def apply_resource(
            self, *, project: str, controller: str, key: str, spec: Any, initial: Any, expected_version: int | None,
            now: int) -> ApplyReceipt:
        """Create the resource, or change its spec; the same spec again writes nothing. A new or changed spec
        is queued for a reconcile (and lifts a hold after a permanent error). Raises Conflict, Rejected.
        """

    async def request_reconcile(self, project: str, controller: str, key: str, now: int) -> ResourceRef:
        """Queue a reconcile. Deduplicated: however many arrive while one is queued, one runs; while one runs,
        one more runs after it. An operator's request lifts a permanent-error hold too. Raises NotFound.
        """

    async def request_delete(
            self, project: str, controller: str, key: str, now: int, *, force: bool = False) -> ResourceRef:
        """Set the deletion timestamp (once) and queue a reconcile, which must clear the finalizers; a resource
        without finalizers that no reconcile holds goes at once. ``force``: the resource goes now,
        finalizers and all, without a reconcile (a pass running for it loses its claim; nothing it writes
        afterwards is kept). Raises NotFound.
        """

    async def get_resource(self, project: str, controller: str, key: str, now: int) -> ResourceDetail:
        """Raises NotFound."""

    async def list_resources(self, project: str | None, controller: str | None) -> list[ResourceSummary]:
        ...

    async def locate_uid(self, project: str, controller: str, key: str) -> str:
        """Raises NotFound."""

    async def status_counts(self, now: int) -> dict[str, int]:
        ...

    async def add_resource_event(self, uid: str, kind: str, payload: dict[str, Any], now: int) -> None:
        """Record an event; a resource keeps its last ``KEPT_EVENTS`` exactly (one requeued every second for a
        year must not fill the disk). Event ids only grow, so a resource whose oldest event is fewer than
        ``KEPT_EVENTS`` ids back cannot have too many: the common case costs one index lookup.
        """


class ControllerQueueStore(Protocol):
    """The controller queue: claims (token, lease, claim number) and reconcile
    results. A reconcile worker's message is one unit of work opened by ``fence`` (which
    renews the claim); ``reconcile_view``, ``finish_success`` and ``finish_failure`` name no
    token: call them on such a unit of work only.
    """

    async def claim_due(
            self, *, room: int, exclude: frozenset[str], lease_ms: int, now: int, epoch: int) -> list[ControllerClaim]:
        """Claim up to ``room`` due resources (oldest due first) that this host is not already reconciling; a
        row whose claim expired is due again.
        """

    async def next_due(self) -> int | None:
        """When the next row becomes claimable (ms), or None when none will by itself."""

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        """Renew live claims; returns the uids whose claim was lost (expired, or taken)."""

    async def expire_claims_before(self, epoch: int, now: int) -> int:
        """On takeover: reconciles an earlier host was running are due again at once, each counted as an error
        (their workers died with that host, or were killed by the caller).
        """

    async def attach_worker(self, uid: str, token: str, pid: int, identity: str) -> None:
        """Record the reconcile worker's process (pid and start identity) on its claim, so a host taking over
        can kill it (``orphaned_workers``).
        """

    async def orphaned_workers(self, epoch: int) -> list[tuple[str, int, str]]:
        """(uid, pid, identity) of the reconcile workers recorded by claims of earlier hosts."""

    async def fence(self, uid: str, token: str, lease_ms: int, now: int) -> None:
        """Inside a worker message's transaction: the claim is live (else ClaimLost), and the message renews
        it. Raises ClaimLost.
        """

    async def reconcile_view(self, uid: str) -> dict[str, Any]:
        """What a reconcile starts from; the ``resourceVersion`` shown becomes the claim's compare-and-set
        token. Call fenced. Raises ClaimLost.
        """

    async def finish_success(
            self, uid: str, token: str, *, requeue_after_ms: int | None, settled: bool, controller_status: Any,
            conditions: list[dict[str, Any]], finalizers: list[str] | None, keep_status: bool, now: int) -> str:
        """Record a reconcile's result: 'settled', 'requeued', 'deleted', or 'conflict' (the resource changed
        after its worker read it: nothing written but the requeue). Call fenced. Raises Rejected.
        """

    async def finish_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, permanent: bool, now: int,
            counted: bool = True) -> int:
        """Record a failed reconcile: the error, the count in a row, and the next attempt after ``delay_ms``
        (at once if an event arrived meanwhile). A permanent error sets ``Ready=False`` and holds the
        resource until its spec changes, unless the resource or a request moved on during the pass: then it
        is reconciled again at once. Returns the count. Raises Rejected.
        """

    async def record_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, now: int, counted: bool = True) -> int | None:
        """A reconcile that ended without reporting (crash, timeout, host stop), recorded by the host after its
        worker is gone; None when the claim was lost meanwhile. Not ``counted``: its worker could not even
        start (not the resource's fault). Raises Rejected.
        """


class ControllerEffectsStore(Protocol):
    """A resource's effect ledger and the child runs it started, fenced by the claim's
    number (``ControllerClaim.claim_number``, these methods' ``generation``) and the resource's
    spec generation; call them on the unit of work of a fenced reconcile message (after
    ``controller_queue.fence``), except ``resolve`` and ``sync_children``, which are each one
    commit of their own.
    """

    async def reserve(
            self, uid: str, spec_generation: int, key: str, *, generation: int, observable: bool, now: int,
            kind: str | None = None, fingerprint: str | None = None,
    ) -> dict[str, Any]:
        """What ``ctx.effects.ensure(key, ...)`` must do next: ``new`` (apply it), ``applied`` / ``rejected``
        (return or raise what is stored), ``observe``, or ``ambiguous`` (the resource is now held). The
        effect is identified by its key, ``kind`` and request ``fingerprint``: the key reserved before for
        another kind or fingerprint raises Conflict. Raises Rejected.
        """

    async def begin_apply(self, uid: str, spec_generation: int, key: str, *, generation: int, now: int) -> None:
        """Raises Rejected."""

    async def settle(
            self, uid: str, spec_generation: int, key: str, *, generation: int, result: Any = None,
            error: dict[str, Any] | None = None, now: int) -> None:
        """Raises Rejected."""

    async def resolve(self, uid: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        """An operator says whether an ambiguous effect was applied; the resource's hold is lifted (and a
        reconcile queued) once none is left. Raises NotFound.
        """

    async def find_child(self, uid: str, request_key: str, workflow: str, run_input: Any) -> dict[str, Any] | None:
        """The child run recorded for ``request_key``, or None (start one). The same key with another workflow
        or input is refused. Raises Rejected.
        """

    async def record_child(
            self, uid: str, request_key: str, workflow: str, run_input: Any, run_id: str, now: int) -> dict[str, Any]:
        """Raises Rejected."""

    async def sync_children(self, now: int) -> list[str]:
        """Child runs whose state moved on (running → waiting or ended): recorded, shown in their resource's
        ``status.workflowRun``, and the resource queued. Returns their uids. Raises Rejected.
        """
