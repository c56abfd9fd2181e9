"""The CLI's failures: one line on stderr, an exit code per kind, a JSON document with --json.

Issue 14, items 7 (a host that does not answer), 8 (``workflows list`` runs user code in a
child process with a time limit) and 9 (``--json`` errors and exit codes per outcome).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.errors import ExitCode
from piwf.paths import StatePaths
from piwf.processes import is_zombie, start_ticks
from piwf.wire import HOST_RESPONSE

from .conftest import HostProcess, wait_for, write_workflow

DOCS = Path(__file__).resolve().parent.parent / "docs"


async def cli(paths: StatePaths, *args: str, env: dict[str, str] | None = None,
              limit_s: float = 60) -> subprocess.CompletedProcess[bytes]:
    """Run the real CLI, failing (not hanging) if it does not return within ``limit_s``."""
    with trio.fail_after(limit_s):
        return await trio.run_process(
            [sys.executable, "-m", "piwf", *args, "--state-dir", str(paths.root)],
            capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, **(env or {})},
        )


def one_line(done: subprocess.CompletedProcess[bytes]) -> str:
    """The one line the CLI printed on stderr, after checking it is only one and no traceback."""
    text = done.stderr.decode()
    assert "Traceback" not in text, text
    assert text.count("\n") == 1 and text.startswith("piwf: "), text
    return text


def error_document(done: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    document = json.loads(done.stdout)
    assert set(document) == {"outcome", "error", "exitCode"} and document["exitCode"] == done.returncode
    return document


# --- 7: a host that does not answer ---------------------------------------------------------


@pytest.fixture
async def frozen(host_process: Callable[..., HostProcess]) -> AsyncIterator[HostProcess]:
    """A real ``piwf serve``, stopped with SIGSTOP (and continued afterwards)."""
    host = await host_process().start()
    host.signal(signal.SIGSTOP)
    await wait_for(lambda: _state_of(host.proc.pid) == "T")
    try:
        yield host
    finally:
        host.signal(signal.SIGCONT)


def _state_of(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


async def test_a_request_to_a_frozen_host_fails_in_one_line_with_the_timeout_exit_code(
    frozen: HostProcess, paths: StatePaths
) -> None:
    done = await cli(paths, "run", "list", "--timeout", "0.5")
    assert done.returncode == ExitCode.TIMEOUT == 10
    assert "did not answer within 0.5 s" in one_line(done)
    assert done.stdout == b""

    as_json = await cli(paths, "run", "show", "run-x", "--json", env={"PIWF_TIMEOUT": "0.5"})
    assert as_json.returncode == ExitCode.TIMEOUT
    one_line(as_json)
    assert error_document(as_json)["outcome"] == "timeout"

    stop = await cli(paths, "stop", "--timeout", "0.5")  # never "no host was running"
    assert stop.returncode == ExitCode.TIMEOUT and "did not answer" in one_line(stop)


async def test_status_says_stale_when_the_host_does_not_answer(frozen: HostProcess, paths: StatePaths) -> None:
    done = await cli(paths, "status", "--json", env={"PIWF_TIMEOUT": "0.5"})
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "stale" and status["pid"] == frozen.proc.pid
    assert status["detail"] == f"the host (pid {frozen.proc.pid}) does not answer within 0.5 s"
    assert status["socketAvailable"] is False and "queuedRuns" in status

    human = await cli(paths, "status", "--timeout", "0.5")
    assert human.returncode == 0 and human.stderr == b""
    assert re.search(rb"^host: +stale \(pid \d+", human.stdout, re.M), human.stdout


async def test_the_frozen_host_serves_again_once_continued(frozen: HostProcess, paths: StatePaths) -> None:
    frozen.signal(signal.SIGCONT)
    status = json.loads((await cli(paths, "status", "--json", "--timeout", "10")).stdout)
    assert status["state"] == "running"


async def test_status_says_stale_while_the_lease_of_a_host_that_just_died_runs(
    host_process: Callable[..., HostProcess], paths: StatePaths
) -> None:
    host = await host_process().start()
    host.signal(signal.SIGKILL)
    await host.wait()
    done = await cli(paths, "status", "--json")
    status = json.loads(done.stdout)
    assert (done.returncode, status["state"], status["live"]) == (0, "stale", True)
    assert status["detail"].startswith(f"the host (pid {host.proc.pid}) is gone; its lease expires in ")


async def test_a_workflow_whose_import_hangs_times_out_run_start_in_one_line(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    write_workflow(project, "stuck", "import time\ntime.sleep(3600)\n")
    await host_process().start()
    done = await cli(paths, "run", "start", "stuck", "--project", str(project), "--timeout", "1")
    assert done.returncode == ExitCode.TIMEOUT
    one_line(done)


# --- 8: workflows list loads user code in child processes -----------------------------------

HOSTILE = {
    "chatty": """
        import os, sys
        from piwf import Workflow, compute
        print("hello from chatty")
        os.write(1, b"raw bytes from chatty\\n")
        workflow = Workflow(name="chatty", start_at="a", nodes={"a": compute(lambda ctx: 1)})
    """,
    "hangs": """
        import subprocess, time
        child = subprocess.Popen(["sleep", "3600"])  # holds the pipes too: it must not keep the CLI waiting
        with open("hangs.pid", "w") as f:  # the cwd is the project
            f.write(str(child.pid))
        print("hanging")
        time.sleep(3600)
    """,
    "quits": """
        import os
        os._exit(0)
    """,
    "raises": """
        raise RuntimeError("no luck")
    """,
}


@pytest.fixture
def hostile(project: Path) -> Path:
    for name, source in HOSTILE.items():
        write_workflow(project, name, source)
    return project


async def test_workflows_list_reports_each_workflow_that_does_not_load_and_exits_non_zero(
    hostile: Path, paths: StatePaths
) -> None:
    done = await cli(paths, "workflows", "list", "--project", str(hostile), "--json", env={"PIWF_TIMEOUT": "3"},
                     limit_s=30)
    assert done.returncode == ExitCode.WORKFLOW_INVALID == 11
    assert one_line(done) == "piwf: 3 of 8 workflows did not load: hangs, quits, raises\n"
    rows = {row["name"]: row for row in json.loads(done.stdout)}  # nothing user code printed
    assert sorted(rows) == ["boom", "chatty", "gated", "greet", "hangs", "quits", "raises", "sleepy"]
    assert rows["chatty"]["error"] is None and rows["chatty"]["nodes"] == 1
    assert rows["greet"]["error"] is None and rows["greet"]["startAt"] == "hello"
    assert rows["hangs"]["error"] == "workflow 'hangs' took over 3 s to load (killed)"
    assert rows["quits"]["error"] == "loading workflow 'quits' exited with status 0 before reporting"
    assert rows["raises"]["error"].endswith("failed to import: RuntimeError: no luck")


async def test_workflows_list_keeps_user_output_off_its_stdout_and_kills_what_a_hung_import_started(
    hostile: Path, paths: StatePaths
) -> None:
    done = await cli(paths, "workflows", "list", "--project", str(hostile), "--timeout", "3")
    assert done.returncode == ExitCode.WORKFLOW_INVALID
    assert b"chatty" in done.stdout and b"from chatty" not in done.stdout and b"hanging" not in done.stdout
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 8 and sum("ERROR" in line for line in lines) == 3
    sleeper = int((hostile / "hangs.pid").read_text())
    await wait_for(lambda: start_ticks(sleeper) is None or is_zombie(sleeper), timeout=5)  # killed with its group


async def test_workflows_list_of_a_healthy_project_exits_zero(project: Path, paths: StatePaths) -> None:
    done = await cli(paths, "workflows", "list", "--project", str(project), "--json")
    assert done.returncode == 0 and done.stderr == b""
    assert [row["error"] for row in json.loads(done.stdout)] == [None] * 4


# --- 9: --json errors and an exit code per outcome ---------------------------------------------


async def test_json_errors_from_a_real_host_print_one_document(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    await host_process().start()
    missing = await cli(paths, "run", "show", "run-x", "--json")
    assert missing.returncode == ExitCode.NOT_FOUND == 6
    assert one_line(missing) == "piwf: notFound: run run-x not found\n"
    assert error_document(missing) == {"outcome": "notFound", "error": "run run-x not found", "exitCode": 6}

    refused = await cli(paths, "run", "start", "nothing", "--project", str(project), "--json")
    assert refused.returncode == ExitCode.ERROR == 1
    assert error_document(refused)["outcome"] == "rejected" and "nothing" in one_line(refused)


@pytest.fixture
async def fake_host(paths: StatePaths, nursery: trio.Nursery) -> dict[str, str]:
    """A socket answering every request with ``reply["outcome"]``: outcomes a real host
    gives only in conditions hard to arrange (a full disk)."""
    paths.ensure()
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(str(paths.socket))
    listener.listen()
    reply = {"outcome": "rejected"}

    async def answer(conn: trio.SocketStream) -> None:
        async with conn:
            async for chunk in conn:
                for line in chunk.splitlines():
                    request = json.loads(line)
                    await conn.send_all(json.dumps({"schema": HOST_RESPONSE, "requestId": request["requestId"],
                                                    "outcome": reply["outcome"], "error": "made up\nhere"}).encode()
                                        + b"\n")

    nursery.start_soon(trio.serve_listeners, answer, [trio.SocketListener(listener)])
    return reply


@pytest.mark.parametrize(("outcome", "code"), [
    ("rejected", ExitCode.ERROR), ("notFound", ExitCode.NOT_FOUND), ("conflict", ExitCode.CONFLICT),
    ("unavailable", ExitCode.UNAVAILABLE),
])
async def test_each_outcome_has_its_own_exit_code(
    fake_host: dict[str, str], paths: StatePaths, outcome: str, code: ExitCode
) -> None:
    fake_host["outcome"] = outcome
    done = await cli(paths, "run", "cancel", "run-x", "--json")
    assert done.returncode == code
    assert one_line(done) == f"piwf: {outcome}: made up here\n"
    assert error_document(done) == {"outcome": outcome, "error": "made up here", "exitCode": code}


async def test_no_host_and_usage_errors_have_their_own_exit_codes(paths: StatePaths) -> None:
    nobody = await cli(paths, "run", "list", "--json")
    assert nobody.returncode == ExitCode.NO_HOST == 9
    assert "no piwf host is serving" in one_line(nobody)
    assert error_document(nobody)["outcome"] == "noHost"
    never = await cli(paths, "run", "wait", "run-x", limit_s=20)  # only a host that went away is waited for
    assert never.returncode == ExitCode.NO_HOST and "no piwf host is serving" in one_line(never)

    for args in (["run", "start", "--json"], ["run", "list", "--limit", "0", "--json"],
                 ["run", "start", "x", "--input", "{", "--json"], ["frobnicate", "--json"]):
        usage = await cli(paths, *args)
        assert usage.returncode == ExitCode.USAGE == 2, args
        one_line(usage)
        assert error_document(usage)["outcome"] == "usage"

    bad_env = await cli(paths, "run", "list", env={"PIWF_TIMEOUT": "soon"})
    assert bad_env.returncode == ExitCode.USAGE and "PIWF_TIMEOUT" in one_line(bad_env)


def test_exit_codes_are_distinct_and_each_is_in_the_operations_table() -> None:
    codes = [int(code) for code in ExitCode]
    assert len(codes) == len(set(codes))
    table = (DOCS / "operations.md").read_text()
    for code in list(ExitCode)[1:]:
        assert re.search(rf"^\| {int(code)} \| `{code.outcome}` \|", table, re.M), code


async def test_json_nested_too_deep_on_the_command_line_is_a_usage_error(paths: StatePaths, project: Path) -> None:
    deep = "[" * 5000 + "]" * 5000
    done = await cli(paths, "run", "start", "greet", "--project", str(project), "--input", deep)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert "nested deeper than 100 levels" in one_line(done)


async def test_a_wait_whose_host_dies_for_good_still_names_the_run_it_started(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path
) -> None:
    """A host that went away is waited for (a restart: tests/test_cli_hints.py), but only
    within the wait's limit: no host back by then is exit 9, naming the run."""
    write_workflow(project, "sleeper", """
        from piwf import Workflow, shell
        workflow = Workflow(name="sleeper", start_at="s", nodes={"s": shell(["sleep", "300"])})
    """)
    host = await host_process().start()
    async with trio.open_nursery() as nursery:
        done: list[subprocess.CompletedProcess[bytes]] = []

        async def start() -> None:
            done.append(await cli(paths, "run", "start", "sleeper", "--project", str(project), "--wait",
                                  "--wait-timeout", "15s"))

        nursery.start_soon(start)
        await wait_for(lambda: list((paths.root / "host").glob("*.sock")) and _a_run_is_running(paths))
        host.kill_group()
    line = one_line(done[0])
    assert done[0].returncode == ExitCode.NO_HOST
    assert re.search(r"run run-[0-9a-f]+ was started, but waiting for it failed: the host went away \(.*\) "
                     r"and did not come back before the wait's limit \(15 s\) passed; follow it with "
                     r"piwf run wait run-[0-9a-f]+$", line.strip()), line


def _a_run_is_running(paths: StatePaths) -> bool:
    from piwf.store.sqlite import Database

    try:
        db = Database.open_readonly(paths.db)
    except Exception:
        return False
    try:
        return bool(db.scalar("SELECT COUNT(*) FROM run_queue WHERE status = 'running'"))
    finally:
        db.close()


async def test_a_run_list_limit_out_of_range_is_a_usage_error_without_a_host(paths: StatePaths) -> None:
    done = await cli(paths, "run", "list", "--limit", "5000")
    assert done.returncode == ExitCode.USAGE and "must be at most 1000" in one_line(done)
