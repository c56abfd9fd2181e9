"""The console's pure parts: an ask's form from its JSON Schema (msgspec's), the value read
back from it, the feed's fan-out, and the graph's layout and escaping."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest
import trio
import trio.testing

pytest.importorskip("piwf.ui.console")  # the ui extra (part of the test extra)

from piwf.paths import StatePaths
from piwf.ui import forms, graph
from piwf.ui.feed import Feed
from piwf.ui.guard import Guard


class Order(msgspec.Struct):
    copies: int
    colour: Literal["red", "blue"]
    note: str = ""
    rush: bool = False
    tags: list[str] = []
    weight: float | None = None


def test_a_whole_number_is_one_field_read_as_a_whole_number() -> None:
    schema = msgspec.json.schema(int)
    [field] = forms.fields(schema)
    assert (field.name, field.kind, field.required) == ("f.value", "integer", True)
    assert forms.read_value(schema, {"f.value": " 7 "}) == (7, {})
    assert forms.read_value(schema, {"f.value": "three"}) == (None, {"f.value": "'three' is not a whole number"})
    assert forms.read_value(schema, {"f.value": ""}) == (None, {"f.value": "a value is needed here"})


def test_a_struct_is_a_field_per_property_each_of_its_kind() -> None:
    schema = msgspec.json.schema(Order)
    got = {f.name: (f.kind, f.required) for f in forms.fields(schema)}
    assert got == {"f.copies": ("integer", True), "f.colour": ("enum", True), "f.note": ("string", False),
                   "f.rush": ("boolean", False), "f.tags": ("json", False), "f.weight": ("json", False)}
    typed = {"f.copies": "2", "f.colour": '"blue"', "f.note": "<b>", "f.rush": "on", "f.tags": '["a"]'}
    value, errors = forms.read_value(schema, typed)
    assert errors == {}
    assert msgspec.convert(value, Order) == Order(2, "blue", "<b>", True, ["a"])
    _, errors = forms.read_value(schema, {**typed, "f.colour": '"green"', "f.tags": "[a"})
    assert set(errors) == {"f.colour", "f.tags"}


def test_the_graph_is_layered_from_the_start_and_its_text_escaped() -> None:
    recorded = {
        "startAt": "a", "nodes": [
            {"id": "a", "kind": "compute", "state": "accepted"},
            {"id": "<b>", "kind": "decision", "state": "waiting", "title": "<script>x</script>"},
            {"id": "c", "kind": "shell", "state": "not_reached"}],
        "edges": [{"node": "a", "exit": "next", "to": "<b>"}, {"node": "<b>", "exit": "yes", "to": "c"},
                  {"node": "<b>", "exit": "no", "to": "a"}],
        "path": [{"seq": 0, "node": "a", "status": "accepted", "exit": "next"},
                 {"seq": 1, "node": "<b>", "status": "waiting", "exit": None}]}
    drawn = graph.from_run_graph(recorded)
    assert graph.layers(drawn) == {"a": 0, "<b>": 1, "c": 2}
    assert [e["taken"] for e in drawn.edges] == [True, False, False]
    counted = {**recorded, "edges": [{**e, "taken": 1 if e["exit"] == "no" else 0} for e in recorded["edges"]]}
    assert [e["taken"] for e in graph.from_run_graph(counted).edges] == [False, False, True]  # the host's count
    svg = str(graph.svg(drawn))
    assert "<script>" not in svg and "&lt;script&gt;" in svg and 'data-node="&lt;b&gt;"' in svg
    assert 'data-state="not reached"' in svg and 'data-state="waiting"' in svg


def test_without_a_recorded_graph_the_path_is_drawn_from_the_steps() -> None:
    run = {"steps": [{"node": "a", "status": "accepted"}, {"node": "b", "status": "waiting"}],
           "waitingFor": [{"nodeId": "b"}]}
    drawn = graph.from_steps(run)
    assert [(n["id"], n["state"]) for n in drawn.nodes] == [("a", "accepted"), ("b", "waiting")]
    assert [(e["from"], e["to"]) for e in drawn.edges] == [("a", "b")]


async def test_one_feed_tells_every_waiting_tab_which_runs_changed() -> None:
    feed = Feed(StatePaths.resolve("/nonexistent"), "t")  # never served: only the fan-out is used
    seen: list[object] = []

    async def tab() -> None:
        seen.append(await feed.next_change(0))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(tab)
        await trio.testing.wait_all_tasks_blocked()
        feed.publish(frozenset({"run-1"}))
    assert [(c.version, c.runs) for c in seen] == [(1, ["run-1"])] * 3  # type: ignore[attr-defined]
    feed.publish(frozenset({"run-2"}))
    feed.publish(None)
    assert (await feed.next_change(1)).runs is None  # anything may have changed
    feed.publish(frozenset({"run-3"}))
    assert (await feed.next_change(3)).runs == ["run-3"]


def test_the_csrf_field_is_derived_from_the_token() -> None:
    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not called")
    one = Guard(app, token="a" * 43, hosts=["127.0.0.1:1"], cookie="c")
    assert one.csrf == Guard(app, token="a" * 43, hosts=[], cookie="c").csrf
    assert one.csrf != Guard(app, token="b" * 43, hosts=[], cookie="c").csrf
    assert "a" * 43 not in one.csrf


def test_the_console_says_a_runs_state_as_the_cli_does() -> None:
    from piwf.cli import runview
    from piwf.ui import words

    assert words.WHY_HELD == runview.WHY_HELD and words.HELD_FOR_A_PERSON == runview.HELD_FOR_A_PERSON
    for hold in (None, "paused", "waiting", "crashed", "effect", "source"):
        for queue in ("queued", "running", "parked", "done"):
            for paused in (False, True):
                run = {"hold": hold, "queueStatus": queue, "paused": paused, "status": "waiting"}
                assert (words.state(run), words.held(run)) == (runview.state(run), runview.held(run))
