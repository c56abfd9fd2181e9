"""The host protocol's live worker output: ``run.output``.

Imported by ``piwf.protocol`` (which re-exports every name here and puts the request in
its union); import it from there.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from piwf.protocol.host import WAIT_LIMIT_MS, NoPayload, RunRequest

__all__ = ["OUTPUT_REQUESTS", "GetRunOutput", "RunOutput", "RunOutputPayload"]


class RunOutputPayload(NoPayload, frozen=True):
    workerEpoch: Annotated[str | None, Meta(description="the worker (`workers[].workerEpoch` of `run.status`); "
                                                        "absent: the run's live worker")] = None
    after: Annotated[int, Meta(ge=0, description="output offset (bytes) already seen: `next` of the last answer")] = 0
    timeoutMs: Annotated[int, Meta(ge=0, le=WAIT_LIMIT_MS, description="while nothing comes after `after` and the "
                                                                      "worker runs, answer after this long")] = 0


class RunOutput(Struct):
    """What a live worker printed (stdout and stderr together) after an offset."""

    workerEpoch: Annotated[str | None, Meta(description="the worker read; null: the run has no live worker here")]
    live: Annotated[bool, Meta(description="the host still reads the worker's output; false: it has ended (its "
                                           "last 64 KiB are in `run.status` `workers[].diagnostic`)")]
    offset: Annotated[int, Meta(description="where `text` starts in the worker's output (bytes)")]
    next: Annotated[int, Meta(description="send it as `after` for what comes next")]
    dropped: Annotated[int, Meta(description="bytes after `after` no longer kept (the host keeps the last 64 KiB)")]
    text: Annotated[str, Meta(description="the output from `offset` to `next` (undecodable bytes replaced)")]


class GetRunOutput(RunRequest, tag="run.output"):
    """A live worker's output after an offset, long-polling with `timeoutMs`."""

    payload: RunOutputPayload = RunOutputPayload()
    is_read = True
    long_poll = True
    receipt_type = RunOutput


OUTPUT_REQUESTS = (GetRunOutput,)
