"""A real host and a real ``piwf ui`` for the console's tests: ``piwf serve`` and ``piwf
ui`` as child processes on one state directory, and a project with the workflows the
tests answer. Synchronous (the browser tests drive selenium, which blocks), so a module
can share one stack and one browser."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piwf.client import Client
from piwf.errors import HostUnavailable
from piwf.paths import StatePaths

WORKFLOWS = {
    # A decision whose title is HTML: the console must show it as text.
    "deploy": """
        from piwf import Workflow, compute, decision

        workflow = Workflow(
            name="deploy",
            start_at="build",
            nodes={
                "build": compute(lambda ctx: {"build": 42}),
                "approve": decision("<script>document.title='owned'</script> Deploy build 42?",
                                    choices={"yes": "Deploy", "no": "Hold"}),
                "deploy": compute(lambda ctx: {"deployed": ctx.outputs["approve"]}),
                "hold": compute(lambda ctx: {"held": True}),
            },
            edges=[("build", "approve"), ("approve.yes", "deploy"), ("approve.no", "hold")],
        )
    """,
    # An ask whose validation refuses with a reason of the workflow's own.
    "count": """
        from piwf import Invalid, Workflow, ask, compute

        def check(value):
            if value > 10:
                raise Invalid("at most 10, please")

        workflow = Workflow(
            name="count",
            start_at="how_many",
            nodes={"how_many": ask("How many copies?", expect=int, validate=check),
                   "print": compute(lambda ctx: {"copies": ctx.outputs["how_many"]})},
            edges=[("how_many", "print")],
        )
    """,
    # A choice that takes text.
    "review": """
        from piwf import Choice, TextInput, Workflow, decision

        workflow = Workflow(name="review", start_at="ship", nodes={"ship": decision(
            "Ship it?", choices={"yes": "Ship", "no": Choice("Hold", input=TextInput("Why hold?", max_length=200))})})
    """,
    # Fails (a retry goes back to its node).
    "boom": """
        from piwf import Workflow, compute

        def explode(ctx):
            raise ValueError("the fuse was lit")

        workflow = Workflow(name="boom", start_at="explode", nodes={"explode": compute(explode)})
    """,
    # An effect whose apply() kills its worker the first time (file 'died' in the project):
    # it has no observe(), so the run is held until a person resolves it.
    "pay": """
        import os
        from pathlib import Path
        from piwf import Workflow, compute

        def pay(ctx):
            def apply():
                if not Path("died").exists():
                    Path("died").touch()
                    os._exit(9)  # applied or not: nobody can tell
                return {"charged": 1}
            return {"paid": ctx.effect("charge", apply)}

        workflow = Workflow(name="pay", start_at="pay", nodes={"pay": compute(pay)})
    """,
    # Settings (budget mutable, model not), waiting on a decision.
    "tuned": """
        import msgspec
        from piwf import Workflow, compute, decision

        class Settings(msgspec.Struct):
            budget: int = 1
            model: str = "small"

        workflow = Workflow(
            name="tuned",
            start_at="go",
            nodes={"go": decision("Go?", choices={"yes": "Go"}),
                   "report": compute(lambda ctx: {"budget": ctx.settings.budget})},
            edges=[("go.yes", "report")],
            settings=Settings,
            mutable=("budget",),
        )
    """,
    # Runs until the file 'gate' exists in the project.
    "gated": """
        from piwf import Workflow, compute, shell

        workflow = Workflow(
            name="gated",
            start_at="wait",
            nodes={"wait": shell(["sh", "-c", "while [ ! -e gate ]; do sleep 0.02; done"]),
                   "done": compute(lambda ctx: {"ok": True})},
            edges=[("wait", "done")],
        )
    """,
}


def wait_until(predicate: Callable[[], Any], timeout: float = 30, what: str = "the condition") -> Any:
    """Poll observable state until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.05)


class Stack:
    """A host and a console on ``root``; ``url`` is the console's address with its token."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = StatePaths.resolve(root / "state")
        self.project = root / "project"
        for name, source in WORKFLOWS.items():
            path = self.project / ".piwf" / "workflows" / f"{name}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        self.host: subprocess.Popen[bytes] | None = None
        self.console: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.base = ""
        self.token = ""

    def start_host(self) -> None:
        with open(self.root / "host.log", "ab") as log:
            self.host = subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(self.paths.root)],
                                         stdout=log, stderr=log, start_new_session=True)
        wait_until(self._answers, what="the host answering")

    def _answers(self) -> bool:
        assert self.host is not None
        if self.host.poll() is not None:
            raise AssertionError(f"the host exited: {(self.root / 'host.log').read_text()[-2000:]}")
        try:
            with Client(self.paths, timeout=5) as client:
                return client.call("host.status").outcome == "accepted"
        except (HostUnavailable, OSError):
            return False

    def start_console(self, *args: str) -> str:
        """Start ``piwf ui`` and return the address it printed."""
        log = open(self.root / "console.log", "ab")  # noqa: SIM115 - the child's, closed with it
        self.console = subprocess.Popen(
            [sys.executable, "-m", "piwf", "ui", "--state-dir", str(self.paths.root), *args],
            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        log.close()
        line = self._first_line()
        self.url = line.split("open ", 1)[1].split()[0]
        self.base, self.token = self.url.split("/?token=")
        return self.url

    def _first_line(self, timeout: float = 60) -> str:
        assert self.console is not None and self.console.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while b"\n" not in seen:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.console.stdout], [], [], max(left, 0))
            if not readable:
                raise AssertionError(f"piwf ui printed no address within {timeout} s: "
                                     f"{(self.root / 'console.log').read_text()[-2000:]}")
            chunk = os.read(self.console.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"piwf ui exited: {(self.root / 'console.log').read_text()[-2000:]}")
            seen += chunk
        return seen.decode().splitlines()[0]

    def another_console(self, root: Path, *args: str) -> Stack:
        """A second console on this stack's host (stopping it leaves the host running)."""
        other = Stack.__new__(Stack)
        other.__dict__.update(self.__dict__, root=root, host=None, console=None)
        other.start_console(*args)
        return other

    def call(self, operation: str, **kwargs: Any) -> Any:
        with Client(self.paths, timeout=30) as client:
            response = client.call(operation, **kwargs)
        assert response.outcome in ("accepted", "adopted"), response
        return response.receipt

    def start_run(self, workflow: str) -> str:
        receipt = self.call("run.start", payload={"workflow": workflow, "projectPath": str(self.project)})
        return str(receipt["runId"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self.call("run.status", run_id=run_id))

    def open_request(self, run_id: str) -> dict[str, Any]:
        def found() -> Any:
            requests = self.call("interaction.list", payload={"runId": run_id})["requests"]
            return requests[0] if requests else None
        return dict(wait_until(found, what=f"run {run_id} waiting"))

    def record(self) -> dict[str, Any]:
        [path] = (self.paths.root / "ui").glob("console-*.json")
        return dict(json.loads(path.read_text()))

    def stop(self) -> None:
        for process in (self.console, self.host):
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self.console is not None and self.console.stdout is not None:
            self.console.stdout.close()
