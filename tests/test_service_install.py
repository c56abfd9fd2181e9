"""``piwf service install|uninstall|status`` (DESIGN.md §10, issue 12): the files are data.

systemd is not PID 1 here and launchd is absent, so every test chooses the platform with
the hidden ``--platform`` (which also keeps the real service manager out of it: the
commands are printed, never run) and a temporary ``XDG_CONFIG_HOME``/``HOME``. Units are
checked with ``systemd-analyze verify``, plists by a ``plistlib`` round trip.
"""

from __future__ import annotations

import json
import os
import plistlib
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


async def test_dry_run_prints_units_that_systemd_analyze_verify_accepts(paths: StatePaths, home: Path,
                                                                         tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    planned = await report(paths, "install", "--dry-run", "--platform", "linux")
    assert files_under(home) == {}, "a dry run writes nothing"
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
