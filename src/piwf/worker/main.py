"""A run's worker (``python -m piwf.worker``): execute one run for one claim, reporting every
step to the host.

Launched by the host with ``$PIWF_WORKER_LAUNCH`` (base64url JSON envelope) and
``$PIWF_WORKER_FDS`` ("read,write" pipe descriptors).
"""

from __future__ import annotations

import contextlib
import os
import sys

from piwf import faults
from piwf.engine.executor import Step, Stop, describe_error, execute
from piwf.engine.definition import Workflow
from piwf.engine.loader import load_workflow, workflow_path
from piwf.errors import ClaimLost, DefinitionError, NodeFailed, PiwfError, WorkflowLoadError
from piwf.protocol.worker import (
    LOAD_ERROR_LIMIT, WORKER_LAUNCH_SCHEMA, LaunchEnvelope, LaunchRefused, NodeLimit, Ready, ReadyPayload,
    ReadyResult, RunComplete, RunCompletePayload, RunFail, RunFailPayload, StepsPage, StepsRead, StepsReadPayload,
    decode_launch,
)
from piwf.wire import sha256_hex
from piwf.worker import warm
from piwf.worker.channel import Channel
from piwf.worker.journal import HostJournal

# For people reading a worker's record: the host never infers anything from these. It
# knows what it told the worker (done, stop, claimLost); a worker that ends without
# having been told is a crash, whatever status it exits with.
EXIT_OK = 0
EXIT_REFUSED = 4  # the host refused one of its messages (a full disk, a stale revision)


EXIT_LAUNCH = 5  # the launch envelope was not one this worker follows (LaunchRefused)


LAUNCH_VAR = "PIWF_WORKER_LAUNCH"


def read_envelope() -> LaunchEnvelope:
    return decode_launch(os.environ[LAUNCH_VAR], WORKER_LAUNCH_SCHEMA, LaunchEnvelope)


def serve(envelope: LaunchEnvelope, channel: Channel) -> None:
    """Load the workflow and execute the run; a warm worker (its workflow declared
    ``reuse_worker``) then executes the next runs the host hands it, one after another."""
    workflow, loaded = _load(envelope)
    reuse = None if workflow is None else workflow.reuse
    baseline = warm.Baseline.take(LAUNCH_VAR) if reuse is not None else None
    runs = 0
    next_envelope: LaunchEnvelope | None = envelope
    while next_envelope is not None:
        executed = run(next_envelope, channel, workflow, loaded)
        runs += 1
        if reuse is None or baseline is None or not executed:
            return
        next_envelope = warm.next_run(channel, baseline, reuse, runs)


def run(envelope: LaunchEnvelope, channel: Channel, workflow: Workflow | None, loaded: ReadyPayload) -> bool:
    """Say ready once the workflow is loaded: the host's startup timeout covers the import
    of user code, and the host (which knows the run's digest) decides whether it may run.
    False when it did not (the run is held): such a worker is not reused."""
    ready = channel.request(Ready, loaded, ReadyResult)
    if ready.stop is not None or workflow is None:
        return False
    _yield_to_the_host(envelope.nice)
    steps = _accepted_steps(channel, ready)
    journal = HostJournal(channel, ready.attempt)
    try:
        output = execute(workflow, run_id=envelope.runId, project_path=envelope.projectPath,
                         input=ready.input, accepted=steps, journal=journal)
    except Stop:
        return True
    except NodeFailed as exc:
        channel.request(RunFail, RunFailPayload(error=exc.error))
        return True
    except DefinitionError as exc:
        channel.request(RunFail, RunFailPayload(error=describe_error(exc, "graph")))
        return True
    if not journal.finished:  # every step was accepted before this worker: complete now
        channel.request(RunComplete, RunCompletePayload(output=output))
    return True


_niced = [False]


def _yield_to_the_host(nice: int) -> None:
    """Run the workflow's nodes below the host's priority (``piwf serve --worker-nice``):
    on cores its runs keep busy, the host, the fork server and workers starting up go
    first. Loading happened at the host's priority; a warm worker lowers it once."""
    if nice and not _niced[0]:
        _niced[0] = True
        with contextlib.suppress(OSError):
            os.nice(nice)


def _accepted_steps(channel: Channel, ready: ReadyResult) -> list[Step]:
    """Every accepted step, read in pages when they do not fit one answer."""
    pages, more = [ready.steps], ready.more
    while more:
        page = channel.request(StepsRead, StepsReadPayload(afterSeq=pages[-1][-1].seq), StepsPage)
        pages.append(page.steps)
        more = page.more
    return [Step(s.seq, s.node, s.exit, s.output) for page in pages for s in page]


def _load(envelope: LaunchEnvelope) -> tuple[Workflow | None, ReadyPayload]:
    source = _source_hash(envelope)
    try:
        workflow = load_workflow(envelope.projectPath, envelope.workflow)
    except (WorkflowLoadError, DefinitionError) as exc:
        return None, ReadyPayload(loadError=str(exc)[:LOAD_ERROR_LIMIT], sourceHash=source)
    limits = {node: NodeLimit(ms=None if seconds is None else max(1, int(seconds * 1000)), timeoutExit=exit_)
              for node, (seconds, exit_) in workflow.time_limits().items()}
    return workflow, ReadyPayload(digest=workflow.digest(), limits=limits, reuse=workflow.reuse is not None,
                                  sourceHash=source)


def _source_hash(envelope: LaunchEnvelope) -> str | None:
    """The sha256 of the workflow file as this worker finds it (None: it cannot read one): a
    host that cannot load the run records it, and tries again once the file is another."""
    try:
        return sha256_hex(workflow_path(envelope.projectPath, envelope.workflow).read_bytes())
    except (OSError, WorkflowLoadError):
        return None


def main() -> int:
    faults.configure()
    faults.point("worker.started")
    if "PIWF_RECONCILE_LAUNCH" in os.environ:  # a controller's reconcile, not a run
        from piwf.worker.reconcile import main as reconcile_main

        return reconcile_main()
    try:
        envelope = read_envelope()
    except LaunchRefused as exc:  # before any message: nothing was done
        print(f"piwf worker: {exc}", file=sys.stderr)
        return EXIT_LAUNCH
    read_fd, write_fd = (int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(","))
    channel = Channel(read_fd, write_fd, worker_id=envelope.workerEpoch, generation=envelope.generation,
                      lease_ms=envelope.claimLeaseMs, until_ms=envelope.vouchedUntilMs)
    try:
        serve(envelope, channel)
    except ClaimLost:  # told so by the host: nothing more to do here
        return EXIT_OK
    except PiwfError as exc:
        print(f"piwf worker: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK

