"""``python -m piwf.worker``: execute one run for one claim, reporting every step to the host.

Launched by the host with ``$PIWF_WORKER_LAUNCH`` (base64url JSON envelope) and
``$PIWF_WORKER_FDS`` ("read,write" pipe descriptors).
"""

from __future__ import annotations

import base64
import os
import sys
from typing import Any

import msgspec

from ..engine.executor import Step, Stop, describe_error, execute
from ..engine.loader import load_workflow
from ..errors import ClaimLost, DefinitionError, NodeFailed, PiwfError, WorkflowLoadError
from ..wire import WORKER_EXIT_CLAIM_LOST, WORKER_EXIT_OK, WORKER_EXIT_PROTOCOL, LaunchEnvelope
from .channel import Channel



class HostJournal:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def start(self, seq: int, node: str) -> str:
        result = self.channel.request("attempt.start", {"seq": seq, "node": node})
        if result.get("stop"):
            raise Stop(result["stop"])
        return result["attemptId"]

    def accept(self, attempt_id: str, output: Any, exit_name: str) -> None:
        self.channel.request("attempt.accept", {"attemptId": attempt_id, "output": output, "exit": exit_name})

    def fail(self, attempt_id: str, error: dict[str, Any]) -> None:
        self.channel.request("attempt.fail", {"attemptId": attempt_id, "error": error})


def read_envelope() -> LaunchEnvelope:
    raw = os.environ["PIWF_WORKER_LAUNCH"]
    data = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    return msgspec.json.decode(data, type=LaunchEnvelope)


def run(envelope: LaunchEnvelope, channel: Channel) -> None:
    ready = channel.request("worker.ready")
    try:
        workflow = load_workflow(envelope.projectPath, envelope.workflow)
    except (WorkflowLoadError, DefinitionError) as exc:
        channel.request("run.park", {"hold": "source", "reason": f"workflow cannot load: {exc}"})
        return
    digest = workflow.digest()
    if digest != envelope.definitionDigest:
        reason = (f"workflow source changed (digest {digest[:19]}, run has {envelope.definitionDigest[:19]}); "
                  "resume to run the new source")
        channel.request("run.park", {"hold": "source", "reason": reason})
        return
    steps = [Step(s["seq"], s["node"], s["exit"], s["output"]) for s in ready["steps"]]
    try:
        output = execute(workflow, run_id=envelope.runId, project_path=envelope.projectPath,
                         input=ready["input"], accepted=steps, journal=HostJournal(channel))
    except Stop:
        return
    except NodeFailed as exc:
        channel.request("run.fail", {"error": exc.error})
        return
    except DefinitionError as exc:
        channel.request("run.fail", {"error": describe_error(exc, "graph")})
        return
    channel.request("run.complete", {"output": output})


def main() -> int:
    envelope = read_envelope()
    read_fd, write_fd = (int(fd) for fd in os.environ["PIWF_WORKER_FDS"].split(","))
    channel = Channel(read_fd, write_fd, worker_epoch=envelope.workerEpoch, generation=envelope.generation)
    try:
        run(envelope, channel)
    except ClaimLost:
        return WORKER_EXIT_CLAIM_LOST
    except PiwfError as exc:
        print(f"piwf worker: {exc}", file=sys.stderr)
        return WORKER_EXIT_PROTOCOL
    return WORKER_EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
