"""The store a state directory's host uses, recorded in the state directory (``store.json``)
when it is not the directory's own SQLite database: its URL without any password, so that
``piwf status`` finds the store with no host running. Imports no backend."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from piwf.wire import decode_json

SECRET_PARAMETERS = ("password", "sslpassword")


def redact(url: str) -> str:
    """``url`` without its password (in the user part or a ``password=`` parameter)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            user, _, host = netloc.rpartition("@")
            netloc = f"{user.partition(':')[0]}@{host}"
        query = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True)
                 if key not in SECRET_PARAMETERS]
        return join(parts.scheme, netloc, parts.path, query)
    except ValueError:
        return "(a store URL that cannot be read)"


def join(scheme: str, netloc: str, path: str, query: list[tuple[str, str]]) -> str:
    """A URL again (urlunsplit would drop the empty host of ``postgresql:///db``)."""
    text = urlencode(query, quote_via=quote, safe="/")
    return f"{scheme}://{netloc}{path}" + (f"?{text}" if text else "")


def _path(paths: Any) -> Path:
    return Path(paths.store_record)


def write(paths: Any, url: str) -> None:
    """Record ``url``, without its password (0600, replaced atomically)."""
    path = _path(paths)
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"url": redact(url)}, handle)
        handle.write("\n")
    os.replace(temporary, path)


def forget(paths: Any) -> None:
    """The host uses the state directory's own database again."""
    _path(paths).unlink(missing_ok=True)


def read(paths: Any) -> str | None:
    """The recorded URL, or None (none recorded, or unreadable)."""
    try:
        data = decode_json(_path(paths).read_bytes())
    except (OSError, ValueError):
        return None
    url = data.get("url") if isinstance(data, dict) else None
    return url if isinstance(url, str) else None
