"""piwf as a background service (DESIGN.md §10): the files ``piwf service install`` writes
and the commands it runs, for systemd (Linux) and launchd (macOS).

A plan is data: the files with their content and the commands, so ``--dry-run`` prints
exactly what ``install`` would do. Install writes only files that differ; uninstall
removes only files install wrote (a unit carries ``MARKER``; a plist, piwf's label), and
neither touches a file someone else put there.

Each state directory has units of its own, named ``piwf-NAME`` (launchd: the label
``dev.piwf.host.NAME``): NAME is ``--name``, else the name its units already have, else one
made from the directory (``<last component>-<8 hex of its path's hash>``). Each file
records the directory it serves, so install refuses to overwrite another directory's
unit, and uninstall removes only this directory's. Units of this directory under another
name, such as the single ``piwf.service`` of earlier versions, are taken over: install
stops them and removes their files before it writes and starts its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.parsers.expat import ExpatError

from piwf.errors import ServiceError, UsageError
from piwf.paths import StatePaths

PLATFORMS = ("linux", "macos")
MARKER = "# Written by `piwf service install`; `piwf service uninstall` removes it."
LABEL = "dev.piwf.host"  # launchd: the label is LABEL.NAME (earlier versions: LABEL alone)
LEGACY = "piwf"  # the one unit name (piwf.service, piwf.socket) of earlier versions
STATE_LINE = "# State directory: "  # the second line of a unit: the directory it serves
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
DRAIN_TIMEOUT_S = 15  # piwf serve's default --drain-timeout
STOP_MARGIN_S = 15  # TimeoutStopSec (launchd: ExitTimeOut) is the drain timeout plus this
WATCHDOG_S = 60  # WatchdogSec: generous, since a start after a crash reads state.db through first
START_TIMEOUT_S = 300  # TimeoutStartSec: that read takes about 15 s per GB from a cold disk
# Exits that a restart cannot mend: usage, a damaged or newer database, another host, a bad state dir.
PERMANENT_EXITS = (2, 3, 4, 5, 12)


@dataclass(frozen=True)
class Command:
    argv: list[str]
    may_fail: bool = False  # launchctl bootout of an agent that is not loaded

    def __str__(self) -> str:
        return " ".join(_shell_quote(arg) for arg in self.argv)


@dataclass(frozen=True)
class Plan:
    """What installing (or uninstalling) this state directory's service here means."""

    platform: str
    name: str  # the unit's name without its suffix (piwf-NAME), or the launchd label
    files: dict[Path, str]
    install: list[Command] = field(default_factory=list)  # after writing the files
    stop: list[Command] = field(default_factory=list)  # before removing them
    after_removal: list[Command] = field(default_factory=list)
    manager: str | None = None  # None: the commands can be run here; else why they cannot
    # This state directory's units under other names (piwf.service of earlier versions):
    # install stops them and removes these files first; uninstall removes them too.
    retired: list[Path] = field(default_factory=list)
    retire: list[Command] = field(default_factory=list)

    @property
    def units(self) -> tuple[str, str]:
        """systemd: the socket and the service unit."""
        return (f"{self.name}.socket", f"{self.name}.service")


def platform_name(override: str | None = None) -> str:
    if override:
        return override
    if sys.platform == "darwin":
        return "macos"
    if sys.platform.startswith("linux"):
        return "linux"
    raise UsageError(f"piwf service supports Linux (systemd) and macOS (launchd), not {sys.platform}")


def piwf_command() -> list[str]:
    """How the service starts this very piwf: its script, else ``python -m piwf``."""
    script = Path(sys.argv[0])
    if script.name == "piwf" and script.is_file():
        return [str(script.absolute())]
    beside = Path(sys.executable).parent / "piwf"  # the script of this interpreter's environment
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    if found := shutil.which("piwf"):
        return [str(Path(found).absolute())]
    return [sys.executable, "-m", "piwf"]


@dataclass(frozen=True)
class Serve:
    """How the service runs ``piwf serve``: the options given to install, as given (each
    checked as ``serve`` checks it), after the ones every service has. The manager's stop
    timeout outlasts the drain timeout they set."""

    options: tuple[str, ...] = ()

    @property
    def stop_timeout_s(self) -> int:
        drain: float = DRAIN_TIMEOUT_S
        for at in range(len(self.options) - 1):
            if self.options[at] == "--drain-timeout":
                with contextlib.suppress(ValueError):
                    drain = float(self.options[at + 1])
        return math.ceil(drain) + STOP_MARGIN_S


FIXED_OPTIONS = ("--log-format", "json")  # every service's, before the options given to install


def serve_argv(paths: StatePaths, serve: Serve = Serve()) -> list[str]:
    return [*piwf_command(), "serve", "--state-dir", str(paths.root), *FIXED_OPTIONS, *serve.options]


def installed_options(path: Path, content: str) -> tuple[str, ...]:
    """The options a service file piwf wrote runs ``piwf serve`` with (those given to install)."""
    if path.suffix == ".plist":
        args = _plist(content).get("ProgramArguments")
        argv = [str(arg) for arg in args] if isinstance(args, list) else []
    else:
        line = next((line for line in content.splitlines() if line.startswith("ExecStart=")), "ExecStart=")
        try:
            argv = [arg.replace("%%", "%").replace("$$", "$") for arg in shlex.split(line[len("ExecStart="):])]
        except ValueError:
            argv = []
    for at in range(len(argv) - 1):
        if tuple(argv[at:at + 2]) == FIXED_OPTIONS:
            return tuple(argv[at + 2:])
    return ()


def make_plan(platform: str, paths: StatePaths, *, name: str | None = None, forced: bool = False,
              serve: Serve = Serve()) -> Plan:
    """``forced``: the platform was chosen by hand (for testing): never run its commands.
    ``name``: ``--name``; by default the name this directory's units have, or a new one.
    ``serve``: the options the service runs ``piwf serve`` with."""
    if name is not None and not NAME.fullmatch(name):
        raise UsageError(f"--name {name!r}: letters, digits, '-' and '_', at most 64, not starting with '-' or '_'")
    mine = installed(platform, paths)
    base = _base(platform, name, mine, paths)
    retired = sorted(path for other, files in mine.items() if other != base for path in files)
    if platform == "linux":
        return _systemd_plan(paths, base, _systemd_missing(forced), retired, [b for b in mine if b != base], serve)
    return _launchd_plan(paths, base, _launchd_missing(forced), retired, [b for b in mine if b != base], serve)


def _base(platform: str, name: str | None, mine: dict[str, list[Path]], paths: StatePaths) -> str:
    prefix = "piwf-" if platform == "linux" else f"{LABEL}."
    if name is not None:
        return prefix + name
    current = sorted(base for base in mine if base not in (LEGACY, LABEL))
    return current[0] if current else prefix + default_name(paths)


def default_name(paths: StatePaths) -> str:
    """The name made from a state directory: its last component (as NAME allows) and 8 hex
    digits of its path's hash, so two directories never share one."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", paths.root.name)[:40].lstrip("-_") or "state"
    return f"{slug}-{hashlib.sha256(os.fsencode(paths.root)).hexdigest()[:8]}"


def installed(platform: str, paths: StatePaths) -> dict[str, list[Path]]:
    """This state directory's service files, by unit name (label): files piwf wrote that
    serve it, whatever their name."""
    if platform == "linux":
        candidates = sorted([*systemd_dir().glob("piwf*.service"), *systemd_dir().glob("piwf*.socket")])
    else:
        candidates = sorted(launch_agents().glob(f"{LABEL}*.plist"))
    mine: dict[str, list[Path]] = {}
    for path in candidates:
        try:
            content = read_existing(path)
        except ServiceError:
            continue
        if content is not None and is_ours(path, content) and served_dir(path, content) == str(paths.root):
            mine.setdefault(path.stem, []).append(path)
    return mine


def served_dir(path: Path, content: str) -> str | None:
    """The state directory a service file piwf wrote serves (None if it does not say)."""
    if path.suffix == ".plist":
        args = _plist(content).get("ProgramArguments")
        if not isinstance(args, list) or "--state-dir" not in args[:-1]:
            return None
        return str(args[args.index("--state-dir") + 1])
    for line in content.splitlines():
        if line.startswith(STATE_LINE):
            return line[len(STATE_LINE):]
    for prefix in ("Description=piwf workflow host for ", "Description=piwf host socket for "):
        for line in content.splitlines():  # a unit of an earlier version
            if line.startswith(prefix):
                return line[len(prefix):].replace("%%", "%")
    return None


def check_target(plan: Plan, paths: StatePaths) -> None:
    """Refuse a file at the plan's paths that piwf did not write or that serves another
    state directory (a --name taken)."""
    for path in plan.files:
        existing = read_existing(path)
        check_ours(path, existing)
        if existing is not None and (served := served_dir(path, existing)) != str(paths.root):
            raise ServiceError(f"{path} is the service of another state directory ({served}); choose another "
                               "--name, or uninstall that one first (`piwf service uninstall --state-dir DIR`)")


# --- systemd ----------------------------------------------------------------------------------


def systemd_dir() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user"


def _systemd_plan(paths: StatePaths, name: str, missing: str | None, retired: list[Path],
                  others: list[str], serve: Serve) -> Plan:
    directory = systemd_dir()
    systemctl = ["systemctl", "--user"]
    units = (f"{name}.socket", f"{name}.service")
    return Plan("linux", name, {directory / units[0]: socket_unit(paths),
                                directory / units[1]: service_unit(paths, units[0], serve)},
                install=[Command([*systemctl, "daemon-reload"]), Command([*systemctl, "enable", "--now", *units])],
                stop=[Command([*systemctl, "disable", "--now", *reversed(units)])],
                after_removal=[Command([*systemctl, "daemon-reload"])], manager=missing, retired=retired,
                retire=[Command([*systemctl, "disable", "--now", f"{other}.service", f"{other}.socket"], may_fail=True)
                        for other in others])


def socket_unit(paths: StatePaths) -> str:
    return f"""{MARKER}
{STATE_LINE}{paths.root}
[Unit]
Description=piwf host socket for {_escape(str(paths.root))}

[Socket]
ListenStream={_escape(str(paths.socket))}
SocketMode=0600
DirectoryMode=0700
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""


def service_unit(paths: StatePaths, socket: str = "piwf.socket", serve: Serve = Serve()) -> str:
    exec_start = " ".join(_systemd_quote(arg) for arg in serve_argv(paths, serve))
    return f"""{MARKER}
{STATE_LINE}{paths.root}
[Unit]
Description=piwf workflow host for {_escape(str(paths.root))}
Requires={socket}
After={socket}

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
WatchdogSec={WATCHDOG_S}
TimeoutStartSec={START_TIMEOUT_S}
TimeoutStopSec={serve.stop_timeout_s}
KillMode=mixed
Restart=on-failure
RestartSec=1
RestartPreventExitStatus={" ".join(map(str, PERMANENT_EXITS))}

[Install]
WantedBy=default.target
"""


def _escape(text: str) -> str:
    """systemd expands %-specifiers in unit values."""
    return text.replace("%", "%%")


def _systemd_quote(arg: str) -> str:
    arg = _escape(arg).replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_missing(forced: bool) -> str | None:
    if forced:
        return "the platform was chosen with --platform"
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    if not Path("/run/systemd/system").is_dir():  # sd_booted(3)
        return "systemd is not running here: no /run/systemd/system"
    return None


# --- launchd ----------------------------------------------------------------------------------


def launch_agents() -> Path:
    return Path.home() / "Library" / "LaunchAgents"


def _launchd_plan(paths: StatePaths, label: str, missing: str | None, retired: list[Path],
                  others: list[str], serve: Serve) -> Plan:
    path = launch_agents() / f"{label}.plist"
    domain = f"gui/{os.getuid()}"
    return Plan("macos", label, {path: launchd_plist(paths, label, serve)},
                install=[Command(["launchctl", "bootout", f"{domain}/{label}"], may_fail=True),
                         Command(["launchctl", "bootstrap", domain, str(path)])],
                stop=[Command(["launchctl", "bootout", f"{domain}/{label}"], may_fail=True)], manager=missing,
                retired=retired,
                retire=[Command(["launchctl", "bootout", f"{domain}/{other}"], may_fail=True) for other in others])


def launchd_plist(paths: StatePaths, label: str = LABEL, serve: Serve = Serve()) -> str:
    name = "piwf" if label == LABEL else f"piwf-{label.removeprefix(LABEL + '.')}"
    log = str(Path.home() / "Library" / "Logs" / f"{name}.log")
    agent = {
        "Label": label,
        "ProgramArguments": serve_argv(paths, serve),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # as Restart=on-failure: `piwf stop` stays stopped
        "ExitTimeOut": serve.stop_timeout_s,
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }
    return plistlib.dumps(agent, sort_keys=True).decode()


def _launchd_missing(forced: bool) -> str | None:
    if forced:
        return "the platform was chosen with --platform"
    return None if sys.platform == "darwin" and shutil.which("launchctl") else "launchctl is not here"


# --- install, uninstall, status -----------------------------------------------------------------


def is_ours(path: Path, content: str) -> bool:
    """Whether ``content`` (of a file at ``path``) was written by install."""
    if path.suffix != ".plist":
        return content.startswith(MARKER)
    label = _plist(content).get("Label")
    return isinstance(label, str) and (label == LABEL or label.startswith(LABEL + ".")) and label == path.stem


def _plist(content: str) -> dict[str, object]:
    try:
        agent = plistlib.loads(content.encode())
    except (plistlib.InvalidFileException, ValueError, ExpatError):
        return {}
    return agent if isinstance(agent, dict) else {}


def read_existing(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ServiceError(f"cannot read {path}: {exc}") from exc


def check_ours(path: Path, existing: str | None) -> None:
    if existing is not None and not is_ours(path, existing):
        raise ServiceError(f"{path} exists and was not written by `piwf service install`; "
                           "move it aside and run the command again")


def changes(plan: Plan) -> dict[Path, bool]:
    """Each file and whether install would (re)write it; refuses files that are not piwf's."""
    result = {}
    for path, content in plan.files.items():
        existing = read_existing(path)
        check_ours(path, existing)
        result[path] = existing != content
    return result


def write_files(plan: Plan, changed: dict[Path, bool]) -> None:
    for path, content in plan.files.items():
        if changed[path]:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(content)
            partial.replace(path)  # a reader never sees half a unit


def remove_retired(plan: Plan) -> None:
    """Remove this state directory's files under other names (install takes them over)."""
    for path in plan.retired:
        path.unlink(missing_ok=True)


def remove_files(plan: Plan) -> list[Path]:
    """The plan's files and its retired ones (this state directory's under other names)."""
    removed = []
    for path in [*plan.files, *plan.retired]:
        existing = read_existing(path)
        check_ours(path, existing)
        if existing is not None:
            path.unlink()
            removed.append(path)
    return removed


def run_commands(commands: list[Command]) -> None:
    for command in commands:
        try:
            done = subprocess.run(command.argv, capture_output=True, text=True, check=False, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ServiceError(f"`{command}` could not run: {exc}") from exc
        if done.returncode != 0 and not command.may_fail:
            reason = (done.stderr or done.stdout).strip().splitlines()
            raise ServiceError(f"`{command}` exited {done.returncode}" + (f": {reason[-1]}" if reason else ""))


def manager_state(plan: Plan) -> str:
    """What the service manager says of piwf's service, or why it cannot be asked."""
    if plan.manager is not None:
        return f"unknown: {plan.manager}"
    if plan.platform == "linux":
        argv = ["systemctl", "--user", "is-active", *plan.units]
    else:
        argv = ["launchctl", "print", f"gui/{os.getuid()}/{plan.name}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown: {exc}"
    if plan.platform == "linux":
        return ", ".join(f"{unit} {state}" for unit, state in zip(plan.units, done.stdout.split(), strict=False))
    return "loaded" if done.returncode == 0 else "not loaded"


def _shell_quote(arg: str) -> str:
    return shlex.quote(arg)
