"""``piwf serve --standby``: loaded and waiting on the host lock, it takes over the moment
the live host dies, with the guarantees of any takeover."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import trio

from piwf.paths import StatePaths

from .conftest import HostProcess, wait_for
from .test_lifecycle import call, contradictions, group_members, run_status, start, step_states


async def standby(host_process: Callable[..., HostProcess], log: Path) -> HostProcess:
    """A standby, once it says it is waiting (its fork server is up by then)."""
    process = host_process("--standby")
    process.log = log
    await process.start()  # answered by the live host
    await wait_for(lambda: b"standing by" in log.read_bytes())
    return process


async def serving_pid(paths: StatePaths) -> int:
    return (await call(paths, "host.status"))["pid"]


async def test_a_standby_takes_over_from_a_killed_host_and_finishes_its_run(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path
) -> None:
    live = await host_process().start()
    spare = await standby(host_process, tmp_path / "standby.log")
    assert await serving_pid(paths) == live.proc.pid  # the standby answers nothing while it waits
    run_id = await start(paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())  # 'once' accepted, 'wait' running
    worker_pid = (await run_status(paths, run_id))["workers"][0]["pid"]

    live.signal(signal.SIGKILL)
    assert await live.wait() == -signal.SIGKILL
    await wait_for(lambda: _served_by(paths, spare))
    await wait_for(lambda: not group_members(worker_pid))  # the killed host's worker is gone
    (project / "gate").touch()
    done = await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 20_000})
    assert done["status"] == "completed", done
    assert (project / "once.log").read_text().splitlines() == [run_id]  # an accepted step is not redone
    assert step_states(done)[0] == ("once", "accepted") and step_states(done)[-1] == ("done", "accepted")
    status = await call(paths, "host.status")
    assert status["epoch"] == 2 and status["lifecycleContradictions"] == 0
    assert await contradictions(paths) == 0


async def test_of_two_standbys_exactly_one_takes_over_and_the_other_waits_on(
    host_process: Callable[..., HostProcess], paths: StatePaths, tmp_path: Path
) -> None:
    live = await host_process().start()
    spares = [await standby(host_process, tmp_path / f"standby-{i}.log") for i in range(2)]
    live.signal(signal.SIGKILL)
    await live.wait()
    pid = await wait_for(lambda: _standby_serving(paths, spares))
    taker = next(s for s in spares if s.proc.pid == pid)
    other = next(s for s in spares if s is not taker)
    assert other.proc.returncode is None and b"the lock is free" not in other.log.read_bytes()
    # The other one still waits; when the taker stops, it is the next host (a new epoch).
    epoch = (await call(paths, "host.status"))["epoch"]
    taker.signal(signal.SIGTERM)
    assert await taker.wait() == 0
    await wait_for(lambda: _served_by(paths, other))
    assert (await call(paths, "host.status"))["epoch"] == epoch + 1


async def test_a_standby_told_to_stop_while_waiting_exits_cleanly(
    host_process: Callable[..., HostProcess], paths: StatePaths, tmp_path: Path
) -> None:
    live = await host_process().start()
    spare = await standby(host_process, tmp_path / "standby.log")
    spare.signal(signal.SIGTERM)
    assert await spare.wait() == 0
    assert await serving_pid(paths) == live.proc.pid
    with trio.fail_after(5):  # the live host is untouched
        assert (await call(paths, "host.status"))["state"] == "running"


async def _served_by(paths: StatePaths, process: HostProcess) -> bool:
    return await _standby_serving(paths, [process]) is not None


async def _standby_serving(paths: StatePaths, candidates: list[HostProcess]) -> int | None:
    try:
        pid = await serving_pid(paths)
    except Exception:  # no host answers yet (the socket is the dead host's until the new one binds)
        return None
    return pid if pid in {c.proc.pid for c in candidates} else None
