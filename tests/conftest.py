"""Shared fixtures: real state directories, real projects, real hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio

from piwf.client import AsyncClient
from piwf.clock import ManualClock
from piwf.errors import HostUnavailable
from piwf.host.host import Host
from piwf.host.state import HostConfig, HostState
from piwf.paths import StatePaths
from piwf.store.sqlite import Database
from piwf.store.sqlite.schema import APPLICATION_ID

CONFORMANCE = Path(__file__).parent / "conformance"


def pytest_itemcollected(item: pytest.Item) -> None:
    """Under pytest-xdist (``--dist loadgroup``, pyproject.toml) each module's tests run in
    one worker, in their order, as without it: a module-scoped fixture (one host, one web
    console) is made once, and what a test finds on it is what the tests before it left.
    The conformance suite is one group of its own (tests/conformance/conftest.py)."""
    if CONFORMANCE not in item.path.parents:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


WORKFLOWS = {
    "greet": """
        from piwf import Workflow, compute, shell

        workflow = Workflow(
            name="greet",
            start_at="hello",
            nodes={
                "hello": shell(["echo", "hello"]),
                "shout": compute(lambda ctx: {"text": ctx.outputs["hello"]["stdout"].upper()}),
            },
            edges=[("hello", "shout")],
        )
    """,
    # once: counted side effect; gate: blocks until the file 'gate' exists; done: final.
    "gated": """
        from pathlib import Path
        from piwf import Workflow, compute, shell

        def once(ctx):
            with open(Path(ctx.project_path) / "once.log", "a") as f:
                f.write(ctx.run_id + "\\n")
            return {"counted": True}

        workflow = Workflow(
            name="gated",
            start_at="once",
            nodes={
                "once": compute(once),
                "wait": shell(["sh", "-c", "echo started >> wait.log; while [ ! -e gate ]; do sleep 0.02; done"]),
                "done": compute(lambda ctx: {"input": ctx.input, "once": ctx.outputs["once"]}),
            },
            edges=[("once", "wait"), ("wait", "done")],
        )
    """,
    "sleepy": """
        from piwf import Workflow, shell

        workflow = Workflow(
            name="sleepy",
            start_at="nap",
            nodes={"nap": shell(["sh", "-c", "sleep 300 & sleep 300; wait"])},
        )
    """,
    "boom": """
        from piwf import Workflow, compute

        def explode(ctx):
            raise ValueError("the fuse was lit")

        workflow = Workflow(name="boom", start_at="explode", nodes={"explode": compute(explode)})
    """,
}


def write_workflow(project: Path, name: str, source: str) -> Path:
    path = project / ".piwf" / "workflows" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for name, source in WORKFLOWS.items():
        write_workflow(root, name, source)
    return root


@pytest.fixture
def paths(tmp_path: Path) -> StatePaths:
    return StatePaths.resolve(tmp_path / "state")


@pytest.fixture
def db(tmp_path: Path) -> Any:
    database = Database.open(tmp_path / "unit.db")
    yield database
    database.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


async def wait_for(predicate: Callable[[], Any], timeout: float = 20, interval: float = 0.02) -> Any:
    """Poll observable state until it holds, failing after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not (value := await _maybe_await(predicate())):
            await trio.sleep(interval)
        return value


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


def config(paths: StatePaths, **overrides: Any) -> HostConfig:
    return HostConfig(paths, **{"kill_grace_s": 1.0, **overrides})


@pytest.fixture
async def host(paths: StatePaths, nursery: trio.Nursery) -> AsyncIterator[HostState]:
    """An in-process host; real worker processes, real SQLite."""
    state = await nursery.start(Host(config(paths)).serve)
    yield state
    state.stop_requested.set()


@pytest.fixture
async def client(host: HostState, paths: StatePaths) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(paths) as c:
        yield c


class HostProcess:
    """``piwf serve`` as a real child process."""

    def __init__(self, paths: StatePaths, log: Path, *extra: str, env: dict[str, str] | None = None,
                 module: str = "piwf") -> None:
        self.paths = paths
        self.log = log
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.module = module  # what `python -m` runs: piwf, or a test's variant of it (tests/newer_piwf.py)
        self.proc: trio.Process | None = None

    async def start(self, *, wait: bool = True) -> HostProcess:
        """Start ``piwf serve``; with ``wait``, return once it answers."""
        with open(self.log, "ab") as log:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", self.module, "serve", "--state-dir", str(self.paths.root), *self.extra],
                stdout=log, stderr=log, start_new_session=True, env=self.env,
            )
        if wait:
            await wait_for(self.answers, timeout=20)
        return self

    async def answers(self) -> bool:
        assert self.proc is not None
        if self.proc.returncode is not None:
            raise AssertionError(f"host exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            async with AsyncClient(self.paths) as c:
                return (await c.call("host.status")).outcome == "accepted"
        except (HostUnavailable, OSError):
            return False

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 20) -> int:
        assert self.proc is not None
        with trio.fail_after(timeout):
            return await self.proc.wait()

    def kill_group(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
async def host_process(paths: StatePaths, tmp_path: Path) -> AsyncIterator[Callable[..., HostProcess]]:
    started: list[HostProcess] = []

    def make(*extra: str, env: dict[str, str] | None = None) -> HostProcess:
        process = HostProcess(paths, tmp_path / "host.log", *extra, env=env)
        started.append(process)
        return process

    yield make
    for process in started:
        if process.proc is not None and process.proc.returncode is None:
            process.signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await process.proc.wait()
            process.kill_group()
            await process.proc.wait()


async def piwf(
    paths: StatePaths, *args: str, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """Run the real CLI."""
    done = await trio.run_process(
        [sys.executable, "-m", "piwf", *args, "--state-dir", str(paths.root)],
        capture_stdout=True, capture_stderr=True, check=False, cwd=cwd,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"piwf {' '.join(args)} exited {done.returncode}: {done.stderr.decode()}")
    return done


def frozen_layout(path: Path, version: int) -> apsw.Connection:
    """A database at the old layout ``version``, as tests/data/schema_v{version}.sql froze it
    (piwf's application id, ``user_version`` set): the starting point of a migration test."""
    conn = apsw.Connection(str(path))
    conn.execute((Path(__file__).parent / "data" / f"schema_v{version}.sql").read_text())
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {version}")
    return conn


# --- PostgreSQL ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres() -> Any:
    """A throwaway PostgreSQL server for the session (tests/postgres_server.py), or the one
    ``PIWF_TEST_STORE`` names (its ``url(database)``). Without PostgreSQL the test skips,
    saying how to run it; with ``CI=true`` it fails instead."""
    from .postgres_server import External, start_server

    if os.environ.get("PIWF_TEST_STORE"):
        yield External(os.environ["PIWF_TEST_STORE"])
        return
    server = start_server()
    if server is None:
        no_postgres(os.environ)
    try:
        yield server
    finally:
        server.stop("immediate")
        server.remove()


def no_postgres(environ: Any) -> None:
    """A test that needs PostgreSQL where there is none: skipped, saying how to run it; a
    failure in CI (``CI=true``), where a skipped PostgreSQL test would hide a missing server."""
    from .postgres_server import HOW_TO_RUN

    if environ.get("CI") == "true":
        pytest.fail(f"CI=true and no PostgreSQL: {HOW_TO_RUN}")
    pytest.skip(HOW_TO_RUN)


_SCHEMAS = iter(range(1, 1 << 30))


def pg_store_url(postgres: Any, schema: str | None = None) -> str:
    """A store URL on the session's PostgreSQL with a schema of its own (fresh by default)."""
    return f"{postgres.url()}&schema={schema or f't{os.getpid()}_{next(_SCHEMAS)}'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """``piwf serve`` arguments for each backend: none (the state directory's SQLite), or
    ``--store`` with a fresh schema on the session's PostgreSQL."""
    if request.param == "sqlite":
        return ()
    return ("--store", pg_store_url(request.getfixturevalue("postgres")))
