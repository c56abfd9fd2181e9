"""Store URLs: libpq's ``postgresql://`` form, plus piwf's own ``schema`` parameter.

``schema=NAME`` (default ``piwf``) names the schema piwf keeps its tables in, so several
installations can share one database; it is taken out before the URL reaches libpq. The
password comes from where libpq finds it (the URL, ``PGPASSWORD``, ``~/.pgpass``);
``redacted`` is the URL without any password, the only form piwf ever writes or prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from piwf.errors import StoreError
from piwf.store.api.record import join as _join, redact

DEFAULT_SCHEMA = "piwf"
SCHEMES = ("postgresql", "postgres")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class StoreUrl:
    conninfo: str  # for libpq (may hold a password: never log it)
    schema: str
    redacted: str  # without any password


def is_postgres(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def parse(url: str) -> StoreUrl:
    """Split piwf's parameters off a store URL; one clear line for a malformed one, never
    quoting its password."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise StoreError(f"a store URL starts with postgresql://, not {redact(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((value for key, value in query if key == "schema"), DEFAULT_SCHEMA)
    if not _SCHEMA_NAME.match(schema):
        raise StoreError(f"schema {schema!r} in the store URL is not a plain lower-case name (a-z, 0-9, _)")
    rest = [(key, value) for key, value in query if key != "schema"]
    conninfo = _join(parts.scheme, parts.netloc, parts.path, rest)
    return StoreUrl(conninfo, schema, redact(url))


def database_name(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/"))
