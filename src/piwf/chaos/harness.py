"""``python -m piwf.chaos``: run workflows and controllers while killing the host and its workers.

Starts a host on a temporary state directory, submits ``--runs`` runs of a workflow with
shell nodes and effects (the outside world is a ledger file), and meanwhile kills
``--kills`` times at random: SIGKILL of the host, SIGKILL of a worker, or a host started
with a fault point that makes it exit at a commit or reply boundary. Clients retry with the
same request ids, as they should. With ``--power-cuts N``, N of the host kills are power
cuts instead (``piwf.store.sqlite.powercut``: the host, its workers and its standby die at
once, and writes not yet synced are thrown away as a disk losing power may). With
``--standby`` a ``piwf serve --standby`` always waits beside the live host: a killed host
is replaced by it, and a new standby started. One run in ``--hostile-every`` is a hostile
workflow instead: its node exits early with status 0 or 3, kills its parent, or returns an
output over the limit. With ``--hosts N`` (and a ``--store`` they share) N hosts serve
at once, and the kills also SIGKILL any of them and SIGSTOP hosts and workers for a while
(``piwf.chaos.hosts``). Each chaos run notifies its own session (and so gets a turn when it
ends). Afterwards it plays the operator for effects held as ambiguous (the ledger says what
happened), waits for every run, and prints one JSON summary on stdout: no run lost or done
twice, each run's notification and turn stored exactly once, every hostile run held or
failed with its reason, and the host never exiting but when killed; with ``--resources``
(``piwf.chaos.controllers``) every controller resource converged and no effect of a
reconcile applied twice. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from piwf.chaos import ledger, people
from piwf.chaos.common import Tally
from piwf.chaos.controllers import ControllerChaos, bad as controllers_bad
from piwf.chaos.hosts import Fleet, workers_of
from piwf.chaos.options import parse_args
from piwf.chaos.people import Person
from piwf.client import Client, Reply, make_request
from piwf.errors import HostUnavailable
from piwf.faults import POINTS
from piwf.paths import StatePaths
from piwf.store.sqlite import Database
from piwf.wire import HostRequest

WORKFLOW = """
    import os
    import time
    from pathlib import Path
    from piwf import Workflow, compute, shell
    from piwf.chaos import ledger

    LEDGER = Path(os.environ["PIWF_CHAOS_LEDGER"])

    def effect(ctx, key, observable):
        apply, observe = ledger.effect(LEDGER, f"{ctx.run_id} {key}", "done")
        return ctx.effect(key, apply, observe if observable else None)

    workflow = Workflow(
        name="chaos",
        start_at="prepare",
        nodes={
            "prepare": shell(["sh", "-c", "sleep 0.05; echo prepared"]),
            "work": compute(lambda ctx: ctx.notify("working") or time.sleep(ctx.input["pause"])
                            or {"worked": ctx.input["pause"]}),
            "charge": compute(lambda ctx: effect(ctx, "charge", observable=True)),
            "notify": compute(lambda ctx: effect(ctx, "notify", observable=ctx.input["observeNotify"])),
            "finish": shell(["echo", "finished"]),
        },
        edges=[("prepare", "work"), ("work", "charge"), ("charge", "notify"), ("notify", "finish")],
    )
"""

HOSTILE = """
    import os
    import signal
    from piwf import Workflow, compute

    def misbehave(ctx):
        kind = ctx.input["kind"]
        if kind == "exit0":
            os._exit(0)  # ends before its run did: a crash, not a success
        if kind == "exit3":
            os._exit(3)
        if kind == "parricide":
            os.kill(os.getppid(), signal.SIGKILL)  # its parent is the fork server, never the host
            os._exit(1)
        return "x" * (5 * 1024 * 1024)  # oversized: over the 4 MiB output limit

    workflow = Workflow(name="hostile", start_at="misbehave", nodes={"misbehave": compute(misbehave)})
"""
HOSTILE_KINDS = ("exit0", "exit3", "parricide", "oversized")

# Host-side points only: a worker point would fire in every worker of that host.
HOST_POINTS = sorted(p for p in POINTS if p.startswith("host."))


class Chaos:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = root
        self.paths = StatePaths.resolve(root / "state")
        self.project = root / "project"
        self.ledger = root / "ledger.txt"
        self.log = root / "host.log"
        self.host: subprocess.Popen[bytes] | None = None
        self.fault_armed = False
        self.standby: subprocess.Popen[bytes] | None = None  # with --standby: waiting on the lock
        self.standby_fault = False
        self.tally = Tally()
        self.lock = threading.Lock()
        self.settled = threading.Event()  # every run settled: the person stops
        self.person = Person(self, random.Random(args.seed + 1))  # its own draws: the others' stay the seed's
        self.controllers = ControllerChaos(self)
        self.fleet = Fleet(root, args.hosts, lambda paths, log: self._serve(None, paths=paths, log=log), args.lease,
                           random.Random(args.seed + 2)) if args.hosts > 1 else None

    # --- the host ---

    def _serve(self, fault: str | None, *extra: str, paths: StatePaths | None = None,
               log: Path | None = None) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PIWF_CHAOS_LEDGER": str(self.ledger), **self.controllers.env()}
        env.pop("PIWF_FAULT", None)
        if self.args.power_cuts:
            env["PIWF_POWER_CUT"] = str(self.rng.randrange(2**32))
        if fault:
            env["PIWF_FAULT"] = fault
        lease = ("--lease", str(self.args.lease)) if self.args.hosts > 1 else ()
        with open(log or self.log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "piwf", "serve", "--state-dir", str((paths or self.paths).root),
                 "--max-workers", str(self.args.max_workers), "--durability", self.args.durability,
                 *(("--store", self.args.store) if self.args.store else ()), *lease, *extra],
                stdout=out, stderr=out, env=env, start_new_session=True,
            )

    def start_standby(self) -> None:
        """A standby, once it says it stands by (so a takeover's time is a warm one's)."""
        fault = self.random_fault()
        self.standby, self.standby_fault = self._serve(fault, "--standby"), fault is not None
        said = f'"pid": {self.standby.pid}'
        deadline = time.monotonic() + 30
        while not any("standing by" in line and said in line for line in self.log.read_text().splitlines()):
            if self.standby.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not stand by; see {self.log}")
            time.sleep(0.01)

    def promote_standby(self) -> None:
        """The live host is gone: the standby takes over; a new standby waits behind it."""
        assert self.standby is not None
        began = time.monotonic()
        self.host, self.fault_armed = self.standby, self.standby_fault
        self.standby = None
        self.tally.standby_takeovers += 1
        self._wait_serving(began, None)
        self.start_standby()

    def random_fault(self) -> str | None:
        if self.rng.random() < 0.5:
            return f"{self.rng.choice(HOST_POINTS)}:exit:{self.rng.randint(1, 40)}"
        return None

    def start_host(self, fault: str | None = None) -> None:
        self.fault_armed = fault is not None
        self.host = self._serve(fault)
        self._wait_serving(time.monotonic(), fault)

    def _wait_serving(self, began: float, fault: str | None) -> None:
        assert self.host is not None
        while not self._answers():
            if self.host.poll() is not None:
                if self.fault_armed:  # the fault fired during start-up (takeover): that is a kill too
                    self.tally.fault_exits += 1
                    return self.replace_host()
                raise RuntimeError(f"host exited with {self.host.returncode}; see {self.log}")
            if time.monotonic() - began > 30:
                raise RuntimeError(f"host not serving after 30 s; see {self.log}")
            time.sleep(0.005)
        self.tally.takeover_ms.append((time.monotonic() - began) * 1000)
        return None

    def replace_host(self, fault: str | None = None) -> None:
        if self.standby is not None and self.standby.poll() is None:
            self.promote_standby()
        else:
            self.start_host(fault)

    def _wait_peer(self, paths: StatePaths, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 30
        while not self._answers(paths):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a host of --hosts did not start (exit {proc.returncode}); see {self.root}")
            time.sleep(0.005)

    def _answers(self, paths: StatePaths | None = None) -> bool:
        try:
            with Client(paths or self.paths, timeout=5) as client:
                return client.call("host.status").outcome == "accepted"
        except (HostUnavailable, OSError):
            return False

    def ensure_host(self) -> None:
        """Restart the host if a fault point made it exit (or, counted as a failure, anything else)."""
        assert self.host is not None
        if self.host.poll() is not None:
            if self.fault_armed:
                self.tally.fault_exits += 1
            else:
                self.tally.unexpected_host_exits += 1
            self.replace_host()
        if self.fleet is not None:
            self.fleet.ensure(self._wait_peer)

    def kill_host(self) -> None:
        assert self.host is not None
        with contextlib.suppress(ProcessLookupError):
            self.host.send_signal(signal.SIGKILL)
        self.host.wait()
        self.tally.host_kills += 1
        self.replace_host(self.random_fault())

    def power_cut(self) -> None:
        """SIGUSR2: the host's VFS cuts the power at one of its next file operations (its
        workers die with it, and the standby on the same machine too)."""
        assert self.host is not None
        self.stop_standby()
        with contextlib.suppress(ProcessLookupError):
            self.host.send_signal(signal.SIGUSR2)
        try:
            self.host.wait(timeout=10)
        except subprocess.TimeoutExpired:  # the cut never came: counted, and the host killed
            self.tally.power_cut_failures += 1
            self.host.send_signal(signal.SIGKILL)
            self.host.wait()
        self.tally.power_cuts += 1
        self.replace_host(self.random_fault())

    def kill_worker(self) -> bool:
        assert self.host is not None
        workers = workers_of(self.host.pid)
        if not workers:
            return False
        with contextlib.suppress(psutil.Error):
            self.rng.choice(workers).send_signal(signal.SIGKILL)
            self.tally.worker_kills += 1
            return True
        return False

    # --- clients ---

    def request(self, request: HostRequest, deadline_s: float = 120.0) -> Reply:
        """Send until answered, retrying the same request across host deaths."""
        deadline = time.monotonic() + deadline_s
        while True:
            for paths in self.targets():
                try:
                    with Client(paths, timeout=30) as client:
                        response = client.send(request)
                    if response.outcome != "unavailable":
                        return response
                except (HostUnavailable, OSError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{request.operation} unanswered for {deadline_s} s")
            time.sleep(0.01)

    def targets(self) -> list[StatePaths]:
        """The host to ask first, then the others (with --hosts: any host answers any request)."""
        if self.fleet is None:
            return [self.paths]
        return self.fleet.targets(self.paths, self.host.pid if self.host is not None else None)

    def submit_all(self) -> None:
        for index in range(self.args.runs):
            hostile = self.args.hostile_every and index % self.args.hostile_every == self.args.hostile_every - 1
            kind = HOSTILE_KINDS[index // self.args.hostile_every % len(HOSTILE_KINDS)] if hostile else None
            loop = not kind and self.args.loop_every and index % self.args.loop_every == self.args.loop_every - 1
            payload = {"workflow": "hostile", "projectPath": str(self.project), "input": {"kind": kind}} if kind else {
                "workflow": "chaos", "projectPath": str(self.project), "originSessionId": f"chaos-{index}",
                "input": {"index": index, "observeNotify": index % 2 == 0, "pause": round(self.rng.uniform(0, 0.3), 3)}}
            if loop:
                payload = {"workflow": "loop", "projectPath": str(self.project), "input": {"index": index}}
            request = make_request("run.start", client_id="chaos", idempotency_key=f"chaos-{index}",
                                   request_id=f"chaos-{index}", payload=payload)
            response = self.request(request)
            if response.outcome not in ("accepted", "adopted"):
                raise RuntimeError(f"run.start {index}: {response.outcome}: {response.error}")
            with self.lock:
                self.tally.accepted[index] = response.receipt["runId"]
                if kind:
                    self.tally.hostile[response.receipt["runId"]] = kind
                if loop:
                    self.tally.loop_runs.add(response.receipt["runId"])
            time.sleep(self.rng.uniform(0, 0.03))

    def call(self, operation: str, **kwargs: Any) -> Any:
        response = self.request(make_request(operation, client_id="chaos", **kwargs))
        if response.outcome not in ("accepted", "adopted"):
            raise RuntimeError(f"{operation}: {response.outcome}: {response.error}")
        return response.receipt

    # --- the run ---

    def run(self) -> dict[str, Any]:
        self.project.joinpath(".piwf", "workflows").mkdir(parents=True)
        for name, source in (("chaos", WORKFLOW), ("hostile", HOSTILE), ("loop", people.LOOP)):
            if self.args.warm_workers:  # every workflow's runs share warm worker processes
                source = source.replace("workflow = Workflow(", "workflow = Workflow(reuse_worker=True, ")
            self.project.joinpath(".piwf", "workflows", f"{name}.py").write_text(textwrap.dedent(source))
        self.controllers.install()
        self.start_host()
        self.tally.takeover_ms.clear()  # the first start is not a takeover
        if self.fleet is not None:
            self.fleet.start(self._wait_peer)
        if self.args.standby:
            self.start_standby()
        submitter = threading.Thread(target=self.submit_all, name="submitter", daemon=True)
        submitter.start()
        threading.Thread(target=self.person.run, name="person", daemon=True).start()
        applier = threading.Thread(target=self.controllers.apply_all, name="applier", daemon=True)
        applier.start()
        cuts = set(self.rng.sample(range(self.args.kills), self.args.power_cuts)) if self.args.power_cuts else set()
        freezes = set(self.rng.sample(sorted(set(range(self.args.kills)) - cuts), self.args.freezes))
        started = 0
        for kill in range(self.args.kills):
            time.sleep(self.rng.uniform(0.05, 0.5))
            self.ensure_host()
            started = self.wait_for_a_start(submitter, started)
            assert self.host is not None
            if kill in cuts:
                self.power_cut()
            elif self.fleet is not None and kill in freezes:
                self.fleet.freeze_one(self.host, long=True)
            elif self.fleet is not None and (self.rng.random() < 0.6 or self.fleet.is_frozen(self.host)):
                self.fleet.strike(self.host, self._wait_peer)  # a frozen host is left to join again
            elif self.rng.random() < 0.5 or not self.kill_worker():
                self.kill_host()
        while submitter.is_alive():  # a fault armed by the last kill may still stop the host
            self.ensure_host()
            submitter.join(0.05)
        while applier.is_alive():
            self.ensure_host()
            applier.join(0.05)
        self.ensure_host()
        self.restart_clean()
        return self.settle_and_summarize()

    def wait_for_a_start(self, submitter: threading.Thread, before: int) -> int:
        """Until a run.start more than ``before`` was answered (or the submitter is done):
        a host killed before any request got through tests nothing, and on a loaded machine
        a new host's first run.start (it loads the workflow) can take longer than the pause
        between kills, every time. Returns how many are answered now."""
        deadline = time.monotonic() + 120
        while submitter.is_alive() and len(self.tally.accepted) <= before and time.monotonic() < deadline:
            self.ensure_host()
            time.sleep(0.01)
        return len(self.tally.accepted)

    def restart_clean(self) -> None:
        """The last host runs without faults: the end state must be reachable by itself."""
        assert self.host is not None
        self.stop_standby()
        if self.fleet is not None:
            self.fleet.thaw_all()
        if self.host.poll() is None:
            self.host.send_signal(signal.SIGKILL)
            self.host.wait()
        self.start_host()

    def settle_and_summarize(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.args.timeout
        final: dict[str, dict[str, Any]] = {}
        for run_id in self.tally.accepted.values():
            final[run_id] = self.wait_run(run_id, deadline)
        self.settled.set()
        summary = self.summarize(final) | self.person.summary(final)
        summary.update(self.controllers.settle(deadline))
        if self.fleet is not None:
            summary.update(self.fleet.summary(self.log))
            summary["unexpected_host_exits"] += summary["unexpected_peer_exits"]
        self.stop_host()
        summary["integrity_check"] = self.integrity()
        summary["warm_reuses"] = self.warm_reuses()
        return summary

    def wait_run(self, run_id: str, deadline: float) -> dict[str, Any]:
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            run: dict[str, Any] = self.call("run.wait", run_id=run_id, payload={"timeoutMs": min(left_ms, 600_000)})
            if run.get("hold") == "effect":
                self.tally.ambiguous_runs.add(run_id)
                self.resolve(run)
                continue
            if run["status"] == "waiting" and left_ms > 0:  # for the person: ask again
                time.sleep(0.02)
                continue
            if run["atRest"] or left_ms == 0:
                return run

    def resolve(self, run: dict[str, Any]) -> None:
        """The operator's part: the ledger says whether each ambiguous effect was applied."""
        entries = set(ledger.entries(self.ledger))
        for effect in run["effects"]:
            if effect["status"] != "ambiguous":
                continue
            entry = f"{run['runId']} {effect['key']}"
            applied = entry in entries
            self.call("effect.resolve", run_id=run["runId"],
                      payload={"key": effect["key"], "applied": applied,
                               "result": {"done": entry} if applied else None})

    def summarize(self, final: dict[str, dict[str, Any]]) -> dict[str, Any]:
        known = {r["runId"] for r in self.call("run.list", payload={"limit": 1000})}
        applied = Counter(ledger.entries(self.ledger))
        status = self.call("host.status")
        takeover = self.tally.takeover_ms or [0.0]
        normal = {run_id: run for run_id, run in final.items() if run_id not in self.tally.hostile}
        hostile = {run_id: run for run_id, run in final.items() if run_id in self.tally.hostile}
        return {
            "runs": self.args.runs,
            "kills": self.args.kills,
            "host_kills": self.tally.host_kills,
            "worker_kills": self.tally.worker_kills,
            "fault_exits": self.tally.fault_exits,
            "unexpected_host_exits": self.tally.unexpected_host_exits,
            "runs_lost": sum(1 for run_id in self.tally.accepted.values() if run_id not in known)
            + (self.args.runs - len(self.tally.accepted)),
            "runs_duplicated": len(known) - len(set(self.tally.accepted.values())),
            "runs_completed": sum(1 for r in normal.values() if r["status"] == "completed"),
            "runs_failed": sum(1 for r in normal.values() if r["status"] in ("failed", "timed_out", "cancelled")),
            "runs_stuck": sum(1 for r in normal.values() if r["status"] not in
                              ("completed", "failed", "timed_out", "cancelled"))
            + sum(1 for r in hostile.values() if not _held_or_failed_with_reason(r)),
            "hostile_runs": dict(Counter(self.tally.hostile.values())),
            "hostile_held": sum(1 for r in hostile.values() if r["hold"] == "crashed"),
            "hostile_failed": sum(1 for r in hostile.values() if r["status"] == "failed"),
            "effects_applied": sum(applied.values()),
            "effects_applied_twice": sum(1 for count in applied.values() if count > 1),
            "runs_parked_ambiguous": len(self.tally.ambiguous_runs),
            **self.delivery_summary(normal),
            "lifecycle_contradictions": status["lifecycleContradictions"],
            "standby_takeovers": self.tally.standby_takeovers,
            **self.power_summary(),
            "takeover_ms": {"p50": round(statistics.median(takeover), 1), "max": round(max(takeover), 1),
                            "count": len(self.tally.takeover_ms)},
        }

    def power_summary(self) -> dict[str, int]:
        """Power cuts and what they threw away (each cut's line in the host log)."""
        cuts = [json.loads(line)["powerCut"] for line in self.log.read_text(errors="replace").splitlines()
                if line.startswith('{"powerCut"')]
        return {"power_cuts": self.tally.power_cuts, "power_cut_failures": self.tally.power_cut_failures,
                "power_cut_blocks_dropped": sum(c["blocksDropped"] + c["blocksTorn"] for c in cuts)}

    def stop_standby(self) -> None:
        """Kill a waiting standby first (it would take over from the host being stopped)."""
        if self.standby is not None and self.standby.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.standby.pid, signal.SIGKILL)
            self.standby.wait()
        self.standby = None

    def delivery_summary(self, normal: dict[str, dict[str, Any]]) -> dict[str, int]:
        """Each chaos run notified its session once (its work node, however often it ran)
        and left it exactly one turn (nobody delivers them here)."""
        page = self.call("delivery.list", payload={"limit": 1000})
        notes = Counter(n["runId"] for n in page["notifications"])
        turns = Counter(t["runId"] for t in page["turns"])
        chaos_runs = [r for r in normal if r not in self.tally.loop_runs]
        return {"notifications_missing": sum(1 for r in chaos_runs if notes[r] == 0),
                "notifications_duplicated": sum(1 for r in chaos_runs if notes[r] > 1),
                "turns_missing": sum(1 for r in chaos_runs if turns[r] == 0),
                "turns_duplicated": sum(1 for r in chaos_runs if turns[r] > 1)}

    def stop_host(self) -> None:
        self.stop_standby()
        if self.fleet is not None:
            self.fleet.stop()
        if self.host is None or self.host.poll() is not None:
            return
        self.host.send_signal(signal.SIGTERM)
        try:
            self.host.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.host.pid, signal.SIGKILL)
            self.host.wait()

    def integrity(self) -> str:
        if self.args.store:  # PostgreSQL checks its own files; what piwf checks is the runs above
            return "ok"
        db = Database.open_readonly(self.paths.db)
        try:
            return str(db.scalar("PRAGMA integrity_check"))
        finally:
            db.close()

    def warm_reuses(self) -> int:
        """Worker records that named a process an earlier record of the same host named too:
        runs handed to a warm worker (--warm-workers). Only the SQLite store is read."""
        if self.args.store:
            return 0
        db = Database.open_readonly(self.paths.db)
        try:
            return int(db.scalar("SELECT count(*) - count(DISTINCT host_epoch || ':' || pid) FROM run_workers "
                                 "WHERE pid IS NOT NULL"))
        finally:
            db.close()

    def cleanup(self) -> None:
        self.stop_standby()
        if self.fleet is not None:
            self.fleet.cleanup()
        if self.host is not None and self.host.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.host.pid, signal.SIGKILL)
            self.host.wait()


def _held_or_failed_with_reason(run: dict[str, Any]) -> bool:
    if run["status"] == "failed":
        return bool(run["error"] and run["error"].get("message"))
    return run["hold"] == "crashed" and bool(run["statusDetail"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="piwf-chaos-"))
    chaos = Chaos(args, root)
    print(f"piwf chaos: seed {args.seed}, {args.runs} runs, {args.kills} kills, in {root}", file=sys.stderr)
    try:
        summary = chaos.run()
    finally:
        chaos.cleanup()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary["seed"] = args.seed
    # What a client was answered `accepted` for and is missing at the end: runs started, answers given.
    summary["acknowledged_lost"] = summary["runs_lost"] + summary["answers_lost"]
    print(json.dumps(summary, sort_keys=True))
    bad = summary["runs_lost"] or summary["effects_applied_twice"] or summary["runs_stuck"] \
        or summary["runs_duplicated"] or summary["unexpected_host_exits"] or summary["integrity_check"] != "ok" \
        or summary["answers_lost"] or summary["answered_twice"] or summary["answers_refused"] \
        or summary["notifications_missing"] or summary["notifications_duplicated"] or summary["turns_missing"] \
        or summary["turns_duplicated"] or summary["power_cut_failures"] or controllers_bad(summary)
    return 1 if bad else 0

