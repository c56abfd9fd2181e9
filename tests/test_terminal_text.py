"""Text from a workflow (errors, notifications, updates, titles, node names) reaches the
terminal escaped in every view: `run show`, `run events`, `run logs`, `inbox` (listing
and `--follow`), `watch`; JSON output carries it as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.cli.text import terminal_text
from piwf.paths import StatePaths

from .conftest import piwf, write_workflow
from .test_interactions import open_request, start, wait_run

# A colour, a window title set with a bell, a carriage return that overwrites the line,
# a right-to-left override, a C1 control: none may reach a terminal as it is.
EVIL = "evil\x1b[31mred\x1b]0;owned\x07\rover\u202eright\x9bX"
RAW = ("\x1b", "\x07", "\r", "\u202e", "\x9b")

HOSTILE = """
    from piwf import Workflow, compute, decision

    EVIL = "evil\\x1b[31mred\\x1b]0;owned\\x07\\rover\\u202eright\\x9bX"

    def speak(ctx):
        print("printed " + EVIL, flush=True)
        ctx.notify("note " + EVIL)
        ctx.publish("kind" + EVIL[:8], "key" + EVIL[:8], {"text": EVIL})
        raise ValueError("boom " + EVIL)

    workflow = Workflow(name="hostile", start_at="speak", nodes={"speak": compute(speak)})
"""

ASKS = """
    from piwf import Workflow, decision

    EVIL = "evil\\x1b[31mred\\x1b]0;owned\\x07\\rover\\u202eright\\x9bX"

    workflow = Workflow(name="asks", start_at="approve",
                        nodes={"approve": decision("Deploy [bold]" + EVIL, choices={"yes": "Yes " + EVIL})})
"""


def _clean(out: str) -> None:
    assert not [c for c in RAW if c in out], repr(out)
    assert "\\x1b[31m" in out, out  # escaped, not dropped: a person sees what was sent


@pytest.fixture
async def runs(host: Any, paths: StatePaths, project: Path) -> tuple[str, str]:
    write_workflow(project, "hostile", HOSTILE)
    write_workflow(project, "asks", ASKS)
    failed = await start(paths, project, "hostile", originSessionId="s-evil")
    assert (await wait_run(paths, failed))["status"] == "failed"
    waiting = await start(paths, project, "asks", originSessionId="s-evil")
    await open_request(paths, waiting)
    return failed, waiting


@pytest.mark.parametrize("command", [
    ("run", "show", "{failed}"), ("run", "events", "{failed}"), ("run", "logs", "{failed}"),
    ("run", "show", "{waiting}"), ("inbox",), ("inbox", "--session", "s-evil"), ("watch", "--once"),
])
async def test_every_view_shows_workflow_text_escaped(paths: StatePaths, runs: tuple[str, str],
                                                      command: tuple[str, ...]) -> None:
    failed, waiting = runs
    done = await piwf(paths, *(part.format(failed=failed, waiting=waiting) for part in command))
    _clean(done.stdout.decode())
    if "{waiting}" in command or command[0] in ("inbox", "watch"):
        assert "Deploy [bold]evil" in done.stdout.decode()  # shown as it was written: no markup either


async def test_the_follower_shows_notifications_and_turns_escaped(paths: StatePaths, runs: tuple[str, str]) -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "piwf", "inbox", "--session", "s-evil", "--follow", "--state-dir", str(paths.root)],
        stdout=subprocess.PIPE)
    assert proc.stdout is not None
    out = b""
    try:
        with trio.fail_after(20):
            while out.count(b"\n") < 2:  # the notification, then the failed run's turn
                out += await proc.stdout.receive_some(65536)
    finally:
        proc.kill()
        await proc.wait()
    text = out.decode()
    assert "note" in text
    _clean(text)


async def test_json_output_keeps_the_text_as_it_was_sent(paths: StatePaths, runs: tuple[str, str]) -> None:
    failed, _ = runs
    shown = json.loads((await piwf(paths, "run", "show", failed, "--json")).stdout)
    assert shown["error"]["message"] == f"node speak: boom {EVIL}"
    assert "\x1b" not in (await piwf(paths, "run", "show", failed, "--json")).stdout.decode()  # JSON escapes it


def test_terminal_text_keeps_line_breaks_and_printable_text_and_escapes_the_rest() -> None:
    assert terminal_text("a\nb\tc é ✓") == "a\nb\\tc é ✓"
    assert terminal_text(EVIL) == "evil\\x1b[31mred\\x1b]0;owned\\x07\\rover\\u202eright\\x9bX"
