"""The host protocol as types: every operation's request, payload and receipt.

A request line decodes straight into ``Request`` union member chosen by its
``operation`` (the union's tag), so a bad payload is refused by msgspec with the field
named (``Expected `str`, got `int` - at `$.payload.workflow```). Receipts are Structs the
store builds directly; their JSON is what clients read. The reference part of
docs/protocol.md is generated from these classes (``piwf.protocol.doc``).

It imports only msgspec, the standard library, ``piwf.status`` and ``piwf.wire``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar

from msgspec import UNSET, Meta, Struct, UnsetType

from piwf.wire import Outcome  # noqa: F401 - part of the host protocol
from piwf.status import (
    DEFAULT_QUEUE, QUEUE_PATTERN, EffectStatus, Hold, Provenance, QueueStatus, RequestStatus, RunStatus,
    SubmissionStatus, WorkerStatus,
)

WAIT_LIMIT_MS = 600_000




# --- payloads ---------------------------------------------------------------------------


class NoPayload(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The payload of an operation that takes none: `{}` or absent; any field is refused."""


class StartRunPayload(NoPayload, frozen=True):
    workflow: Annotated[str, Meta(min_length=1, description="the workflow's name")]
    projectPath: Annotated[str, Meta(description="absolute path of the project holding `.piwf/workflows/`")]
    input: Annotated[Any, Meta(description="the run input, any JSON")] = {}
    originSessionId: Annotated[str | None, Meta(description="an id (see Ids); at most one queued or running run "
                                                            "per session (a waiting run does not count)")] = None
    definitionDigest: Annotated[str | None, Meta(description="refused unless the workflow has this digest")] = None
    settings: Annotated[dict[str, Any] | None, Meta(description="initial settings: a merge patch over the "
                                                                "defaults of the workflow's settings type, "
                                                                "checked against it (any path)")] = None
    queue: Annotated[str, Meta(pattern=QUEUE_PATTERN, description="the named queue to run on: only a host "
                                                                  "serving it (`piwf serve --queue`) claims the "
                                                                  "run; 1 to 63 letters, digits, `_`, `.`, `-`")] = (
        DEFAULT_QUEUE)


class ListRunsPayload(NoPayload, frozen=True):
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many runs, newest first")] = 50
    status: Annotated[RunStatus | None, Meta(description="only runs with this engine status")] = None
    workflow: Annotated[str | None, Meta(description="only this workflow's runs")] = None
    originSessionId: Annotated[str | None, Meta(description="only runs this session started")] = None
    since: Annotated[int, Meta(ge=0), Meta(description="only runs created at or after this time (ms since the "
                                                       "Unix epoch)")] | None = None
    held: Annotated[bool, Meta(description="only runs held for a person (crashed, effect, source)")] = False
    after: Annotated[str | None, Meta(description="the cursor: only runs after this one in the listing's order "
                                                  "(send the last `runId` of a page for the next)")] = None


EVENTS_PAGE = 1000


class RunEventsPayload(NoPayload, frozen=True):
    after: Annotated[int, Meta(ge=0, description="only events with a larger `eventId`")] = 0
    limit: Annotated[int, Meta(ge=1, le=EVENTS_PAGE, description="at most this many events, oldest first")] = (
        EVENTS_PAGE)


class WaitRunPayload(NoPayload, frozen=True):
    timeoutMs: Annotated[int, Meta(ge=0, le=WAIT_LIMIT_MS, description="answer after this long at the latest")] = (
        WAIT_LIMIT_MS)


class ResolveEffectPayload(NoPayload, frozen=True):
    key: Annotated[str, Meta(min_length=1, description="the effect's key")]
    applied: Annotated[bool, Meta(description="whether the effect was applied")]
    result: Annotated[Any, Meta(description="its result (JSON), only with `applied: true`")] = None


class ListInteractionsPayload(NoPayload, frozen=True):
    sessionId: Annotated[str | None, Meta(description="only requests of runs started by this session")] = None
    runId: Annotated[str | None, Meta(description="only this run's requests")] = None
    open: Annotated[bool, Meta(description="only open requests (`pending`, `presenting`)")] = True
    limit: Annotated[int, Meta(ge=1, le=1000, description="at most this many, oldest first")] = 100


class UpdateAction(enum.StrEnum):
    CLAIM = "claim"
    PRESENTED = "presented"
    PROGRESS = "progress"


class UpdateInteractionPayload(NoPayload, frozen=True):
    requestId: str
    expectedRevision: Annotated[int, Meta(description="the request's revision; a stale one is a `conflict`")]
    action: Annotated[UpdateAction, Meta(description="`claim` the presentation (a lease, presenter = clientId), "
                                                     "say it was `presented` (with `entryId`), or report "
                                                     "`progress`")]
    entryId: Annotated[str, Meta(max_length=512), Meta(description="where it was presented (`presented`)")] | None = (
        None)
    progress: Annotated[str, Meta(max_length=8192), Meta(description="a line of progress (`progress`)")] | None = None


class SubmitInteractionPayload(NoPayload, frozen=True):
    requestId: str
    value: Annotated[Any, Meta(description="the answer to an `ask`, any JSON; the workflow validates it")]
    sessionId: Annotated[str | None, Meta(description="the submitting session; must be the run's origin "
                                                      "session when it has one")] = None
    expectedRevision: Annotated[int | None, Meta(description="the request's revision; stale is a `conflict`")] = None


class AnswerDecisionPayload(NoPayload, frozen=True):
    requestId: str
    choice: Annotated[str, Meta(min_length=1, description="one of the decision's choice ids")]
    input: Annotated[str | None, Meta(description="the text a choice with `input` takes (Unicode code points "
                                                  "counted against its bounds; kept exactly as given)")] = None
    expectedRevision: Annotated[int | None, Meta(description="the request's revision; stale is a `conflict`")] = None


# --- interaction requests (shared with the worker protocol) -----------------------------


class TextInputSpec(Struct, frozen=True, forbid_unknown_fields=True):
    prompt: str
    minLength: Annotated[int, Meta(ge=0, le=4000)] = 1
    maxLength: Annotated[int, Meta(ge=1, le=4000)] = 4000


class ChoiceSpec(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    label: str
    input: TextInputSpec | None = None


class DefaultAnswer(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    choice: str
    input: str | None = None


class SubmissionInfo(Struct):
    submissionId: str
    status: SubmissionStatus
    error: Annotated[str | None, Meta(description="why it was rejected")]
    submittedBy: Annotated[str, Meta(description="the submitting clientId")]
    submittedAt: str


class Resolution(Struct, omit_defaults=True):
    """How a request was closed: a decision's answer, an ask's accepted value, or none
    (`expired`, `cancelled`)."""

    provenance: Provenance | None
    answeredBy: Annotated[str | None, Meta(description="the clientId that answered; null for a timeout")]
    answeredAt: str
    choice: str | None = None
    input: str | None = None
    value: Any = None
    submissionId: str | None = None


class InteractionRequest(Struct):
    """A decision or an ask a waiting run put to a person or an agent (DESIGN.md §7)."""

    requestId: Annotated[str, Meta(description="derived from the run and the attempt that asked")]
    kind: Annotated[str, Meta(description="`decision` or `ask`")]
    runId: str
    workflow: str
    nodeId: str
    originSessionId: str | None
    title: Annotated[str, Meta(description="a decision's title, an ask's prompt")]
    choices: Annotated[dict[str, ChoiceSpec] | None, Meta(description="a decision's choices by id")]
    schema: Annotated[Any, Meta(description="JSON Schema of the value an ask expects")]
    deadline: Annotated[str | None, Meta(description="when it expires (ISO 8601 UTC)")]
    default: Annotated[DefaultAnswer | None, Meta(description="what a decision resolves to at its deadline")]
    timeoutExit: Annotated[bool, Meta(description="whether its node leaves through `timeout` at the deadline "
                                                  "(else the run ends `timed_out`)")]
    status: RequestStatus
    revision: int
    presenter: Annotated[str | None, Meta(description="the clientId holding a live presentation claim")]
    presenterExpiresAt: str | None
    entryId: str | None
    progress: str | None
    lastSubmission: SubmissionInfo | None
    resolution: Resolution | None
    createdAt: str


class InteractionsPage(Struct):
    requests: list[InteractionRequest]


class UpdateReceipt(Struct):
    requestId: str
    status: RequestStatus
    revision: int
    presenter: str | None
    presenterExpiresAt: str | None
    updateSeq: Annotated[int | None, Meta(description="`progress`: the run update's seq (`run.watch` shows it)")] = (
        None)


class SubmitReceipt(Struct):
    requestId: str
    runId: str
    submissionId: str
    status: SubmissionStatus


class AnswerReceipt(Struct):
    requestId: str
    runId: str
    choice: str
    input: str | None
    provenance: Provenance
    revision: Annotated[int, Meta(description="the request's revision after the answer")]


# --- receipts: what an accepted request answers -----------------------------------------


class LiveHost(Struct):
    """A host sharing the store whose lease is live (SQLite: the state directory's one)."""

    hostId: str
    epoch: int
    machine: Annotated[str | None, Meta(description="its boot id (on PostgreSQL with its pid namespace), or "
                                                    "`$PIWF_BOOT_ID`: hosts on one machine prove each other dead")]
    pid: int | None
    startedAt: int | None
    heartbeatAt: int | None
    heartbeatAgeMs: Annotated[int | None, Meta(description="how long ago it last renewed its lease")]
    expiresAt: int | None
    activeRuns: Annotated[int, Meta(description="runs it holds a live claim on")]
    activeReconciles: Annotated[int, Meta(description="reconciles it holds a live claim on")]
    this: Annotated[bool, Meta(description="the host that answered")]
    hostname: Annotated[str | None, Meta(description="the answering host's; null for the others (not in the "
                                                     "store)")] = None
    standby: Annotated[bool, Meta(description="a `piwf serve --standby` waiting for its state directory's lock "
                                              "(epoch 0, no claims)")] = False


class HostStatus(Struct):
    state: Annotated[str, Meta(description="`running` or `stale` (`stopped`, `uninitialized` offline)")]
    epoch: int
    hostId: str | None
    pid: int | None
    startedAt: int | None
    heartbeatAt: int | None
    expiresAt: int | None
    live: bool
    stateDir: str
    socketAvailable: bool
    activeWorkers: int
    maxWorkers: int
    durability: str
    connectedClients: int
    hostRssBytes: Annotated[int, Meta(description="the host process's resident memory (psutil)")]
    queuedRuns: int
    runningRuns: int
    parkedRuns: int
    waitingRuns: int
    pausedRuns: int
    heldRuns: Annotated[int, Meta(description="runs held for a person (crashed, effect, source): "
                                              "`run.list` with `held`")]
    completedRuns: int
    failedRuns: int
    cancelledRuns: int
    expiredClaims: int
    pendingInteractions: Annotated[int, Meta(description="open decisions and asks")]
    undeliveredNotifications: Annotated[int, Meta(description="notifications not yet delivered to their session")]
    unresolvedTurns: Annotated[int, Meta(description="turns (eligible or not) not yet resolved by their session")]
    lifecycleContradictions: Annotated[int, Meta(description="0 unless the database was edited by hand")]
    ambiguousEffects: Annotated[int, Meta(description="run effects whose outcome is unknown, each holding its run "
                                                      "for an operator (`piwf run resolve-effect`)")] = 0
    pendingControllers: Annotated[int, Meta(description="resources with a reconcile queued (due now or later)")] = 0
    heldControllers: Annotated[int, Meta(description="resources held after a permanent error or an ambiguous "
                                                     "effect")] = 0
    ambiguousControllerEffects: Annotated[int, Meta(description="reconcile effects whose outcome is unknown, each "
                                                                "holding its resource (`piwf controller "
                                                                "resolve-effect`)")] = 0
    activeControllerWorkers: Annotated[int, Meta(description="reconciles running now")] = 0
    maxControllerWorkers: int = 4
    store: Annotated[str | None, Meta(description="the PostgreSQL store's URL, without any password "
                                                  "(absent: the state directory's SQLite)")] = None
    hosts: Annotated[list[LiveHost], Meta(description="the live hosts sharing the store, oldest first (standbys "
                                                      "wait on their own state directory: `standbys`)")] = []
    queues: Annotated[list[str], Meta(description="the named queues this host claims runs of (`piwf serve "
                                                  "--queue`); empty when no host runs")] = []


class StopReceipt(Struct):
    stopping: bool


class StartReceipt(Struct):
    runId: str
    workflow: str
    status: RunStatus
    definitionDigest: str


class RunSummary(Struct):
    runId: str
    workflow: str
    status: Annotated[RunStatus, Meta(description="engine status: what the workflow is doing")]
    queueStatus: Annotated[QueueStatus, Meta(description="who may work on the run")]
    paused: bool
    hold: Annotated[Hold | None, Meta(description="why the run is not claimed again until someone acts")]
    statusDetail: str | None
    revision: int
    originSessionId: str | None
    generation: int
    createdAt: str
    updatedAt: str
    finishedAt: str | None
    queue: Annotated[str, Meta(description="the named queue the run is on: only hosts serving it claim it "
                                           "(`run.start`'s `queue`)")]


class Step(Struct):
    seq: int
    node: str
    status: Annotated[str, Meta(description="running, accepted, failed, interrupted")]
    generation: int
    exit: str | None
    startedAt: str
    finishedAt: str | None
    settingsChange: Annotated[int | None, Meta(description="the settings change number the attempt started "
                                                           "under (null: the workflow has no settings)")]


class WorkerSummary(Struct):
    workerEpoch: str
    generation: int
    pid: int | None
    status: Annotated[WorkerStatus, Meta(description="live (starting, running), then how the worker ended")]
    exitCode: int | None
    signal: int | None
    diagnostic: Annotated[str | None, Meta(description="the last 64 KiB the worker printed")]
    stopped: Annotated[bool, Meta(description="a live worker whose process is stopped (SIGSTOP, a debugger): "
                                              "it makes no progress until continued")] = False


class EffectSummary(Struct):
    key: str
    status: EffectStatus
    node: str
    generation: int
    result: Any
    error: dict[str, Any] | None


class RunUpdate(Struct):
    """The current value of one (type, key) a run published (`ctx.publish`)."""

    runId: str
    type: str
    key: str
    data: Any
    seq: Annotated[int, Meta(description="the `eventId` of the run event that published it")]
    updatedAt: str


class RunDetail(RunSummary):
    projectPath: str
    definitionDigest: str
    placement: Annotated[str | None, Meta(description="why a run ready to be claimed is not being claimed, when "
                                                      "the store can tell: no live host serves its queue, or "
                                                      "live hosts of its queue cannot load its workflow")]
    input: Any
    output: Any
    error: Annotated[dict[str, Any] | None, Meta(description="`type`, `message`, `node`, `traceback`, `where` "
                                                              "(`file`, `line`, `function`, `code` in the user's "
                                                              "code, or null)")]
    steps: Annotated[list[Step], Meta(description="every node attempt, in order")]
    workers: list[WorkerSummary]
    effects: list[EffectSummary]
    waitingFor: Annotated[list[InteractionRequest], Meta(description="the run's open requests")]
    updates: Annotated[list[RunUpdate], Meta(description="the current value of each (type, key) the run "
                                                         "published, by type and key")]


class WaitReceipt(RunDetail):
    atRest: Annotated[bool, Meta(description="false when the timeout passed first (the run, or its worker's end, "
                                             "was not yet at rest)")]


class RunEvent(Struct):
    """One entry of a run's trace: `eventId`, `at`, `type`, then only the fields its type
    carries (`created`: `workflow`; `attempt.started`: `node`, `seq`, `attemptId`; ...).

    A stored event with a field not declared here cannot be read back: give a new event
    field its place here (tests/test_protocol_types.py checks every ``add_event`` call)."""

    eventId: int
    at: str
    type: str
    workflow: str | UnsetType = UNSET
    node: str | UnsetType = UNSET
    seq: int | UnsetType = UNSET
    attemptId: str | UnsetType = UNSET
    exit: str | UnsetType | None = UNSET
    error: str | UnsetType | None = UNSET
    generation: int | UnsetType = UNSET
    epoch: int | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    key: str | UnsetType = UNSET
    applied: bool | UnsetType = UNSET
    workerEpoch: str | UnsetType = UNSET
    outcome: str | UnsetType = UNSET
    exitCode: int | UnsetType | None = UNSET
    signal: int | UnsetType | None = UNSET
    requestId: str | UnsetType = UNSET
    kind: str | UnsetType = UNSET
    choice: str | UnsetType | None = UNSET
    provenance: str | UnsetType | None = UNSET
    submissionId: str | UnsetType = UNSET
    notificationId: str | UnsetType = UNSET
    index: int | UnsetType = UNSET
    turnId: str | UnsetType = UNSET
    cause: str | UnsetType = UNSET
    updateType: str | UnsetType = UNSET
    followUpId: str | UnsetType = UNSET
    changeNumber: int | UnsetType = UNSET
    by: Annotated[str, Meta(description="`retried`: the clientId that retried the run")] | UnsetType = UNSET
    retriedFrom: Annotated[str, Meta(description="`retried`: `failed` or `timed_out`")] | UnsetType = UNSET
    reopenedEffects: list[str] | UnsetType = UNSET


class RunEventsPage(Struct):
    """One page of a run's trace, oldest first."""

    events: list[RunEvent]
    nextAfter: Annotated[int | None, Meta(description="more events remain: send this as `after` for the next "
                                                      "page; null when this page reaches the end of the trace")]


class CancelReceipt(Struct):
    runId: str
    status: str


class HoldReceipt(Struct):
    runId: str
    paused: bool
    queueStatus: Annotated[str, Meta(description="the queue status when the request was made")]


class ResolveReceipt(Struct):
    runId: str
    key: str
    status: Annotated[str, Meta(description="`applied` or `pending`")]
    ambiguous: Annotated[list[str], Meta(description="the run's keys still ambiguous")]


# --- requests ---------------------------------------------------------------------------


class Request(Struct, tag_field="operation", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """The envelope every request shares; ``operation`` is the tag naming the subclass."""

    schema: Annotated[str, Meta(description="`piwf.host-request.v1`")]
    requestId: Annotated[str, Meta(description="an id (see Ids); answered under this id")]
    clientId: Annotated[str, Meta(description="an id (see Ids)")]
    idempotencyKey: Annotated[str, Meta(description="an id (see Ids); a retry reuses it")]
    runId: Annotated[str | None, Meta(description="an id (see Ids)")] = None
    expectedRevision: Annotated[int | None, Meta(description="refused as a `conflict` when stale")] = None
    payload: NoPayload = NoPayload()

    is_read: ClassVar[bool] = False  # answered from the store, never logged
    long_poll: ClassVar[bool] = False  # may wait long for a change: given up when its client goes away
    receipt_type: ClassVar[Any] = None

    @property
    def operation(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]  # a tag is str | int; ours are str


class RunRequest(Request, kw_only=True):
    runId: Annotated[str, Meta(description="the run")]


class GetHostStatus(Request, tag="host.status"):
    """The host's lease, limits and run counts."""

    is_read = True
    receipt_type = HostStatus


class StopHost(Request, tag="host.stop"):
    """Drain and exit after replying."""

    receipt_type = StopReceipt


class StartRun(Request, tag="run.start"):
    """Queue a new run; the request's `runId` is the id to use (made by the host when absent)."""

    payload: StartRunPayload
    receipt_type = StartReceipt


class ListRuns(Request, tag="run.list"):
    """Run summaries, newest first."""

    payload: ListRunsPayload = ListRunsPayload()
    is_read = True
    receipt_type = list[RunSummary]


class GetRun(RunRequest, tag="run.status"):
    """One run with its steps, workers and effects."""

    is_read = True
    receipt_type = RunDetail


class GetRunEvents(RunRequest, tag="run.events"):
    """A page of a run's trace, oldest first, and where the next page starts."""

    payload: RunEventsPayload = RunEventsPayload()
    is_read = True
    receipt_type = RunEventsPage


class WaitRun(RunRequest, tag="run.wait"):
    """Answer once the run is at rest (ended, waiting, or held and not running) and its
    worker's end is recorded, or on timeout."""

    payload: WaitRunPayload = WaitRunPayload()
    is_read = True
    long_poll = True
    receipt_type = WaitReceipt


class CancelRun(RunRequest, tag="run.cancel"):
    """End a queued, parked or running run as cancelled."""

    receipt_type = CancelReceipt


class PauseRun(RunRequest, tag="run.pause"):
    """Hold the run; a running worker stops at the next node boundary."""

    receipt_type = HoldReceipt


class ResumeRun(RunRequest, tag="run.resume"):
    """Release a held run and wake the dispatcher."""

    receipt_type = HoldReceipt


class ResolveEffect(RunRequest, tag="effect.resolve"):
    """Say whether an ambiguous effect was applied."""

    payload: ResolveEffectPayload
    receipt_type = ResolveReceipt


class ListInteractions(Request, tag="interaction.list"):
    """Decisions and asks, oldest first: open ones by default."""

    payload: ListInteractionsPayload = ListInteractionsPayload()
    is_read = True
    receipt_type = InteractionsPage


class UpdateInteraction(Request, tag="interaction.update"):
    """Claim a request's presentation, say it was presented, or report progress."""

    payload: UpdateInteractionPayload
    receipt_type = UpdateReceipt


class SubmitInteraction(Request, tag="interaction.submit"):
    """Submit a value to an `ask`; the workflow validates it (status `validating`)."""

    payload: SubmitInteractionPayload
    receipt_type = SubmitReceipt


class AnswerDecision(Request, tag="decision.answer"):
    """Answer a decision; the first answer wins and the run goes on along its choice."""

    payload: AnswerDecisionPayload
    receipt_type = AnswerReceipt
