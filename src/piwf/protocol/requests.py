"""Every host operation's request type in one union, and reading a request line into it.

A request line decodes straight into its operation's Struct, whose validation errors name
the offending field. Only a refused line is decoded again, as plain JSON, so the refusal
can carry its ``requestId`` and an unknown operation can be told apart from a bad field.
"""

from __future__ import annotations

import msgspec

from piwf.errors import ProtocolError
from piwf.protocol.controllers import (
    ApplyResource, DeleteResource, GetResource, ListResources, ReconcileResource, ResolveResourceEffect,
)
from piwf.protocol.delivery import (
    ClaimNotification, ClaimTurn, DeliverNotification, ListDelivery, ListFollowUps, QueueFollowUp, RemoveFollowUp,
    ResolveTurn, WatchRuns,
)
from piwf.protocol.host import (
    AnswerDecision, CancelRun, GetHostStatus, GetRun, GetRunEvents, ListInteractions, ListRuns, PauseRun, Request,
    ResolveEffect, ResumeRun, StartRun, StopHost, SubmitInteraction, UpdateInteraction, WaitRun,
)
from piwf.protocol.maintenance import PruneRuns, RetryRun
from piwf.protocol.graph import GetRunGraph, GetRunSteps
from piwf.protocol.output import GetRunOutput
from piwf.protocol.settings import ChangeSettings, GetSettings
from piwf.wire import HOST_REQUEST, HostRequest, check_id, check_nesting, decode_json, readable_request_id

AnyRequest = (GetHostStatus | StopHost | StartRun | ListRuns | GetRun | GetRunEvents | WaitRun | CancelRun
              | PauseRun | ResumeRun | ResolveEffect | ListInteractions | UpdateInteraction | SubmitInteraction
              | AnswerDecision
              | ApplyResource | GetResource | ListResources | DeleteResource | ReconcileResource
              | ResolveResourceEffect
              | ClaimNotification | DeliverNotification | ClaimTurn | ResolveTurn | QueueFollowUp
              | RemoveFollowUp | ListFollowUps | ListDelivery | WatchRuns
              | ChangeSettings | GetSettings
              | GetRunOutput | RetryRun | PruneRuns | GetRunGraph | GetRunSteps)
REQUEST_TYPES: tuple[type[Request], ...] = AnyRequest.__args__
OPERATIONS: dict[str, type[Request]] = {str(kind.__struct_config__.tag): kind for kind in REQUEST_TYPES}


_request_decoder = msgspec.json.Decoder(AnyRequest)
_envelope_decoder = msgspec.json.Decoder(HostRequest)


def read_request(line: bytes) -> Request:
    """A request line straight into its operation's Struct, or a ProtocolError (with the
    request id when one can be read)."""
    check_nesting(line)
    try:
        request = _request_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise _refusal(line, exc) from exc
    try:
        return _check_request(request)
    except ProtocolError as exc:
        exc.request_id = readable_request_id({"requestId": request.requestId})
        raise


def _refusal(line: bytes, exc: msgspec.DecodeError) -> ProtocolError:
    request_id = readable_request_id(decode_json(line))  # not JSON at all: ProtocolError without an id
    try:
        operation = _envelope_decoder.decode(line).operation
    except msgspec.DecodeError:
        operation = None
    if operation is not None and operation not in OPERATIONS:
        return ProtocolError(f"unknown operation {operation!r}; known: {', '.join(sorted(OPERATIONS))}", request_id)
    return ProtocolError(f"bad request: {exc}", request_id)


def _check_request(request: Request) -> Request:
    if request.schema != HOST_REQUEST:
        raise ProtocolError(f"unknown schema {request.schema!r}; expected {HOST_REQUEST!r}")
    for field in ("requestId", "clientId", "idempotencyKey"):
        check_id(getattr(request, field), field)
    if request.runId is not None:
        check_id(request.runId, "runId")
    return request
