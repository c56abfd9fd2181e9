"""Service units per state directory (issue 23, point 10): names, refusals, uninstall of
one's own only, and the take-over of the single `piwf.service` of earlier versions. As in
test_service_install.py: `--platform` keeps the service manager out (files only)."""

from __future__ import annotations

import json
import os
import plistlib
from pathlib import Path

import pytest

from piwf import service
from piwf.errors import ExitCode
from piwf.paths import StatePaths

from .test_service_install import files_under, home, report, service_cli

__all__ = ["home"]  # the fixture: a temporary HOME and XDG_CONFIG_HOME

SYSTEMD = Path(".config") / "systemd" / "user"


def state(tmp_path: Path, name: str) -> StatePaths:
    return StatePaths.resolve(tmp_path / name / "state")


@pytest.mark.usefixtures("home")
async def test_two_state_directories_get_two_services_and_uninstall_removes_only_its_own(
        tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    first, second = state(tmp_path, "a"), state(tmp_path, "b")
    one = await report(first, "install", "--platform", "linux")
    two = await report(second, "install", "--platform", "linux")
    assert one["name"] != two["name"] and one["name"].startswith("piwf-state-")
    installed = files_under(home)
    assert len(installed) == 4
    for paths, receipt in ((first, one), (second, two)):
        for f in receipt["files"]:
            assert installed[f["path"]] == f["content"] and f"# State directory: {paths.root}\n" in f["content"]
    again = await report(first, "install", "--platform", "linux")
    assert not any(f["changed"] for f in again["files"]) and again["name"] == one["name"]
    removed = await report(first, "uninstall", "--platform", "linux")
    assert sorted(removed["removed"]) == sorted(f["path"] for f in one["files"])
    assert files_under(home) == {f["path"]: f["content"] for f in two["files"]}
    nothing = await service_cli(first, "uninstall", "--platform", "linux")
    assert nothing.stdout.decode() == f"no piwf service is installed for {first.root}; nothing to remove\n"


@pytest.mark.usefixtures("home")
async def test_a_name_is_kept_and_another_state_directorys_name_is_refused(tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    first, second = state(tmp_path, "a"), state(tmp_path, "b")
    named = await report(first, "install", "--name", "web", "--platform", "linux")
    assert named["name"] == "piwf-web"
    assert sorted(Path(f["path"]).name for f in named["files"]) == ["piwf-web.service", "piwf-web.socket"]
    before = files_under(home)
    taken = await service_cli(second, "install", "--name", "web", "--platform", "linux")
    assert taken.returncode == ExitCode.SERVICE
    [line] = taken.stderr.decode().splitlines()
    assert f"piwf-web.socket is the service of another state directory ({first.root})" in line
    refused = await service_cli(second, "uninstall", "--name", "web", "--platform", "linux")
    assert refused.returncode == ExitCode.SERVICE
    assert files_under(home) == before  # nothing written, nothing removed
    kept = await report(first, "install", "--platform", "linux")  # no --name: the name it has
    assert kept["name"] == "piwf-web" and not any(f["changed"] for f in kept["files"])
    bad = await service_cli(first, "install", "--name", "../x", "--platform", "linux")
    assert bad.returncode == ExitCode.USAGE


def legacy_units(paths: StatePaths) -> dict[str, str]:
    """The two units earlier versions wrote for ``paths``: piwf.service and piwf.socket,
    with no state-directory line."""
    def old(text: str) -> str:
        return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(service.STATE_LINE))
    return {"piwf.socket": old(service.socket_unit(paths)), "piwf.service": old(service.service_unit(paths))}


@pytest.mark.usefixtures("home")
async def test_the_single_piwf_service_of_earlier_versions_is_taken_over_for_its_own_state_directory(
        tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    first, second = state(tmp_path, "a"), state(tmp_path, "b")
    directory = home / SYSTEMD
    directory.mkdir(parents=True)
    for name, content in legacy_units(first).items():
        (directory / name).write_text(content)
    status = json.loads((await service_cli(first, "status", "--platform", "linux", "--json")).stdout)
    assert [f["path"] for f in status["files"] if f.get("takenOverByInstall")] == [
        str(directory / "piwf.service"), str(directory / "piwf.socket")]

    other = await report(second, "install", "--platform", "linux")  # another directory: left alone
    assert other["tookOver"] == [] and (directory / "piwf.service").exists()

    dry = await service_cli(first, "install", "--dry-run", "--platform", "linux")
    assert f"# would take over (remove): {directory / 'piwf.service'}" in dry.stdout.decode()
    assert (directory / "piwf.service").exists()
    taken = await report(first, "install", "--platform", "linux")
    assert sorted(taken["tookOver"]) == [str(directory / "piwf.service"), str(directory / "piwf.socket")]
    assert taken["commands"][0] == ["systemctl", "--user", "disable", "--now", "piwf.service", "piwf.socket"]
    assert not (directory / "piwf.service").exists() and not (directory / "piwf.socket").exists()
    assert sorted(files_under(home)) == sorted(f["path"] for f in [*taken["files"], *other["files"]])


@pytest.mark.usefixtures("home")
async def test_uninstall_removes_an_earlier_versions_unit_of_its_own_state_directory(
        tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    paths = state(tmp_path, "a")
    directory = home / SYSTEMD
    directory.mkdir(parents=True)
    for name, content in legacy_units(paths).items():
        (directory / name).write_text(content)
    removed = await report(paths, "uninstall", "--platform", "linux")
    assert sorted(removed["removed"]) == [str(directory / "piwf.service"), str(directory / "piwf.socket")]
    assert files_under(home) == {}


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.usefixtures("home")
async def test_an_earlier_launchd_agent_is_taken_over_only_for_its_own_state_directory(
        tmp_path: Path, own: bool) -> None:
    home = Path(os.environ["HOME"])
    first, second = state(tmp_path, "a"), state(tmp_path, "b")
    agents = home / "Library" / "LaunchAgents"
    agents.mkdir(parents=True)
    legacy = agents / "dev.piwf.host.plist"
    legacy.write_text(service.launchd_plist(first))  # the label of earlier versions
    installed = await report(first if own else second, "install", "--platform", "macos")
    assert installed["tookOver"] == ([str(legacy)] if own else [])
    assert legacy.exists() is not own
    [plist] = installed["files"]
    assert plistlib.loads(Path(plist["path"]).read_bytes())["Label"] == installed["name"]
