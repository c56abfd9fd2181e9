"""Where a state directory and its files live (DESIGN.md §2)."""

from __future__ import annotations

import os
import stat

from piwf.errors import StateDirError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the CLI's one-shot path
if TYPE_CHECKING:
    from pathlib import Path

MAX_SOCKET_PATH = 108  # sizeof(sockaddr_un.sun_path) on Linux


def default_state_dir() -> str:
    if env := os.environ.get("PIWF_STATE_DIR"):
        return env
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return os.path.join(xdg, "piwf")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "piwf")


def absolute(path: str) -> str:
    """``str(Path(path).absolute())`` without loading pathlib: joined to the working
    directory, with empty and ``.`` parts dropped (``..`` kept, as pathlib keeps it)."""
    if not path.startswith("/"):
        path = os.path.join(os.getcwd(), path)
    head = "//" if path.startswith("//") and not path.startswith("///") else "/"  # POSIX keeps exactly two
    return head + "/".join(part for part in path.split("/") if part not in ("", "."))


class StatePaths:
    """A state directory's files. ``root`` and the file properties are ``Path``s; ``name``
    and ``socket_name`` are the same as text, for the CLI's one-shot commands, which load
    neither pathlib nor ``dataclasses`` (a plain class for that reason)."""

    __slots__ = ("_path", "name")

    def __init__(self, name: str) -> None:
        self.name = name  # the root, absolute
        self._path: Path | None = None

    @classmethod
    def resolve(cls, state_dir: str | os.PathLike[str] | None) -> StatePaths:
        root = os.fspath(state_dir) if state_dir else default_state_dir()
        return cls(absolute(os.path.expanduser(root)))

    @property
    def root(self) -> Path:
        if self._path is None:
            import pathlib

            self._path = pathlib.Path(self.name)
        return self._path

    @property
    def socket_name(self) -> str:
        """``socket`` as text."""
        return os.path.join(self.name, "host", "host.sock")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StatePaths) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"StatePaths({self.name!r})"

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def store_record(self) -> Path:
        """Where the host records the store it uses when that is not the state database:
        its URL without any password (``piwf status`` finds the store from it)."""
        return self.root / "store.json"

    @property
    def host_dir(self) -> Path:
        return self.root / "host"

    @property
    def socket(self) -> Path:
        return self.host_dir / "host.sock"

    @property
    def lock(self) -> Path:
        return self.host_dir / "host.lock"

    @property
    def lock_record(self) -> Path:
        return self.host_dir / "host.lock.json"

    def ensure(self) -> None:
        """Create the state and host directories (0700) or refuse unsafe ones."""
        if len(os.fsencode(self.socket)) >= MAX_SOCKET_PATH:
            raise StateDirError(f"socket path {self.socket} is too long for a Unix socket "
                                f"(at most {MAX_SOCKET_PATH - 1} bytes); choose a shorter state directory")
        for directory in (self.root, self.host_dir):
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                blocker = next(p for p in (directory, *directory.parents) if p.exists() and not p.is_dir())
                raise StateDirError(f"{blocker} is not a directory"
                                    + (f" (cannot create {directory})" if blocker != directory else "")) from None
            except OSError as exc:
                raise StateDirError(f"cannot create {directory}: {exc.strerror}") from exc
            check_private_dir(directory)


def check_private_dir(directory: Path) -> None:
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{directory} is not a directory (symlinks are refused)")
    if info.st_uid != os.getuid():
        raise StateDirError(f"{directory} is owned by uid {info.st_uid}, not by you")
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)
