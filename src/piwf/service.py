"""piwf as a background service (DESIGN.md §10): the files ``piwf service install`` writes
and the commands it runs, for systemd (Linux) and launchd (macOS).

A plan is data: the files with their content and the commands, so ``--dry-run`` prints
exactly what ``install`` would do. Install writes only files that differ; uninstall
removes only files install wrote (a unit carries ``MARKER``; a plist, piwf's label), and
neither touches a file someone else put there.
"""

from __future__ import annotations

import os
import plistlib
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
LABEL = "dev.piwf.host"
UNITS = ("piwf.socket", "piwf.service")
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
    """What installing (or uninstalling) piwf's service here means."""

    platform: str
    files: dict[Path, str]
    install: list[Command] = field(default_factory=list)  # after writing the files
    stop: list[Command] = field(default_factory=list)  # before removing them
    after_removal: list[Command] = field(default_factory=list)
    manager: str | None = None  # None: the commands can be run here; else why they cannot


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


def serve_argv(paths: StatePaths) -> list[str]:
    return [*piwf_command(), "serve", "--state-dir", str(paths.root), "--log-format", "json"]


def make_plan(platform: str, paths: StatePaths, *, forced: bool = False) -> Plan:
    """``forced``: the platform was chosen by hand (for testing): never run its commands."""
    if platform == "linux":
        return _systemd_plan(paths, _systemd_missing(forced))
    return _launchd_plan(paths, _launchd_missing(forced))


# --- systemd ----------------------------------------------------------------------------------


def systemd_dir() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user"


def _systemd_plan(paths: StatePaths, missing: str | None) -> Plan:
    directory = systemd_dir()
    systemctl = ["systemctl", "--user"]
    return Plan("linux", {directory / "piwf.socket": socket_unit(paths),
                          directory / "piwf.service": service_unit(paths)},
                install=[Command([*systemctl, "daemon-reload"]), Command([*systemctl, "enable", "--now", *UNITS])],
                stop=[Command([*systemctl, "disable", "--now", *reversed(UNITS)])],
                after_removal=[Command([*systemctl, "daemon-reload"])], manager=missing)


def socket_unit(paths: StatePaths) -> str:
    return f"""{MARKER}
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


def service_unit(paths: StatePaths) -> str:
    exec_start = " ".join(_systemd_quote(arg) for arg in serve_argv(paths))
    return f"""{MARKER}
[Unit]
Description=piwf workflow host for {_escape(str(paths.root))}
Requires=piwf.socket
After=piwf.socket

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
WatchdogSec={WATCHDOG_S}
TimeoutStartSec={START_TIMEOUT_S}
TimeoutStopSec={DRAIN_TIMEOUT_S + STOP_MARGIN_S}
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


def _launchd_plan(paths: StatePaths, missing: str | None) -> Plan:
    path = Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    domain = f"gui/{os.getuid()}"
    return Plan("macos", {path: launchd_plist(paths)},
                install=[Command(["launchctl", "bootout", f"{domain}/{LABEL}"], may_fail=True),
                         Command(["launchctl", "bootstrap", domain, str(path)])],
                stop=[Command(["launchctl", "bootout", f"{domain}/{LABEL}"], may_fail=True)], manager=missing)


def launchd_plist(paths: StatePaths) -> str:
    log = str(Path.home() / "Library" / "Logs" / "piwf.log")
    agent = {
        "Label": LABEL,
        "ProgramArguments": serve_argv(paths),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # as Restart=on-failure: `piwf stop` stays stopped
        "ExitTimeOut": DRAIN_TIMEOUT_S + STOP_MARGIN_S,
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
    try:
        agent = plistlib.loads(content.encode())
    except (plistlib.InvalidFileException, ValueError, ExpatError):
        return False
    return isinstance(agent, dict) and agent.get("Label") == LABEL


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


def remove_files(plan: Plan) -> list[Path]:
    removed = []
    for path in plan.files:
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
        argv = ["systemctl", "--user", "is-active", *UNITS]
    else:
        argv = ["launchctl", "print", f"gui/{os.getuid()}/{LABEL}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown: {exc}"
    if plan.platform == "linux":
        return ", ".join(f"{unit} {state}" for unit, state in zip(UNITS, done.stdout.split(), strict=False))
    return "loaded" if done.returncode == 0 else "not loaded"


def _shell_quote(arg: str) -> str:
    return shlex.quote(arg)
