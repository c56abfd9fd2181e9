"""``piwf service install|uninstall|status``: the command-line side of ``service``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from piwf import service
from piwf.errors import UsageError
from piwf.paths import StatePaths


def _plan(args: argparse.Namespace) -> tuple[service.Plan, StatePaths]:
    """The plan for this state directory: ``install`` with the serve options it was given;
    ``status`` and ``uninstall`` with those the installed unit carries (so it is current)."""
    platform = service.platform_name(args.platform)
    paths = StatePaths.resolve(args.state_dir)
    plan = service.make_plan(platform, paths, name=args.name, forced=args.platform is not None)
    serve = _serve(args) if hasattr(args, "serve_flags") else _installed(plan)
    if serve != service.Serve():
        plan = service.make_plan(platform, paths, name=args.name, forced=args.platform is not None, serve=serve)
    service.check_target(plan, paths)
    return plan, paths


def _serve(args: argparse.Namespace) -> service.Serve:
    """``install``'s serve options, as given and in serve's order; ``$PIWF_STORE`` as
    ``--store`` when that is not given (``serve`` would read it; a service has no such
    variable). A store URL with a password is refused: the unit is a plain file."""
    given = vars(args)
    if "store" not in given and os.environ.get("PIWF_STORE"):
        given = {**given, "store": os.environ["PIWF_STORE"]}
    options: list[str] = []
    for flag in args.serve_flags:
        value = given.get(flag.removeprefix("--").replace("-", "_"))
        if value is None or value is False:
            continue
        if isinstance(value, list):  # an option given again and again (--queue)
            options += [part for one in value for part in (flag, one)]
            continue
        options += [flag] if value is True else [flag, value]
    if "store" in given:
        _refuse_password(given["store"])
    return service.Serve(tuple(options))


def _refuse_password(url: str) -> None:
    from urllib.parse import parse_qs, urlsplit

    try:
        parts = urlsplit(url)
        password = parts.password is not None or "password" in parse_qs(parts.query)
    except ValueError:
        password = False  # serve says what is wrong with it
    if password:
        raise UsageError("--store (or $PIWF_STORE): the URL has a password, which the service file would show "
                         "to anyone who can read it; leave it out and put it in ~/.pgpass (libpq's password "
                         "file, mode 0600)")


def _installed(plan: service.Plan) -> service.Serve:
    """The serve options of this directory's installed service file, if any."""
    for path in plan.files:
        existing = service.read_existing(path)
        if existing is not None and service.is_ours(path, existing) and path.suffix != ".socket":
            return service.Serve(service.installed_options(path, existing))
    return service.Serve()


def cmd_install(args: argparse.Namespace) -> int:
    plan, _ = _plan(args)
    changed = service.changes(plan)
    commands = _install_commands(plan, changed)
    run = plan.manager is None and not args.dry_run
    if not args.dry_run:
        if run and plan.retired:
            service.run_commands(plan.retire)
        service.remove_retired(plan)
        service.write_files(plan, changed)
        if run:
            service.run_commands(plan.install if plan.retired else commands)
    files = [{"path": str(path), "changed": changed[path], "content": content} for path, content in plan.files.items()]
    report = {"platform": plan.platform, "name": plan.name, "dryRun": args.dry_run, "files": files,
              "tookOver": [str(path) for path in plan.retired],
              "commands": [command.argv for command in commands], "commandsRun": run,
              "manager": plan.manager, "serveOptions": list(_serve(args).options)}
    _print(args, report, _format_install)
    return 0


def _install_commands(plan: service.Plan, changed: dict[Path, bool]) -> list[service.Command]:
    """Stop the units taken over first; launchd: reload the agent only if its plist changed
    or it is not loaded (a reload restarts the host); systemd's commands are harmless to repeat."""
    if plan.retired:
        return plan.retire + plan.install
    if plan.platform == "macos" and not any(changed.values()) and service.manager_state(plan) == "loaded":
        return []
    return plan.install


def cmd_uninstall(args: argparse.Namespace) -> int:
    plan, paths = _plan(args)
    present = [path for path in plan.files if service.read_existing(path) is not None]
    stop = (plan.stop if present else []) + (plan.retire if plan.retired else [])
    commands = (stop + plan.after_removal) if stop else []
    run = plan.manager is None and not args.dry_run
    if not args.dry_run:
        if run:
            service.run_commands(stop)
        service.remove_files(plan)
        if run and stop:
            service.run_commands(plan.after_removal)
    removed = [str(p) for p in [*present, *plan.retired]]
    report = {"platform": plan.platform, "name": plan.name, "stateDir": str(paths.root), "dryRun": args.dry_run,
              "removed": removed, "commands": [command.argv for command in commands],
              "commandsRun": run and bool(removed), "manager": plan.manager}
    _print(args, report, _format_uninstall)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    plan, _ = _plan(args)
    files = []
    for path, content in plan.files.items():
        existing = service.read_existing(path)
        files.append({"path": str(path), "installed": existing is not None,
                      "ours": existing is not None and service.is_ours(path, existing),
                      "current": existing == content})
    files += [{"path": str(path), "installed": True, "ours": True, "current": False, "takenOverByInstall": True}
              for path in plan.retired]
    report = {"platform": plan.platform, "name": plan.name, "files": files, "manager": service.manager_state(plan)}
    _print(args, report, _format_status)
    return 0


# --- printing ---------------------------------------------------------------------------------


def _print(args: argparse.Namespace, report: dict[str, Any], human: Any) -> None:
    from piwf.cli.common import _print as print_report

    print_report(args, report, human)


def _format_install(r: dict[str, Any]) -> str:
    if r["dryRun"]:
        lines = []
        for f in r["files"]:
            lines += [f"# {'would write' if f['changed'] else 'unchanged'}: {f['path']}", f["content"].rstrip("\n"), ""]
        lines += [f"# would take over (remove): {path}" for path in r["tookOver"]]
        lines += [f"# would run: {_command(c)}" for c in r["commands"]]
        return "\n".join(lines)
    lines = [f"took over {path} (this state directory's service under an earlier name): removed"
             for path in r["tookOver"]]
    lines += [f"{'wrote' if f['changed'] else 'unchanged'} {f['path']}" for f in r["files"]]
    lines += _commands_lines(r, "to start the service")
    return "\n".join(lines)


def _format_uninstall(r: dict[str, Any]) -> str:
    if not r["removed"]:
        return f"no piwf service is installed for {r['stateDir']}; nothing to remove"
    verb = "would remove" if r["dryRun"] else "removed"
    lines = [f"{verb} {path}" for path in r["removed"]]
    if r["dryRun"]:
        return "\n".join(lines + [f"would run: {_command(c)}" for c in r["commands"]])
    return "\n".join(lines + _commands_lines(r, "to stop the service"))


def _commands_lines(r: dict[str, Any], purpose: str) -> list[str]:
    if not r["commands"]:
        return []
    if r["commandsRun"]:
        return [f"ran {_command(c)}" for c in r["commands"]]
    joined = " && ".join(_command(c) for c in r["commands"])
    return [f"{r['manager']}; {purpose}, run: {joined}"]


def _format_status(r: dict[str, Any]) -> str:
    lines = []
    for f in r["files"]:
        state = ("not installed" if not f["installed"] else "not written by piwf" if not f["ours"]
                 else "installed under an earlier name: `piwf service install` takes it over"
                 if f.get("takenOverByInstall")
                 else "installed" if f["current"] else "installed, differs from what install would write now")
        lines.append(f"{f['path']}: {state}")
    lines.append(f"service: {r['manager']}")
    return "\n".join(lines)


def _command(argv: list[str]) -> str:
    return str(service.Command(argv))
