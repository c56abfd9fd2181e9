"""Where state lives, and refusing unsafe state directories."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from piwf.errors import StateDirError
from piwf.paths import StatePaths


def test_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIWF_STATE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert StatePaths.resolve(tmp_path / "flag").root == tmp_path / "flag"
    assert StatePaths.resolve(None).root == tmp_path / "env"
    monkeypatch.delenv("PIWF_STATE_DIR")
    assert StatePaths.resolve(None).root == tmp_path / "xdg" / "piwf"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert StatePaths.resolve(None).root == tmp_path / "home" / ".local" / "state" / "piwf"


def test_directories_are_created_private(tmp_path: Path) -> None:
    paths = StatePaths.resolve(tmp_path / "state")
    paths.ensure()
    for directory in (paths.root, paths.host_dir):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_symlinked_state_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StateDirError, match="symlinks are refused"):
        StatePaths.resolve(tmp_path / "link").ensure()


def test_a_file_in_place_of_the_state_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    with pytest.raises(StateDirError, match=r"state is not a directory$"):
        StatePaths.resolve(tmp_path / "state").ensure()


def test_a_state_directory_too_long_for_a_socket_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    root = tmp_path / ("d" * 120)
    with pytest.raises(StateDirError, match="too long for a Unix socket"):
        StatePaths.resolve(root).ensure()
    assert not root.exists()
