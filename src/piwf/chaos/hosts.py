"""Chaos with several hosts (``--hosts N``, on a ``--store`` they share): the N-1 hosts
beside the harness's own, each on a state directory of its own, and the strikes that only
several hosts make interesting: SIGKILL of any host, SIGSTOP of a host or of a worker
(SIGCONT after a while: longer than the lease, sometimes, so the others take its runs over
while it is frozen and it must join again), SIGKILL of any host's worker. Clients send each
request to the hosts in turn, skipping frozen ones: any host answers any request.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from piwf.paths import StatePaths

Serve = Callable[[StatePaths, Path], "subprocess.Popen[bytes]"]  # start `piwf serve` on (state dir, log)


@dataclass
class Peer:
    paths: StatePaths
    log: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Strikes:
    peer_kills: int = 0
    host_freezes: int = 0
    worker_freezes: int = 0
    peer_worker_kills: int = 0
    unexpected_peer_exits: int = 0
    skipped: int = 0  # strikes that found nothing to strike (every host frozen, say)


class Fleet:
    def __init__(self, root: Path, count: int, serve: Serve, lease_s: float, rng: random.Random) -> None:
        self.peers = [Peer(StatePaths.resolve(root / f"state-{i}"), root / f"host-{i}.log") for i in range(1, count)]
        self.serve = serve
        self.lease_s = lease_s
        self.rng = rng
        self.strikes = Strikes()
        self.frozen: set[int] = set()  # pids of hosts stopped now
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._thaws: list[threading.Timer] = []

    def start(self, wait: Callable[[StatePaths, subprocess.Popen[bytes]], None]) -> None:
        for peer in self.peers:
            peer.proc = self.serve(peer.paths, peer.log)
            wait(peer.paths, peer.proc)

    def targets(self, primary: StatePaths, primary_pid: int | None) -> list[StatePaths]:
        """Where the next request goes first, then the others: in turn, frozen hosts last."""
        hosts = [(primary, primary_pid), *((p.paths, p.proc.pid if p.proc else None) for p in self.peers)]
        with self._lock:
            first = next(self._turn) % len(hosts)
            frozen = set(self.frozen)
        order = hosts[first:] + hosts[:first]
        return [paths for paths, pid in order if pid not in frozen] + [paths for paths, pid in order if pid in frozen]

    def ensure(self, wait: Callable[[StatePaths, subprocess.Popen[bytes]], None]) -> None:
        """A peer that exited though nothing killed it is counted, and started again."""
        for peer in self.peers:
            if peer.proc is not None and peer.proc.poll() is not None:
                self.strikes.unexpected_peer_exits += 1
                peer.proc = self.serve(peer.paths, peer.log)
                wait(peer.paths, peer.proc)

    def strike(self, primary: subprocess.Popen[bytes], wait: Callable[[StatePaths, subprocess.Popen[bytes]], None],
               ) -> None:
        kind = self.rng.choice(("kill peer", "freeze host", "freeze worker", "kill worker"))
        if kind == "freeze host":
            self.freeze_one(primary, long=self.rng.random() < 0.5)
        elif kind == "kill peer" or not self.strike_worker(primary, freeze=kind == "freeze worker"):
            self.kill_peer(wait)

    def hosts(self, primary: subprocess.Popen[bytes]) -> list[subprocess.Popen[bytes]]:
        return [primary, *(p.proc for p in self.peers if p.proc is not None)]

    def freeze_one(self, primary: subprocess.Popen[bytes], *, long: bool) -> None:
        """Freeze a host that is not frozen already (none, when all are)."""
        thawed = [proc for proc in self.hosts(primary) if not self.is_frozen(proc) and proc.poll() is None]
        if thawed:
            self.freeze_host(self.rng.choice(thawed), long=long)
        else:
            self.strikes.skipped += 1

    def is_frozen(self, proc: subprocess.Popen[bytes]) -> bool:
        with self._lock:
            return proc.pid in self.frozen

    def kill_peer(self, wait: Callable[[StatePaths, subprocess.Popen[bytes]], None]) -> None:
        """SIGKILL a peer (not a frozen one: it is left to join again) and start it again."""
        live = [p for p in self.peers if p.proc is not None and not self.is_frozen(p.proc)]
        if not live:
            self.strikes.skipped += 1
            return
        peer = self.rng.choice(live)
        assert peer.proc is not None
        with contextlib.suppress(ProcessLookupError):
            peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait()
        with self._lock:
            self.frozen.discard(peer.proc.pid)
        self.strikes.peer_kills += 1
        peer.proc = self.serve(peer.paths, peer.log)
        wait(peer.paths, peer.proc)

    def freeze_host(self, proc: subprocess.Popen[bytes], *, long: bool) -> None:
        """SIGSTOP, then SIGCONT after a while: ``long``, one to two leases (its workers stop
        themselves in time, the others take its runs, and it joins again with a new epoch);
        else up to half a lease."""
        if proc.poll() is not None:
            self.strikes.skipped += 1
            return
        with self._lock:
            if proc.pid in self.frozen:
                self.strikes.skipped += 1
                return
            self.frozen.add(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        self.strikes.host_freezes += 1
        span = (self.lease_s, 2 * self.lease_s) if long else (0.1, self.lease_s / 2)
        self._later(self.rng.uniform(*span), lambda: self._thaw_host(proc))

    def _thaw_host(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self.frozen.discard(proc.pid)
        if proc.poll() is None:  # a killed one is waited for: its pid is not signalled again
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)

    def strike_worker(self, primary: subprocess.Popen[bytes], *, freeze: bool) -> bool:
        hosts = [primary, *(p.proc for p in self.peers if p.proc is not None)]
        workers = [w for host in hosts for w in workers_of(host.pid)]
        if not workers:
            return False
        worker = self.rng.choice(workers)
        with contextlib.suppress(psutil.Error):  # psutil checks it is still the same process
            if freeze:
                worker.suspend()
                self.strikes.worker_freezes += 1
                self._later(self.rng.uniform(0.1, self.lease_s), lambda: _resume(worker))
            else:
                worker.kill()
                self.strikes.peer_worker_kills += 1
            return True
        return False

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(delay_s, action)
        timer.daemon = True
        self._thaws.append(timer)
        timer.start()

    def thaw_all(self) -> None:
        """Every frozen host and worker goes on now (before the end is judged)."""
        for timer in self._thaws:
            timer.cancel()
            if timer.function is not None:
                timer.function()
        self._thaws.clear()

    def stop(self) -> None:
        self.thaw_all()
        for peer in self.peers:
            if peer.proc is not None and peer.proc.poll() is None:
                peer.proc.send_signal(signal.SIGTERM)
                try:
                    peer.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill_group(peer.proc)

    def cleanup(self) -> None:
        self.thaw_all()
        for peer in self.peers:
            if peer.proc is not None and peer.proc.poll() is None:
                kill_group(peer.proc)

    def summary(self, primary_log: Path) -> dict[str, int]:
        """What was done, and how often a host stopped its work because it could not renew
        in time (``fenced``) and joined again with a new epoch (``rejoined``)."""
        s = self.strikes
        logs = [primary_log, *(p.log for p in self.peers)]
        text = "".join(log.read_text(errors="replace") for log in logs if log.exists())
        return {"hosts": len(self.peers) + 1, "peer_kills": s.peer_kills, "host_freezes": s.host_freezes,
                "worker_freezes": s.worker_freezes, "peer_worker_kills": s.peer_worker_kills,
                "unexpected_peer_exits": s.unexpected_peer_exits, "strikes_skipped": s.skipped,
                "fenced": text.count("could not be renewed for"),
                "rejoined": text.count("joined again at epoch")}


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    import os

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _resume(worker: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        worker.resume()


def workers_of(host_pid: int) -> list[psutil.Process]:
    """A host's workers, spawned by it or forked by its template (not the template itself)."""
    try:
        children = psutil.Process(host_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for process in children:
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline())
            if "piwf.worker" in command and not ("forkserver" in command and process.ppid() == host_pid):
                found.append(process)
    return found
