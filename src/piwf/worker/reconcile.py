"""A reconcile worker: one pass of one controller over one resource, for one claim.

Started like a run's worker (by the fork server, or ``python -m piwf.worker``) with
``$PIWF_RECONCILE_LAUNCH`` instead of ``$PIWF_WORKER_LAUNCH``. It loads the controller,
says ready (the host answers with the resource), calls ``reconcile(ctx)`` and reports the
``Result``, or the error: ``TemporaryError(delay=)`` retries after its delay,
``PermanentError`` holds the resource until its spec changes, anything else backs off.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from piwf.protocol.reconcile import (
    EFFECT_NODE, LAUNCH_VAR, ChildRun, ReconcileFail, ReconcileFailPayload, ReconcileFinish, ReconcileFinishPayload,
    ReconcileLaunch, ReconcileLog, ReconcileLogPayload, ReconcileReady, ReconcileReadyPayload, ReconcileStart,
    WorkflowEnsure, WorkflowEnsurePayload,
)
from piwf.protocol.steering import (
    ChangeSettingsPayload, FollowUpQueued, QueueFollowUpPayload, RemoveFollowUpPayload, SettingsChanged,
    WorkflowChangeSettings, WorkflowQueueFollowUp, WorkflowRemoveFollowUp,
)
from piwf.controllers import Controller, Resource, Result
from piwf.controllers.loader import load_controller
from piwf.engine.executor import MAX_OUTPUT_NESTING, EffectRejected, Stop
from piwf.engine.values import NotJson, TooDeep, as_stored
from piwf.errors import ClaimLost, PermanentError, PiwfError, TemporaryError
from piwf.wire import sha256_hex
from piwf.worker.journal import HostJournal
from piwf.worker.channel import Channel
from piwf.protocol.worker import LOAD_ERROR_LIMIT, RECONCILE_LAUNCH_SCHEMA, LaunchRefused, decode_launch

EXIT_LAUNCH = 5  # as a run's worker: the launch envelope was not one this worker follows

TRACEBACK_TAIL = 4000
DEFAULT_KIND = "effect"


class Effects:
    """``ctx.effects``: keyed side effects on the resource's ledger (once per spec generation)."""

    def __init__(self, channel: Channel) -> None:
        self._journal = HostJournal(channel)  # the run worker's effect steps, reused as they are

    def ensure(self, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None = None, *,
               kind: str = DEFAULT_KIND, request: Any = None) -> Any:
        """Apply ``apply()`` once for this key and spec generation and return its result; a
        later pass gets the stored result. ``observe()`` (result, or None when not applied)
        lets a pass after a crash mid-apply find out instead of holding the resource. An
        exception from ``apply()`` fails the pass and the next pass applies it again; a
        ``PermanentError`` from it is stored and raised again for this spec generation.
        ``kind`` (text) names the action and ``request`` (JSON) what it is asked to do: with
        the key they are the effect's identity, so the key reused for another kind or
        request fails the pass (a conflict) instead of returning the other action's result."""
        if not isinstance(kind, str) or not 0 < len(kind) <= 128:
            raise PiwfError(f"effect {key!r}: kind must be text of 1 to 128 characters, not {kind!r}")
        try:  # JSON exactly (engine/values.py): NaN taken as null would be another request's fingerprint
            encoded, _ = as_stored(request, f"effect {key!r}: request", MAX_OUTPUT_NESTING)
        except (NotJson, TooDeep) as exc:
            raise PiwfError(str(exc)) from None
        fingerprint = sha256_hex(encoded)
        try:
            return self._journal.effect(EFFECT_NODE, key, apply, observe, kind=kind, fingerprint=fingerprint)
        except EffectRejected as exc:  # only a PermanentError is stored as rejected
            raise PermanentError(f"effect {key!r}: {exc.error.get('message', '')}") from None


class Workflows:
    """``ctx.workflows``: child workflow runs, one per request key."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def ensure(self, request_key: str, workflow: str, input: Any = None, *,
               session: str | None = None) -> dict[str, Any]:
        """Start the run, or find the one started for ``request_key``: ``{runId, state,
        attempt, output}`` (state: running, waiting, succeeded, failed). Its end queues
        this resource again. ``session``: the new run's origin session (its turns and
        follow-ups go there)."""
        child = self._channel.request(WorkflowEnsure, WorkflowEnsurePayload(
            requestKey=request_key, workflow=workflow, input=input, originSessionId=session), ChildRun)
        return msgspec.structs.asdict(child)

    def change_settings(self, run_id: str, patch: dict[str, Any], request_key: str, *,
                        expected_change: int | None = None) -> dict[str, Any]:
        """Change the settings of a run this resource started (a JSON merge patch on its
        mutable paths): ``{runId, scopeId, changeNumber, settings, adopted}``. The same
        ``request_key`` again changes nothing more (``adopted``)."""
        done = self._channel.request(WorkflowChangeSettings, ChangeSettingsPayload(
            runId=run_id, requestKey=request_key, patch=patch, expectedChangeNumber=expected_change), SettingsChanged)
        return msgspec.structs.asdict(done)

    def queue_follow_up(self, run_id: str, prompt: str, request_key: str) -> dict[str, Any]:
        """Queue ``prompt`` for the origin session of a run this resource started, delivered
        with the run's turn: ``{runId, followUpId, order, state, adopted}``."""
        done = self._channel.request(WorkflowQueueFollowUp, QueueFollowUpPayload(
            runId=run_id, requestKey=request_key, prompt=prompt), FollowUpQueued)
        return msgspec.structs.asdict(done)

    def remove_follow_up(self, run_id: str, follow_up_id: str) -> dict[str, Any]:
        """Take back a follow-up queued for a run this resource started."""
        done = self._channel.request(WorkflowRemoveFollowUp, RemoveFollowUpPayload(
            runId=run_id, followUpId=follow_up_id), FollowUpQueued)
        return msgspec.structs.asdict(done)


class ReconcileContext:
    def __init__(self, channel: Channel, resource: Resource, project_path: str) -> None:
        self.resource = resource
        self.generation = resource.generation
        self.project_path = project_path
        self.effects = Effects(channel)
        self.workflows = Workflows(channel)
        self._channel = channel

    def log(self, message: str) -> None:
        """A line in the resource's events (``piwf controller get``)."""
        self._channel.request(ReconcileLog, ReconcileLogPayload(message=str(message)[:2000]))


def read_launch() -> ReconcileLaunch:
    return decode_launch(os.environ[LAUNCH_VAR], RECONCILE_LAUNCH_SCHEMA, ReconcileLaunch)


def run(launch: ReconcileLaunch, channel: Channel) -> None:
    controller, loaded = _load(launch)
    start = channel.request(ReconcileReady, loaded, ReconcileStart)
    if start.stop or controller is None or start.resource is None:
        return
    view = start.resource
    resource = Resource(uid=view["uid"], key=view["key"], controller=view["controller"], spec=view["spec"],
                        status=view["status"], generation=view["generation"], resource_version=view["resourceVersion"],
                        finalizers=view["finalizers"], deletion_timestamp=view["deletionTimestamp"])
    ctx = ReconcileContext(channel, resource, launch.projectPath)
    try:
        result = controller.reconcile(ctx)
    except Stop:  # an ambiguous effect: the host holds the resource
        return
    except ClaimLost:
        raise
    except TemporaryError as exc:
        _fail(channel, exc, delay_ms=int(exc.delay * 1000))
        return
    except PermanentError as exc:
        _fail(channel, exc, permanent=True)
        return
    except Exception as exc:
        _fail(channel, exc)
        return
    _finish(channel, result)


def _finish(channel: Channel, result: Any) -> None:
    if not isinstance(result, Result):
        _fail(channel, TypeError(f"reconcile returned {type(result).__name__}, not a Result "
                                 "(Result.settled(), Result.requeue() or Result.requeue_after(ms))"))
        return
    try:  # stored as JSON exactly, as a node's output is (engine/values.py)
        _, status = as_stored(result.status, "the Result's status", MAX_OUTPUT_NESTING)
        _, conditions = as_stored(list(result.conditions), "the Result's conditions", MAX_OUTPUT_NESTING)
    except (NotJson, TooDeep) as exc:
        _fail(channel, TypeError(str(exc)))
        return
    channel.request(ReconcileFinish, ReconcileFinishPayload(
        settled=result.kind == "settled", requeueAfterMs=result.requeue_after_ms, keepStatus=result.keep_status,
        status=status, conditions=conditions, finalizers=result.finalizers))


def _fail(channel: Channel, exc: BaseException, *, permanent: bool = False, delay_ms: int | None = None) -> None:
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, (TemporaryError, PermanentError)):
        text += "\n" + "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL:]
    channel.request(ReconcileFail, ReconcileFailPayload(error=text[:8192], permanent=permanent, delayMs=delay_ms))


def _load(launch: ReconcileLaunch) -> tuple[Controller | None, ReconcileReadyPayload]:
    try:
        controller = load_controller(launch.projectPath, launch.controller)
    except PiwfError as exc:
        return None, ReconcileReadyPayload(loadError=str(exc)[:LOAD_ERROR_LIMIT])
    return controller, ReconcileReadyPayload(timeoutS=float(controller.timeout))


def main() -> int:
    try:
        launch = read_launch()
    except LaunchRefused as exc:  # before any message: nothing was done
        print(f"piwf reconcile worker: {exc}", file=sys.stderr)
        return EXIT_LAUNCH
    read_fd, write_fd = (int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(","))
    channel = Channel(read_fd, write_fd, worker_id=launch.workerEpoch, generation=launch.generation,
                      lease_ms=launch.claimLeaseMs, until_ms=launch.vouchedUntilMs)
    try:
        run(launch, channel)
    except ClaimLost:
        return 0
    except PiwfError as exc:
        print(f"piwf reconcile worker: {exc}", file=sys.stderr)
        return 4
    return 0
