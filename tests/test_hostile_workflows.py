"""Workflows that misbehave cannot spin the host: every way a worker ends that did not
finish its run is a crash, backed off and held; imports that hang are timed out."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from piwf.client import AsyncClient
from piwf.clock import ManualClock, WallClock
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import config, wait_for, write_workflow

EXITS = """
    import os
    from piwf import Workflow, compute

    def leave(ctx):
        os._exit(ctx.input["status"])

    workflow = Workflow(name="exits", start_at="leave", nodes={"leave": compute(leave)})
"""

HANGS_IN_WORKER = """
    import os, time
    if "PIWF_WORKER_LAUNCH" in os.environ:  # only in a run's worker, not when inspected
        time.sleep(600)
    from piwf import Workflow, compute

    workflow = Workflow(name="hangs", start_at="a", nodes={"a": compute(lambda ctx: 1)})
"""


async def _start(client: AsyncClient, project: Path, workflow: str, **payload: object) -> str:
    started = await client.call("run.start", payload={"workflow": workflow, "projectPath": str(project), **payload})
    assert started.outcome == "accepted", started.error
    return started.receipt["runId"]


@pytest.mark.parametrize("status", [0, 3])
async def test_a_worker_that_exits_before_its_run_ended_is_a_crash_whatever_its_status(
    paths: StatePaths, project: Path, nursery: trio.Nursery, status: int
) -> None:
    write_workflow(project, "exits", EXITS)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=3)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "exits", input={"status": status})
        held = (await client.call("run.wait", run_id=run_id)).receipt
    assert (held["queueStatus"], held["hold"]) == ("parked", "crashed")
    assert [(w["status"], w["exitCode"]) for w in held["workers"]] == [("crashed", status)] * 3


async def test_a_run_between_crashes_can_be_cancelled(paths: StatePaths, project: Path,
                                                     nursery: trio.Nursery) -> None:
    write_workflow(project, "exits", EXITS)
    await nursery.start(Host(config(paths, crash_backoff_s=30)).serve)  # a long back-off after the first
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "exits", input={"status": 3})
        await wait_for(lambda: _workers_ended(client, run_id, 1))
        cancelled = await client.call("run.cancel", run_id=run_id)
        assert cancelled.outcome == "accepted", cancelled.error
        assert (await client.call("run.status", run_id=run_id)).receipt["status"] == "cancelled"


async def _workers_ended(client: AsyncClient, run_id: str, count: int) -> bool:
    workers = (await client.call("run.status", run_id=run_id)).receipt["workers"]
    return sum(w["status"] not in ("starting", "running") for w in workers) >= count


async def test_a_workflow_whose_import_hangs_in_the_worker_is_timed_out_and_held(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    write_workflow(project, "hangs", HANGS_IN_WORKER)
    await nursery.start(Host(config(paths, worker_startup_s=0.5, crash_backoff_s=0.01, max_crashes=2)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "hangs")
        held = (await client.call("run.wait", run_id=run_id)).receipt
        status = (await client.call("host.status")).receipt
    assert (held["queueStatus"], held["hold"]) == ("parked", "crashed")
    assert [w["status"] for w in held["workers"]] == ["timedOut", "timedOut"]
    assert held["statusDetail"].endswith("last output: [piwf] not ready after 0.5 s (loading its workflow included)")
    assert status["activeWorkers"] == 0  # no slot held


BIG_OUTPUTS = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def big(ctx):
        return {"blob": "x" * (3 * 1024 * 1024)}  # under the 4 MiB limit; six add up past the 16 MiB frame

    def last(ctx):
        marker = Path(ctx.project_path) / "crashed-once"
        if not marker.exists():
            marker.touch()
            os._exit(9)  # the next worker must receive all six outputs
        return {"sizes": [len(ctx.outputs[n]["blob"]) for n in "abcdef"]}

    workflow = Workflow(
        name="big", start_at="a",
        nodes={**{n: compute(big) for n in "abcdef"}, "last": compute(last)},
        edges=[("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("e", "f"), ("f", "last")],
    )
"""

TOO_BIG = """
    from pathlib import Path
    from piwf import Workflow, compute

    def huge(ctx):
        with open(Path(ctx.project_path) / "huge.log", "a") as f:
            f.write("ran\\n")
        return "x" * (5 * 1024 * 1024)

    workflow = Workflow(name="huge", start_at="huge", nodes={"huge": compute(huge)})
"""


async def test_a_run_whose_outputs_add_up_past_the_frame_limit_resumes(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    write_workflow(project, "big", BIG_OUTPUTS)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "big")
        done = (await client.call("run.wait", run_id=run_id)).receipt
        await wait_for(lambda: _workers_ended(client, run_id, 2))
        done["workers"] = (await client.call("run.status", run_id=run_id)).receipt["workers"]
    assert done["status"] == "completed", done["statusDetail"]
    assert done["output"] == {"sizes": [3 * 1024 * 1024] * 6}
    assert [w["status"] for w in done["workers"]] == ["crashed", "exited"]


async def test_an_output_over_the_limit_fails_its_node_once(paths: StatePaths, project: Path,
                                                            nursery: trio.Nursery) -> None:
    write_workflow(project, "huge", TOO_BIG)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "huge")
        failed = (await client.call("run.wait", run_id=run_id)).receipt
    assert failed["status"] == "failed"
    assert "over the 4194304-byte limit" in failed["error"]["message"]
    assert (project / "huge.log").read_text() == "ran\n"  # once: not a crash to retry


PARRICIDE = """
    import os, signal
    from piwf import Workflow, compute

    def kill_parent(ctx):
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)

    workflow = Workflow(name="parricide", start_at="kill", nodes={"kill": compute(kill_parent)})
"""


@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_a_node_that_kills_its_parent_never_reaches_the_host_and_is_held(
    paths: StatePaths, project: Path, nursery: trio.Nursery, mode: str
) -> None:
    """In-process host: were the host a worker's parent, this test's own process would die."""
    write_workflow(project, "parricide", PARRICIDE)
    await nursery.start(Host(config(paths, worker_start=mode, crash_backoff_s=0.01, max_crashes=3)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "parricide")
        held = (await client.call("run.wait", run_id=run_id)).receipt
        assert (held["queueStatus"], held["hold"]) == ("parked", "crashed")
        assert held["statusDetail"].startswith("worker crashed 3 times in a row")
        greet = await _start(client, project, "greet")  # a template is there again
        assert (await client.call("run.wait", run_id=greet)).receipt["status"] == "completed"


async def test_crashes_in_a_row_are_counted_across_host_restarts(paths: StatePaths, project: Path) -> None:
    write_workflow(project, "exits", EXITS)
    clock = ManualClock(WallClock().now_ms())  # the hosts' clock: it moves when the test says
    async with trio.open_nursery() as nursery:  # the first host sees one crash, then stops
        await nursery.start(Host(config(paths, crash_backoff_s=60), clock=clock).serve)
        async with AsyncClient(paths) as client:
            run_id = await _start(client, project, "exits", input={"status": 1})
            await wait_for(lambda: _workers_ended(client, run_id, 1))
        nursery.cancel_scope.cancel()
    clock.advance(60_000)  # the back-off the first host parked it with (kept with the run) is over
    async with trio.open_nursery() as nursery:  # the next host holds it after its second
        await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=2), clock=clock).serve)
        async with AsyncClient(paths) as client:
            held = (await client.call("run.wait", run_id=run_id)).receipt
        nursery.cancel_scope.cancel()
    assert held["hold"] == "crashed" and held["statusDetail"].startswith("worker crashed 2 times in a row")
    assert [w["status"] for w in held["workers"]] == ["crashed", "crashed"]


FREEZES_PARENT = """
    import os, signal
    from piwf import Workflow, compute

    def freeze_parent(ctx):
        os.kill(os.getppid(), signal.SIGSTOP)  # the fork server stops answering
        os._exit(1)

    workflow = Workflow(name="freezer", start_at="f", nodes={"f": compute(freeze_parent)})
"""

KILLS_PARENT_AND_LINGERS = """
    import os, signal, subprocess, time
    from pathlib import Path
    from piwf import Workflow, compute

    def orphan_maker(ctx):
        child = subprocess.Popen(["sleep", "777"])  # in the worker's own process group
        (Path(ctx.project_path) / "child.pid").write_text(str(child.pid))
        os.kill(os.getppid(), signal.SIGKILL)  # the fork server dies; init adopts the worker
        time.sleep(600)

    workflow = Workflow(name="orphan_maker", start_at="o", nodes={"o": compute(orphan_maker)})
"""


async def test_a_node_that_freezes_the_fork_server_does_not_stop_later_runs(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piwf.host import fork_launcher

    monkeypatch.setattr(fork_launcher, "TEMPLATE_READY_S", 1.0)  # how long a start waits for an answer
    write_workflow(project, "freezer", FREEZES_PARENT)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=1)).serve)
    async with AsyncClient(paths) as client:
        frozen = await _start(client, project, "freezer")
        assert (await client.call("run.wait", run_id=frozen)).receipt["hold"] == "crashed"
        greet = await _start(client, project, "greet")  # the frozen server is killed and replaced
        done = (await client.call("run.wait", run_id=greet)).receipt
    assert done["status"] == "completed"
    assert all(w["status"] in ("notStarted", "exited") for w in done["workers"]), done["workers"]


async def test_a_worker_whose_fork_server_died_takes_its_children_with_it_when_stopped(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    import psutil

    write_workflow(project, "orphan_maker", KILLS_PARENT_AND_LINGERS)
    await nursery.start(Host(config(paths)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "orphan_maker")
        child = int(await wait_for(lambda: (project / "child.pid").exists() and (project / "child.pid").read_text()))
        await wait_for(lambda: not _worker_has_its_fork_server(child))  # its worker was adopted by init
        assert (await client.call("run.cancel", run_id=run_id)).outcome == "accepted"
        await wait_for(lambda: _workers_ended(client, run_id, 1))
    await wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)


def _worker_has_its_fork_server(pid: int) -> bool:
    """The child's worker still has the fork server as its parent."""
    import psutil as ps

    try:
        return "forkserver" in " ".join(ps.Process(ps.Process(pid).ppid()).parent().cmdline())
    except ps.Error:
        return False


async def test_runs_started_while_the_fork_server_is_away_are_not_charged_crashes(
    paths: StatePaths, project: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piwf.host.fork_launcher import ForkLauncher
    from piwf.host.launcher import LauncherUnavailable

    real_start, refusals = ForkLauncher.start, []

    async def away_at_first(self: ForkLauncher, launch: object) -> object:
        if len(refusals) < 3:
            refusals.append(1)
            raise LauncherUnavailable("the fork server is not running (it is being restarted)")
        return await real_start(self, launch)

    monkeypatch.setattr(ForkLauncher, "start", away_at_first)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=2)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "greet")
        done = (await client.call("run.wait", run_id=run_id)).receipt
    assert done["status"] == "completed"  # three failed starts, max_crashes 2: never held
    assert [w["status"] for w in done["workers"]][:3] == ["notStarted"] * 3


DEEP = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def deep(ctx):
        value = "x"
        for _ in range(ctx.input["depth"]):
            value = [value]
        return value

    def crash_once(ctx):
        marker = Path(ctx.project_path) / "crashed-once"
        if not marker.exists():
            marker.touch()
            os._exit(9)  # the next worker receives the deep output from the host
        depth, value = 0, ctx.outputs["deep"]
        while isinstance(value, list):
            depth, value = depth + 1, value[0]
        return {"depth": depth}

    workflow = Workflow(name="deep", start_at="deep", nodes={"deep": compute(deep), "then": compute(crash_once)},
                        edges=[("deep", "then")])
"""


@pytest.mark.parametrize("depth", [64, 65])
async def test_an_output_nested_up_to_the_limit_survives_a_resume_and_a_deeper_one_fails_its_node(
    paths: StatePaths, project: Path, nursery: trio.Nursery, depth: int
) -> None:
    write_workflow(project, "deep", DEEP)
    await nursery.start(Host(config(paths, crash_backoff_s=0.01)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "deep", input={"depth": depth})
        run = (await client.call("run.wait", run_id=run_id)).receipt
    if depth == 64:
        assert (run["status"], run["output"]) == ("completed", {"depth": 64})
    else:
        assert run["status"] == "failed" and "nested deeper than 64 levels" in run["error"]["message"]
        assert [w["status"] for w in run["workers"]] == ["exited"]  # failed once: not a crash


async def test_a_shell_node_ends_with_its_program_not_with_its_background_children(
    paths: StatePaths, project: Path, nursery: trio.Nursery
) -> None:
    write_workflow(project, "bg", """
        from piwf import Workflow, shell
        workflow = Workflow(name="bg", start_at="s", nodes={"s": shell(["sh", "-c", "sleep 300 & echo started"])})
    """)
    await nursery.start(Host(config(paths)).serve)
    async with AsyncClient(paths) as client:
        run_id = await _start(client, project, "bg")
        with trio.fail_after(20):  # it used to wait for the background sleep: 300 s
            run = (await client.call("run.wait", run_id=run_id)).receipt
    assert run["status"] == "completed" and run["output"]["stdout"] == "started\n"
