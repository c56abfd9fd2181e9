"""Every console example of README.md and docs/*.md, run against a real host and compared
with what the page shows (the convention: docs/contributing.md, tests/docs_examples.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from piwf.paths import StatePaths

from .conftest import HostProcess
from .docs_examples import PROJECT, Block, ExampleError, Ids, Page, pages, read_page

ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 90
PAGES = [page for page in pages(ROOT) if read_page(page).blocks]


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
async def test_the_console_examples_of_a_page_print_what_it_shows(path: Path, tmp_path: Path) -> None:
    page = read_page(path)
    project, paths = tmp_path / "project", StatePaths.resolve(tmp_path / "state")
    project.mkdir()
    for name, content in page.files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(content)
    host = await HostProcess(paths, tmp_path / "host.log").start()
    try:
        ids = Ids()
        for block in page.blocks:
            await _run_block(page, block, ids, project, paths)
    finally:
        host.signal(15)
        await host.wait()


async def _run_block(page: Page, block: Block, ids: Ids, project: Path, paths: StatePaths) -> None:
    for line in block.setup:
        done = await _shell(ids.substitute(line), project, paths)
        if done.returncode != 0:
            raise AssertionError(f"{page.path.name}:{block.line}: setup `{line}` exited {done.returncode}: "
                                 f"{done.stdout.decode()}")
    for command in block.commands:
        done = await _shell(ids.substitute(command.text), project, paths)
        printed = done.stdout.decode().replace(str(project), PROJECT).replace(str(paths.root), "/home/me/state")
        try:
            ids.match(command.expected, [line.rstrip() for line in printed.splitlines()])
        except ExampleError as exc:
            raise AssertionError(f"{page.path.name}:{command.line}: $ {command.text}\n{exc}") from None


async def _shell(command: str, project: Path, paths: StatePaths) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PIWF_STATE_DIR": str(paths.root), "PIWF_CLIENT_ID": "cli:me",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PIWF_TIMEOUT", None)
    with trio.fail_after(COMMAND_TIMEOUT_S):
        return await trio.run_process(["bash", "-c", command], cwd=project, env=env, check=False,
                                      stdin=subprocess.DEVNULL, capture_stdout=True, stderr=subprocess.STDOUT)


def test_every_console_block_is_run_or_says_why_not() -> None:
    for path in pages(ROOT):
        page = read_page(path)
        for line, reason in page.skipped:
            assert len(reason.split()) >= 3, f"{path.name}:{line}: say why the example is not run"


def test_the_matcher_binds_ids_masks_times_and_refuses_a_difference() -> None:
    ids = Ids()
    ids.match(["run:      run-4c1d0e9a2b7f3a10 (greet)", "...", "at 2026-12-01T02:49:26.665Z: done …"],
              ["run:      run-00112233aabbccdd (greet)", "a", "b", "at 2027-01-02T03:04:05.006Z: done in 3s"])
    assert ids.substitute("piwf run show run-4c1d0e9a2b7f3a10") == "piwf run show run-00112233aabbccdd"
    with pytest.raises(ExampleError):
        ids.match(["run-4c1d0e9a2b7f3a10 completed"], ["run-99112233aabbccdd completed"])  # bound to another
    with pytest.raises(ExampleError):
        ids.match(["greet                2 nodes"], ["greet                2 node"])
    with pytest.raises(ExampleError):
        ids.match(["one line"], ["one line", "and another"])
    with pytest.raises(ExampleError):
        ids.match(["req-89565d438ba91697bc0a x", "req-89565d438ba91697bc0a y"],
                  ["req-000000000000000000aa x", "req-000000000000000000bb y"])  # one doc id, two real ids


def test_a_page_is_read_with_its_directives(tmp_path: Path) -> None:
    page_path = tmp_path / "page.md"
    page_path.write_text("\n".join([
        "<!-- example: file .piwf/workflows/w.py -->", "```python", "x = 1", "```",
        "<!-- example: setup", "touch README.md", "-->",
        "```console", "$ piwf status", "host: running", "$ true", "```",
        "<!-- example: skip it takes minutes -->", "```console", "$ python -m piwf.chaos", "```",
        "```sh", "not run", "```",
    ]) + "\n")
    page = read_page(page_path)
    assert page.files == {".piwf/workflows/w.py": "x = 1\n"}
    [block] = page.blocks
    assert block.setup == ["touch README.md"]
    assert [(c.text, c.expected) for c in block.commands] == [("piwf status", ["host: running"]), ("true", [])]
    assert page.skipped == [(14, "it takes minutes")]
