"""The console's run actions that the browser tests do not click, over plain HTTP against
a real host and a real ``piwf ui``: resolving an ambiguous effect, resuming a paused run,
and the run's settings section — each with its refusals (nothing sent, nothing changed)."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from .ui_support import Stack, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("piwf.ui.console")  # the ui extra (part of the test extra)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("ui-actions"))
    try:
        s.start_host()
        s.start_console("--as", "ann")
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[Any]:
    """A client with the console's cookie and its Origin, as its own pages send forms."""
    port = stack.base.rsplit(":", 1)[1]
    with httpx.Client(base_url=stack.base, headers={"cookie": f"piwf_ui_{port}={stack.token}", "origin": stack.base},
                      follow_redirects=False) as c:
        yield c


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)  # type: ignore[union-attr]


def said(client: Any, answer: Any) -> str:
    """What the page an action led to says about it (its notice), as text."""
    assert answer.status_code == 303, answer.text
    page = client.get(answer.headers["location"]).text
    found = re.search(r'<p class="notice (ok|bad)" role="status">(.*?)</p>', page, re.S)
    assert found is not None, page
    return f"{found.group(1)}: {html.unescape(found.group(2))}"


def held_on_effect(stack: Stack, run_id: str) -> dict[str, Any] | None:
    run = stack.run(run_id)
    return run if run["hold"] == "effect" and run["queueStatus"] == "parked" else None


def test_an_ambiguous_effect_is_resolved_from_its_run_page_and_bad_forms_send_nothing(
        stack: Stack, client: Any) -> None:
    run_id = stack.start_run("pay")
    held = wait_until(lambda: held_on_effect(stack, run_id), what="the run held on its effect")
    assert [(e["key"], e["status"]) for e in held["effects"]] == [("charge", "ambiguous")]
    page = client.get(f"/runs/{run_id}").text
    assert f'action="/runs/{run_id}/effects/resolve"' in page and "It was applied" in page
    assert 'id="action-resume"' not in page  # the host refuses resume here: the effect's form is the way on
    form = {"csrf": csrf_of(page), "back": f"/runs/{run_id}", "key": "charge"}
    url = f"/runs/{run_id}/effects/resolve"

    refusals = [
        ({"applied": "no", "result": '{"charged": 1}'}, "bad: a result goes with 'it was applied'; nothing was sent"),
        ({"applied": "yes", "result": "{charged"}, "bad: the result is not JSON (a JSON string needs its quotes); "
                                                   "nothing was sent"),
    ]
    for fields, expected in refusals:
        assert said(client, client.post(url, data={**form, **fields})) == expected
    unknown = said(client, client.post(url, data={**form, "key": "refund", "applied": "yes"}))
    assert unknown.startswith("bad: notFound: ") and "refund" in unknown, unknown
    no_csrf = client.post(url, data={**form, "csrf": "0" * 64, "applied": "yes"})
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text
    assert held_on_effect(stack, run_id) is not None  # none of these changed anything

    resolved = said(client, client.post(url, data={**form, "applied": "yes", "result": '{"charged": 1}'}))
    assert resolved == f"ok: {run_id}: effect charge resolved as applied"
    wait_until(lambda: stack.run(run_id)["status"] == "completed", what="the run going on")
    done = stack.run(run_id)
    assert done["output"] == {"paid": {"charged": 1}}  # the recorded result, never applied again
    again = said(client, client.post(url, data={**form, "applied": "no"}))
    assert again.startswith("bad: ") and "charge" in again, again  # no longer ambiguous: the host refuses


def test_a_paused_run_is_resumed_from_its_page_and_a_refused_resume_says_why(stack: Stack, client: Any) -> None:
    run_id = stack.start_run("tuned")
    stack.open_request(run_id)
    stack.call("run.pause", run_id=run_id)
    assert stack.run(run_id)["paused"]
    page = client.get(f"/runs/{run_id}").text
    assert 'id="action-resume"' in page and 'id="action-pause"' not in page
    form = {"csrf": csrf_of(page), "back": f"/runs/{run_id}"}

    no_csrf = client.post(f"/runs/{run_id}/resume", data={**form, "csrf": ""})
    assert no_csrf.status_code == 403
    other_origin = client.post(f"/runs/{run_id}/resume", data=form, headers={"origin": "http://evil.example"})
    assert other_origin.status_code == 403
    assert stack.run(run_id)["paused"]  # refused before anything was sent

    assert said(client, client.post(f"/runs/{run_id}/resume", data=form)) == f"ok: {run_id}: resume accepted"
    resumed = stack.run(run_id)
    assert not resumed["paused"] and resumed["status"] == "waiting"
    page = client.get(f"/runs/{run_id}").text
    assert 'id="action-resume"' not in page and 'id="action-pause"' in page

    ended = stack.start_run("boom")
    wait_until(lambda: stack.run(ended)["status"] == "failed", what="the run failing")
    refused = said(client, client.post(f"/runs/{ended}/resume", data=form))  # not offered; sent by hand
    assert refused == f"bad: rejected: run {ended} has already ended (failed)"  # the host's refusal, as the CLI says
    assert stack.run(ended)["status"] == "failed"


def test_the_settings_section_shows_the_settings_in_force_and_every_change(stack: Stack, client: Any) -> None:
    run_id = stack.start_run("tuned")
    stack.open_request(run_id)
    stack.call("workflow.changeSettings", run_id=run_id, payload={"patch": {"budget": 5}})
    page = client.get(f"/runs/{run_id}").text
    section = page.split("<h2>Settings</h2>", 1)[1].split("<h2>", 1)[0]
    assert "change 1 · mutable: budget" in section
    assert re.search(r'"budget": 5,\s*"model": "small"', html.unescape(section)), section
    rows = re.findall(r"<tr><td>(\d+)</td><td>(.*?)</td>", section)
    assert [(n, who.split()[0]) for n, who in rows] == [("0", "start"), ("1", "client")], rows
    plain = client.get(f"/runs/{stack.start_run('boom')}").text
    assert "<h2>Settings</h2>" not in plain  # a workflow without settings has no section (the host rejects the read)


def test_a_run_the_host_does_not_know_is_a_404_page_with_the_hosts_reason(client: Any) -> None:
    answer = client.get("/runs/run-0000000000000000")
    assert answer.status_code == 404, answer.status_code
    assert "run-0000000000000000" in answer.text and "notFound" in answer.text
    assert client.get("/runs/run-0000000000000000/confirm/cancel").status_code == 404
