"""A run worker's journal: the engine's steps, effects, interactions and processes told to
the host over the worker's channel, one request each.

The run worker (``piwf.worker.main``) gives it to the engine; a reconcile worker
(``piwf.worker.reconcile``) uses its effect steps as they are.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec

from piwf import faults, processes
from piwf.engine.executor import EffectRejected, Stop, check_output
from piwf.errors import PiwfError
from piwf.protocol.worker import (
    AttemptAccept, AttemptAcceptPayload, AttemptFail, AttemptFailPayload, AttemptStart, AttemptStartPayload,
    AttemptStartResult, EffectApply, EffectKeyPayload, EffectReserve, EffectReservePayload, EffectSettle,
    EffectSettlePayload, EffectState, InteractionOpen, InteractionOpenPayload, NotificationSend, NotifyPayload,
    PendingSubmission, PresentationRequest, PresentPayload, ProcessPayload, ProcessRegister, ProcessRegisterPayload,
    ProcessUnregister, PublishPayload, StartedAttempt, SubmissionReject, SubmissionRejectPayload, UpdatePublish,
)
from piwf.worker.channel import Channel


class HostJournal:
    def __init__(self, channel: Channel, started: StartedAttempt | None = None) -> None:
        self.channel = channel
        self.started = started  # the first attempt, started by the host with worker.ready
        self.finished = False  # the run was completed with its last node's output
        self.submissions: dict[str, PendingSubmission] = {}  # waiting attempt -> submission to validate
        self.settings_of: dict[str, Any] = {}  # attempt -> the run's settings when it started
        # One effect key at a time: threads of a node sharing a key wait for the first to
        # settle it, then get its stored result (apply() runs once).
        self._effect_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)

    def start(self, seq: int, node: str) -> str:
        started, self.started = self.started, None
        if started is not None and (started.seq, started.node) == (seq, node):
            self.settings_of[started.attemptId] = started.settings
            return started.attemptId
        result = self.channel.request(AttemptStart, AttemptStartPayload(seq=seq, node=node), AttemptStartResult)
        if result.stop is not None:
            raise Stop(result.stop)
        assert result.attemptId is not None
        self.settings_of[result.attemptId] = result.settings
        if result.submission is not None:
            self.submissions[result.attemptId] = result.submission
        return result.attemptId

    def accept(self, attempt_id: str, output: Any, exit_name: str, *, final: bool = False) -> None:
        # final: the last node, accepted and the run completed in one step
        submission = self.submissions.pop(attempt_id, None)
        self.channel.request(AttemptAccept, AttemptAcceptPayload(
            attemptId=attempt_id, exit=exit_name, output=output, final=final,
            submissionId=None if submission is None else submission.submissionId))
        self.finished = final

    def fail(self, attempt_id: str, error: dict[str, Any]) -> None:
        self.channel.request(AttemptFail, AttemptFailPayload(attemptId=attempt_id, error=error))

    def effect(self, node: str, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None, *,
               kind: str | None = None, fingerprint: str | None = None) -> Any:
        with self._effect_locks[key]:  # defaultdict's insertion is atomic under the GIL
            return self._effect(node, key, apply, observe, kind, fingerprint)

    def _effect(self, node: str, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None,
                kind: str | None, fingerprint: str | None) -> Any:
        state = self.channel.request(EffectReserve, EffectReservePayload(
            key=key, node=node, observable=observe is not None, kind=kind, requestFingerprint=fingerprint),
            EffectState)
        if state.state == "applied":
            return state.result
        if state.state == "rejected":
            raise EffectRejected(key, state.error or {})
        if state.state == "ambiguous":
            raise Stop(f"ambiguous effect {key}")
        if state.state == "observe":
            assert observe is not None
            observed = _json_result(observe(), key, "observe()")
            if observed is not None:
                self.channel.request(EffectSettle, EffectSettlePayload(key=key, result=observed))
                return observed
        self.channel.request(EffectApply, EffectKeyPayload(key=key))
        faults.point("worker.effect.applying")
        try:
            result = _json_result(apply(), key, "apply()")
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc)[:2000]}
            self.channel.request(EffectSettle, EffectSettlePayload(key=key, error=error))
            raise
        faults.point("worker.effect.applied")
        self.channel.request(EffectSettle, EffectSettlePayload(key=key, result=result))
        return result

    def wait_for(self, attempt_id: str, request: dict[str, Any]) -> None:
        payload = msgspec.convert({"attemptId": attempt_id, **request}, InteractionOpenPayload)
        self.channel.request(InteractionOpen, payload)
        raise Stop("waiting")

    def submission(self, attempt_id: str) -> tuple[str, Any] | None:
        pending = self.submissions.get(attempt_id)
        return None if pending is None else (pending.submissionId, pending.value)

    def reject(self, submission_id: str, reason: str) -> None:
        self.channel.request(SubmissionReject, SubmissionRejectPayload(submissionId=submission_id,
                                                                       error=reason[:8192]))
        raise Stop("waiting")

    def notify(self, attempt_id: str, index: int, kind: str, content: str) -> None:
        self.channel.request(NotificationSend, NotifyPayload(attemptId=attempt_id, index=index, kind=kind,  # type: ignore[arg-type]  # Context.notify checked it
                                                             content=content))

    def present(self, instructions: str) -> None:
        self.channel.request(PresentationRequest, PresentPayload(instructions=instructions))

    def publish(self, attempt_id: str, type: str, key: str, data: Any) -> None:
        self.channel.request(UpdatePublish, PublishPayload(attemptId=attempt_id, type=type, key=key, data=data))

    def settings(self, attempt_id: str) -> Any:
        return self.settings_of.get(attempt_id)

    def process_started(self, node: str, pid: int) -> None:
        faults.point("worker.shell.spawned")
        identity = processes.identity(pid)
        if identity is None:  # cannot happen before the gate opens: the process waits for it
            raise PiwfError(f"shell process {pid} vanished before it was registered")
        self.channel.children.add(pid)  # killed with the worker should the host go, registered or not
        try:
            self.channel.request(ProcessRegister, ProcessRegisterPayload(pid=pid, identity=identity, node=node))
        except PiwfError:
            self.channel.children.discard(pid)  # not registered: nothing to unregister
            raise

    def process_ended(self, pid: int) -> None:
        if pid in self.channel.children:
            self.channel.children.discard(pid)
            self.channel.request(ProcessUnregister, ProcessPayload(pid=pid))


def _json_result(value: Any, key: str, where: str) -> Any:
    """An effect's result is stored and sent back like a node's output: same limits, and
    handed to its caller as a replay would (a tuple as a list)."""
    try:
        return check_output(value, f"the value {where} returned")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"effect {key!r}: {exc}") from exc
