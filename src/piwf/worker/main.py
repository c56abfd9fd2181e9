"""A run's worker (``python -m piwf.worker``): execute one run for one claim, reporting every
step to the host.

Launched by the host with ``$PIWF_WORKER_LAUNCH`` (base64url JSON envelope) and
``$PIWF_WORKER_FDS`` ("read,write" pipe descriptors).
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from piwf import faults
from piwf.engine.executor import EffectRejected, Step, Stop, check_output, describe_error, execute
from piwf.engine.definition import Workflow
from piwf.engine.loader import load_workflow
from piwf.errors import ClaimLost, DefinitionError, NodeFailed, PiwfError, WorkflowLoadError
from piwf import processes
from piwf.protocol.worker import (
    AttemptAccept, AttemptAcceptPayload, AttemptFail, AttemptFailPayload, AttemptStart, AttemptStartPayload,
    AttemptStartResult, EffectApply, EffectKeyPayload, EffectReserve, EffectReservePayload, EffectSettle,
    EffectSettlePayload, EffectState, InteractionOpen, InteractionOpenPayload, LaunchEnvelope, NotificationSend,
    NotifyPayload, PendingSubmission, PresentationRequest, PresentPayload, PublishPayload, UpdatePublish,
    ProcessPayload, ProcessRegister, ProcessRegisterPayload, SubmissionReject, SubmissionRejectPayload,
    ProcessUnregister, Ready, ReadyPayload, ReadyResult, RunComplete, RunCompletePayload, RunFail,
    RunFailPayload, StartedAttempt, StepsPage, StepsRead, StepsReadPayload,
)
from piwf.worker.channel import Channel

# For people reading a worker's record: the host never infers anything from these. It
# knows what it told the worker (done, stop, claimLost); a worker that ends without
# having been told is a crash, whatever status it exits with.
EXIT_OK = 0
EXIT_REFUSED = 4  # the host refused one of its messages (a full disk, a stale revision)


class HostJournal:
    def __init__(self, channel: Channel, started: StartedAttempt | None = None) -> None:
        self.channel = channel
        self.started = started  # the first attempt, started by the host with worker.ready
        self.finished = False  # the run was completed with its last node's output
        self.submissions: dict[str, PendingSubmission] = {}  # waiting attempt -> submission to validate
        self.settings_of: dict[str, Any] = {}  # attempt -> the run's settings when it started

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

    def effect(self, node: str, key: str, apply: Callable[[], Any], observe: Callable[[], Any] | None) -> Any:
        state = self.channel.request(EffectReserve, EffectReservePayload(key=key, node=node,
                                                                         observable=observe is not None), EffectState)
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
        self.channel.request(NotificationSend, NotifyPayload(attemptId=attempt_id, index=index, kind=kind,  # type: ignore[arg-type]
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
        self.channel.children.add(pid)
        self.channel.request(ProcessRegister, ProcessRegisterPayload(pid=pid, identity=identity, node=node))

    def process_ended(self, pid: int) -> None:
        if pid in self.channel.children:
            self.channel.children.discard(pid)
            self.channel.request(ProcessUnregister, ProcessPayload(pid=pid))


def _json_result(value: Any, key: str, where: str) -> Any:
    """An effect's result is stored and sent back like a node's output: same limits."""
    try:
        check_output(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"effect {key!r}: {where} returned an unusable value: {exc}") from exc
    return value


def read_envelope() -> LaunchEnvelope:
    raw = os.environ["PIWF_WORKER_LAUNCH"]
    data = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    return msgspec.json.decode(data, type=LaunchEnvelope)


def run(envelope: LaunchEnvelope, channel: Channel) -> None:
    """Load the workflow, then say ready: the host's startup timeout covers the import of
    user code, and the host (which knows the run's digest) decides whether it may run."""
    workflow, loaded = _load(envelope)
    ready = channel.request(Ready, loaded, ReadyResult)
    if ready.stop is not None or workflow is None:
        return
    steps = _accepted_steps(channel, ready)
    journal = HostJournal(channel, ready.attempt)
    try:
        output = execute(workflow, run_id=envelope.runId, project_path=envelope.projectPath,
                         input=ready.input, accepted=steps, journal=journal)
    except Stop:
        return
    except NodeFailed as exc:
        channel.request(RunFail, RunFailPayload(error=exc.error))
        return
    except DefinitionError as exc:
        channel.request(RunFail, RunFailPayload(error=describe_error(exc, "graph")))
        return
    if not journal.finished:  # every step was accepted before this worker: complete now
        channel.request(RunComplete, RunCompletePayload(output=output))


def _accepted_steps(channel: Channel, ready: ReadyResult) -> list[Step]:
    """Every accepted step, read in pages when they do not fit one answer."""
    pages, more = [ready.steps], ready.more
    while more:
        page = channel.request(StepsRead, StepsReadPayload(afterSeq=pages[-1][-1].seq), StepsPage)
        pages.append(page.steps)
        more = page.more
    return [Step(s.seq, s.node, s.exit, s.output) for page in pages for s in page]


def _load(envelope: LaunchEnvelope) -> tuple[Workflow | None, ReadyPayload]:
    try:
        workflow = load_workflow(envelope.projectPath, envelope.workflow)
    except (WorkflowLoadError, DefinitionError) as exc:
        return None, ReadyPayload(loadError=str(exc)[:1500])
    return workflow, ReadyPayload(digest=workflow.digest())


def main() -> int:
    faults.configure()
    faults.point("worker.started")
    if "PIWF_RECONCILE_LAUNCH" in os.environ:  # a controller's reconcile, not a run
        from piwf.worker.reconcile import main as reconcile_main

        return reconcile_main()
    envelope = read_envelope()
    read_fd, write_fd = (int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(","))
    channel = Channel(read_fd, write_fd, worker_epoch=envelope.workerEpoch, generation=envelope.generation)
    try:
        run(envelope, channel)
    except ClaimLost:  # told so by the host: nothing more to do here
        return EXIT_OK
    except PiwfError as exc:
        print(f"piwf worker: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK

