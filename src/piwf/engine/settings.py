"""Run settings (DESIGN.md §9b): a workflow's settings type, its mutable paths, and how a
JSON merge patch (RFC 7396) is checked against them.

Everything here runs where user code may run: in a worker, or in the throwaway process
``python -m piwf.engine.inspect --settings`` that the host asks to check a change. The host
only stores what came back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from piwf.errors import DefinitionError, Rejected

MAX_PATH = 256  # characters of one mutable path


def check_declaration(name: str, settings: Any, mutable: Iterable[str]) -> tuple[Any, tuple[str, ...]]:
    """The settings type and mutable paths a ``Workflow`` was given, checked: a msgspec
    Struct whose every field has a default, and dotted paths that start at one of its fields."""
    paths = (mutable,) if isinstance(mutable, str) else tuple(mutable)
    if settings is None:
        if paths:
            raise DefinitionError(f"workflow {name}: mutable= needs settings= (a msgspec Struct type)")
        return None, ()
    if not (isinstance(settings, type) and issubclass(settings, msgspec.Struct)):
        raise DefinitionError(f"workflow {name}: settings= must be a msgspec Struct type, not {settings!r}")
    try:
        defaults(settings)
    except TypeError as exc:
        raise DefinitionError(f"workflow {name}: every field of {settings.__name__} needs a default ({exc})") from None
    for path in paths:
        _check_path(name, settings, path)
    if len(set(paths)) != len(paths):
        raise DefinitionError(f"workflow {name}: a mutable path is named twice")
    return settings, tuple(sorted(paths))


def _check_path(name: str, settings: type[msgspec.Struct], path: Any) -> None:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or any(not part for part in path.split(".")):
        raise DefinitionError(f"workflow {name}: mutable path {path!r} must be dotted field names, like 'limits.max'")
    if missing := _missing_field(settings, path):
        raise DefinitionError(f"workflow {name}: mutable path {path!r}: {missing}")


def _missing_field(settings: type[msgspec.Struct], path: str) -> str | None:
    """Why dotted ``path`` names no field of ``settings`` (None when it does). Below a field
    that is not a Struct (a dict) any key may be named."""
    kind: Any = settings
    for part in path.split("."):
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            return None
        fields = {field.encode_name: field.type for field in msgspec.structs.fields(kind)}
        if part not in fields:
            return f"{kind.__name__} has no field {part!r}"
        kind = fields[part]
    return None


def defaults(settings: type[msgspec.Struct]) -> Any:
    """The settings a run starts with when it is given none, as JSON."""
    return msgspec.to_builtins(settings())


def as_value(settings: type[msgspec.Struct] | None, value: Any) -> Any:
    """What ``ctx.settings`` is: the stored JSON converted to the workflow's type (None
    for a workflow without settings)."""
    if settings is None:
        return None
    return msgspec.convert(value if value is not None else defaults(settings), settings)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: an object patch merges key by key (null removes the key); anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def touched_paths(patch: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted paths a merge patch sets or removes: a nested object is followed down."""
    for key, value in patch.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):  # followed down; an empty one changes nothing (RFC 7396)
            yield from touched_paths(value, path + ".")
        else:
            yield path


def allowed(path: str, mutable: Iterable[str]) -> bool:
    """A path may change when it, or a path above it, is mutable."""
    return any(path == m or path.startswith(m + ".") for m in mutable)


def resolve(name: str, settings: type[msgspec.Struct] | None, mutable: Iterable[str], current: Any, patch: Any,
            *, mutable_only: bool) -> Any:
    """The settings after ``patch``, as JSON; one clear line (``Rejected``) when the patch
    touches a path that may not change or the result does not fit the type."""
    if settings is None:
        raise Rejected(f"workflow {name} declares no settings")
    if not isinstance(patch, dict):
        raise Rejected("settings must be a JSON object (a merge patch)")
    for path in touched_paths(patch):  # msgspec would drop an unknown key without a word
        if missing := _missing_field(settings, path):
            raise Rejected(f"settings path {path!r} of workflow {name}: {missing}")
    if mutable_only:
        mutable = tuple(mutable)
        if not list(touched_paths(patch)):
            raise Rejected("the settings patch changes nothing")
        refused = [path for path in touched_paths(patch) if not allowed(path, mutable)]
        if refused:
            may = ", ".join(mutable) or "none"
            raise Rejected(f"settings path {refused[0]!r} of workflow {name} cannot change while a run goes on "
                           f"(mutable: {may})")
    merged = merge_patch(current if current is not None else defaults(settings), patch)
    try:
        value = msgspec.convert(merged, settings)
    except msgspec.ValidationError as exc:
        raise Rejected(f"settings do not fit {settings.__name__}: {exc}") from None
    return msgspec.to_builtins(value)


def describe(settings: type[msgspec.Struct] | None, mutable: tuple[str, ...]) -> dict[str, Any]:
    """What the digest covers of the settings: the type's schema, its defaults, the mutable paths."""
    if settings is None:
        return {}
    return {"settings": {"schema": msgspec.json.schema(settings), "defaults": defaults(settings),
                         "mutable": list(mutable)}}
