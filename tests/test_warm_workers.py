"""Warm workers (``Workflow(..., reuse_worker=...)``): runs of one workflow executed one
after another by one process, with a real host and real worker processes; what a run
leaves (its registered process groups, its environment) gone before the next; a run's
crash, hang or cancel affects that run alone."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from piwf.client import AsyncClient
from piwf.engine.definition import WARM_MEMORY_MB, WARM_RUNS, Workflow, WorkerReuse, compute
from piwf.errors import DefinitionError
from piwf.host.host import Host
from piwf.paths import StatePaths

from .conftest import HostProcess, config, wait_for, write_workflow
from .test_lifecycle import group_members

WARM = """
    import os, signal, subprocess, threading, time
    from pathlib import Path
    from piwf import Workflow, compute

    RUNS = []  # module state: a warm worker keeps it between runs (what reuse gives up)

    def work(ctx):
        RUNS.append(ctx.run_id)
        what = (ctx.input or {}).get("do")
        seen = {"pid": os.getpid(), "runs": len(RUNS), "leak": os.environ.get("WARM_LEAK"), "cwd": os.getcwd(),
                "threads": threading.active_count(), "nice": os.nice(0)}
        if what == "leak":  # change the environment and cwd, leave a registered group running
            os.environ["WARM_LEAK"] = "leaked"
            os.chdir("/")
            child = subprocess.Popen(["sleep", "300"], start_new_session=True)
            ctx.journal.process_started("work", child.pid)
            seen["child"] = child.pid
        elif what == "crash" and not (Path(ctx.project_path) / "crashed").exists():
            (Path(ctx.project_path) / "crashed").write_text("x")
            os._exit(9)
        elif what == "hang":
            (Path(ctx.project_path) / "hanging").write_text(str(os.getpid()))
            time.sleep(300)
        elif what == "thread":  # a thread of the run still alive when it ends: not reused
            threading.Thread(target=time.sleep, args=(1.5,), daemon=True).start()
        elif what == "alive":
            try:
                os.kill(ctx.input["pid"], 0)
                seen["alive"] = True
            except ProcessLookupError:
                seen["alive"] = False
        return seen

    workflow = Workflow(name="warm", start_at="work", nodes={"work": compute(work)}, reuse_worker=REUSE)
"""


def warm_project(project: Path, reuse: str = "True") -> Path:
    write_workflow(project, "warm", WARM.replace("REUSE", reuse))
    return project


async def run_once(client: AsyncClient, project: Path, input: Any = None, workflow: str = "warm") -> dict[str, Any]:
    """Start a run, wait for it to end and for its worker's record (a warm worker is back
    in the pool by then), and return its status."""
    started = await client.call("run.start", payload={"workflow": workflow, "projectPath": str(project),
                                                      "input": input})
    run_id = started.receipt["runId"]
    await client.call("run.wait", run_id=run_id)
    return await wait_for(lambda: _settled(client, run_id))


async def _settled(client: AsyncClient, run_id: str) -> dict[str, Any] | None:
    run = (await client.call("run.status", run_id=run_id)).receipt
    done = run["status"] in ("completed", "failed") and run["workers"]
    return run if done and all(w["status"] not in ("starting", "running") for w in run["workers"]) else None


def worker_pids(run: dict[str, Any]) -> list[int]:
    return [w["pid"] for w in run["workers"]]


@pytest.fixture
async def warm_host(paths: StatePaths, nursery: trio.Nursery) -> Any:
    state = await nursery.start(Host(config(paths, crash_backoff_s=0.01)).serve)
    yield state
    state.stop_requested.set()


async def test_a_run_whose_idle_worker_died_counts_its_fresh_process_from_one(
        warm_host: Any, paths: StatePaths, project: Path) -> None:
    """The idle worker was killed and not yet swept from the pool: the next run gets a
    fresh process, and the end recorded with its last message says so (no amend)."""
    warm_project(project)
    async with AsyncClient(paths) as client:
        first = (await run_once(client, project))["output"]
        os.kill(first["pid"], signal.SIGKILL)
        await wait_for(lambda: not _alive(first["pid"]))
        after = await run_once(client, project)
        events = (await client.call("run.events", run_id=after["runId"])).receipt["events"]
    assert after["output"]["runs"] == 1
    assert "worker.amended" not in [e["type"] for e in events], events


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_runs_of_a_reusing_workflow_share_one_worker_process(warm_host: Any, paths: StatePaths,
                                                                   project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        runs = [await run_once(client, project) for _ in range(3)]
        fresh = [await run_once(client, project, workflow="boom") for _ in range(2)]
        traces = [(await client.call("run.events", run_id=run["runId"])).receipt["events"] for run in runs]
    outputs = [run["output"] for run in runs]
    assert len({o["pid"] for o in outputs}) == 1, outputs  # one process ...
    assert [o["runs"] for o in outputs] == [1, 2, 3]  # ... that kept its module loaded
    assert all(len(run["workers"]) == 1 and run["workers"][0]["status"] == "exited" for run in runs)
    # each run has its own worker record (its own epoch and fence), naming the same process
    assert len({run["workers"][0]["workerEpoch"] for run in runs}) == 3
    assert "kept warm for another run" in runs[0]["workers"][0]["diagnostic"]
    assert len(warm_host.warm) == 1
    # each end was recorded with its run's, as it turned out (its process's runs counted): none amended
    assert [run["workers"][0]["diagnostic"].rsplit("[piwf] ", 1)[-1] for run in runs] == [
        f"kept warm for another run after {n} run(s) (reuse_worker)" for n in (1, 2, 3)]
    assert all("worker.amended" not in [e["type"] for e in events] for events in traces)
    # a workflow that does not opt in still gets a fresh process for every run
    assert len({pid for run in fresh for pid in worker_pids(run)}) == 2


async def test_a_spawned_worker_is_reused_as_a_forked_one_is(paths: StatePaths, project: Path,
                                                             nursery: trio.Nursery) -> None:
    warm_project(project)
    host = await nursery.start(Host(config(paths, worker_start="spawn")).serve)
    async with AsyncClient(paths) as client:
        outputs = [(await run_once(client, project))["output"] for _ in range(2)]
    host.stop_requested.set()
    assert outputs[0]["pid"] == outputs[1]["pid"] and [o["runs"] for o in outputs] == [1, 2]


async def test_a_warm_worker_is_replaced_after_its_number_of_runs(warm_host: Any, paths: StatePaths,
                                                                  project: Path) -> None:
    warm_project(project, reuse="2")
    async with AsyncClient(paths) as client:
        outputs = [(await run_once(client, project))["output"] for _ in range(5)]
    assert [o["runs"] for o in outputs] == [1, 2, 1, 2, 1]
    pids = [o["pid"] for o in outputs]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


async def test_a_warm_worker_past_its_memory_ceiling_is_replaced(warm_host: Any, paths: StatePaths,
                                                                  project: Path) -> None:
    warm_project(project, reuse="True, worker_memory_mb=1")  # any Python process is resident over 1 MB
    async with AsyncClient(paths) as client:
        outputs = [(await run_once(client, project))["output"] for _ in range(3)]
    assert [o["runs"] for o in outputs] == [1, 1, 1]
    assert len({o["pid"] for o in outputs}) == 3


async def test_what_a_run_registered_and_changed_is_gone_before_the_next_run(warm_host: Any, paths: StatePaths,
                                                                           project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        leaking = (await run_once(client, project, {"do": "leak"}))["output"]
        after = (await run_once(client, project, {"do": "alive", "pid": leaking["child"]}))["output"]
    assert after["pid"] == leaking["pid"] and after["runs"] == 2  # the same process ...
    assert after["alive"] is False  # ... without the process group the first run registered
    assert after["leak"] is None and after["cwd"] == leaking["cwd"]  # ... nor its environment, nor its cwd


async def test_a_crash_in_a_warm_worker_affects_that_run_alone(warm_host: Any, paths: StatePaths,
                                                               project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        first = await run_once(client, project)
        crashed = await run_once(client, project, {"do": "crash"})
        after = await run_once(client, project)
    assert first["status"] == crashed["status"] == after["status"] == "completed"
    assert [w["status"] for w in crashed["workers"]] == ["crashed", "exited"]
    assert crashed["workers"][0]["pid"] == first["output"]["pid"]  # it crashed in the warm worker
    assert crashed["workers"][0]["exitCode"] == 9
    # retried in a fresh process, which then served the next run: the crash cost only itself
    assert crashed["output"]["runs"] == 1 and crashed["output"]["pid"] != first["output"]["pid"]
    assert after["output"]["pid"] == crashed["output"]["pid"] and after["output"]["runs"] == 2
    assert first["workers"][0]["status"] == "exited"  # the run before is untouched


async def test_a_hung_run_in_a_warm_worker_is_cancelled_alone(warm_host: Any, paths: StatePaths,
                                                              project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        first = await run_once(client, project)
        hung = await client.call("run.start", payload={"workflow": "warm", "projectPath": str(project),
                                                       "input": {"do": "hang"}})
        hung_id = hung.receipt["runId"]
        await wait_for(lambda: (project / "hanging").exists())
        assert int((project / "hanging").read_text()) == first["output"]["pid"]  # hanging in the warm worker
        await client.call("run.cancel", run_id=hung_id)
        cancelled = await wait_for(lambda: _settled_any(client, hung_id))
        after = await run_once(client, project)
    assert cancelled["status"] == "cancelled"
    assert [w["status"] for w in cancelled["workers"]] == ["cancelled"]
    with pytest.raises(ProcessLookupError):  # the warm process went with the run it was running
        os.kill(first["output"]["pid"], 0)
    assert after["status"] == "completed" and after["output"]["runs"] == 1
    assert after["output"]["pid"] != first["output"]["pid"]


async def _settled_any(client: AsyncClient, run_id: str) -> dict[str, Any] | None:
    run = (await client.call("run.status", run_id=run_id)).receipt
    return run if run["workers"] and all(w["status"] not in ("starting", "running") for w in run["workers"]) else None


async def test_a_run_that_leaves_a_thread_running_is_not_followed_in_its_process(
        warm_host: Any, paths: StatePaths, project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        threaded = (await run_once(client, project, {"do": "thread"}))
        after = (await run_once(client, project))["output"]
    assert "kept warm" not in (threaded["workers"][0]["diagnostic"] or "")
    assert after["pid"] != threaded["output"]["pid"] and after["runs"] == 1


async def test_an_idle_warm_worker_that_dies_is_not_handed_a_run(warm_host: Any, paths: StatePaths,
                                                                 project: Path) -> None:
    warm_project(project)
    async with AsyncClient(paths) as client:
        first = (await run_once(client, project))["output"]
        os.kill(first["pid"], signal.SIGKILL)
        await wait_for(lambda: len(warm_host.warm) == 0)
        after = await run_once(client, project)
    assert after["status"] == "completed" and after["output"]["pid"] != first["pid"]
    assert after["output"]["runs"] == 1


async def test_the_host_stopping_stops_its_idle_warm_workers(paths: StatePaths, project: Path) -> None:
    warm_project(project)
    async with trio.open_nursery() as nursery:
        host = await nursery.start(Host(config(paths)).serve)
        async with AsyncClient(paths) as client:
            pid = (await run_once(client, project))["output"]["pid"]
        assert len(host.warm) == 1
        host.stop_requested.set()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("nice", [10, 0, 19])
async def test_a_run_worker_executes_its_nodes_nicer_than_the_host_by_worker_nice(
        paths: StatePaths, project: Path, nursery: trio.Nursery, nice: int) -> None:
    warm_project(project)
    write_workflow(project, "fresh", WARM.replace("REUSE", "False").replace('name="warm"', 'name="fresh"'))
    overrides = {} if nice == 10 else {"worker_nice": nice}  # 10 is the default
    host = await nursery.start(Host(config(paths, **overrides)).serve)
    async with AsyncClient(paths) as client:
        fresh = (await run_once(client, project, workflow="fresh"))["output"]
        warm = [(await run_once(client, project))["output"] for _ in range(2)]
    host.stop_requested.set()
    own = os.nice(0)
    assert fresh["nice"] == min(19, own + nice)
    assert [w["nice"] for w in warm] == [min(19, own + nice)] * 2  # lowered once, not once per run
    assert warm[0]["pid"] == warm[1]["pid"]


def test_reuse_worker_is_checked_where_the_workflow_is_declared() -> None:
    node = {"n": compute(lambda ctx: None)}
    assert Workflow("w", "n", node).reuse is None
    assert Workflow("w", "n", node, reuse_worker=True).reuse == WorkerReuse(WARM_RUNS, WARM_MEMORY_MB)
    assert Workflow("w", "n", node, reuse_worker=5, worker_memory_mb=64).reuse == WorkerReuse(5, 64)
    assert Workflow("w", "n", node, reuse_worker=1).reuse is None  # one run per process: a fresh one each
    assert Workflow("w", "n", node, reuse_worker=True).digest() == Workflow("w", "n", node).digest()
    for bad, message in [({"reuse_worker": 0}, "reuse_worker must be"), ({"reuse_worker": "yes"}, "reuse_worker"),
                         ({"reuse_worker": True, "worker_memory_mb": 0}, "worker_memory_mb must be"),
                         ({"worker_memory_mb": 64}, "applies to reused workers only")]:
        with pytest.raises(DefinitionError, match=message):
            Workflow("w", "n", node, **bad)


async def test_a_reusing_worker_whose_run_is_held_for_its_source_ends_as_a_fresh_one_does(
        paths: StatePaths, project: Path, nursery: trio.Nursery) -> None:
    """The run was started with another digest than the file's now: held (source), and its
    worker exits by itself instead of offering itself for runs of a digest it did not load."""
    warm_project(project)
    host = await nursery.start(Host(config(paths, max_workers=1)).serve)
    async with AsyncClient(paths) as client:
        blocker = await client.call("run.start", payload={"workflow": "warm", "projectPath": str(project),
                                                          "input": {"do": "hang"}})
        await wait_for(lambda: (project / "hanging").exists())
        held = await client.call("run.start", payload={"workflow": "warm", "projectPath": str(project)})
        path = project / ".piwf" / "workflows" / "warm.py"
        path.write_text(path.read_text().replace('RUNS.append(ctx.run_id)', 'RUNS.append(ctx.run_id); RUNS.sort()'))
        await client.call("run.cancel", run_id=blocker.receipt["runId"])
        run = await wait_for(lambda: _settled_any(client, held.receipt["runId"]))
    host.stop_requested.set()
    assert run["hold"] == "source"
    assert [w["status"] for w in run["workers"]] == ["exited"]
    assert "kept warm" not in (run["workers"][0]["diagnostic"] or "")
    assert len(host.warm) == 0


async def test_warm_workers_of_piwf_serve_on_both_stores_and_an_idle_one_dies_with_its_host(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path,
        store_args: tuple[str, ...]) -> None:
    warm_project(project)
    served = await host_process(*store_args).start()
    async with AsyncClient(paths) as client:
        outputs = [(await run_once(client, project))["output"] for _ in range(3)]
    pid = outputs[0]["pid"]
    assert [o["pid"] for o in outputs] == [pid] * 3 and [o["runs"] for o in outputs] == [1, 2, 3]
    assert group_members(pid)  # idle, waiting for another run
    served.signal(signal.SIGKILL)
    await served.wait()
    await wait_for(lambda: not group_members(pid))  # the pipe's hang-up took it down


async def test_a_warm_workers_end_is_recorded_with_the_message_that_ended_its_run(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    """A worker that may be kept warm has its end recorded as it will look once idle (no
    exit code, the kept-warm note) in the unit of work of the message that ended its run:
    a host that dies just after answering that message has left it recorded so, not live."""
    warm_project(project)
    dying = await host_process(env={"PIWF_FAULT": "host.worker.answered:exit:2"}).start()  # ready, then the end
    async with AsyncClient(paths) as client:
        started = await client.call("run.start", payload={"workflow": "warm", "projectPath": str(project)})
    await dying.wait()
    await host_process().start()
    async with AsyncClient(paths) as client:
        run = (await client.call("run.status", run_id=started.receipt["runId"])).receipt
    assert run["status"] == "completed"
    [worker] = run["workers"]
    assert (worker["status"], worker["exitCode"], worker["signal"]) == ("exited", None, None)
    assert worker["diagnostic"].endswith("[piwf] kept warm for another run after 1 run(s) (reuse_worker)")
