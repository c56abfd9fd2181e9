"""An ask's form, generated from the JSON Schema the ask publishes (msgspec's, from its
``expect`` type), and the value read back from what was typed into it.

An object with properties is a field per property; anything else one field. Numbers,
whole numbers, text, yes/no and a choice among constants get inputs of their kind; what
a form cannot draw (a list, a nested object, a union, ``Any``) is a JSON text field. What
does not even read as its kind (``abc`` for a whole number) is refused here, by the
field, and nothing is sent; everything else goes to the workflow, whose refusal reason
(``lastSubmission.error``) the page shows by the form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PREFIX = "f."  # a form field's name: f.<property>, or f.value for a form of one field
SIMPLE = ("integer", "number", "string", "boolean")


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str  # integer, number, string, boolean, enum, json
    required: bool
    description: str = ""
    choices: list[tuple[str, str]] = field(default_factory=list)  # (value as JSON, label)


def _resolve(schema: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$ref`` (``#/$defs/Name``) followed."""
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 32:
        schema = defs.get(str(schema["$ref"]).rsplit("/", 1)[-1], {})
        seen += 1
    return schema if isinstance(schema, dict) else {}


def _kind(schema: dict[str, Any]) -> str:
    if "enum" in schema and all(isinstance(v, str | int | float | bool) or v is None for v in schema["enum"]):
        return "enum"
    kind = schema.get("type")
    return kind if kind in SIMPLE else "json"


def _field(name: str, schema: dict[str, Any], required: bool, label: str) -> Field:
    kind = _kind(schema)
    choices = [(json.dumps(v), str(v)) for v in schema.get("enum", [])] if kind == "enum" else []
    return Field(PREFIX + name, label, kind, required, str(schema.get("description", "")), choices)


def fields(schema: Any) -> list[Field]:
    """The form's fields for an ask expecting ``schema``."""
    defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    root = _resolve(schema, defs)
    properties = root.get("properties")
    if root.get("type") == "object" and isinstance(properties, dict) and properties:
        required = set(root.get("required", []))
        return [_field(name, _resolve(sub, defs), name in required, name) for name, sub in properties.items()]
    return [_field("value", root, True, str(root.get("title") or "value"))]


def is_object(schema: Any) -> bool:
    defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    root = _resolve(schema, defs)
    return root.get("type") == "object" and bool(root.get("properties"))


def read_value(schema: Any, form: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """The value typed into the form, and the fields that did not read (name → why)."""
    value: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for f in fields(schema):
        text = form.get(f.name, "")
        if f.kind == "boolean":
            value[f.name] = text == "on"
            continue
        if text.strip() == "" and f.kind != "string":
            if f.required:
                errors[f.name] = "a value is needed here"
            continue
        try:
            value[f.name] = _read(f, text)
        except ValueError as exc:
            errors[f.name] = str(exc)
    if not is_object(schema):
        return value.get(PREFIX + "value"), errors
    return {name.removeprefix(PREFIX): v for name, v in value.items()}, errors


def _read(f: Field, text: str) -> Any:
    if f.kind == "integer":
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not a whole number") from None
    if f.kind == "number":
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not a number") from None
    if f.kind == "enum":
        if text not in {value for value, _ in f.choices}:
            raise ValueError("choose one of the listed values")
        return json.loads(text)
    if f.kind == "json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc.args[0].split(':')[0]}); a JSON string needs its quotes") from None
    return text
