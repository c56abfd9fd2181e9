"""What a node may hand the host to store: JSON, exactly.

A node's output, an effect's result and a published update are stored as JSON and read
back by later nodes, later attempts and watchers. msgspec would encode far more than JSON
holds (NaN and Infinity as ``null``, bytes as base64, a set as a list in no set order,
``{1: "a"}`` as ``{"1": "a"}``, a datetime as text), so a later node would see one value
before a crash and another after it. Such values are refused here, each with the path to
the first one; what passes is handed on as the JSON decodes (a tuple becomes a list), on
the first pass as after a replay.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from piwf.errors import ProtocolError
from piwf.wire import canonical_json, check_nesting

_decoder = msgspec.json.Decoder()

_HINTS = {
    bytes: "decode it to text or base64 it yourself",
    bytearray: "decode it to text or base64 it yourself",
    memoryview: "decode it to text or base64 it yourself",
    set: "return a sorted list",
    frozenset: "return a sorted list",
}


class NotJson(TypeError):
    """A value JSON cannot hold as it is: storing it would change it."""


class TooDeep(ValueError):
    """A value nested deeper than its limit (the frames carrying it add their own levels)."""


def as_stored(value: Any, what: str, max_nesting: int) -> tuple[bytes, Any]:
    """``value`` as JSON and as a later reader decodes it; NotJson (naming ``what`` and the
    path) for a value JSON cannot hold exactly, TooDeep past ``max_nesting`` levels."""
    try:
        encoded = canonical_json(value)
    except RecursionError:
        raise TooDeep(f"{what} is nested too deep (or holds itself)") from None
    except (TypeError, msgspec.EncodeError) as exc:
        raise NotJson(f"{what} is not JSON: {_walked(value) or exc}") from exc
    try:
        check_nesting(encoded, max_nesting)
    except ProtocolError as exc:
        raise TooDeep(f"{what} is {exc}") from None
    decoded = _decoder.decode(encoded)
    if decoded != value:  # cheap in C; only a difference is walked, to name it (or find only tuples)
        problem = _walked(value)
        if problem is not None:
            raise NotJson(f"{what} is not JSON: {problem}")
    return encoded, decoded


def _walked(value: Any) -> str | None:
    try:
        return _first_problem(value, "$")
    except RecursionError:  # nested past Python's own limit: msgspec's message says enough
        return None


def _first_problem(value: Any, path: str) -> str | None:
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} at {path} (JSON has no NaN or Infinity)"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"the {type(key).__name__} key {key!r} at {path} (JSON keys are text)"
            found = _first_problem(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_problem(item, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    kind = type(value).__name__
    hint = next((h for t, h in _HINTS.items() if isinstance(value, t)), "convert it to JSON yourself")
    return f"a {kind} at {path} (JSON has no {kind}; {hint})"
