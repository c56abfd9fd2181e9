"""The host ↔ worker protocol: every message and answer a msgspec Struct.

A worker message is one NDJSON line on the worker's own pipe::

    {"messageId", "workerEpoch", "generation", "expectedRevision", "operation", "payload"}

decoded straight into the tagged union ``WorkerMessage`` (tag: ``operation``); a line that
does not fit it is a protocol error and ends the worker. Answers are ``WorkerResponse``,
whose ``result`` is the operation's result Struct. This protocol is internal: host and
worker always come from the same installation.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from piwf.protocol.host import ChoiceSpec, DefaultAnswer
from piwf.wire import canonical_json, decode_with

MAX_WORKER_LINE = 16 * 1024 * 1024

Text = Annotated[str, msgspec.Meta(min_length=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]
ErrorInfo = dict[str, Any]  # type, message, node, traceback, output: see engine.executor.describe_error


class Payload(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    pass


class WorkerMessage(msgspec.Struct, tag_field="operation", forbid_unknown_fields=True, omit_defaults=True):
    messageId: Text
    workerEpoch: Text
    generation: Count
    expectedRevision: Count

    @property
    def operation(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]  # a tag is str | int; ours are str


# --- payloads ------------------------------------------------------------------------------


LOAD_ERROR_LIMIT = 8192  # characters of why a workflow or controller did not load (seed: error text)
LoadError = Annotated[str, msgspec.Meta(max_length=LOAD_ERROR_LIMIT)]


class NodeLimit(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """A node's time limit, enforced by the host from its attempt's start."""

    ms: Annotated[int, msgspec.Meta(gt=0)] | None = None  # None: only the host's limit (serve --node-time-limit)
    timeoutExit: bool = False  # the graph has a `timeout` exit for the node: taken at a limit


class ReadyPayload(Payload, frozen=True):
    """What the worker loaded: its workflow's digest and its nodes' time limits, or why it
    could not load it."""

    digest: str | None = None
    loadError: LoadError | None = None
    limits: Annotated[dict[str, NodeLimit], msgspec.Meta(max_length=10_000)] = {}
    reuse: bool = False  # the workflow opts in to warm workers: once its part ends it may say worker.idle
    sourceHash: Annotated[str, msgspec.Meta(max_length=64)] | None = None  # sha256 of the file it found (None: none)


class AttemptStartPayload(Payload, frozen=True):
    seq: Count
    node: Text


class AttemptAcceptPayload(Payload, frozen=True):
    attemptId: Text
    exit: Text
    output: Any = None
    final: bool = False  # the run's last node: complete the run with this output, same transaction
    submissionId: str | None = None  # the output is this submission's value, validated: accept it too


class AttemptFailPayload(Payload, frozen=True):
    attemptId: Text
    error: ErrorInfo


class RunCompletePayload(Payload, frozen=True):
    output: Any = None


class RunFailPayload(Payload, frozen=True):
    error: ErrorInfo


class StepsReadPayload(Payload, frozen=True):
    afterSeq: Count


class EffectReservePayload(Payload, frozen=True):
    key: Text
    node: Text
    observable: bool
    # a reconcile's effect: the action the key names (a reused key for another is a conflict)
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    requestFingerprint: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None


class EffectKeyPayload(Payload, frozen=True):
    key: Text


class EffectSettlePayload(Payload, frozen=True):
    key: Text
    result: Any = None
    error: ErrorInfo | None = None


class ProcessRegisterPayload(Payload, frozen=True):
    pid: Count
    identity: Text
    node: str | None = None


class ProcessPayload(Payload, frozen=True):
    pid: Count


class InteractionOpenPayload(Payload, frozen=True):
    """A decision or ask node waits: open its request and park the run as waiting."""

    attemptId: Text
    kind: Literal["decision", "ask"]
    title: Text
    choices: dict[str, ChoiceSpec] | None = None
    schema: Any = None
    deadlineMs: Annotated[int, msgspec.Meta(gt=0)] | None = None
    default: DefaultAnswer | None = None
    timeoutExit: bool = False  # the graph has a `timeout` exit for the node


class SubmissionRejectPayload(Payload, frozen=True):
    submissionId: Text
    error: Annotated[str, msgspec.Meta(max_length=8192)]


class NotifyPayload(Payload, frozen=True):
    """``ctx.notify``: the attempt's ``index``-th call (1, 2, ...) with this ``kind`` and
    ``content``: a replay's call matches the one stored by content, not by call order."""

    attemptId: Text
    index: Annotated[int, msgspec.Meta(ge=1)]
    kind: Literal["progress", "final"]
    content: str


class PresentPayload(Payload, frozen=True):
    """``ctx.present``: instructions for the turn the run's completion gives its session."""

    instructions: str


class PublishPayload(Payload, frozen=True):
    """``ctx.publish``: replace the run's current value of (type, key)."""

    attemptId: Text
    type: Text
    key: Text
    data: Any = None


# --- messages ------------------------------------------------------------------------------


class Ready(WorkerMessage, tag="worker.ready"):
    payload: ReadyPayload = ReadyPayload()


class AttemptStart(WorkerMessage, tag="attempt.start"):
    payload: AttemptStartPayload


class AttemptAccept(WorkerMessage, tag="attempt.accept"):
    payload: AttemptAcceptPayload


class AttemptFail(WorkerMessage, tag="attempt.fail"):
    payload: AttemptFailPayload


class RunComplete(WorkerMessage, tag="run.complete"):
    payload: RunCompletePayload = RunCompletePayload()


class RunFail(WorkerMessage, tag="run.fail"):
    payload: RunFailPayload


class StepsRead(WorkerMessage, tag="steps.read"):
    """The next page of accepted steps, when ``worker.ready`` said there were more."""

    payload: StepsReadPayload


class EffectReserve(WorkerMessage, tag="effect.reserve"):
    payload: EffectReservePayload


class EffectApply(WorkerMessage, tag="effect.apply"):
    payload: EffectKeyPayload


class EffectSettle(WorkerMessage, tag="effect.settle"):
    payload: EffectSettlePayload


class ProcessRegister(WorkerMessage, tag="process.register"):
    payload: ProcessRegisterPayload


class ProcessUnregister(WorkerMessage, tag="process.unregister"):
    payload: ProcessPayload


class InteractionOpen(WorkerMessage, tag="interaction.open"):
    payload: InteractionOpenPayload


class SubmissionReject(WorkerMessage, tag="submission.reject"):
    """The submission being validated did not fit: the request opens again with the reason."""

    payload: SubmissionRejectPayload


class NotificationSend(WorkerMessage, tag="notification.send"):
    payload: NotifyPayload


class PresentationRequest(WorkerMessage, tag="presentation.request"):
    payload: PresentPayload


class UpdatePublish(WorkerMessage, tag="update.publish"):
    payload: PublishPayload


AnyWorkerMessage = (Ready | AttemptStart | AttemptAccept | AttemptFail | RunComplete | RunFail
                    | StepsRead | EffectReserve | EffectApply | EffectSettle | ProcessRegister | ProcessUnregister
                    | InteractionOpen | SubmissionReject | NotificationSend | PresentationRequest | UpdatePublish)
WORKER_OPERATIONS = {cls.__struct_config__.tag: cls for cls in AnyWorkerMessage.__args__}


# --- answers -------------------------------------------------------------------------------


class Result(msgspec.Struct, omit_defaults=True):
    """What an operation with nothing to report answers."""


class AcceptedStep(msgspec.Struct):
    seq: int
    node: str
    exit: str | None
    output: Any


class StartedAttempt(msgspec.Struct):
    seq: int
    node: str
    attemptId: str
    settings: Any = None  # the run's settings when the attempt started (None: the workflow has none)
    settingsChange: int | None = None


class ReadyResult(Result):
    input: Any = None
    steps: list[AcceptedStep] = []
    attempt: StartedAttempt | None = None  # a fresh run's first attempt, started with the answer
    stop: Literal["source"] | None = None  # the workflow did not load or changed: the run is held
    more: bool = False  # more accepted steps than fit one answer: read them with steps.read


class StepsPage(Result):
    steps: list[AcceptedStep] = []
    more: bool = False


class PendingSubmission(msgspec.Struct):
    submissionId: str
    value: Any


class AttemptStartResult(Result):
    attemptId: str | None = None
    stop: Literal["paused", "waiting"] | None = None  # stop at this node boundary instead
    submission: PendingSubmission | None = None  # the node's request has a submission to validate
    settings: Any = None  # the run's settings when the attempt started (None: the workflow has none)
    settingsChange: int | None = None


class EffectState(Result):
    state: Literal["new", "applied", "rejected", "observe", "ambiguous"]
    result: Any = None
    error: ErrorInfo | None = None


WorkerOutcome = Literal["accepted", "rejected", "claimLost"]


class WorkerResponse(msgspec.Struct, omit_defaults=True):
    messageId: str
    outcome: WorkerOutcome
    revision: int | None = None
    result: Any = None
    error: str | None = None


WORKER_LAUNCH_SCHEMA = "piwf.worker-launch.v1"
RECONCILE_LAUNCH_SCHEMA = "piwf.reconcile-launch.v1"
WORKER_PROTOCOL_VERSION = 1  # the messages of this module; a worker refuses any other


class LaunchEnvelope(msgspec.Struct, forbid_unknown_fields=True):
    runId: str
    generation: int
    workerEpoch: str
    projectPath: str
    workflow: str
    definitionDigest: str
    inputHash: str
    schema: str = WORKER_LAUNCH_SCHEMA
    protocolVersion: int = WORKER_PROTOCOL_VERSION
    nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 0  # added to the worker's nice value once it is ready
    claimLeaseMs: Count = 0  # the run claim's lease: bounds the worker's wait for the host (0: unbounded)
    vouchedUntilMs: Count = 0  # until when (the machine's monotonic clock, ms) the host vouches for the claim


class LaunchRefused(ValueError):
    """A launch envelope this worker cannot follow: unreadable, or of another schema or
    protocol version (a host and its workers from different piwf releases)."""


class _LaunchHeader(msgspec.Struct):
    """What says which envelope this is, read before the rest (whose fields may differ)."""

    schema: str | None = None
    protocolVersion: int | None = None


E = TypeVar("E", bound=msgspec.Struct)


def decode_launch(raw: str, schema: str, kind: type[E]) -> E:
    """The envelope in ``raw`` (base64url JSON), as ``kind``; LaunchRefused, with one line
    saying why, unless it is a ``schema`` envelope of WORKER_PROTOCOL_VERSION."""
    try:
        data = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        header = msgspec.json.decode(data, type=_LaunchHeader)
    except (ValueError, msgspec.DecodeError) as exc:
        raise LaunchRefused(f"the launch envelope is unreadable: {exc}") from None
    if header.schema != schema or header.protocolVersion != WORKER_PROTOCOL_VERSION:
        raise LaunchRefused(
            f"the launch envelope is {header.schema or 'of no schema'}, protocol version {header.protocolVersion}; "
            f"this worker follows {schema}, protocol version {WORKER_PROTOCOL_VERSION} (the host and its workers "
            "must be the same piwf)")
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError as exc:
        raise LaunchRefused(f"the launch envelope is unreadable: {exc}") from None


# --- the host's heartbeat (host → worker; see worker/channel.py) ---------------------------


class HostHeartbeat(msgspec.Struct, tag_field="type", tag="host.heartbeat", forbid_unknown_fields=True):
    """Host → worker, between answers: the host vouches for the worker's claim until
    ``untilMs``, a time of the machine's monotonic clock (``time.monotonic()`` in ms: the
    host and its workers share one machine, and so one clock). Past it with no newer
    heartbeat (a frozen host, or one that cannot renew the claim) the worker stops itself:
    its registered process groups and its own group are killed."""

    untilMs: int


HEARTBEAT_PREFIX = b'{"type":"host.heartbeat"'  # how a heartbeat line begins (msgspec writes the tag first)
_heartbeat_decoder = msgspec.json.Decoder(HostHeartbeat)


def parse_heartbeat(line: bytes) -> HostHeartbeat:
    return decode_with(_heartbeat_decoder, line, "host.heartbeat")


# --- warm workers (a workflow with reuse_worker; see worker/warm.py) ------------------------


class WorkerIdle(msgspec.Struct, tag_field="operation", tag="worker.idle", forbid_unknown_fields=True):
    """Worker → host, after the answer that ended its part of a run: it has dropped what
    the run left (registered process groups, environment, working directory) and waits
    for another run. Not a request: the host answers it with ``NextRun`` or by stopping
    the worker."""

    workerEpoch: Text  # the run's worker epoch it just served
    runs: Annotated[int, msgspec.Meta(ge=1)]  # runs this process has executed


class NextRun(msgspec.Struct, tag_field="type", tag="run.next", forbid_unknown_fields=True):
    """Host → an idle warm worker: execute this run next (the envelope a fresh worker would
    have found in ``$PIWF_WORKER_LAUNCH``)."""

    launch: LaunchEnvelope


_idle_decoder = msgspec.json.Decoder(WorkerIdle)
_next_decoder = msgspec.json.Decoder(NextRun)


def parse_worker_idle(line: bytes) -> WorkerIdle:
    return decode_with(_idle_decoder, line, "worker.idle")


def parse_next_run(line: bytes) -> NextRun:
    return decode_with(_next_decoder, line, "run.next")


# --- the fork server's control socket (host ↔ template; see worker/forkserver.py) --------


class TemplateMessage(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    pass


class Fork(TemplateMessage, tag="fork"):
    """Start a worker (its three descriptors travel with the message, SCM_RIGHTS)."""

    id: int
    cwd: str
    env: dict[str, str]
    execWorker: bool = False  # --worker-start spawn: fork and exec a fresh interpreter


class Reap(TemplateMessage, tag="reap"):
    """The host is done with this worker: reap it (its pid may be reused from now on)."""

    pid: int


class TemplateReady(TemplateMessage, tag="ready"):
    pass


class Forked(TemplateMessage, tag="forked"):
    id: int
    pid: int


class ForkFailed(TemplateMessage, tag="forkFailed"):
    id: int
    error: str


class Exited(TemplateMessage, tag="exited"):
    """A worker ended; it stays unreaped until the host sends ``Reap``."""

    pid: int
    returncode: int  # negative: the signal that ended it


ToTemplate = Fork | Reap
FromTemplate = TemplateReady | Forked | ForkFailed | Exited
to_template = msgspec.json.Decoder(ToTemplate)
from_template = msgspec.json.Decoder(FromTemplate)


_message_decoder = msgspec.json.Decoder(AnyWorkerMessage)
_response_decoder = msgspec.json.Decoder(WorkerResponse)


def parse_worker_message(line: bytes) -> WorkerMessage:
    return decode_with(_message_decoder, line, "worker message")


def parse_worker_response(line: bytes) -> WorkerResponse:
    return decode_with(_response_decoder, line, "host answer")


def worker_fingerprint(message: WorkerMessage) -> bytes:
    """Everything but ``messageId`` (the operation included)."""
    return hashlib.sha256(canonical_json(msgspec.structs.replace(message, messageId="-"))).digest()


def reused_id(message: WorkerMessage) -> WorkerResponse:
    """The answer to a message whose id was answered before with another body."""
    return WorkerResponse(message.messageId, "rejected", error="messageId was reused with another body")
