"""The host ↔ reconcile worker protocol: the same framing, envelope fields and answers as
a run's worker (``piwf.protocol.worker``), with its own operations.

A reconcile worker is launched with ``$PIWF_RECONCILE_LAUNCH`` (``ReconcileLaunch``) and
speaks for one claim of one resource: ``generation`` is the claim's number. Its effects use
the run workers' ``effect.reserve|apply|settle`` messages, answered from the resource's
effect ledger.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from piwf.protocol.steering import WorkflowChangeSettings, WorkflowQueueFollowUp, WorkflowRemoveFollowUp
from piwf.wire import decode_with
from piwf.protocol.worker import (
    RECONCILE_LAUNCH_SCHEMA, WORKER_PROTOCOL_VERSION, Count, EffectApply, EffectReserve, EffectSettle, LoadError,
    Payload, Result, Text, WorkerMessage,
)

LAUNCH_VAR = "PIWF_RECONCILE_LAUNCH"
EFFECT_NODE = "reconcile"  # the ``node`` a reconcile's effect.reserve names


class ReconcileLaunch(msgspec.Struct, forbid_unknown_fields=True):
    uid: str
    generation: int
    workerEpoch: str
    projectPath: str
    controller: str
    schema: str = RECONCILE_LAUNCH_SCHEMA
    protocolVersion: int = WORKER_PROTOCOL_VERSION
    claimLeaseMs: int = 0  # the reconcile claim's lease: bounds the worker's wait for the host (0: unbounded)
    vouchedUntilMs: int = 0  # until when (the machine's monotonic clock, ms) the host vouches for the claim


# --- payloads --------------------------------------------------------------------------------


class ReconcileReadyPayload(Payload, frozen=True):
    """The controller loaded (with its timeout), or why it could not."""

    timeoutS: float | None = None
    loadError: LoadError | None = None


class ReconcileFinishPayload(Payload, frozen=True):
    settled: bool
    requeueAfterMs: Count = 0
    keepStatus: bool = True
    status: Any = None
    conditions: list[dict[str, Any]] = msgspec.field(default_factory=list)
    finalizers: list[str] | None = None


class ReconcileFailPayload(Payload, frozen=True):
    error: Annotated[str, msgspec.Meta(max_length=8192)]
    permanent: bool = False
    delayMs: Count | None = None  # TemporaryError(delay=): this wait instead of the back-off


class WorkflowEnsurePayload(Payload, frozen=True):
    requestKey: Text
    workflow: Text
    input: Any = None
    originSessionId: str | None = None  # the child run's origin session (run settings: follow-ups go there)


class ReconcileLogPayload(Payload, frozen=True):
    message: Annotated[str, msgspec.Meta(max_length=2000)]


# --- messages --------------------------------------------------------------------------------


class ReconcileReady(WorkerMessage, tag="reconcile.ready"):
    payload: ReconcileReadyPayload = ReconcileReadyPayload()


class ReconcileFinish(WorkerMessage, tag="reconcile.finish"):
    payload: ReconcileFinishPayload


class ReconcileFail(WorkerMessage, tag="reconcile.fail"):
    payload: ReconcileFailPayload


class WorkflowEnsure(WorkerMessage, tag="workflow.ensure"):
    payload: WorkflowEnsurePayload


class ReconcileLog(WorkerMessage, tag="reconcile.log"):
    payload: ReconcileLogPayload


AnyReconcileMessage = (ReconcileReady | ReconcileFinish | ReconcileFail | WorkflowEnsure | ReconcileLog
                       | EffectReserve | EffectApply | EffectSettle
                       | WorkflowChangeSettings | WorkflowQueueFollowUp | WorkflowRemoveFollowUp)
RECONCILE_OPERATIONS = {cls.__struct_config__.tag: cls for cls in AnyReconcileMessage.__args__}


# --- answers ---------------------------------------------------------------------------------


class ReconcileStart(Result):
    resource: dict[str, Any] | None = None  # uid, key, controller, spec, status, generation, ...
    stop: bool = False  # nothing to do: the controller did not load (the failure is recorded)


class ChildRun(Result):
    requestKey: str
    runId: str
    state: str  # running | waiting | succeeded | failed
    attempt: int
    output: Any = None


_decoder = msgspec.json.Decoder(AnyReconcileMessage)


def parse_reconcile_message(line: bytes) -> WorkerMessage:
    return decode_with(_decoder, line, "reconcile worker message")
