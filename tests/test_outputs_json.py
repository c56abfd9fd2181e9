"""Outputs, effect results and updates JSON cannot hold exactly (NaN, Infinity, bytes,
sets, non-text keys, other types) are refused with a clear error that names where; what
is stored is exactly what a later node sees, before a crash as after one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from piwf.engine.values import NotJson, as_stored
from piwf.paths import StatePaths

from .conftest import write_workflow
from .test_interactions import start, wait_run

ODD = """
    import datetime, os
    from pathlib import Path
    from piwf import Workflow, compute

    VALUES = {
        "nan": lambda: {"score": float("nan")},
        "infinity": lambda: {"scores": [1.5, float("-inf")]},
        "bytes": lambda: {"blob": b"\\x00\\x01"},
        "set": lambda: {"tags": {"a", "b"}},
        "intkey": lambda: {"by_id": {1: "one"}},
        "datetime": lambda: {"at": datetime.datetime(2026, 1, 2)},
        "effect": None,
        "update": None,
    }

    def make(ctx):
        with open(Path(ctx.project_path) / "make.log", "a") as f:
            f.write("ran\\n")
        kind = ctx.input["kind"]
        if kind == "effect":
            return ctx.effect("tags", lambda: {"tags": {"x"}})
        if kind == "update":
            ctx.publish("progress", "ratio", {"done": float("nan")})
            return 1
        return VALUES[kind]()

    workflow = Workflow(name="odd", start_at="make", nodes={"make": compute(make)})
"""

TUPLES = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def pair(ctx):
        return {"pair": (1, 2), "nested": [("a", 1)]}

    def look(ctx):
        seen = ctx.outputs["pair"]
        marker = Path(ctx.project_path) / "crashed-once"
        if ctx.input.get("crash") and not marker.exists():
            marker.touch()
            os._exit(9)  # the next worker sees "pair" from the store
        return {"pair": type(seen["pair"]).__name__, "nested": type(seen["nested"][0]).__name__,
                "effect": type(ctx.effect("e", lambda: (3, 4))).__name__}

    workflow = Workflow(name="tuples", start_at="pair", nodes={"pair": compute(pair), "look": compute(look)},
                        edges=[("pair", "look")])
"""


@pytest.mark.parametrize(("kind", "said"), [
    ("nan", "node output is not JSON: nan at $['score'] (JSON has no NaN or Infinity)"),
    ("infinity", "node output is not JSON: -inf at $['scores'][1] (JSON has no NaN or Infinity)"),
    ("bytes", "node output is not JSON: a bytes at $['blob'] (JSON has no bytes; decode it to text or base64"),
    ("set", "node output is not JSON: a set at $['tags'] (JSON has no set; return a sorted list)"),
    ("intkey", "node output is not JSON: the int key 1 at $['by_id'] (JSON keys are text)"),
    ("datetime", "node output is not JSON: a datetime at $['at'] (JSON has no datetime"),
    ("effect", "effect 'tags': the value apply() returned is not JSON: a set at $['tags']"),
    ("update", "update progress/ratio is not JSON: nan at $['done']"),
])
async def test_a_value_json_cannot_hold_fails_its_node_once_saying_where(
        host: Any, paths: StatePaths, project: Path, kind: str, said: str) -> None:
    write_workflow(project, "odd", ODD)
    failed = await wait_run(paths, await start(paths, project, "odd", input={"kind": kind}))
    assert failed["status"] == "failed"
    assert said in failed["error"]["message"]
    assert (project / "make.log").read_text() == "ran\n"  # a failure, not a crash to retry
    assert [w["status"] for w in failed["workers"]] == ["exited"]


@pytest.mark.parametrize("crash", [False, True])
async def test_a_later_node_sees_the_stored_json_before_a_crash_as_after_one(
        host: Any, paths: StatePaths, project: Path, crash: bool) -> None:
    write_workflow(project, "tuples", TUPLES)
    done = await wait_run(paths, await start(paths, project, "tuples", input={"crash": crash}))
    assert done["status"] == "completed", done.get("error")
    assert done["output"] == {"pair": "list", "nested": "list", "effect": "list"}
    assert len(done["workers"]) == (2 if crash else 1)


def test_json_values_pass_as_they_decode() -> None:
    value = {"a": [1, 2.5, -0.0, True, None, "é", {"b": (1, (2,))}], "big": 2**63 - 1}
    encoded, stored = as_stored(value, "output", 64)
    assert stored == {"a": [1, 2.5, -0.0, True, None, "é", {"b": [1, [2]]}], "big": 2**63 - 1}
    assert encoded.startswith(b'{"a":')
    with pytest.raises(NotJson, match=r"nan at \$\[0\]\['x'\]"):
        as_stored([{"x": float("nan")}], "output", 64)
