"""Issue 22, points 3 and 4: the host's own files changed under it. A state database
deleted or replaced while the host runs is noticed: writes are refused as `unavailable`,
saying what happened, and logged. A socket deleted is bound again; something else put
at its path is left alone and the host stops; `piwf stop` stops a host nobody can reach."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any


from piwf.client import AsyncClient
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for


def start_payload(project: Path, workflow: str = "greet") -> dict[str, Any]:
    return {"workflow": workflow, "projectPath": str(project)}


async def call(paths: StatePaths, operation: str, **kwargs: Any) -> Any:
    async with AsyncClient(paths) as client:
        return await client.call(operation, **kwargs)


# --- point 3: the state database deleted or replaced ---------------------------------------------


async def test_a_deleted_state_database_refuses_writes_as_unavailable_and_says_so(
        paths: StatePaths, project: Path, host_process: Any, tmp_path: Path) -> None:
    served: HostProcess = await host_process().start()
    assert (await call(paths, "run.start", payload=start_payload(project))).outcome == "accepted"
    os.unlink(paths.db)
    refused = await call(paths, "run.start", payload=start_payload(project))
    assert refused.outcome == "unavailable", refused
    assert f"the state database {paths.db} was deleted while the host ran" in (refused.error or "")
    assert "nothing was changed" in (refused.error or "")
    assert (await call(paths, "host.status")).outcome == "accepted"  # reads go on
    log = (tmp_path / "host.log").read_text()
    assert "was deleted while the host ran" in log and "/proc/" in log  # where the open file can be copied
    assert served.proc is not None and served.proc.returncode is None


async def test_a_replaced_state_database_refuses_writes_and_the_replacement_is_left_as_it_was(
        paths: StatePaths, project: Path, host_process: Any, tmp_path: Path) -> None:
    await host_process().start()
    assert (await call(paths, "run.start", payload=start_payload(project))).outcome == "accepted"
    copy = tmp_path / "copy.db"
    shutil.copyfile(paths.db, copy)
    os.replace(copy, paths.db)
    replaced = paths.db.read_bytes()
    refused = await call(paths, "run.cancel", run_id="nothing-here")
    assert refused.outcome == "unavailable" and "was replaced by another file" in (refused.error or ""), refused
    assert (await call(paths, "run.start", payload=start_payload(project))).outcome == "unavailable"
    assert paths.db.read_bytes() == replaced


# --- point 4: the socket deleted or taken -------------------------------------------------------


async def test_a_deleted_socket_is_bound_again_and_the_host_answers(
        paths: StatePaths, project: Path, host_process: Any, tmp_path: Path) -> None:
    await host_process().start()
    for _ in range(2):  # and again: each new socket is watched as the first was
        paths.socket.unlink()
        assert await wait_for(lambda: paths.socket.is_socket() and _answers(paths), timeout=10)
    assert (await call(paths, "run.start", payload=start_payload(project))).outcome == "accepted"
    assert "was deleted while the host ran; bound it again" in (tmp_path / "host.log").read_text()


def _answers(paths: StatePaths) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(paths.socket))
        return True
    except OSError:
        return False
    finally:
        probe.close()


async def test_a_regular_file_put_at_the_socket_path_is_never_deleted_and_the_host_stops(
        paths: StatePaths, host_process: Any, tmp_path: Path) -> None:
    served: HostProcess = await host_process().start()
    paths.socket.unlink()
    paths.socket.write_text("mine\n")
    assert await served.wait(timeout=20) == 0
    assert paths.socket.read_text() == "mine\n"  # neither while running nor when stopping
    log = (tmp_path / "host.log").read_text()
    assert "was replaced by a regular file: no client can reach this host; stopping" in log


async def test_stop_finds_a_host_whose_socket_is_gone(paths: StatePaths, host_process: Any,
                                                      tmp_path: Path) -> None:
    served: HostProcess = await host_process("--socket-check", "3600").start()
    paths.socket.unlink()  # and the host does not look for an hour: nobody can reach it meanwhile
    done = await piwf(paths, "stop", "--json")
    assert json.loads(done.stdout) == {"stopped": True, "takenOverBy": None}
    assert await served.wait() == 0
    started_again = await host_process().start()  # the state directory is free again
    assert started_again.proc is not None


async def test_stop_says_no_host_when_none_holds_the_lock(paths: StatePaths) -> None:
    paths.ensure()
    done = await piwf(paths, "stop")
    assert done.stdout.decode().strip() == "no host was running"


async def test_a_directory_put_at_the_socket_path_is_left_and_the_host_stops(
        paths: StatePaths, host_process: Any, tmp_path: Path) -> None:
    served: HostProcess = await host_process().start()
    paths.socket.unlink()
    paths.socket.mkdir()
    (paths.socket / "keep").write_text("kept")
    assert await served.wait(timeout=20) == 0
    assert (paths.socket / "keep").read_text() == "kept"
    assert "was replaced by a directory" in (tmp_path / "host.log").read_text()
