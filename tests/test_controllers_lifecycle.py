"""Controllers from the review: an effect that raised is applied again, the host's own
Ready=False is cleared, requeues are rate-limited, a requeuing resource can be deleted,
force delete, takeover kills a recorded reconcile worker, child runs that fail, are
cancelled or outlive their resource, and the CLI's spec input and output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from piwf import processes
from piwf.client import AsyncClient
from piwf.paths import StatePaths
from piwf.store.sqlite import Database

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_controllers import MIRROR, ctl, get, ready, refused, write_controller
from .test_controllers_failures import SLOW, at, event_types

# apply() raises TemporaryError the first time (before touching the world), then writes
# the ledger; every attempt is counted in attempts.txt.
FLAKY_EFFECT = """
    from pathlib import Path
    from piwf import Controller, Result, TemporaryError

    def reconcile(ctx):
        def charge():
            with open("attempts.txt", "a") as f:
                f.write("attempt\\n")
            if not Path("tried").exists():
                Path("tried").touch()
                raise TemporaryError("the bank is busy", delay=0.1)
            with open("ledger.txt", "a") as f:
                f.write("charged\\n")
            return {"charged": True}
        result = ctx.effects.ensure("charge", charge)
        return Result.settled(status=result, conditions=[{"type": "Ready", "status": "True"}])

    controller = Controller(name="payer", reconcile=reconcile)
"""

# spec.mode "permanent" raises PermanentError; otherwise settles with a Synced condition only.
QUIET = """
    from piwf import Controller, PermanentError, Result

    def reconcile(ctx):
        if ctx.resource.spec.get("mode") == "permanent":
            raise PermanentError("cannot")
        return Result.settled(conditions=[{"type": "Synced", "status": "True"}])

    controller = Controller(name="quiet", reconcile=reconcile)
"""

# Requeues at once, forever; without finalizers. Each pass waits until the file 'gate' exists.
SPINNER = """
    import time
    from pathlib import Path
    from piwf import Controller, Result

    def reconcile(ctx):
        with open("passes.txt", "a") as f:
            f.write("pass\\n")
        while not Path("gate").exists():
            time.sleep(0.02)
        return Result.requeue()

    controller = Controller(name="spinner", reconcile=reconcile)
"""

# One child run of spec.workflow; the child's state is the controller status.
CHILDISH = """
    from piwf import Controller, Result

    def reconcile(ctx):
        child = ctx.workflows.ensure("main", ctx.resource.spec["workflow"], {})
        return Result.settled(status={"child": child["state"], "runId": child["runId"]})

    controller = Controller(name="childish", reconcile=reconcile)
"""


async def idle(paths: StatePaths, project: Path, name: str, key: str, check: Any) -> dict[str, Any] | None:
    got = await get(paths, project, name, key)
    return got if got is not None and not got["reconciling"] and check(got) else None


async def test_an_effect_whose_apply_raised_is_applied_again_and_converges_once(host: Any, paths: StatePaths,
                                                                                project: Path) -> None:
    write_controller(project, "payer", FLAKY_EFFECT)
    await ctl(paths, "apply", project, "payer", "p", spec={})
    got = await wait_for(lambda: idle(paths, project, "payer", "p", ready))
    assert got["status"]["controllerStatus"] == {"charged": True} and got["consecutiveErrors"] == 0
    assert (project / "ledger.txt").read_text() == "charged\n"  # applied once
    assert (project / "attempts.txt").read_text().count("attempt") == 2  # tried again, not rejected for good
    [failed] = event_types(got, "effect_failed")
    assert failed["detail"] == {"key": "charge", "error": "TemporaryError: the bank is busy"}


async def test_a_successful_pass_clears_the_hosts_permanent_error(host: Any, paths: StatePaths,
                                                                  project: Path) -> None:
    write_controller(project, "quiet", QUIET)
    await ctl(paths, "apply", project, "quiet", "q", spec={"mode": "permanent"})
    held = await wait_for(lambda: idle(paths, project, "quiet", "q", lambda g: g["hold"] == "permanent"))
    assert held["ready"] == "False"
    await ctl(paths, "apply", project, "quiet", "q", spec={"mode": "fixed"})
    fixed = await wait_for(lambda: idle(paths, project, "quiet", "q",
                                        lambda g: g["status"]["observedGeneration"] == 2))
    assert fixed["ready"] is None  # nothing says it is not ready any more
    assert [c["type"] for c in fixed["status"]["conditions"]] == ["Synced"]


async def test_requeues_are_rate_limited_and_a_requeuing_resource_can_be_deleted(host: Any, paths: StatePaths,
                                                                                 project: Path) -> None:
    write_controller(project, "spinner", SPINNER)
    (project / "gate").touch()
    await ctl(paths, "apply", project, "spinner", "s", spec={})
    passes = project / "passes.txt"
    await wait_for(lambda: passes.exists() and passes.read_text().count("pass") >= 3, timeout=30)
    got = await get(paths, project, "spinner", "s")
    assert got is not None
    finished = event_types(got, "reconcile_finished")
    starts = event_types(got, "reconcile_started")
    assert finished and all(at(s) - at(f) >= 0.99 for f, s in zip(finished, starts[1:], strict=False))
    # deleted while a pass runs (so not at once): the requeue that follows deletes it
    (project / "gate").unlink()
    count = passes.read_text().count("pass")
    await wait_for(lambda: passes.read_text().count("pass") > count, timeout=30)
    deleting = await ctl(paths, "delete", project, "spinner", "s")
    assert not deleting["deleted"]
    (project / "gate").touch()
    await wait_for(lambda: _gone(paths, project, "spinner", "s"))


async def _gone(paths: StatePaths, project: Path, name: str, key: str) -> bool:
    return await get(paths, project, name, key) is None


async def test_force_delete_removes_a_resource_whose_controller_is_gone(host: Any, paths: StatePaths,
                                                                        project: Path) -> None:
    path = write_controller(project, "mirror", MIRROR)
    where = ("--project", str(project))
    await ctl(paths, "apply", project, "mirror", "m", spec={"text": "x"})
    got = await wait_for(lambda: idle(paths, project, "mirror", "m", ready))
    assert got["finalizers"] == ["mirror/file"]
    path.unlink()
    await piwf(paths, "controller", "delete", "mirror", "m", *where)
    stuck = await wait_for(lambda: idle(paths, project, "mirror", "m", lambda g: g["consecutiveErrors"] >= 1))
    assert stuck["deletionTimestamp"] is not None and "controller cannot load" in stuck["lastError"]
    forced = await piwf(paths, "controller", "delete", "mirror", "m", "--force", *where)
    assert "deleted by force (finalizers not run)" in forced.stdout.decode()
    assert await get(paths, project, "mirror", "m") is None
    assert (project / "out" / "m.txt").exists()  # nothing was cleaned up


async def test_takeover_kills_a_recorded_reconcile_worker_and_passes_never_overlap(
        host_process: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "slow", SLOW)
    first: HostProcess = await host_process().start()
    await ctl(paths, "apply", project, "slow", "k", spec={})
    trace = project / "trace.txt"

    async def effect_settled() -> dict[str, Any] | None:  # killed mid-apply would be the ambiguity test's case
        got = await get(paths, project, "slow", "k")
        return got if got and event_types(got, "effect_applied") else None

    uid = (await wait_for(effect_settled))["uid"]
    worker = int(trace.read_text().split()[1])

    def recorded() -> tuple[int, str]:
        db = Database.open_readonly(paths.db)
        try:
            return db.one("SELECT worker_pid, worker_identity FROM controller_queue WHERE uid = ?", (uid,))
        finally:
            db.close()

    identity = processes.identity(worker)
    assert recorded() == (worker, identity)  # the claim names its worker
    first.signal(signal.SIGKILL)
    await first.wait()
    # A worker that outlived its host (here a stand-in that ignores everything): recorded on the claim.
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        db = Database.open(paths.db)
        try:
            db.execute("UPDATE controller_queue SET worker_pid = ?, worker_identity = ? WHERE uid = ?",
                       (straggler.pid, processes.identity(straggler.pid), uid))
        finally:
            db.close()
        second: HostProcess = await host_process().start()
        await wait_for(lambda: straggler.poll() is not None)  # killed by the takeover
        assert straggler.returncode == -signal.SIGKILL
        await wait_for(lambda: trace.read_text().count("start") == 2)
        assert not processes.alive(worker, identity)  # the first pass's worker was gone before the second began
        (project / "gate").touch()
        got = await wait_for(lambda: idle(paths, project, "slow", "k", ready))
        lines = trace.read_text().split()[::2]
        assert lines == ["start", "start", "end"]  # the first never ended; the second ran alone
        interrupted = [e for e in event_types(got, "reconcile_failed")
                       if e["detail"]["error"] == "interrupted: its host died"]
        assert len(interrupted) == 1
        second.signal(signal.SIGTERM)
        assert await second.wait() == 0
    finally:
        if straggler.poll() is None:
            straggler.kill()
            straggler.wait()


async def test_child_runs_that_fail_are_cancelled_or_outlive_their_resource(host: Any, paths: StatePaths,
                                                                            project: Path) -> None:
    from .conftest import WORKFLOWS

    for name in ("boom", "sleepy"):
        write_workflow(project, name, WORKFLOWS[name])
    write_controller(project, "childish", CHILDISH)

    def child_is(state: str) -> Any:
        return lambda g: g["status"]["controllerStatus"].get("child") == state

    await ctl(paths, "apply", project, "childish", "failing", spec={"workflow": "boom"})
    failed = await wait_for(lambda: idle(paths, project, "childish", "failing", child_is("failed")))
    assert failed["status"]["workflowRun"]["state"] == "failed"

    await ctl(paths, "apply", project, "childish", "cancelled", spec={"workflow": "sleepy"})
    running = await wait_for(lambda: idle(paths, project, "childish", "cancelled", child_is("running")))
    async with AsyncClient(paths) as client:
        response = await client.call("run.cancel", run_id=running["status"]["controllerStatus"]["runId"])
    assert response.outcome == "accepted", response
    await wait_for(lambda: idle(paths, project, "childish", "cancelled", child_is("failed")))

    # deleting a resource leaves its running child alone (docs/controllers.md)
    await ctl(paths, "apply", project, "childish", "orphan", spec={"workflow": "sleepy"})
    live = await wait_for(lambda: idle(paths, project, "childish", "orphan", child_is("running")))
    run_id = live["status"]["controllerStatus"]["runId"]
    assert (await ctl(paths, "delete", project, "childish", "orphan"))["deleted"]
    async with AsyncClient(paths) as client:
        assert (await client.call("run.status", run_id=run_id)).receipt["status"] in ("running", "queued")
        assert (await client.call("run.cancel", run_id=run_id)).outcome == "accepted"


async def test_keys_must_be_printable_and_the_example_keeps_files_inside_out(host: Any, paths: StatePaths,
                                                                             project: Path) -> None:
    write_controller(project, "mirror", MIRROR)
    base = {"projectPath": str(project), "controller": "mirror", "spec": {"text": "x"}}
    for key in ("two\nlines", "\x1b[2Jclear"):
        response = await refused(paths, "apply", {**base, "key": key})
        assert response.outcome == "rejected" and "key must be printable" in response.error
        assert "\n" not in response.error
    async with AsyncClient(paths) as client:
        assert (await client.call("controller.list", payload={})).receipt == []
    await ctl(paths, "apply", project, "mirror", "../escape", spec={"text": "x"})
    await wait_for(lambda: idle(paths, project, "mirror", "../escape", ready))
    assert not (project.parent / "escape.txt").exists() and not (project / "escape.txt").exists()
    [written] = (project / "out").iterdir()
    assert written.read_text() == "x"


async def test_the_cli_reads_a_spec_from_a_file_or_stdin_and_shows_one_line_per_event(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_controller(project, "mirror", MIRROR)
    where = ("--project", str(project))
    (project / "spec.json").write_text('{"text": "from a file"}')
    await piwf(paths, "controller", "apply", "mirror", "f", "--spec", f"@{project / 'spec.json'}", *where)
    done = await trio.run_process([sys.executable, "-m", "piwf", "controller", "apply", "mirror", "i", "--spec", "-",
                                   *where, "--state-dir", str(paths.root)], stdin=b'{"text": "from stdin"}',
                                  capture_stdout=True, capture_stderr=True)
    assert done.returncode == 0
    for key, text in (("f", "from a file"), ("i", "from stdin")):
        got = await wait_for(lambda key=key: idle(paths, project, "mirror", key, ready))  # type: ignore[misc]
        assert got["spec"] == {"text": text}
    missing = await piwf(paths, "controller", "apply", "mirror", "m", "--spec", "@nope.json", *where, check=False)
    assert missing.returncode == 2 and missing.stderr.decode().count("\n") == 1
    # a reconcile that raises: its event carries the traceback, the human view its first line
    write_controller(project, "broken", """
        from piwf import Controller

        def reconcile(ctx):
            raise ValueError("the widget is broken")

        controller = Controller(name="broken", reconcile=reconcile)
    """)
    await ctl(paths, "apply", project, "broken", "b", spec={})
    got = await wait_for(lambda: idle(paths, project, "broken", "b", lambda g: g["consecutiveErrors"] >= 1))
    assert "Traceback" in event_types(got, "reconcile_failed")[0]["detail"]["error"]
    human = (await piwf(paths, "controller", "get", "broken", "b", *where)).stdout.decode()
    assert "error=ValueError: the widget is broken …" in human and "Traceback" not in human
    status = (await piwf(paths, "status")).stdout.decode()
    assert "resources: " in status and "held" in status
    listed = json.loads((await piwf(paths, "controller", "list", "--json")).stdout)
    assert {r["key"] for r in listed} == {"f", "i", "b"}
