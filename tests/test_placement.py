"""Placement and named queues with real hosts: a run is executed by a host that can load its
workflow and never held because another host cannot; a run no live host can load is held
with the reason and goes on once a capable host starts or the file is restored; queues pin
runs to the hosts that serve them (docs/operations.md, "Placement and named queues").

The hosts share this machine's files, so a host is made to look like a machine without the
workflow file, or with another version of it, by its environment: the workflow file below
refuses to load (as a missing file would) or defines another graph (another digest) in a
worker whose host runs with ``PIWF_TEST_MACHINE`` set.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piwf.paths import StatePaths

from .conftest import HostProcess, pg_store_url, piwf, wait_for, write_workflow
from .test_lifecycle import call, run_status

PLACED = """
    import os
    from piwf import Workflow, compute, shell

    MACHINE = os.environ.get("PIWF_TEST_MACHINE", "")
    if MACHINE == "without-file":
        raise ImportError("no such file on this machine")
    gate = "while [ ! -e gate ]; do sleep 0.02; done" + ("; echo older" if MACHINE == "older" else "")

    workflow = Workflow(
        name="placed",
        start_at="wait",
        nodes={
            "wait": shell(["sh", "-c", "echo started >> wait.log; " + gate]),
            "done": compute(lambda ctx: {"machine": MACHINE or "capable"}),
        },
        edges=[("wait", "done")],
    )
"""


def placed(project: Path) -> Path:
    return write_workflow(project, "placed", PLACED)


async def start(paths: StatePaths, project: Path, queue: str | None = None) -> str:
    payload: dict[str, Any] = {"workflow": "placed", "projectPath": str(project)}
    if queue is not None:
        payload["queue"] = queue
    return str((await call(paths, "run.start", payload=payload))["runId"])


async def events(paths: StatePaths, run_id: str) -> list[dict[str, Any]]:
    return list((await call(paths, "run.events", run_id=run_id))["events"])


def other_host(tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> HostProcess:
    return HostProcess(StatePaths.resolve(tmp_path / f"state-{name}"), tmp_path / f"host-{name}.log", *extra, env=env)


async def stop(*hosts: HostProcess) -> None:
    for host in hosts:
        if host.proc is not None and host.proc.returncode is None:
            host.signal(signal.SIGTERM)
            await host.wait()


async def test_a_run_goes_to_the_host_that_can_load_it_and_is_never_held_for_another_host(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    placed(project)
    url = pg_store_url(postgres)
    await host_process("--store", url, "--max-workers", "1").start()  # has the workflow as the runs do
    older = other_host(tmp_path, "older", "--store", url, env={"PIWF_TEST_MACHINE": "older"})
    await older.start()  # free workers, another version of the workflow
    try:
        run_ids = [await start(paths, project)]
        await wait_for(lambda: (project / "wait.log").exists())  # on the capable host, at its gate: it is full
        run_ids += [await start(paths, project) for _ in range(2)]

        async def tried_elsewhere() -> int:  # runs the older host claimed, could not load and released
            shown = [await run_status(paths, run_id) for run_id in run_ids]
            return sum(1 for run in shown if run["placement"] and "cannot load its workflow" in run["placement"])

        # The older host takes the other two, finds another digest, releases them and passes
        # them over from then on; they wait for the capable host.
        await wait_for(lambda: _count(tried_elsewhere, 2), timeout=30)
        (project / "gate").touch()
        for run_id in run_ids:
            done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})
            assert done["status"] == "completed" and done["output"] == {"machine": "capable"}, done
            assert done["hold"] is None and done["queue"] == "default"
            assert "held" not in [e["type"] for e in await events(paths, run_id)]
        released = [e for run_id in run_ids for e in await events(paths, run_id)
                    if e["type"] == "parked" and "cannot be loaded on" in e.get("reason", "")]
        assert len(released) == 2 and all("workflow source changed" in e["reason"] for e in released)
        assert len((project / "wait.log").read_text().splitlines()) == 3  # each ran once, on the capable host
    finally:
        await stop(older)


async def _count(measure: Callable[[], Any], wanted: int) -> bool:
    return bool(await measure() == wanted)


async def test_a_run_no_live_host_can_load_is_held_and_goes_on_when_a_capable_host_starts(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    placed(project)
    (project / "gate").touch()
    url = pg_store_url(postgres)
    await host_process("--store", url).start()  # serves 'default' only
    run_id = await start(paths, project, queue="gpu")
    run = await run_status(paths, run_id)
    assert (run["status"], run["queue"], run["placement"]) == ("queued", "gpu", "no live host serves queue 'gpu'")
    hosts = [other_host(tmp_path, "older", "--store", url, "--queue", "gpu", env={"PIWF_TEST_MACHINE": "older"}),
             other_host(tmp_path, "bare", "--store", url, "--queue", "gpu", "--queue", "batch",
                        env={"PIWF_TEST_MACHINE": "without-file"})]
    try:
        for host in hosts:
            await host.start()
        status = json.loads((await piwf(hosts[1].paths, "status", "--json")).stdout)
        assert status["queues"] == ["gpu", "batch"]
        # Both hosts of queue gpu claim it in turn, neither can load it: held, with each one's reason.
        held = await wait_for(lambda: _held(paths, run_id), timeout=30)
        assert held["statusDetail"].startswith("no live host can load its workflow: ")
        assert "workflow source changed" in held["statusDetail"] and "no such file" in held["statusDetail"]
        listed = json.loads((await piwf(paths, "run", "list", "--held", "--json")).stdout)
        assert [r["runId"] for r in listed] == [run_id]
        shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
        assert "held (source)" in shown and "queue:    gpu" in shown
        assert "start a host of queue gpu that has it" in shown
        capable = other_host(tmp_path, "capable", "--store", url, "--queue", "gpu")
        hosts.append(capable)
        await capable.start()  # joins: the run is released for it, and it runs it
        done = await wait_for(lambda: _ended(paths, run_id), timeout=30)
        assert done["status"] == "completed" and done["output"] == {"machine": "capable"}, done
        kinds = [e["type"] for e in await events(paths, run_id)]
        assert kinds.index("held") < kinds.index("released") < kinds.index("completed")
    finally:
        await stop(*hosts)


async def _ended(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["finishedAt"] is not None else None


async def _held(paths: StatePaths, run_id: str) -> dict[str, Any] | None:
    run = await run_status(paths, run_id)
    return run if run["hold"] == "source" else None


async def test_a_queue_pins_a_run_and_a_run_whose_file_is_missing_goes_on_once_it_is_restored(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path,
) -> None:
    """SQLite, one host: a run on a queue the host does not serve stays queued, and status
    and run show say why; served, with its file gone, it is held at once (the only host
    cannot load it); with the file back it goes on, nobody acting."""
    path = placed(project)
    (project / "gate").touch()
    host = await host_process().start()
    started = await piwf(paths, "run", "start", "placed", "--project", str(project), "--queue", "gpu", "--json")
    run_id = json.loads(started.stdout)["runId"]
    shown = (await piwf(paths, "run", "show", run_id)).stdout.decode()
    assert "queue:    gpu" in shown and "waiting:  no live host serves queue 'gpu'" in shown
    assert "queued on gpu" in (await piwf(paths, "run", "list")).stdout.decode()
    status = (await piwf(paths, "status")).stdout.decode()
    assert "queues:    default (this host claims runs of these)" in status
    assert (await run_status(paths, run_id))["status"] == "queued"
    host.signal(signal.SIGTERM)
    await host.wait()
    source = path.read_text()
    path.unlink()
    await host_process("--queue", "gpu").start()
    held = await wait_for(lambda: _held(paths, run_id), timeout=30)
    assert held["statusDetail"].startswith("no live host can load its workflow: host-")
    path.write_text(source)  # the host looks at the file again on its next poll
    done = await wait_for(lambda: _ended(paths, run_id), timeout=30)
    assert done["status"] == "completed" and done["output"] == {"machine": "capable"}, done
    kinds = [e["type"] for e in await events(paths, run_id)]
    assert kinds.index("held") < kinds.index("released") < kinds.index("completed")


async def test_a_bad_queue_name_is_refused_in_one_line_and_changes_nothing(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    await host_process().start()
    for bad in ("gpu pool", "", "-gpu", "x" * 64, "gpu/1", "gpü"):
        result = await piwf(paths, "run", "start", "greet", "--project", str(project), f"--queue={bad}",
                            check=False)
        error = result.stderr.decode()
        assert result.returncode != 0 and "is not a short identifier" in error, error
        assert len(error.strip().splitlines()) == 1
    refused = await piwf(StatePaths.resolve(tmp_path / "never"), "serve", "--queue", "a b", check=False)
    assert refused.returncode != 0 and "is not a short identifier" in refused.stderr.decode()
    assert len(refused.stderr.decode().strip().splitlines()) == 1 and not (tmp_path / "never").exists()
    for lease in ("0.5", "0"):  # a lease too short to renew and fence sensibly: refused the same way
        refused = await piwf(StatePaths.resolve(tmp_path / "never"), "serve", "--lease", lease, check=False)
        said = refused.stderr.decode()
        assert refused.returncode == 2 and "argument --lease: must" in said and len(said.strip().splitlines()) == 1
        assert not (tmp_path / "never").exists()
    from piwf.client import AsyncClient

    async with AsyncClient(paths) as client:  # the protocol refuses it too, a final newline as well
        for bad in ("a b", "gpu\n"):
            response = await client.call("run.start", payload={"workflow": "greet", "projectPath": str(project),
                                                               "queue": bad})
            assert response.outcome == "rejected" and "queue" in response.error, bad
    assert await call(paths, "run.list") == []
