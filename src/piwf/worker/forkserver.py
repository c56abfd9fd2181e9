"""``python -m piwf.worker.forkserver``: a template process that forks workers fast.

Starting ``python -m piwf.worker`` costs an interpreter start and the imports of msgspec
and the engine (about 80 ms here). The host keeps this one template process instead, with
those modules imported and no user code: for each run it forks a fresh child, which
leads a process group of its own (in the template's session, which has no controlling
terminal), takes the run's pipes as its descriptors,
its project as cwd and its environment, and runs the worker (or, with ``exec``, execs
a fresh ``python -m piwf.worker``: ``--worker-start spawn``). A run still gets a new
process and a new process group; only the start-up is shared. Either way the worker's
parent is this template, never the host: a node that kills its parent kills only the
template, which the host starts again. At its start, and once idle for ``SPARE_IDLE_S``
after a worker took its spare, the template forks the next child ahead of its run (a
spare, ``_fork_spare``), so that a claim's worker
needs no fork: the spare is handed the Fork and its descriptors on a socket of its own.

The template is single-threaded (forking a threaded process is unsafe). It speaks to the
host over a SOCK_SEQPACKET socket (descriptor ``$PIWF_FORKSERVER_FD``), one JSON message
per packet, descriptors passed with SCM_RIGHTS:

    host → template  Fork {id, cwd, env, execWorker}  + fds [to_worker_r, from_worker_w, output_w]
    template → host  TemplateReady                   once, at start
                     Forked {id, pid} | ForkFailed {id, error}
                     Exited {pid, returncode}        when a child ends (negative: its signal)
    host → template  Reap {pid}                      the host is done with that pid

(msgspec Structs in ``piwf.protocol.worker``, tagged by ``type``).

A child that has ended is left unreaped (a zombie) until the host says ``reap``: while
it is, its pid and the process group it names cannot be given to another process, so
the host may still signal that group without hitting a stranger. The template exits
when the host's end of the socket closes (its zombies are then reaped by init).
"""

from __future__ import annotations

import array
import base64
import contextlib
import gc
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable

import msgspec

from piwf.wire import canonical_json, decode_as, encode_line
from piwf.protocol.worker import (
    WORKER_LAUNCH_SCHEMA, Exited, Fork, Forked, ForkFailed, LaunchEnvelope, Ready, Reap, TemplateMessage, TemplateReady,
    WorkerResponse, decode_launch, parse_worker_response, to_template,
)
from piwf.worker import main as worker_main

MAX_MESSAGE = 1 << 20  # the environment of a run fits easily
FD_COUNT = 3
SPARE_IDLE_S = 0.05  # a used spare's successor is forked once no message came for this long
_fd_ceiling = 3  # above every descriptor the template held at its last fork (``_fork``)


def serve(control: socket.socket) -> None:
    children: dict[int, bool] = {}  # pid -> its exit was reported
    wakeup_r, wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wakeup_r, selectors.EVENT_READ, "child")
    _send(control, TemplateReady())
    spare = _fork_spare(control, children)
    while True:
        events = selector.select(SPARE_IDLE_S if spare is None else None)
        if not events:  # quiet since the last worker started: its spare's fork no longer competes with it
            spare = _fork_spare(control, children)
        for key, _ in events:
            if key.data == "child":
                _empty_pipe(wakeup_r)
                _report_exits(control, children)
                continue
            handled, spare = _handle(control, children, spare)
            if not handled:
                return


Spare = tuple[int, socket.socket]  # a child forked ahead of the next Fork, and our end of its socket


def _handle(control: socket.socket, children: dict[int, bool], spare: Spare | None) -> tuple[bool, Spare | None]:
    """Start one worker, or reap one the host is done with; False once the host has gone.
    The worker is the spare when there is one that takes the run (the next is forked once
    the template is idle), else a child forked now."""
    fds = array.array("i")
    try:
        data = _receive(control, fds)
    except (ConnectionResetError, BrokenPipeError):
        return False, spare
    if not data:
        return False, spare
    request = to_template.decode(data)
    if isinstance(request, Reap):
        _reap(request.pid, children)
        return True, spare
    try:
        if len(fds) != FD_COUNT:
            raise ValueError(f"expected {FD_COUNT} descriptors, got {len(fds)}")
        if not os.path.isdir(request.cwd):
            raise FileNotFoundError(f"the project directory {request.cwd} does not exist")
        pid = _hand_over(spare, data, fds)
        if pid is None:
            pid = _fork(control, children, lambda: _child(control, request, list(fds)))
        _send(control, Forked(id=request.id, pid=pid))
    except (OSError, ValueError) as exc:
        _send(control, ForkFailed(id=request.id, error=str(exc)))
    finally:
        for fd in fds:
            os.close(fd)
    if spare is not None and spare[1].fileno() == -1:  # used (or gone): the next once the template is idle
        spare = None
    return True, spare


def _receive(sock: socket.socket, fds: array.array[int]) -> bytes:
    """One message; the descriptors it carries are added to ``fds``."""
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(FD_COUNT * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data


def _fork(control: socket.socket, children: dict[int, bool], child: Callable[[], None]) -> int:
    global _fd_ceiling
    sys.stdout.flush()
    sys.stderr.flush()
    # The child closes what it does not keep up to here, never up to the largest descriptor
    # number: where close_range(2) is missing (a kernel before 5.9, a seccomp profile that
    # denies it, a CPython built without it) closerange calls close() on each number.
    _fd_ceiling = max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    pid = os.fork()
    if pid == 0:
        child()  # never returns
    children[pid] = False
    # The child makes itself a process group leader too; whichever runs first creates
    # the group, so it exists before the host hears the pid (and may signal it).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpgid(pid, pid)
    return pid


def _fork_spare(control: socket.socket, children: dict[int, bool]) -> Spare | None:
    """Fork the next worker ahead of its run: it does what no run decides (its own process
    group, default signals, only its own descriptors) and waits for a Fork on a socket of
    its own, so the fork and the child's first page copies are off the next claim's path.
    (Not at once after the last spare took its run: the fork would take CPU from that
    worker's start.) It knows nothing of any run until it is handed one, and is used for
    one only; it exits when the template goes (its socket's end). Its pid reaches the host
    only in that run's Forked; a spare that dies unused is reported as any child (the host
    reaps a pid it does not know at once)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = _fork(control, children, lambda: _spare(control, theirs))
    except OSError:
        ours.close()
        return None
    finally:
        theirs.close()
    return pid, ours


def _hand_over(spare: Spare | None, data: bytes, fds: array.array[int]) -> int | None:
    """The spare's pid once it has the request and its descriptors; None (and a child is
    forked instead) when there is none or it has gone."""
    if spare is None:
        return None
    pid, sock = spare
    try:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    except OSError:
        return None
    finally:
        sock.close()  # used once either way: the next Fork forks another spare
    return pid


def _spare(control: socket.socket, sock: socket.socket) -> None:
    code = 70
    try:
        _leave_template(control, sock.fileno())
        fds = array.array("i")
        data = _receive(sock, fds)
        sock.close()
        request = to_template.decode(data) if data else None
        if not isinstance(request, Fork):  # the template has gone
            code = 0
            return
        code = _become_worker(request, list(fds))
    except BaseException as exc:  # the child must end here, whatever happened
        print(f"piwf worker: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _leave_template(control: socket.socket, *keep: int) -> None:
    """A child's first steps: a process group of its own, default signals, and none of the
    template's descriptors (its socket, selector and wake-up pipe)."""
    os.setpgid(0, 0)
    for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    control.detach()
    _close_all_but(0, 1, 2, *keep)


def _child(control: socket.socket, request: Fork, fds: list[int]) -> None:
    code = 70
    try:
        _leave_template(control, *fds)
        code = _become_worker(request, fds)
    except BaseException as exc:  # the child must end here, whatever happened
        print(f"piwf worker: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become_worker(request: Fork, fds: list[int]) -> int:
    """Take the run's descriptors, directory and environment, and run the worker (or exec
    one); its exit code."""
    to_worker_r, from_worker_w, output_w = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output_w, 1)
    os.dup2(output_w, 2)
    os.close(devnull)
    os.close(output_w)
    os.chdir(request.cwd)
    _set_environment(request.env)
    os.environ["PIWF_WORKER_FDS"] = f"{to_worker_r},{from_worker_w}"
    if request.execWorker:  # --worker-start spawn: a fresh interpreter, still our child
        for fd in (to_worker_r, from_worker_w):
            os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-m", "piwf.worker"])
    sys.argv = ["piwf-worker"]
    return worker_main.main()


def _set_environment(wanted: dict[str, str]) -> None:
    """Make ``os.environ`` (and so the C environment) exactly ``wanted``, touching only what
    differs: a run's environment is mostly the template's own (the host's), and clearing
    and refilling it cost each child 0.8 ms and a hundred page copies."""
    env = os.environ
    for key in [key for key in env if key not in wanted]:
        del env[key]
    for key, value in wanted.items():
        if env.get(key) != value:
            env[key] = value


def _close_all_but(*keep: int) -> None:
    """Close every descriptor but ``keep``: ``os.closerange`` over the gaps up to the
    template's highest descriptor at the fork (``_fd_ceiling``; the template listed them,
    so the child does not)."""
    low = 0
    for fd in sorted(set(keep)):
        if fd > low:  # only a non-empty range: closerange(n, n) is not "nothing" everywhere
            os.closerange(low, fd)
        low = fd + 1
    if _fd_ceiling > low:
        os.closerange(low, _fd_ceiling)


def _report_exits(control: socket.socket, children: dict[int, bool]) -> None:
    """Report children that ended, leaving them unreaped (WNOWAIT) until the host says so."""
    for pid in [pid for pid, reported in children.items() if not reported]:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
            del children[pid]
        if info is None:
            continue
        children[pid] = True
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        _send(control, Exited(pid=pid, returncode=code))


def _reap(pid: int, children: dict[int, bool]) -> None:
    if children.get(pid):  # reported, so it has ended: this returns at once
        del children[pid]
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _empty_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _send(control: socket.socket, message: TemplateMessage) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the host has gone: the next read ends it
        control.send(msgspec.json.encode(message))


def _warm_up() -> None:
    """Do once here what every worker would do first: msgspec resolves a struct's type
    annotations on its first use, which costs each child half a millisecond."""
    envelope = LaunchEnvelope(runId="r", generation=1, workerEpoch="e", projectPath="/", workflow="w",
                              definitionDigest="d", inputHash="h")
    decode_as(canonical_json(envelope), LaunchEnvelope, "launch envelope")
    # the worker's own reading of it (its header first): 0.6 ms and 140 page copies a child less
    raw = base64.urlsafe_b64encode(canonical_json(envelope)).decode().rstrip("=")
    decode_launch(raw, WORKER_LAUNCH_SCHEMA, LaunchEnvelope)
    parse_worker_response(encode_line(WorkerResponse("m", "accepted", revision=1, result={})))
    encode_line(Ready("m", "e", 1, 0))


def main() -> int:
    control = socket.socket(fileno=int(os.environ.pop("PIWF_FORKSERVER_FD")))
    _warm_up()
    # Everything imported so far is shared with every child: keep the collector from
    # touching (and so copying) those pages in each of them.
    gc.collect()
    gc.freeze()
    try:
        serve(control)
    finally:
        control.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
