"""The CLI starts at once (issue 24): a one-shot command loads only what it needs, and the
shortcuts that make it so (the parser built for the command named, the client reading
the wire format with the standard library) change nothing a user or the host sees.

What a command loads is pinned structurally (the modules in ``sys.modules`` once the
command has run, in a fresh interpreter, against a real host), never by timing; the
figures are bench/measure_cli.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from piwf.cli.parser import SKIPPED, build_parser
from piwf.client import Reply, _decode, _line, make_request, request_fields
from piwf.errors import PiwfError, ProtocolError
from piwf.host.state import HostState
from piwf.paths import StatePaths, absolute
from piwf.wire import HostRequest, HostResponse, decode_with, encode_line

from .test_lifecycle import start

# Whole packages a one-shot command must not load: the host's event loop and store, the
# message codecs, the live view, and the standard library's slow imports.
HEAVY = ("trio", "msgspec", "rich", "apsw", "psutil", "psycopg", "typing", "dataclasses", "inspect", "pathlib",
         "uuid", "hashlib", "asyncio", "logging", "subprocess")
# piwf's own modules that are not the CLI's business for a one-shot request.
NOT_PIWF = ("piwf.engine", "piwf.host.host", "piwf.host.server", "piwf.store", "piwf.worker", "piwf.protocol",
            "piwf.wire", "piwf.controllers", "piwf.cli.watch", "piwf.cli.waiting")

PROBE = """
import sys
from piwf.cli import main
code = main(sys.argv[2:])
sys.stdout.flush()
with open(sys.argv[1], "w") as out:
    out.write("\\n".join(sorted(sys.modules)))
sys.exit(code)
"""


async def loaded_by(tmp_path: Path, paths: StatePaths, *args: str) -> tuple[str, set[str]]:
    """Run ``piwf ARGS`` in a fresh interpreter; what it printed, and every module loaded."""
    listing = tmp_path / "modules.txt"
    with trio.fail_after(60):
        done = await trio.run_process([sys.executable, "-c", PROBE, str(listing), *args, "--state-dir",
                                       str(paths.root)], capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode(), set(listing.read_text().split("\n"))


def too_heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY or m.startswith(NOT_PIWF))


async def test_status_and_run_show_load_no_event_loop_no_codec_no_engine(
        host: HostState, paths: StatePaths, project: Path, tmp_path: Path) -> None:
    run_id = await start(paths, project, "greet")
    status, loaded = await loaded_by(tmp_path, paths, "status")
    assert "host:      running" in status and too_heavy(loaded) == []
    shown, loaded = await loaded_by(tmp_path, paths, "run", "show", run_id)
    assert f"run:      {run_id} (greet)" in shown and too_heavy(loaded) == []
    as_json, loaded = await loaded_by(tmp_path, paths, "run", "show", run_id, "--json")
    assert json.loads(as_json)["runId"] == run_id and too_heavy(loaded) == []


async def test_the_probe_sees_what_a_command_loads(tmp_path: Path, project: Path) -> None:
    """The check above can fail: a command that does load the engine is caught."""
    paths = StatePaths.resolve(tmp_path / "state")
    listed, loaded = await loaded_by(tmp_path, paths, "workflows", "list", "--project", str(project))
    assert "greet" in listed and "piwf.engine.inspect" in too_heavy(loaded)


# --- the parser built for the command named parses as the whole parser does -------------

ARGVS = [
    ["status"], ["--json", "status"], ["--state-dir", "/s", "status", "--json"], ["--state-dir=/s", "status"],
    ["--timeout", "5", "run", "show", "r1"], ["run", "--json", "show", "r1"], ["run", "show"], ["run", "bogus"],
    ["bogus"], [], ["run"], ["--state", "/s", "status"], ["status", "--bogus"], ["run", "list", "--status", "nope"],
    ["run", "list", "--status", "failed", "--limit", "3"], ["--timeout", "abc", "status"], ["--timeout"],
    ["controller", "get", "n", "k", "--project", "p"], ["decide", "q1", "yes"], ["service", "status"],
    ["followup", "add", "r1", "text"], ["run", "start", "w", "--input", "{}", "--wait"], ["--", "status"],
    ["status", "extra"], ["workflows", "list"], ["prune", "--older-than", "1s"], ["watch", "--once"],
]


def _parsed(parser: Any, argv: list[str]) -> Any:
    try:
        return vars(parser.parse_args(argv))
    except PiwfError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_the_parser_for_one_command_parses_as_the_whole_one(argv: list[str]) -> None:
    assert _parsed(build_parser(argv), argv) == _parsed(build_parser(), argv)


def test_only_the_command_named_is_built() -> None:
    """Not a parser that happens to build everything anyway: the others are skipped."""
    whole = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    one = build_parser(["run", "show", "r1"])._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert len(whole) > 10 and list(one) == ["run"]
    run_subs = one["run"]._subparsers._group_actions[0].choices
    assert list(run_subs) == ["show"]
    assert SKIPPED.add_parser("x").add_argument("--y") is None


# --- the blocking client's JSON is the wire format's ----------------------------------------

CALLS: list[dict[str, Any]] = [
    {"operation": "host.status"},
    {"operation": "run.status", "run_id": "r1"},
    {"operation": "run.start", "payload": {"workflow": "w", "input": {"é": [1, 2.5, None, True]}, "x": "\u2028"}},
    {"operation": "run.pause", "run_id": "r1", "expected_revision": 0, "request_id": "q", "idempotency_key": "k"},
    {"operation": "run.list", "payload": {}},
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c["operation"])
def test_a_request_line_is_what_host_request_encodes(call: dict[str, Any]) -> None:
    fields = request_fields(client_id="me", **{"request_id": "same", **call})
    struct = make_request(client_id="me", **{"request_id": "same", **call})
    line = _line(fields)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert msgspec.json.decode(line, type=HostRequest) == struct
    assert json.loads(line) == json.loads(encode_line(struct))


REPLIES = [
    b'{"requestId":"q","outcome":"accepted","schema":"piwf.host-response.v1","receipt":{"a":[1]}}',
    b'{"requestId":"q","outcome":"notFound","error":"run r not found","revision":3}',
    b'{"requestId":"","outcome":"unavailable","error":null,"revision":null,"extra":1}',
    b'{"requestId":"q","outcome":"accepted","receipt":null}',
    b'{"requestId":"q","outcome":"maybe"}', b'{"outcome":"accepted"}', b'{"requestId":"q"}',
    b'{"requestId":1,"outcome":"accepted"}', b'{"requestId":"q","outcome":"accepted","revision":true}',
    b'{"requestId":"q","outcome":"accepted","revision":"3"}', b'{"requestId":"q","outcome":"accepted","error":5}',
    b'{"requestId":"q","outcome":"accepted","schema":null}', b'{"requestId":"q","outcome":"accepted","revision":1.5}',
    b'[1]', b'"text"', b"not json", b"\xff\xfe", b'{"requestId":"q","outcome":"accepted"', b"[" * 101 + b"]" * 101,
    b'{"requestId":"q","outcome":"accepted","receipt":' + b"[" * 98 + b"]" * 98 + b"}",
]

_struct_decoder = msgspec.json.Decoder(HostResponse)


@pytest.mark.parametrize("line", REPLIES)
def test_a_reply_is_read_as_host_response_reads_it(line: bytes) -> None:
    """The same lines are refused (a ProtocolError: "unreadable host response"), and the
    same fields come out of the others."""
    try:
        expected: HostResponse | None = decode_with(_struct_decoder, line, "host response")
    except ProtocolError:
        expected = None
    if expected is None:
        with pytest.raises(ProtocolError, match=r"unreadable host response|nested deeper"):
            _decode(line)
        return
    got = _decode(line)
    assert got == Reply(**msgspec.structs.asdict(expected))
    assert got.outcome is expected.outcome


def test_state_paths_are_what_pathlib_makes_of_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for given in ("rel/./dir/", "/a//b/../c", "//net/x", "///x", ".", "~/s", "a/../b"):
        assert StatePaths.resolve(given).root == Path(given).expanduser().absolute(), given
        assert StatePaths.resolve(given).name == str(Path(given).expanduser().absolute()), given
    assert absolute("x") == str(tmp_path / "x")
    paths = StatePaths.resolve(tmp_path / "s")
    assert paths.socket_name == str(paths.socket) and paths == StatePaths.resolve(str(tmp_path / "s"))
