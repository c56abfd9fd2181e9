"""Wake-ups between hosts sharing a PostgreSQL store (store/postgres/wakeups.py): a run
started on one host, a request answered on it, a resource applied on it reach the host
that acts on them at once — every host's poll is set to hours, so nothing but a wake-up
can (the test fails by its own timeout without them). Poll-only mode still works by
polling. Real in-process hosts with real worker processes, each with its own state
directory (its socket), one store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import config, pg_store_url, wait_for, write_workflow
from .test_controllers import ctl, get, mirror, ready  # noqa: F401 (mirror: a fixture)
from .test_interactions import deploy_source, open_request, start
from .test_lifecycle import call

HOURS = 3 * 3600.0  # the poll: never, within a test


@pytest.fixture
def store_url(postgres: Any) -> str:
    return pg_store_url(postgres)


async def serve(nursery: trio.Nursery, tmp_path: Path, name: str, store_url: str, **options: Any) -> StatePaths:
    """A host of its own state directory on the shared store; its state directory."""
    paths = StatePaths.resolve(tmp_path / name)
    state: HostState = await nursery.start(Host(config(paths, store_url=store_url, poll_s=HOURS, **options)).serve)
    assert state.config.poll_s == HOURS
    return paths


async def wait(paths: StatePaths, run_id: str) -> dict[str, Any]:
    """run.wait on ``paths``'s host: it answers when another host's change wakes it."""
    return await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 15_000})


async def test_a_run_started_on_a_full_host_is_claimed_by_another_at_once(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    front = await serve(nursery, tmp_path, "front", store_url, max_workers=0)  # takes requests, runs nothing
    await serve(nursery, tmp_path, "worker", store_url)
    run_id = await start(front, project, "greet")
    with trio.fail_after(15):
        done = await wait(front, run_id)  # the front host hears of the end from the other too
    assert done["status"] == "completed", done


async def test_a_run_released_by_a_stopping_host_is_claimed_by_another_at_once(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    first_paths = StatePaths.resolve(tmp_path / "first")
    first: HostState = await nursery.start(Host(config(first_paths, store_url=store_url, poll_s=HOURS)).serve)
    run_id = await start(first_paths, project, "gated")
    await wait_for(lambda: (project / "wait.log").exists())  # running on the first host
    second = await serve(nursery, tmp_path, "second", store_url)  # it finds nothing to claim: all is held
    first.stop_requested.set()  # the first parks the run as it stops
    await wait_for(lambda: not first_paths.socket.exists())
    (project / "gate").touch()
    with trio.fail_after(15):
        done = await wait(second, run_id)
    assert done["status"] == "completed", done
    assert (project / "once.log").read_text().split() == [run_id]  # its accepted step was not redone


async def test_an_answer_on_one_host_lets_another_go_on_at_once(
        nursery: trio.Nursery, tmp_path: Path, project: Path, store_url: str) -> None:
    write_workflow(project, "deploy", deploy_source())
    front = await serve(nursery, tmp_path, "front", store_url, max_workers=0)
    await serve(nursery, tmp_path, "worker", store_url)
    run_id = await start(front, project, "deploy")
    request = await open_request(front, run_id)
    await call(front, "decision.answer", payload={"requestId": request["requestId"], "choice": "yes"})
    with trio.fail_after(15):
        done = await wait(front, run_id)
    assert done["status"] == "completed", done


async def test_a_resource_applied_on_one_host_is_reconciled_by_another_at_once(
        nursery: trio.Nursery, tmp_path: Path, mirror: Path, store_url: str) -> None:  # noqa: F811
    front = await serve(nursery, tmp_path, "front", store_url, max_controller_workers=0)
    await serve(nursery, tmp_path, "worker", store_url)
    applied = await ctl(front, "apply", mirror, "mirror", "a", spec={"text": "hi"})
    assert applied["generation"] == 1

    async def reconciled() -> bool:
        return ready(await get(front, mirror, "mirror", "a"))

    await wait_for(reconciled, timeout=15)
    assert (mirror / "out" / "a.txt").read_text() == "hi"


async def test_poll_only_hosts_carry_on_by_polling(nursery: trio.Nursery, tmp_path: Path, project: Path,
                                                   store_url: str) -> None:
    front = await serve(nursery, tmp_path, "front", store_url, max_workers=0, store_listen=False)
    paths = StatePaths.resolve(tmp_path / "worker")
    await nursery.start(Host(config(paths, store_url=store_url, poll_s=0.2, store_listen=False)).serve)
    run_id = await start(front, project, "greet")

    async def ended() -> bool:
        return bool((await call(front, "run.status", run_id=run_id))["status"] == "completed")

    await wait_for(ended, timeout=15)
