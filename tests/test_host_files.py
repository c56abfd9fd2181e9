"""Issue 22, points 1, 2 and 6: user files and throwaway processes within the host's
bounds. A workflow or controller file that is a FIFO, a device or huge is refused with
what it is, at once, without a thread stuck on it; what an import prints is kept as a
bounded tail; throwaway processes are few at a time, and what can be refused before
spawning one is."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.client import AsyncClient
from piwf.errors import Rejected, StorageUnavailable
from piwf.host import isolated
from piwf.host.isolated import ISOLATED_AT_ONCE, SOURCE_LIMIT
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import HostProcess, wait_for, write_workflow
from .test_settings import TUNED
from .test_interactions import open_request, start


def start_payload(project: Path, workflow: str) -> dict[str, Any]:
    return {"workflow": workflow, "projectPath": str(project)}


async def refused(client: AsyncClient, project: Path, workflow: str) -> str:
    with trio.fail_after(10):  # on main a FIFO never answers
        answer = await client.call("run.start", payload=start_payload(project, workflow))
    assert answer.outcome == "rejected", answer
    assert answer.error is not None
    return answer.error


def fifo_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


# --- point 1: FIFOs, devices, huge files --------------------------------------------------------


async def test_a_fifo_workflow_is_refused_as_a_fifo_and_many_leave_status_and_stop_served(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    fifo_at(project / ".piwf" / "workflows" / "piped.py")
    error = await refused(client, project, "piped")
    assert "piped.py is a FIFO (named pipe), not a regular file" in error

    errors: list[str] = []

    async def one() -> None:
        async with AsyncClient(paths) as c:
            errors.append(await refused(c, project, "piped"))

    async with trio.open_nursery() as nursery:  # more than the 64 connections and trio's 40 threads
        for _ in range(70):
            nursery.start_soon(one)
    assert len(errors) == 70 and all("FIFO" in e for e in errors)
    with trio.fail_after(5):
        assert (await client.call("host.status")).outcome == "accepted"
    assert (await client.call("run.list")).receipt == []  # nothing was written


async def test_a_link_to_a_device_and_a_huge_file_are_refused_unread(
        client: AsyncClient, project: Path) -> None:
    workflows = project / ".piwf" / "workflows"
    (workflows / "zero.py").symlink_to("/dev/zero")
    with open(workflows / "huge.py", "wb") as f:  # sparse: 2.5 GB that costs no disk
        f.truncate(2_500_000_000)
    assert "zero.py is a character device, not a regular file" in await refused(client, project, "zero")
    error = await refused(client, project, "huge")
    assert f"huge.py is 2500000000 bytes; a workflow or controller file is at most {SOURCE_LIMIT}" in error
    (workflows / "dir.py").mkdir()
    assert "dir.py is a directory" in await refused(client, project, "dir")


async def test_a_fifo_or_device_controller_file_is_refused_as_what_it_is(
        client: AsyncClient, project: Path) -> None:
    fifo_at(project / ".piwf" / "controllers" / "piped.py")
    (project / ".piwf" / "controllers" / "null.py").symlink_to("/dev/null")
    for name, what in (("piped", "a FIFO (named pipe)"), ("null", "a character device")):
        with trio.fail_after(10):
            answer = await client.call("controller.apply", payload={
                "projectPath": str(project), "controller": name, "key": "k", "spec": {}})
        assert answer.outcome == "rejected" and f"{name}.py is {what}, not a regular file" in (answer.error or "")


async def test_a_host_with_fifo_requests_drains_within_its_deadline(
        paths: StatePaths, project: Path, host_process: Any) -> None:
    served: HostProcess = await host_process("--drain-timeout", "3").start()
    fifo_at(project / ".piwf" / "workflows" / "piped.py")
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            async def one() -> None:
                async with AsyncClient(paths) as c:
                    await refused(c, project, "piped")
            nursery.start_soon(one)
    served.signal(signal.SIGTERM)
    assert await served.wait(timeout=10) == 0


# --- point 2: what an import prints --------------------------------------------------------------

LOUD = """
    import os, sys
    chunk = b"x" * (1 << 20) + b"\\n"
    for _ in range(int(os.environ.get("LOUD_MIB", "300"))):
        sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
    raise RuntimeError("the loud module gives up")
"""


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_what_an_import_prints_is_a_bounded_tail_not_kept_whole(
        paths: StatePaths, project: Path, host_process: Any) -> None:
    served: HostProcess = await host_process().start()
    assert served.proc is not None
    write_workflow(project, "loud", LOUD)
    before = peak_rss_mib(served.proc.pid)
    async with AsyncClient(paths) as client:
        with trio.fail_after(60):
            answer = await client.call("run.start", payload=start_payload(project, "loud"))
        assert answer.outcome == "rejected" and "the loud module gives up" in (answer.error or ""), answer
        assert (await client.call("host.status")).outcome == "accepted"
    grown = peak_rss_mib(served.proc.pid) - before
    assert grown < 60, f"the host's peak memory grew {grown:.0f} MiB for 300 MiB printed"


async def test_a_module_printing_without_a_line_end_still_names_its_error(
        client: AsyncClient, project: Path) -> None:
    write_workflow(project, "mute", """
        import sys
        sys.stderr.write("y" * 200_000)
        sys.stderr.flush()
        import os
        os._exit(7)
    """)
    error = await refused(client, project, "mute")
    assert "could not be inspected" in error and len(error) < 8300


# --- point 6: throwaway processes ------------------------------------------------------------------


async def test_sixty_settings_changes_at_once_spawn_few_processes_and_leave_status_fast(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    isolation = host.catalog.isolation
    started_before = isolation.started
    outcomes: list[str] = []

    async def change(budget: int) -> None:
        async with AsyncClient(paths) as c:
            answer = await c.call("workflow.changeSettings", run_id=run_id,
                                  payload={"patch": {"budget": budget}, "expectedChangeNumber": 0})
            outcomes.append(answer.outcome)

    async with trio.open_nursery() as nursery:
        for budget in range(60):
            nursery.start_soon(change, budget + 2)
        with trio.fail_after(5):  # while they are checked, the host answers at once
            assert (await client.call("host.status")).outcome == "accepted"
    assert outcomes.count("accepted") == 1 and outcomes.count("conflict") == 59, outcomes
    assert isolation.peak <= ISOLATED_AT_ONCE
    # after the first accepted change, the rest are stale before any process is spawned
    assert isolation.started - started_before <= ISOLATED_AT_ONCE


async def test_changes_without_an_expected_number_are_checked_a_few_at_a_time_and_each_commits_or_conflicts(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    run_id = await start(paths, project, "tuned")
    await open_request(paths, run_id)
    outcomes: list[str] = []

    async def change(budget: int) -> None:
        async with AsyncClient(paths) as c:
            outcomes.append((await c.call("workflow.changeSettings", run_id=run_id,
                                          payload={"patch": {"budget": budget}})).outcome)

    async with trio.open_nursery() as nursery:
        for budget in range(12):
            nursery.start_soon(change, budget + 2)
    # those checked at the same moment race to commit: the first wins, the rest conflict
    assert outcomes.count("accepted") >= 3 and set(outcomes) <= {"accepted", "conflict"}, outcomes
    assert host.catalog.isolation.peak <= ISOLATED_AT_ONCE
    settings = (await client.call("workflow.settings", run_id=run_id)).receipt
    assert settings["changeNumber"] == outcomes.count("accepted")


async def test_the_same_check_of_the_same_file_spawns_no_second_process(
        client: AsyncClient, host: HostState, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "tuned", TUNED)
    first = await client.call("run.start", payload={**start_payload(project, "tuned"), "settings": {"budget": 4}})
    assert first.outcome == "accepted", first
    started = host.catalog.isolation.started
    again = await client.call("run.start", payload={**start_payload(project, "tuned"), "settings": {"budget": 4}})
    assert again.outcome == "accepted" and host.catalog.isolation.started == started


async def test_beyond_the_waiting_bound_a_check_is_refused_unavailable_before_spawning(
        project: Path, nursery: trio.Nursery) -> None:
    from piwf.host.isolated import Busy, Isolation

    write_workflow(project, "slow", """
        import os, time
        while not os.path.exists("gate"):
            time.sleep(0.02)
        from piwf import Workflow, compute
        workflow = Workflow(name="slow", start_at="a", nodes={"a": compute(lambda ctx: {})})
    """)
    isolation = Isolation(at_once=1, waiting_max=0)
    results: list[Any] = []

    async def inspect() -> None:
        results.append(await isolation.run(["piwf.engine.inspect", str(project), "slow"], str(project),
                                           "workflow 'slow'", "inspected"))
    nursery.start_soon(inspect)
    await wait_for(lambda: isolation.running == 1)
    try:
        await isolation.run(["piwf.engine.inspect", str(project), "slow"], str(project), "workflow 'slow'",
                            "inspected")
        raise AssertionError("not refused")
    except Busy as exc:
        assert exc.outcome == "unavailable" and "retry shortly" in str(exc)
    assert isolation.started == 1  # the refused one spawned nothing
    (project / "gate").touch()
    await wait_for(lambda: results)
    assert results[0]["name"] == "slow"


async def test_a_read_that_hangs_holds_the_reader_thread_alone_and_later_reads_get_their_own_bytes(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The host's own reader thread (a cheaper hop than trio's threads): a read whose file
    system hangs is given up at its time limit and keeps that thread, while the next reads
    go to trio's threads; once the hung read returns, the thread serves again, and the
    answer of the abandoned read is never taken for a later one's."""
    hang, ok = tmp_path / "hang.py", tmp_path / "ok.py"
    hang.write_bytes(b"hung")
    ok.write_bytes(b"fine")
    release = threading.Event()
    real = isolated._read_bounded

    def hanging(path: Path, limit: int, known: Any) -> Any:
        if path == hang:
            release.wait()  # what a hung NFS mount does to a thread
        return real(path, limit, known)

    monkeypatch.setattr(isolated, "_read_bounded", hanging)
    isolation = isolated.Isolation()
    monkeypatch.setattr(isolated, "READ_TIMEOUT_S", 0.2)
    with trio.fail_after(10), pytest.raises(StorageUnavailable, match=r"took over 0\.2 s"):
        await isolation.read_user_file(hang)
    monkeypatch.setattr(isolated, "READ_TIMEOUT_S", 30.0)
    assert isolation._reader.busy  # held by the hung read
    with trio.fail_after(10):
        assert (await isolation.read_user_file(ok))[1] == b"fine"  # through one of trio's threads
    release.set()
    with trio.fail_after(10):
        while isolation._reader.busy:  # freed once the hung read returns
            await trio.sleep(0.01)
        for _ in range(3):
            assert (await isolation.read_user_file(ok))[1] == b"fine"  # its own answer, not the hung one's
            assert not isolation._reader.busy


# --- what a start sees of its workflow file (isolated.StatKey) ------------------------------------

SAYS = """
    from piwf import Workflow, compute

    def say(ctx):
        return {"said": "WORD"}

    workflow = Workflow(name="says", start_at="say", nodes={"say": compute(say)})
"""


async def test_a_rewrite_that_keeps_the_size_and_the_mtime_is_seen_by_the_next_start(
        client: AsyncClient, host: HostState, project: Path, monkeypatch: Any) -> None:
    """``cp -p``, ``touch -r`` and ``rsync -t`` set a file's mtime back; its ctime moves all the
    same, so a start after such a rewrite records the file as it is now."""
    monkeypatch.setattr(isolated, "RECENT_NS", 0, raising=False)  # keep a key however young the file
    path = write_workflow(project, "says", SAYS.replace("WORD", "one"))
    first = await client.call("run.start", payload=start_payload(project, "says"))
    assert first.outcome == "accepted", first
    before = os.stat(path)
    probe = project / "probe"
    for _ in range(1_000_000):  # until the file system's clock has moved past the first write's
        probe.write_bytes(b"x")
        if os.stat(probe).st_ctime_ns > before.st_ctime_ns:
            break
    path.write_text(textwrap.dedent(SAYS.replace("WORD", "two")))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    second = await client.call("run.start", payload=start_payload(project, "says"))
    assert second.outcome == "accepted", second
    assert second.receipt["definitionDigest"] != first.receipt["definitionDigest"]
    third = await client.call("run.start", payload=start_payload(project, "says"))  # unchanged: known by its key
    assert third.receipt["definitionDigest"] == second.receipt["definitionDigest"]


async def test_a_file_known_by_its_key_is_looked_at_again_and_one_changed_just_before_its_read_is_not_kept(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A file read moments after it changed gets no key (another write within the file
    system's clock tick could give it the same times): it is read again next time. One
    known by its key is looked at with one stat, and a FIFO put in its place is still
    refused as one, at once."""
    path = tmp_path / "flow.py"
    path.write_bytes(b"first")
    isolation = isolated.Isolation()
    with trio.fail_after(10):
        monkeypatch.setattr(isolated, "RECENT_NS", 3600 * 10**9, raising=False)  # however slow this machine is
        assert await isolation.read_user_file(path) == (None, b"first")  # just written: no key
        monkeypatch.setattr(isolated, "RECENT_NS", 0)
        key, content = await isolation.read_user_file(path)
        assert key is not None and content == b"first"
        assert await isolation.read_user_file(path, key) == (key, None)  # unchanged
        path.unlink()
        fifo_at(path)
        with pytest.raises(Rejected, match="is a FIFO"):
            await isolation.read_user_file(path, key)
