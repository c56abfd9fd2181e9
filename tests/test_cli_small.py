"""Small things a user trips on (issue 23, point 11): the version, shell completion, where
a mistake's help is, JSON strings, a state directory that is a file, "1 node", and a
workflow whose import hangs, on a terminal."""

from __future__ import annotations

import importlib.metadata
import os
import pty
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import piwf
from piwf.cli.common import LOAD_LIMIT_S
from piwf.errors import ExitCode
from piwf.host.isolated import INSPECT_TIMEOUT_S
from piwf.paths import StatePaths

from .conftest import HostProcess, write_workflow
from .test_cli_errors import cli, one_line

ROOT = Path(__file__).resolve().parent.parent


async def test_version_is_printed_from_the_one_version_source(paths: StatePaths) -> None:
    done = await cli(paths, "--version")
    assert (done.returncode, done.stdout.decode()) == (0, f"piwf {piwf.__version__}\n")
    assert importlib.metadata.version("piwf") == piwf.__version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "piwf.__version__"}


async def _script(paths: StatePaths, shell: str, tmp_path: Path) -> Path:
    done = await cli(paths, "completion", shell)
    assert done.returncode == 0 and done.stderr == b""
    script = tmp_path / f"piwf.{shell}"
    script.write_bytes(done.stdout)
    return script


async def _completions(argv: list[str]) -> list[str]:
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=True)
    return done.stdout.decode().split()


async def test_bash_completes_subcommands_and_flags_from_a_generated_script(paths: StatePaths, tmp_path: Path) -> None:
    script = await _script(paths, "bash", tmp_path)
    complete = ('source "$1"; COMP_WORDS=($2); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); '
                '_shtab_piwf; printf "%s\\n" "${COMPREPLY[@]}"')
    assert await _completions(["bash", "-c", complete, "-", str(script), "piwf run st"]) == ["start"]
    assert await _completions(["bash", "-c", complete, "-", str(script), "piwf run start --wa"]) == [
        "--wait", "--wait-timeout"]
    assert await _completions(["bash", "-c", complete, "-", str(script), "piwf service un"]) == ["uninstall"]


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
async def test_fish_completes_from_a_generated_script(paths: StatePaths, tmp_path: Path) -> None:
    script = await _script(paths, "fish", tmp_path)
    done = await _completions(["fish", "-c", f"source {script}; complete -C 'piwf service in'"])
    assert done[0] == "install"


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
async def test_the_zsh_script_is_valid_zsh(paths: StatePaths, tmp_path: Path) -> None:
    script = await _script(paths, "zsh", tmp_path)
    await trio.run_process(["zsh", "-n", str(script)], check=True)
    assert "#compdef piwf" in script.read_text()


async def test_an_unknown_flag_points_to_its_subcommands_help(paths: StatePaths) -> None:
    for args, prog in ((["run", "start", "greet", "--bogus"], "piwf run start"),
                       (["serve", "--bogus", "1"], "piwf serve"), (["status", "--nope"], "piwf status")):
        done = await cli(paths, *args)
        assert done.returncode == ExitCode.USAGE
        assert one_line(done).endswith(f"(see `{prog} --help`)\n"), args


async def test_a_bare_word_where_json_goes_says_a_json_string_needs_quotes(paths: StatePaths) -> None:
    done = await cli(paths, "answer", "req-0123456789abcdef0123", "--value", "three")
    assert done.returncode == ExitCode.USAGE
    assert one_line(done).endswith("""; a JSON string needs its quotes: '"three"'\n""")
    broken = await cli(paths, "answer", "req-0123456789abcdef0123", "--value", "{bad")
    assert "quotes" not in one_line(broken)  # an object gone wrong is not a missing-quotes mistake


async def test_a_state_directory_that_is_a_file_is_refused_by_serve_and_status(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("")
    paths = StatePaths.resolve(file)
    serve = await cli(paths, "serve")
    assert serve.returncode == ExitCode.STATE_DIR and one_line(serve) == f"piwf: {file} is not a directory\n"
    status = await cli(paths, "status")
    assert status.returncode == ExitCode.STATE_DIR
    assert one_line(status) == f"piwf: state directory {file} is not a directory\n"
    below = await cli(StatePaths.resolve(file / "state"), "serve")
    assert one_line(below) == f"piwf: {file} is not a directory (cannot create {file / 'state'})\n"


async def test_workflows_list_says_1_node(project: Path, paths: StatePaths) -> None:
    done = await cli(paths, "workflows", "list", "--project", str(project))
    assert "sleepy               1 node, starts at nap\n" in done.stdout.decode()
    assert "greet                2 nodes, starts at hello\n" in done.stdout.decode()


def test_the_clis_load_limit_is_the_hosts() -> None:
    assert LOAD_LIMIT_S == INSPECT_TIMEOUT_S


async def test_run_start_says_on_a_terminal_that_it_waits_for_a_hanging_import_and_timeout_bounds_it(
        host_process: Callable[..., HostProcess], paths: StatePaths, project: Path) -> None:
    write_workflow(project, "stuck", "import time\ntime.sleep(3600)\n")
    await host_process().start()
    primary, secondary = pty.openpty()  # stderr is a terminal; stdout a pipe
    try:
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, "-m", "piwf", "run", "start", "stuck", "--project", str(project),
                 "--state-dir", str(paths.root), "--timeout", "3"],
                stdin=subprocess.DEVNULL, capture_stdout=True, stderr=secondary, check=False)
        os.close(secondary)
        secondary = -1
        said = await _read_all(primary)
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert done.returncode == ExitCode.TIMEOUT
    lines = said.decode().splitlines()
    assert lines[0] == ("piwf: waiting for the host to load workflow stuck (its import may take up to 30 s; "
                        "--timeout S waits less)")
    assert lines[1].startswith("piwf: ") and "3 s" in lines[1]
    piped = await cli(paths, "run", "start", "stuck", "--project", str(project), "--timeout", "1")
    assert "waiting for the host" not in one_line(piped)  # not a terminal: only the failure


async def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        try:
            chunk = await trio.to_thread.run_sync(os.read, fd, 4096)
        except OSError:  # EIO: the other side is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).replace(b"\r\n", b"\n")


