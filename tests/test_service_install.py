"""``piwf service install|uninstall|status`` (DESIGN.md §10, issue 12): the files are data.

systemd is not PID 1 here and launchd is absent, so every test chooses the platform with
the hidden ``--platform`` (which also keeps the real service manager out of it: the
commands are printed, never run) and a temporary ``XDG_CONFIG_HOME``/``HOME``. Units are
checked with ``systemd-analyze verify``, plists by a ``plistlib`` round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf import service
from piwf.errors import ExitCode
from piwf.host.state import HostConfig
from piwf.paths import StatePaths

PLATFORMS = ("linux", "macos")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("HOME", str(root))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(root / ".config"))
    return root


async def service_cli(paths: StatePaths, *args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process([sys.executable, "-m", "piwf", "service", *args, "--state-dir", str(paths.root)],
                                      capture_stdout=True, capture_stderr=True, check=False)


async def report(paths: StatePaths, *args: str) -> dict[str, Any]:
    done = await service_cli(paths, *args, "--json")
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def unit(paths: StatePaths, suffix: str) -> str:
    """The name of the state directory's unit (made from it: no --name)."""
    return f"piwf-{service.default_name(paths)}.{suffix}"


def files_under(root: Path) -> dict[str, str]:
    return {str(path): path.read_text() for path in sorted(root.rglob("*")) if path.is_file()}


def verify(paths: StatePaths, planned: dict[str, Any], tmp_path: Path) -> None:
    """``systemd-analyze verify`` accepts the planned units, saying nothing."""
    units = tmp_path / "units"
    units.mkdir()
    for f in planned["files"]:
        (units / Path(f["path"]).name).write_text(f["content"])
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    verified = subprocess.run(["systemd-analyze", "--user", "verify", str(units / unit(paths, "service")),
                               str(units / unit(paths, "socket"))], capture_output=True, text=True, check=False,
                              env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), verified.stderr


async def test_dry_run_prints_units_that_systemd_analyze_verify_accepts(paths: StatePaths, home: Path,
                                                                         tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    planned = await report(paths, "install", "--dry-run", "--platform", "linux")
    assert files_under(home) == {}, "a dry run writes nothing"
    verify(paths, planned, tmp_path)
    human = (await service_cli(paths, "install", "--dry-run", "--platform", "linux")).stdout.decode()
    for f in planned["files"]:
        assert f["content"].strip() in human
    assert (f"# would run: systemctl --user enable --now {unit(paths, 'socket')} {unit(paths, 'service')}"
            in human)


async def test_the_service_unit_says_what_the_issue_asks(paths: StatePaths, home: Path) -> None:
    planned = await report(paths, "install", "--dry-run", "--platform", "linux")
    units = {Path(f["path"]).name: f["content"] for f in planned["files"]}
    settings = dict(line.split("=", 1) for line in units[unit(paths, "service")].splitlines() if "=" in line)
    assert {k: settings[k] for k in ("Type", "NotifyAccess", "Restart", "KillMode")} == {
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillMode": "mixed"}
    assert int(settings["WatchdogSec"]) > 0
    assert int(settings["TimeoutStopSec"]) > HostConfig(paths).drain_timeout_s == service.DRAIN_TIMEOUT_S
    program, *args = settings["ExecStart"].split()
    assert Path(program).is_absolute() and os.access(program, os.X_OK)
    assert args[:3] == ["serve", "--state-dir", str(paths.root)]
    assert f"ListenStream={paths.socket}\n" in units[unit(paths, "socket")]
    assert "SocketMode=0600\n" in units[unit(paths, "socket")]
    assert settings["Requires"] == settings["After"] == unit(paths, "socket")
    assert str(home / ".config" / "systemd" / "user" / unit(paths, "service")) in [f["path"] for f in planned["files"]]


async def test_dry_run_prints_a_plist_that_plistlib_round_trips(paths: StatePaths, home: Path) -> None:
    planned = await report(paths, "install", "--dry-run", "--platform", "macos")
    [plist] = planned["files"]
    label = f"dev.piwf.host.{service.default_name(paths)}"
    assert plist["path"] == str(home / "Library" / "LaunchAgents" / f"{label}.plist")
    agent = plistlib.loads(plist["content"].encode())
    assert plistlib.dumps(agent, sort_keys=True).decode() == plist["content"]
    assert agent["Label"] == label and agent["RunAtLoad"] is True and agent["KeepAlive"]
    assert agent["ProgramArguments"][1:4] == ["serve", "--state-dir", str(paths.root)]
    assert agent["StandardErrorPath"] and agent["ExitTimeOut"] > service.DRAIN_TIMEOUT_S
    assert ["launchctl", "bootstrap", f"gui/{os.getuid()}", plist["path"]] in planned["commands"]
    assert files_under(home) == {}


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_install_writes_exactly_the_printed_files_and_uninstall_removes_them(
        paths: StatePaths, home: Path, platform: str) -> None:
    planned = await report(paths, "install", "--dry-run", "--platform", platform)
    expected = {f["path"]: f["content"] for f in planned["files"]}

    first = await report(paths, "install", "--platform", platform)
    assert files_under(home) == expected
    assert all(f["changed"] for f in first["files"]) and not first["commandsRun"]
    stamps = {path: os.stat(path).st_mtime_ns for path in expected}

    again = await report(paths, "install", "--platform", platform)
    assert not any(f["changed"] for f in again["files"])
    assert files_under(home) == expected and {p: os.stat(p).st_mtime_ns for p in expected} == stamps

    status = await report(paths, "status", "--platform", platform)
    assert all(f["installed"] and f["ours"] and f["current"] for f in status["files"])

    removed = await report(paths, "uninstall", "--platform", platform)
    assert sorted(removed["removed"]) == sorted(expected)
    assert files_under(home) == {}
    nothing = await report(paths, "uninstall", "--platform", platform)
    assert nothing["removed"] == [] and nothing["commands"] == []


async def test_install_without_the_manager_says_what_to_run(paths: StatePaths, home: Path) -> None:
    done = await service_cli(paths, "install", "--platform", "linux")
    assert done.returncode == 0
    last = done.stdout.decode().splitlines()[-1]
    assert last.endswith(f"run: systemctl --user daemon-reload && systemctl --user enable --now "
                         f"{unit(paths, 'socket')} {unit(paths, 'service')}")


@pytest.mark.parametrize("command", ["install", "uninstall"])
async def test_a_unit_piwf_did_not_write_is_left_alone(paths: StatePaths, home: Path, command: str) -> None:
    foreign = home / ".config" / "systemd" / "user" / unit(paths, "service")
    foreign.parent.mkdir(parents=True)
    foreign.write_text("[Service]\nExecStart=/bin/true\n")
    done = await service_cli(paths, command, "--platform", "linux")
    assert done.returncode == ExitCode.SERVICE
    [line] = done.stderr.decode().splitlines()
    assert "was not written by `piwf service install`" in line
    assert files_under(home) == {str(foreign): "[Service]\nExecStart=/bin/true\n"}


def test_systemd_quoting_keeps_arguments_whole() -> None:
    quoted = service._systemd_quote("/home/a b/100%$x")
    assert quoted == '"/home/a b/100%%$$x"'
    assert service._systemd_quote("/plain/path") == "/plain/path"


# Every serve option a service carries, each at a value other than its default.
GIVEN = {"--max-workers": "3", "--queue": "gpu", "--durability": "normal",
         "--store": "postgresql://piwf@db.example/piwf?schema=s1",
         "--poll-only": None, "--worker-startup-timeout": "20", "--drain-timeout": "40.5", "--kill-grace": "3",
         "--request-timeout": "11", "--reply-timeout": "12", "--presentation-lease": "13", "--socket-check": "2",
         "--delivery-lease": "14", "--lease": "15", "--max-controller-workers": "5", "--node-time-limit": "600",
         "--worker-start": "spawn", "--worker-nice": "5", "--log-level": "debug", "--retain": "30d"}


def serve_args(flags: dict[str, str | None]) -> list[str]:
    return [arg for flag, value in flags.items() for arg in ([flag] if value is None else [flag, value])]


def exec_start(planned: dict[str, Any], platform: str) -> list[str]:
    """The argv the service manager starts, as it reads the unit (plist)."""
    [content] = [f["content"] for f in planned["files"] if f["path"].endswith((".service", ".plist"))]
    if platform == "macos":
        return list(plistlib.loads(content.encode())["ProgramArguments"])
    [line] = [line for line in content.splitlines() if line.startswith("ExecStart=")]
    return [arg.replace("%%", "%").replace("$$", "$") for arg in shlex.split(line.removeprefix("ExecStart="))]


def test_install_takes_every_serve_option_but_the_log_format_and_standby() -> None:
    """A new serve option that changes behaviour is one a service carries (or is named here)."""
    from piwf.cli.parser import build_parser

    def options(*argv: str) -> set[str]:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for word in argv:
            parser = sub.choices[word]
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), sub)
        return {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}

    common = options("completion")
    serve = options("serve") - common
    install = options("service", "install") - common - {"--dry-run", "--name", "--platform"}
    assert serve - install == {"--log-format", "--standby"}
    assert install == set(GIVEN) and install <= serve


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_install_carries_the_serve_options_given_into_the_unit(paths: StatePaths, home: Path,
                                                                     platform: str) -> None:
    from piwf.cli.parser import build_parser

    planned = await report(paths, "install", "--dry-run", "--platform", platform, *serve_args(GIVEN))
    _, *argv = exec_start(planned, platform)
    assert argv[:5] == ["serve", "--state-dir", str(paths.root), "--log-format", "json"]
    assert argv[5:] == serve_args(GIVEN) == planned["serveOptions"]
    served = build_parser().parse_args(argv)  # what serve makes of them: the values given
    expected = build_parser().parse_args(["serve", "--state-dir", str(paths.root), "--log-format", "json",
                                          *serve_args(GIVEN)])
    assert vars(served) == vars(expected) and served.retain == 30 * 86_400_000 and served.poll_only
    content = next(f["content"] for f in planned["files"] if f["path"].endswith((".service", ".plist")))
    stop = 55 + service.STOP_MARGIN_S - 15  # the drain timeout given (40.5 s, up) and the margin
    assert (f"TimeoutStopSec={stop + 1}\n" in content if platform == "linux"
            else plistlib.loads(content.encode())["ExitTimeOut"] == stop + 1)
    await report(paths, "install", "--platform", platform, *serve_args(GIVEN))
    status = await report(paths, "status", "--platform", platform)  # current: with the options it carries
    assert all(f["installed"] and f["current"] for f in status["files"]), status
    plain = await report(paths, "install", "--dry-run", "--platform", platform)  # exactly the options given
    assert exec_start(plain, platform)[6:] == [] and any(f["changed"] for f in plain["files"])


async def test_a_unit_with_options_is_one_systemd_analyze_verify_accepts(paths: StatePaths, home: Path,
                                                                         tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    odd = "postgresql://piwf@db/piwf?options=-c%20search_path%3Ds%241"  # % and $: escaped for systemd
    planned = await report(paths, "install", "--dry-run", "--platform", "linux",
                           *serve_args({**GIVEN, "--store": odd}))
    verify(paths, planned, tmp_path)
    assert exec_start(planned, "linux")[6:] == serve_args({**GIVEN, "--store": odd})


async def test_the_host_the_unit_starts_keeps_the_options(paths: StatePaths, home: Path, project: Path,
                                                         host_process: Any) -> None:
    """The unit's own command line, started as systemd would: the host has 3 workers and
    deletes an ended run a second after it ended (--retain 1s)."""
    from .conftest import wait_for, write_workflow
    from .test_interactions import start, wait_run
    from .test_lifecycle import call
    from .test_retention import QUICK, _gone

    planned = await report(paths, "install", "--dry-run", "--platform", "linux", "--retain", "1s",
                           "--max-workers", "3")
    argv = exec_start(planned, "linux")
    assert argv[1:4] == ["serve", "--state-dir", str(paths.root)]
    await host_process(*argv[4:]).start()
    assert (await call(paths, "host.status"))["maxWorkers"] == 3
    write_workflow(project, "quick", QUICK)
    done = await start(paths, project, "quick")
    assert (await wait_run(paths, done))["status"] == "completed"
    await wait_for(lambda: _gone(paths, done))


async def test_a_store_url_with_a_password_is_refused_and_piwf_store_is_carried(
        paths: StatePaths, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("postgresql://piwf:secret@db/piwf", "postgresql://piwf@db/piwf?password=secret"):
        done = await service_cli(paths, "install", "--platform", "linux", "--store", url)
        assert done.returncode == 2 and done.stdout == b""
        [line] = done.stderr.decode().splitlines()
        assert "has a password" in line and "~/.pgpass" in line and "secret" not in line, line
    assert files_under(home) == {}
    monkeypatch.setenv("PIWF_STORE", "postgresql://piwf@db/piwf")  # serve reads it; a service would not have it
    planned = await report(paths, "install", "--dry-run", "--platform", "linux")
    assert exec_start(planned, "linux")[-2:] == ["--store", "postgresql://piwf@db/piwf"]
    bad = await service_cli(paths, "install", "--platform", "linux", "--retain", "5x")
    assert bad.returncode == 2 and "is not a length of time" in bad.stderr.decode() and files_under(home) == {}


async def test_install_carries_every_queue_given(paths: StatePaths, home: Path) -> None:
    planned = await report(paths, "install", "--dry-run", "--platform", "linux", "--queue", "gpu", "--queue", "batch")
    _, *argv = exec_start(planned, "linux")
    assert argv[5:] == ["--queue", "gpu", "--queue", "batch"] == planned["serveOptions"]
    from piwf.cli.parser import build_parser

    assert build_parser().parse_args(argv).queue == ["gpu", "batch"]
