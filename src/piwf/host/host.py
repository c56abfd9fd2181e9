"""``piwf serve``: the nursery tree of DESIGN.md §3.

    launcher             the fork-server template; outlives the runs (their exit reports);
                         a standby (--standby) starts it first, then waits for the host lock
    group syncer         at full durability, one fsync of the WAL for every commit before
                         it; answers wait for it (store.serve: store/sqlite/group.py); outlives the drain
    notifier             sd_notify, under systemd: READY=1 once serving, STATUS=, WATCHDOG=1,
                         STOPPING=1 when a drain starts; outlives the host scope (pings
                         go on through the drain)
    host scope
    ├── heartbeat        renews the host lease; on loss stops the host (on a shared store:
    │                    past its bound the host's work is stopped and it joins again, host/fence.py)
    ├── stop watcher     SIGTERM, SIGINT or host.stop: cancel the host scope (drain)
    │                    with reason hostStopping and a deadline for all cleanup
    ├── socket server    one task per connection (on the socket systemd passed, if it did)
    ├── deadline timer   closes interaction requests at their deadline (sleeps until the nearest)
    ├── run dispatcher   claims runs in batches
    │   ├── claim renewer    every active claim, one transaction; a lost one cancels its run
    │   └── run supervisor   one per active run, in its own scope: the worker process
    ├── controller dispatcher  claims due resources (host/reconcile_lane.py)
    │   ├── claim renewer, child watcher
    │   └── reconcile supervisor   one per reconcile, in its own scope: the worker process
    └── peer watcher     takes over the dead hosts on this machine sharing the store (host/peers.py)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
import math
import os
import signal
import time

import trio
import trio_util

from piwf.clock import Clock, WallClock
from piwf.errors import HostAlreadyRunning, PiwfError, SchemaError
from piwf.paths import StatePaths
from piwf.status import StopReason
from piwf.store.api import record as store_record
from piwf.store.api import Store, Wakeup, open_store
from piwf.store.api.rules import RETENTION_MS
from piwf import faults, logs, processes
from piwf.host.fork_launcher import ForkLauncher
from piwf.host.launcher import fork_available
from piwf.host.lock import HostLock, standing_by
from piwf.host.notify import Notifier, open_notifier
from piwf.host.peers import recorded_standby, serve_peers
from piwf.host import fence
from piwf.host.deadlines import serve_deadlines
from piwf.host.reconcile_lane import serve_controllers
from piwf.host.retention import serve_retention
from piwf.host.run_lane import serve_dispatcher
from piwf.host.server import Listening, adopt_listener, check_socket_path, open_listener, serve_socket
from piwf.host.state import HostConfig, HostState, log
from piwf.host.worker_process import reap_registered



class Host:
    def __init__(self, config: HostConfig, *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or WallClock()

    async def serve(self, *, task_status: trio.TaskStatus[HostState] = trio.TASK_STATUS_IGNORED) -> None:
        paths = self.config.state_dir
        paths.ensure()
        check_socket_path(paths.socket)  # before anything is written: a refusal leaves the state as it was
        inherited = None if self.config.listen_fd is None else adopt_listener(self.config.listen_fd, paths.socket)
        try:
            await self._serve_locked(task_status, inherited)
        finally:
            if inherited is not None:  # closes this process's descriptor only: systemd keeps its own
                inherited.listener.socket.close()

    async def _serve_locked(self, task_status: trio.TaskStatus[HostState],
                            inherited: Listening | None) -> None:
        serving: list[HostState] = []  # the launcher's drain deadline is the host's, once there is one
        held: list[HostLock] = []
        refused: PiwfError | None = None  # raised as it is (not in a group): the CLI prints its one line
        try:
            # The launcher outlives the runs (stopping a forked worker needs its exit report);
            # a standby starts it before waiting for the lock, so it is warm when it takes over.
            async with trio.open_nursery() as outer:
                warm = await self._start_launcher(outer, serving) if self.config.standby else None
                try:
                    host = await self._take_state(held)
                except PiwfError as exc:
                    refused = exc
                    outer.cancel_scope.cancel()
                if refused is None and host is not None:
                    serving.append(host)
                    host.launcher = warm or await self._start_launcher(outer, serving) or host.launcher
                    await outer.start(host.store.serve)  # outlives the drain: its answers wait on it too
                    try:
                        await self._serve_runs(host, task_status, inherited)
                    finally:
                        outer.cancel_scope.cancel()
                    log.info("stopped")
                    refused = host.stopped_on
                else:
                    outer.cancel_scope.cancel()
        finally:
            logs.set_epoch(None)
            with trio.CancelScope(shield=True):
                for host in serving:
                    await host.store.close()
            for lock in held:
                lock.release()
        if refused is not None:
            raise refused

    async def _take_state(self, held: list[HostLock]) -> HostState | None:
        """Take the lock (a standby waits for it: None if told to stop first), open the
        database and take over; the lock goes into ``held`` as soon as it is taken."""
        paths = self.config.state_dir
        pid = os.getpid()
        identity = processes.identity(pid) or f"pid:{pid}"
        lock = await self._lock(paths, {"pid": pid, "identity": identity})
        if lock is None:
            return None
        held.append(lock)
        store = await _open_store(paths, self.config)  # refuses a damaged one unwritten
        host = HostState(self.config, store, self.clock)
        try:
            await _owner_exited(host, pid)
            await _take_over(host, pid, identity)
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.close()
            raise
        logs.set_epoch(host.epoch)  # the store's serve, started next, makes commits share fsyncs
        return host

    async def _start_launcher(self, nursery: trio.Nursery, serving: list[HostState]) -> ForkLauncher | None:
        if not fork_available():  # elsewhere the host spawns workers itself (SpawnLauncher)
            return None
        launcher = ForkLauncher(lambda: serving[0].drain_deadline if serving else math.inf,
                                exec_worker=self.config.worker_start == "spawn")
        await nursery.start(launcher.serve)
        return launcher

    async def _lock(self, paths: StatePaths, record: dict[str, object]) -> HostLock | None:
        """The host lock; a standby waits for it (None if it is told to stop first)."""
        if not self.config.standby:
            return HostLock.acquire(paths, record)
        async with recorded_standby(self.config, self.clock, int(str(record["pid"])), str(record["identity"])):
            return await _stand_by(paths, record)

    async def _serve_runs(self, host: HostState, task_status: trio.TaskStatus[HostState],
                          inherited: Listening | None) -> None:
        """``inherited``: the socket systemd bound (socket activation), served as it is."""
        config = self.config
        listening = inherited or await open_listener(config.state_dir.socket)
        notifier = Notifier(config.notify_socket, config.watchdog_s)
        async with open_notifier(notifier, host):
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_stop, host, nursery.cancel_scope)
                    nursery.start_soon(_heartbeat, host)
                    nursery.start_soon(_prune_commands, host)
                    await nursery.start(host.store.serve_wakeups, host.woken)  # other hosts' work
                    await nursery.start(serve_retention, host)
                    await nursery.start(serve_dispatcher, host)
                    await nursery.start(serve_deadlines, host)
                    await nursery.start(serve_controllers, host)
                    await nursery.start(serve_peers, host)  # dead peers on this machine: taken over at once
                    await nursery.start(serve_socket, host, listening)
                    log.info("serving %s at epoch %d (max %d workers)%s", config.state_dir.socket, host.epoch,
                             config.max_workers, "" if inherited is None else " on the inherited socket")
                    notifier.ready(host)  # the socket accepts and the takeover is done
                    task_status.started(host)
            finally:
                notifier.stop(host)
                _start_drain(host)  # however the host scope ended: a stop, a lost lease, a parent's cancel
                with trio.CancelScope(shield=True, deadline=host.drain_deadline):
                    await listening.aclose()  # unlinks the socket file only if it is the one bound here
                    await _release(host)


async def _stand_by(paths: StatePaths, record: dict[str, object]) -> HostLock | None:
    """Wait for the lock, or for SIGTERM/SIGINT (then None)."""
    taken: list[HostLock] = []
    since = {"since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals, standing_by(paths, {**record, **since}):
        # Said once its record is written: a reader of the log then finds the standby in status.
        log.info("standing by: %s is served by another host; taking over when it stops", paths.root)
        async with trio.open_nursery() as nursery:
            async def take() -> None:
                taken.append(await HostLock.wait(paths, record))
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
            async for signum in signals:
                log.info("received %s while standing by; stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    if taken:
        log.info("the lock is free: taking over %s", paths.root)
    return taken[0] if taken else None


async def _open_store(paths: StatePaths, config: HostConfig) -> Store:
    """The state directory's SQLite database, or the store at ``config.store_url`` (opened in
    a thread: it connects over the network), recorded in the state directory without its
    password so that ``piwf status`` finds it with no host running."""
    url = config.store_url
    if url is None:
        store_record.forget(paths)
        return open_store(paths, durability=config.durability)
    store = await trio.to_thread.run_sync(
        lambda: open_store(paths, durability=config.durability, url=url, listen=config.store_listen))
    store_record.write(paths, url)
    log.info("store: %s", store_record.redact(url))
    return store


OWNER_EXIT_S = 2.0  # how long a lease owner that has let go of the lock may take to finish dying


async def _owner_exited(host: HostState, pid: int) -> None:
    """Holding the lock, wait (briefly) for the lease owner to be gone.

    The owner holds the lock until it exits (or until after it released the lease, when
    it stops cleanly), so an owner still there has let go of it and is exiting: a killed
    process closes its files before it becomes a zombie, and a standby waiting on the lock
    is woken in between."""
    previous = await host.store.hosts.read_lease()
    if previous.pid is None or previous.pid == pid:
        return
    with trio.move_on_after(OWNER_EXIT_S):
        while processes.alive(previous.pid, previous.identity) and previous.live(host.now()):
            await trio.sleep(0.001)


async def _take_over(host: HostState, pid: int, identity: str) -> None:
    """Take the lease with a new epoch and recover whatever the previous host left.

    Holding the flock proves no other host runs here; the lease owner is taken to be
    dead unless its recorded pid still carries its recorded start identity.
    """
    now, store = host.now(), host.store
    previous = await store.hosts.read_lease()
    owner_alive = previous.pid is not None and previous.pid != pid and processes.alive(previous.pid, previous.identity)
    if owner_alive and previous.live(now):
        raise HostAlreadyRunning(f"the host with pid {previous.pid} still holds the lease")
    began = trio.current_time()
    host.lease = await store.hosts.acquire_lease(host_id=host.host_id, pid=pid, identity=identity,
                                                 lease_ms=host.config.host_lease_ms, now=now, owner_dead=True)
    host.lease_good_until = fence.good_until(began, host.config.host_lease_ms)
    await store.placement.serve_queues(host.host_id, host.config.queues, now)
    reclaimed = await store.queue.expire_claims_before(host.epoch, now)
    for worker_id, worker_pid, worker_identity in await store.workers.orphan_before(host.epoch, now):
        if processes.kill_recorded_group(worker_pid, worker_identity):
            log.info("killed orphaned worker %s (pid %d)", worker_id, worker_pid)
    await reap_registered(host, await store.workers.orphaned_processes(host.epoch))
    faults.point("host.takeover.committed")
    if previous.host_id is not None:
        log.info("took over from epoch %d; %d run(s) to claim again", previous.epoch, len(reclaimed))


async def _watch_stop(host: HostState, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_first_signal, signals, host)
            await host.stop_requested.wait()
            log.info("draining: stopping %d worker(s), parking their runs", len(host.active))
            _start_drain(host)
            scope.cancel(reason=StopReason.HOST_STOPPING)


def _start_drain(host: HostState) -> None:
    """From now on every cleanup (stopping workers, parking runs) ends by one deadline."""
    host.drain_deadline = min(host.drain_deadline, trio.current_time() + host.config.drain_timeout_s)


async def _first_signal(signals: AsyncIterator[int], host: HostState) -> None:
    async for signum in signals:
        log.info("received %s", signal.Signals(signum).name)
        host.stop_requested.set()
        return


async def _heartbeat(host: HostState) -> None:
    async with contextlib.aclosing(trio_util.periodic(fence.renew_period_s(host.config.host_lease_ms))) as ticks:
        async for _ in ticks:
            if not fence.lease_good(host):
                await _rejoin(host)
            elif not await _renew_lease(host):
                return


async def _renew_lease(host: HostState) -> bool:
    """Renew the host lease; False once it is lost (the host then stops; on a shared store
    it joins again instead, with a new epoch)."""
    assert host.lease is not None
    began = trio.current_time()  # the lease's new expiry is this transaction's now + the lease
    try:
        renewed = await host.store.hosts.renew_lease(host.lease, host.config.host_lease_ms, host.now())
    except SchemaError as exc:  # another host migrated the shared store past this piwf's layout
        log.error("%s", exc)
        host.stopped_on = exc  # it drains (its runs parked for the newer hosts), then exits with it
        host.stop_requested.set()
        return False
    except PiwfError as exc:
        log.warning("lease renewal failed (%s); will retry", exc)
        return True
    if renewed is None and host.fenced:
        log.error("the host lease was lost; stopping this host's work to join again with a new epoch")
        host.lease_good_until = -math.inf
        host.fence_changed.set()
        return True
    if renewed is None:
        log.error("the host lease was lost; stopping")
        host.stop_requested.set()
        return False
    host.lease = renewed
    host.lease_good_until = max(host.lease_good_until, fence.good_until(began, host.config.host_lease_ms))
    host.fence_changed.set()
    faults.point("host.lease.renewed")
    return True


async def _rejoin(host: HostState) -> None:
    """A host whose lease went past its bound (it could not renew it: a partition, a frozen
    host) has had its work stopped by the fence; once all of it has left, it takes its lease
    again with a new epoch, ends what its earlier epochs held (its claims, as a takeover
    does) and claims again. Until the store answers it tries at every tick."""
    if host.active or host.controllers.active:
        return  # the fence is stopping them; their ends are recorded first (or kept for a retry)
    pid = os.getpid()
    identity = processes.identity(pid) or f"pid:{pid}"
    began, previous = trio.current_time(), host.epoch
    try:
        lease = await host.store.hosts.acquire_lease(host_id=host.host_id, pid=pid, identity=identity,
                                                     lease_ms=host.config.host_lease_ms, now=host.now(),
                                                     owner_dead=True)
        host.lease = lease
        host.lease_good_until = fence.good_until(began, host.config.host_lease_ms)
        runs = await host.store.queue.expire_claims_before(lease.epoch, host.now())
        reconciles = await host.store.controller_queue.expire_claims_before(lease.epoch, host.now())
    except PiwfError as exc:
        log.warning("cannot join again yet (%s); will retry", exc)
        return
    logs.set_epoch(host.epoch)
    host.fence_changed.set()
    log.warning("joined again at epoch %d (was %d) after the lease could not be renewed in time; "
                "%d run(s) and %d reconcile(s) of the earlier epoch released", host.epoch, previous, len(runs),
                reconciles)
    host.wake()
    host.controllers.wake()


async def _prune_commands(host: HostState) -> None:
    """Forget logged commands older than the retention window, what was delivered to the
    sessions of ended runs as long ago, and the stored answers of ended runs' workers (a
    backstop: they are forgotten as each run's worker ends), hourly and at start."""
    async with contextlib.aclosing(trio_util.periodic(host.config.prune_interval_s)) as ticks:
        async for _ in ticks:
            try:
                pruned = await host.store.commands.prune(host.now(), host.config.command_retention_ms)
                delivered = await host.store.delivery.prune(host.now(), RETENTION_MS)
            except PiwfError as exc:
                log.warning("could not prune the command log: %s", exc)
                continue
            if pruned:
                log.info("pruned %d command(s) older than the retention window", pruned)
            if delivered:
                log.info("forgot %d delivered notification(s), resolved turn(s) and follow-up(s) of ended runs",
                         delivered)
            await _prune_worker_messages(host)


async def _prune_worker_messages(host: HostState) -> None:
    """In batches, letting the host serve in between (a database from before layout 4 may
    hold hundreds of megabytes of them)."""
    total = 0
    while True:
        try:
            pruned = await host.store.workers.prune_messages()
        except PiwfError as exc:
            log.warning("could not prune stored worker answers: %s", exc)
            return
        if not pruned:
            break
        total += pruned
        await trio.sleep(0)
    if total:
        log.info("forgot %d stored worker answer(s) of ended runs", total)


async def _release(host: HostState) -> None:
    if host.lease is None:
        return
    # the runs and resources this host parked and released are the other hosts' now
    host.store.announce(Wakeup.RUNS)
    host.store.announce(Wakeup.CONTROLLERS)
    try:
        await host.store.hosts.release_lease(host.lease)
    except PiwfError as exc:
        log.error("could not release the host lease: %s", exc)
