"""A throwaway PostgreSQL server for the tests: ``initdb`` in a temporary folder (in
/dev/shm where there is one), a Unix socket in it and no TCP port, stopped at the end.

``initdb`` and ``postgres`` refuse to run as root, so as root (CI, this machine) they run as
``nobody`` (``setpriv``), in a folder that user owns. Without PostgreSQL's programs
(``pg_config --bindir``) ``find_bindir`` returns None and the tests that need a server
skip, saying how to get one; with ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any
import contextlib

HOW_TO_RUN = ("PostgreSQL tests need PostgreSQL's server programs (pg_config --bindir): "
              "apt-get install postgresql, or set PIWF_TEST_STORE to a postgresql:// URL")
USER = "nobody"
SHM = "/dev/shm"


def find_bindir() -> Path | None:
    """PostgreSQL's programs, from ``pg_config --bindir`` (Debian's pg_config names the
    client's; the server's are beside it under /usr/lib/postgresql/N/bin)."""
    pg_config = shutil.which("pg_config")
    if pg_config is None:  # Debian's server without the client's development files
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        return found[-1].parent if found else None
    bindir = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True).stdout.strip())
    if (bindir / "initdb").exists():
        return bindir
    version = subprocess.run([pg_config, "--version"], capture_output=True, text=True, check=True).stdout.split()
    major = version[1].split(".")[0] if len(version) > 1 else ""
    debian = Path(f"/usr/lib/postgresql/{major}/bin")
    return debian if (debian / "initdb").exists() else None


class Server:
    """One PostgreSQL cluster: ``start``, ``url(database)``, ``stop``, ``restart``."""

    def __init__(self, bindir: Path, *, fsync: bool = False) -> None:
        self.bindir = bindir
        self.fsync = fsync
        # In memory where there is /dev/shm: the suite makes hundreds of schemas (tens of
        # thousands of files), and creating and removing them on a disk costs minutes.
        self.root = Path(tempfile.mkdtemp(prefix="piwf-pg-", dir=SHM if os.path.isdir(SHM) else None))
        self.data = self.root / "data"
        self.socket_dir = self.root
        self.log = self.root / "server.log"
        self.port = 5432
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam(USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._as_user = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"]
        os.chmod(self.root, 0o755)

    def _run(self, program: str, *args: str) -> None:
        command = [*self._as_user, str(self.bindir / program), *args]
        done = subprocess.run(command, capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr.strip()}\n{log[-2000:]}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "piwf", "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--locale=C")

    def start(self) -> None:
        # The tests' own durability is not under test here: fsync off keeps them fast (a bench
        # turns it on, as a real server runs).
        durable = "" if self.fsync else "-c fsync=off -c full_page_writes=off "
        options = (f"-k {self.socket_dir} -c listen_addresses='' -p {self.port} {durable}"
                   "-c max_connections=200 -c shared_buffers=32MB")
        self._run("pg_ctl", "start", "-w", "-D", str(self.data), "-l", str(self.log), "-o", options)

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "stop", "-w", "-D", str(self.data), "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://piwf@/{database}?host={self.socket_dir}&port={self.port}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def start_server(*, fsync: bool = False) -> Server | None:
    bindir = find_bindir()
    if bindir is None:
        return None
    server = Server(bindir, fsync=fsync)
    try:
        server.init()
        server.start()
    except BaseException:
        server.remove()
        raise
    return server


class External:
    """A server the tests are pointed at (``PIWF_TEST_STORE``): a base URL, each test in a
    schema of its own."""

    def __init__(self, url: str) -> None:
        self.base = url

    def url(self, database: str = "postgres") -> str:
        return self.base if "?" in self.base else self.base + "?"


class CuttingProxy:
    """A Unix-socket proxy in front of a server that, when armed, passes the next ``COMMIT``
    on to the server, reads the server's answer and drops the connection instead of
    passing it back: the client's commit happened, and it cannot know (a connection lost
    during COMMIT). ``url(database)`` is the store URL through the proxy."""

    def __init__(self, server_socket: Path, directory: Path, port: int = 5432) -> None:
        import socket
        import threading

        self.server_socket = server_socket
        self.directory = directory
        self.port = port
        self.armed = threading.Event()
        self.cuts = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(directory / f".s.PGSQL.{port}"))
        self.listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://piwf@/{database}?host={self.directory}&port={self.port}"

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.server_socket))
            cut = threading.Event()
            threading.Thread(target=self._pump, args=(client, upstream, cut, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, cut, False), daemon=True).start()

    def _pump(self, source: Any, sink: Any, cut: Any, to_server: bool) -> None:
        import socket

        try:
            while data := source.recv(65536):
                if to_server and self.armed.is_set() and b"COMMIT" in data:
                    self.armed.clear()
                    cut.set()  # what the server answers from now on never reaches the client
                elif not to_server and cut.is_set():
                    self.cuts += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

