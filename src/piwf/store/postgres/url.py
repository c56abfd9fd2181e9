"""Store URLs: libpq's ``postgresql://`` form, plus piwf's own parameters.

``schema=NAME`` (default ``piwf``) names the schema piwf keeps its tables in, so several
installations can share one database. ``pool_size=N`` (default 8) is the most connections
a host's pool holds; ``statement_timeout``, ``lock_timeout`` and
``idle_in_transaction_session_timeout`` (milliseconds, or with a unit: ``500ms``, ``30s``,
``2min``, ``1h``) are the time limits every connection of the pool sets. piwf's parameters
are taken out before the URL reaches libpq; libpq's ``connect_timeout`` (seconds) stays in
it and is also how long piwf waits for a connection from its pool. Over TCP a connection
whose peer has gone silent (a partition, a black-holed link) fails within about 10 s
instead of TCP's quarter of an hour: unless the URL sets them, piwf passes libpq
``keepalives_idle=5``, ``keepalives_interval=2``, ``keepalives_count=3`` and
``tcp_user_timeout=10000`` (ignored over a Unix socket). The password comes from
where libpq finds it (the URL, ``PGPASSWORD``, ``~/.pgpass``); ``redacted`` is the URL
without any password, the only form piwf ever writes or prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from piwf.errors import StoreError
from piwf.store.api.record import join as _join, redact

DEFAULT_SCHEMA = "piwf"
SCHEMES = ("postgresql", "postgres")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# No host holds a lock or a connection forever: a statement, a wait for a lock and an idle
# open transaction are each cut off (the call fails with StorageUnavailable, retried).
STATEMENT_TIMEOUT_MS = 30_000
LOCK_TIMEOUT_MS = 5_000  # as SQLite's busy timeout
IDLE_IN_TRANSACTION_MS = 60_000
POOL_SIZE = 8
MAX_POOL_SIZE = 1000
CONNECT_TIMEOUT_S = 10
# libpq's TCP settings, unless the URL gives its own: a silent peer is found within ~10 s,
# so a host cut off mid-call gets its call back (and can join again) soon after its fence.
TCP_DEFAULTS = {"keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "2", "keepalives_count": "3",
                "tcp_user_timeout": "10000"}
_DURATION = re.compile(r"^(\d{1,10})\s*(ms|s|min|h)?$")
_UNIT_MS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000}
_MAX_MS = 2**31 - 1  # PostgreSQL's limit for these settings


@dataclass(frozen=True)
class Limits:
    """The time limits every connection sets (ms): so that no host holds a lock forever."""

    statement_ms: int = STATEMENT_TIMEOUT_MS
    lock_ms: int = LOCK_TIMEOUT_MS
    idle_in_transaction_ms: int = IDLE_IN_TRANSACTION_MS


# URL parameter -> Limits field
LIMIT_PARAMETERS = {"statement_timeout": "statement_ms", "lock_timeout": "lock_ms",
                    "idle_in_transaction_session_timeout": "idle_in_transaction_ms"}
PIWF_PARAMETERS = ("schema", "pool_size", *LIMIT_PARAMETERS)


@dataclass(frozen=True)
class StoreUrl:
    conninfo: str  # for libpq (may hold a password: never log it)
    schema: str
    redacted: str  # without any password
    pool_size: int = POOL_SIZE
    connect_timeout_s: int = CONNECT_TIMEOUT_S
    limits: Limits = field(default_factory=Limits)  # the URL's time limits, else the defaults
    tcp: dict[str, str] = field(default_factory=dict)  # TCP_DEFAULTS the URL does not set

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """What every connection is opened with besides the conninfo."""
        return {"connect_timeout": self.connect_timeout_s, **self.tcp}


def is_postgres(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def parse(url: str) -> StoreUrl:
    """Split piwf's parameters off a store URL; one clear line for a malformed one, never
    quoting its password."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise StoreError(f"a store URL starts with postgresql://, not {redact(url)!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    schema = query.get("schema", DEFAULT_SCHEMA)
    if not _SCHEMA_NAME.match(schema):
        raise StoreError(f"schema {schema!r} in the store URL is not a plain lower-case name (a-z, 0-9, _)")
    pool_size = _count("pool_size", query.get("pool_size"), POOL_SIZE, 2, MAX_POOL_SIZE)
    connect_timeout = _count("connect_timeout", query.get("connect_timeout"), CONNECT_TIMEOUT_S, 1, 86_400)
    limits = Limits(**{name: _duration_ms(key, query[key]) for key, name in LIMIT_PARAMETERS.items() if key in query})
    rest = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True)
            if key not in PIWF_PARAMETERS]
    conninfo = _join(parts.scheme, parts.netloc, parts.path, rest)
    tcp = {key: value for key, value in TCP_DEFAULTS.items() if key not in query}
    return StoreUrl(conninfo, schema, redact(url), pool_size, connect_timeout, limits, tcp)


def _count(key: str, value: str | None, default: int, lowest: int, highest: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not lowest <= int(value) <= highest:
        raise StoreError(f"{key} {value!r} in the store URL is not a whole number from {lowest} to {highest}")
    return int(value)


def _duration_ms(key: str, value: str) -> int:
    """A time limit: milliseconds, or a number with a unit (ms, s, min, h); at least 1 ms."""
    match = _DURATION.match(value.strip())
    ms = int(match.group(1)) * _UNIT_MS[match.group(2) or "ms"] if match else 0
    if not 1 <= ms <= _MAX_MS:
        raise StoreError(f"{key} {value!r} in the store URL is not a time limit: milliseconds, or with a unit "
                         f"(500ms, 30s, 2min, 1h), from 1 ms to {_MAX_MS} ms")
    return ms


def database_name(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/"))
