"""What the CLI says of standbys (issue 23, point 10): `piwf status` shows one waiting,
`piwf stop` says when one took over. Real hosts, real standbys."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for
from .test_standby import serving_pid, standby


async def test_status_shows_a_waiting_standby_and_stop_says_it_took_over(
        host_process: Callable[..., HostProcess], paths: StatePaths, tmp_path: Path) -> None:
    live = await host_process().start()
    alone = (await piwf(paths, "status")).stdout.decode()
    assert "standby:" not in alone
    spare = await standby(host_process, tmp_path / "standby.log")
    assert spare.proc is not None
    shown = (await piwf(paths, "status")).stdout.decode()
    assert f"standby:   pid {spare.proc.pid}, waiting to take over (since " in shown
    assert [s["pid"] for s in json.loads((await piwf(paths, "status", "--json")).stdout)["standbys"]] == [
        spare.proc.pid]

    stopped = await piwf(paths, "stop")
    assert stopped.stdout.decode() == (f"host stopped; a standby (pid {spare.proc.pid}) took over and serves the "
                                       "state directory (`piwf stop` again stops it)\n")
    assert await live.wait() == 0
    assert await serving_pid(paths) == spare.proc.pid
    assert "standby:" not in (await piwf(paths, "status")).stdout.decode()  # it serves now; none waits
    last = json.loads((await piwf(paths, "stop", "--json")).stdout)
    assert last == {"stopped": True, "takenOverBy": None}
    assert await spare.wait() == 0


async def test_a_standby_killed_while_waiting_is_not_shown(
        host_process: Callable[..., HostProcess], paths: StatePaths, tmp_path: Path) -> None:
    await host_process().start()
    spare = await standby(host_process, tmp_path / "standby.log")
    assert spare.proc is not None
    spare.signal(signal.SIGKILL)
    await spare.wait()
    assert list(paths.host_dir.glob("standby-*.json"))  # it could not remove its record
    assert "standby:" not in (await piwf(paths, "status")).stdout.decode()
    stopping = await standby(host_process, tmp_path / "second.log")
    stopping.signal(signal.SIGTERM)  # a standby told to stop while waiting removes its record
    assert await stopping.wait() == 0
    assert stopping.proc is not None
    await wait_for(lambda: not (paths.host_dir / f"standby-{stopping.proc.pid}.json").exists())
