"""Three real hosts on one PostgreSQL store: `piwf status` lists them; a host SIGKILLed on
this machine is proved dead and taken over at once (its lease set to an hour, so nothing
else explains it), its orphaned shell group reaped by one host; a host that looks like
another machine's (``PIWF_BOOT_ID``) is taken over only when its claim expires, and its
orphans are left alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from piwf.paths import StatePaths

from .conftest import WORKFLOWS, HostProcess, pg_store_url, piwf, wait_for, write_workflow
from .test_lifecycle import call, group_members, run_status, start, step_states

ORPHANING = """
    from pathlib import Path
    from piwf import Workflow, compute, shell

    def once(ctx):
        with open(Path(ctx.project_path) / "once.log", "a") as f:
            f.write(ctx.run_id + "\\n")
        return {"counted": True}

    workflow = Workflow(
        name="orphaning",
        start_at="once",
        nodes={
            "once": compute(once),
            "wait": shell(["sh", "-c", "sleep 300 & echo $$ >> wait.log; while [ ! -e gate ]; do sleep 0.02; done"]),
            "done": compute(lambda ctx: {"once": ctx.outputs["once"]}),
        },
        edges=[("once", "wait"), ("wait", "done")],
    )
"""


@contextlib.asynccontextmanager
async def hosts(tmp_path: Path, *names: str, env: dict[str, dict[str, str]] | None = None,
                **extra: tuple[str, ...]) -> AsyncIterator[dict[str, HostProcess]]:
    """Hosts by name, each with its own state directory, started in the body as needed;
    stopped (or killed) at the end."""
    made = {name: HostProcess(StatePaths.resolve(tmp_path / f"state-{name}"), tmp_path / f"host-{name}.log",
                              *extra.get(name, ()), env=(env or {}).get(name)) for name in names}
    try:
        yield made
    finally:
        for process in made.values():
            if process.proc is not None and process.proc.returncode is None:
                process.signal(signal.SIGTERM)
                with contextlib.suppress(Exception):
                    await process.wait(10)
                process.kill_group()
                await process.proc.wait()


async def orphan_the_shell(host: HostProcess, project: Path, run_id: str) -> int:
    """Freeze the host, kill its worker (neither can reap the shell node's group), then kill
    the host; returns the orphaned group's leader."""
    shell_pid = int(await wait_for(lambda: _shell_started(project)))
    worker_pid = (await run_status(host.paths, run_id))["workers"][0]["pid"]
    host.signal(signal.SIGSTOP)
    os.kill(worker_pid, signal.SIGKILL)
    host.signal(signal.SIGKILL)
    assert await host.wait() == -signal.SIGKILL  # its shell's group is orphaned (test_reaping.py)
    return shell_pid


def _shell_started(project: Path) -> str | None:
    """The pid of the first shell of the 'wait' node (it leads its process group)."""
    log = project / "wait.log"
    lines = log.read_text().split() if log.exists() else []
    return lines[0] if lines else None


def taken_over_in(process: HostProcess) -> bool:
    return "on this machine is dead: taking over" in process.log.read_text()


async def status_of(paths: StatePaths) -> dict[str, Any]:
    return dict(json.loads((await piwf(paths, "status", "--json")).stdout))


async def test_a_killed_host_is_proved_dead_and_taken_over_at_once_by_a_host_on_its_machine(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    write_workflow(project, "orphaning", ORPHANING)
    url = pg_store_url(postgres)
    serve = ("--store", url, "--lease", "3600")  # only a proof can explain a takeover within the test
    async with hosts(tmp_path, "a", "b", "c", a=serve, b=serve, c=serve) as h:
        a, b, c = h["a"], h["b"], h["c"]
        await a.start()
        run_id = await start(a.paths, project, "orphaning")
        other = tmp_path / "project-2"  # a second run on a, in a project of its own
        write_workflow(other, "gated", WORKFLOWS["gated"])
        second = await start(a.paths, other, "gated")
        await wait_for(lambda: _shell_started(project) and (other / "wait.log").exists())  # both running on a
        await b.start()
        await c.start()

        status = await status_of(b.paths)
        listed = {row["pid"]: row for row in status["hosts"]}
        assert sorted(listed) == sorted(p.proc.pid for p in (a, b, c) if p.proc)
        assert listed[a.proc.pid]["activeRuns"] == 2 and not listed[a.proc.pid]["this"]  # type: ignore[union-attr]
        assert listed[b.proc.pid]["this"] and listed[b.proc.pid]["hostname"]  # type: ignore[union-attr]
        assert len({row["machine"] for row in status["hosts"]}) == 1
        text = (await piwf(b.paths, "status")).stdout.decode()
        assert "hosts:     3 live sharing the store" in text

        shell_pid = await orphan_the_shell(a, project, run_id)
        await wait_for(lambda: not group_members(shell_pid))  # reaped by the host that won the clean-up
        (project / "gate").touch()
        (other / "gate").touch()
        for rid, root in ((run_id, project), (second, other)):
            done = await call(b.paths, "run.wait", run_id=rid, payload={"timeoutMs": 20_000})
            assert done["status"] == "completed", done
            assert (root / "once.log").read_text().splitlines() == [rid]  # 'once' ran exactly once
            assert step_states(done) == [("once", "accepted"), ("wait", "interrupted"), ("wait", "accepted"),
                                         ("done", "accepted")]
        assert [taken_over_in(b), taken_over_in(c)].count(True) == 1  # one host won the clean-up
        assert len((await status_of(c.paths))["hosts"]) == 2
        offline = await status_of(a.paths)  # no host answers there: read from the store
        assert offline["state"] == "stopped" and len(offline["hosts"]) == 2 and not offline["live"]


async def test_a_host_starting_after_a_peer_died_takes_it_over_at_start(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    url = pg_store_url(postgres)
    serve = ("--store", url, "--lease", "3600")
    async with hosts(tmp_path, "a", "b", a=serve, b=serve) as h:
        a, b = h["a"], h["b"]
        await a.start()
        run_id = await start(a.paths, project, "gated")
        await wait_for(lambda: (project / "wait.log").exists())  # 'once' accepted, 'wait' running
        a.signal(signal.SIGKILL)
        await a.wait()
        (project / "gate").touch()
        await b.start()  # the only proof of a's death: its pid, read at b's start
        done = await call(b.paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
        assert done["status"] == "completed", done
        assert (project / "once.log").read_text().splitlines() == [run_id]
        assert taken_over_in(b)


async def test_a_host_of_another_machine_is_taken_over_by_its_lease_and_its_orphans_are_left_alone(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    write_workflow(project, "orphaning", ORPHANING)
    url = pg_store_url(postgres)
    elsewhere = {"a": {"PIWF_BOOT_ID": "another-machine"}}
    async with hosts(tmp_path, "a", "b", "c", env=elsewhere, a=("--store", url, "--lease", "2"),
                     b=("--store", url), c=("--store", url)) as h:
        a, b, c = h["a"], h["b"], h["c"]
        await a.start()
        run_id = await start(a.paths, project, "orphaning")
        await wait_for(lambda: _shell_started(project))
        await b.start()
        await c.start()
        machines = {row["pid"]: row["machine"] for row in (await status_of(b.paths))["hosts"]}
        assert machines[a.proc.pid] == "another-machine" != machines[b.proc.pid]  # type: ignore[union-attr]

        shell_pid = await orphan_the_shell(a, project, run_id)
        (project / "gate").touch()
        done = await call(b.paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})  # its claim expired
        try:
            assert done["status"] == "completed", done
            assert (project / "once.log").read_text().splitlines() == [run_id]
            assert not taken_over_in(b) and not taken_over_in(c)  # no proof across machines
            assert group_members(shell_pid)  # another machine's processes: left alone
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell_pid, signal.SIGKILL)


async def test_a_standby_of_another_host_is_listed_until_it_takes_over(
    postgres: Any, tmp_path: Path,
) -> None:
    url = pg_store_url(postgres)
    async with hosts(tmp_path, "a", "b", a=("--store", url), b=("--store", url)) as h:
        a, b = h["a"], h["b"]
        await a.start()
        await b.start()
        spare = HostProcess(a.paths, tmp_path / "host-a-standby.log", "--store", url, "--standby")
        h["a-standby"] = spare  # stopped with the others
        await spare.start(wait=False)

        async def standbys() -> list[dict[str, Any]]:
            return [row for row in (await status_of(b.paths))["hosts"] if row["standby"]]

        [row] = await wait_for(standbys)
        assert row["pid"] == spare.proc.pid and row["epoch"] == 0 and not row["this"]  # type: ignore[union-attr]
        assert ", 1 standby(s)" in (await piwf(b.paths, "status")).stdout.decode()
        a.signal(signal.SIGKILL)
        await a.wait()
        await wait_for(spare.answers)  # it took the lock
        listed = (await status_of(b.paths))["hosts"]
        assert not [r for r in listed if r["standby"]]
        assert spare.proc.pid in {r["pid"] for r in listed}  # type: ignore[union-attr]


async def test_status_on_sqlite_lists_its_one_host(
    host_process: Callable[..., HostProcess], paths: StatePaths,
) -> None:
    host = await host_process().start()
    [row] = (await status_of(paths))["hosts"]
    assert row["pid"] == host.proc.pid and row["this"] and row["activeRuns"] == 0  # type: ignore[union-attr]
    assert "hosts:" not in (await piwf(paths, "status")).stdout.decode()  # its one host is the `host:` line
