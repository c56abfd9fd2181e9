"""The fence by the host's own clock (host/fence.py) under ``autojump_clock``, and a worker
that stops itself when its host stops vouching for its claim (worker/channel.py, real
processes). The end-to-end cases, with real hosts on PostgreSQL, are tests/test_partitions.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import trio

from piwf.errors import StorageUnavailable
from piwf.host import fence
from piwf.host.host import _rejoin
from piwf.host.lane import renew_claims
from piwf.host.run_lane import RunLane
from piwf.host.state import HostState
from piwf.protocol.worker import HostHeartbeat
from piwf.status import StopReason
from piwf.wire import encode_line

from .test_supervision import _claim_another, _claimed_run


def _fenced(tmp_path: Path) -> HostState:
    host, _ = _claimed_run(tmp_path)
    object.__setattr__(host.config, "fence", True)  # a store other hosts share, as far as the fence goes
    return host


async def test_work_whose_claim_is_not_renewed_is_killed_at_two_thirds_of_its_lease(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host = _fenced(tmp_path)
    active = host.active["r"]
    killed: list[float] = []
    active.kill = lambda: killed.append(trio.current_time())
    began = trio.current_time()
    active.good_until = fence.good_until(began, host.config.run_lease_ms)  # claimed now, never renewed

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fence.serve_fence, host, host.active, host.config.run_lease_ms, "run")
        while not active.scope.cancel_called:
            await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert len(killed) == 1 and killed[0] - began == pytest.approx(2.0, abs=0.001)  # 2/3 of the 3 s lease
    assert active.stop_reason is StopReason.UNRENEWED and active.unrenewed
    assert "its claim could not be renewed for 2 s of its 3 s lease" in active.stop_note


async def test_renewals_move_the_bound_from_when_they_began_and_it_holds_once_they_stop(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host = _fenced(tmp_path)
    active = host.active["r"]
    active.good_until = fence.good_until(trio.current_time(), host.config.run_lease_ms)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fence.serve_fence, host, host.active, host.config.run_lease_ms, "run")
        renewing = trio.CancelScope()
        nursery.start_soon(_until_cancelled, renewing, renew_claims, RunLane(host))
        await trio.sleep(host.config.run_lease_ms / 1000 * 10)  # ten leases: renewed all along
        assert not active.scope.cancel_called
        renewing.cancel()  # the renewals stop getting through
        cut = trio.current_time()
        while not active.scope.cancel_called:
            await trio.sleep(0.01)
        stopped = trio.current_time()
        nursery.cancel_scope.cancel()
    # within 2/3 of a lease of the last renewal, which began at most a renewal period before the cut
    assert cut < stopped <= cut + 2.0 + 0.02 and active.stop_reason is StopReason.UNRENEWED


async def test_two_renewals_in_a_row_may_fail_and_the_work_goes_on(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """A blip of the store (a lock timeout, a dropped connection) costs a renewal or two,
    not the host's work: renewals come every sixth of a lease, the bound is four of them."""
    host = _fenced(tmp_path)
    active = host.active["r"]
    active.good_until = fence.good_until(trio.current_time(), host.config.run_lease_ms)
    calls: list[float] = []

    class Blipping(RunLane):
        async def renew(self, claims: list[tuple[str, str]]) -> set[str]:
            calls.append(trio.current_time())
            if len(calls) % 4 in (2, 3):  # the 2nd and 3rd of every four fail
                raise StorageUnavailable("the store did not answer")
            return await super().renew(claims)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fence.serve_fence, host, host.active, host.config.run_lease_ms, "run")
        nursery.start_soon(renew_claims, Blipping(host))
        await trio.sleep(host.config.run_lease_ms / 1000 * 10)  # ten leases, half the renewals failing
        nursery.cancel_scope.cancel()
    assert not active.scope.cancel_called and active.stop_reason is None
    assert len(calls) >= 55  # every sixth of a lease


async def _until_cancelled(scope: trio.CancelScope, function: object, *args: object) -> None:
    with scope:
        await function(*args)  # type: ignore[operator]


async def test_a_host_past_its_lease_bound_stops_all_its_work_and_claims_nothing(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host = _fenced(tmp_path)
    other = _claim_another(host, "r2")
    for work in host.active.values():
        work.good_until = trio.current_time() + 3600  # the claims are fine
    host.lease_good_until = trio.current_time() + 1.0  # the host lease is not
    assert fence.lease_good(host)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fence.serve_fence, host, host.active, host.config.run_lease_ms, "run")
        while not (host.active["r"].scope.cancel_called and other.scope.cancel_called):
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert not fence.lease_good(host)  # the dispatcher claims nothing now
    assert all("the host lease could not be renewed" in work.stop_note for work in host.active.values())


async def test_a_host_whose_work_has_left_joins_again_with_a_new_epoch(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    host = _fenced(tmp_path)
    host.lease_good_until = trio.current_time() - 1  # past its bound
    before = host.epoch
    await _rejoin(host)
    assert host.epoch == before  # its run is still there: it waits for the fence to stop it
    host.active.clear()
    await _rejoin(host)
    assert host.epoch > before and fence.lease_good(host)


# --- the worker's side: real processes --------------------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys
    from piwf.worker.channel import Channel

    channel = Channel(int(sys.argv[1]), int(sys.argv[2]), worker_id="w", generation=1, lease_ms=int(sys.argv[3]),
                      until_ms=int(sys.argv[4]))
    while True:
        print(channel.next_line().decode(), flush=True)  # what reaches the main thread
""")


class _Worker:
    """A process holding a worker's channel, in a process group of its own."""

    def __init__(self, lease_ms: int, until_ms: int = 0) -> None:
        self.to_r, self.to_w = os.pipe()
        self.from_r, self.from_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(self.to_r), str(self.from_w), str(lease_ms), str(until_ms)],
            pass_fds=(self.to_r, self.from_w), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        os.close(self.to_r)
        os.close(self.from_w)

    def send(self, data: bytes) -> None:
        os.write(self.to_w, data)

    def vouch(self, seconds: float) -> None:
        self.send(encode_line(HostHeartbeat(untilMs=int((time.monotonic() + seconds) * 1000))))

    def end(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=20)
        for fd in (self.to_w, self.from_r):
            os.close(fd)
        return self.proc.returncode, out.decode(), err.decode()


def test_a_worker_that_hears_no_heartbeat_stops_itself_at_a_third_of_its_lease() -> None:
    worker = _Worker(lease_ms=300)
    code, _, err = worker.end()
    assert code == -signal.SIGKILL and "the host has not vouched for this worker's claim in time" in err


def test_a_worker_started_past_the_bound_its_launch_envelope_gave_stops_at_once() -> None:
    """The envelope says until when the host vouched for the claim when it launched the
    worker: a worker slow to start counts from then, not from its own start."""
    worker = _Worker(lease_ms=60_000, until_ms=int(time.monotonic() * 1000) - 1)
    code, _, err = worker.end()
    assert code == -signal.SIGKILL and "has not vouched" in err


def test_heartbeats_keep_a_worker_going_and_one_already_past_stops_it() -> None:
    worker = _Worker(lease_ms=60_000)
    worker.vouch(3600)
    worker.send(b'{"messageId":"m1","outcome":"accepted"}\n')
    assert worker.proc.stdout is not None
    assert msgspec.json.decode(worker.proc.stdout.readline())["messageId"] == "m1"  # heartbeats are not answers
    worker.vouch(-1)  # the host vouches no longer (sent late, or read late): it stops at once
    code, _, err = worker.end()
    assert code == -signal.SIGKILL and "has not vouched" in err
