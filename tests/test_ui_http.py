"""``piwf ui`` over plain HTTP: a real host, a real console process, httpx as the client.
The security checks (token, cookie, Host, Origin, CSRF, escaping, the token's file), who
an answer is recorded as, first answer wins, and the origin session's read-only rule."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .ui_support import Stack, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("piwf.ui.console")  # the ui extra (part of the test extra)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("ui-http"))
    try:
        s.start_host()
        s.start_console("--as", "ann")
        yield s
    finally:
        s.stop()


def browser(stack: Stack, **headers: str) -> Any:
    """An HTTP client with the console's token (as the cookie a browser has)."""
    host = stack.base.removeprefix("http://")
    cookie = f"piwf_ui_{host.rsplit(':', 1)[1]}={stack.token}"
    return httpx.Client(base_url=stack.base, headers={"cookie": cookie, **headers}, follow_redirects=False)


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', html).group(1)  # type: ignore[union-attr]


def test_a_request_without_the_token_is_refused(stack: Stack) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"cookie": "piwf_ui_1=" + stack.token[:-1] + "x"}):
        answer = httpx.get(stack.base + "/", headers=headers)
        assert answer.status_code == 403, headers
        assert answer.text.startswith("refused: no valid token") and answer.text.count("\n") == 1
    assert httpx.get(stack.base + "/runs/x?token=nope").status_code == 403
    assert httpx.get(stack.base + "/static/ui.js").status_code == 403  # everything is behind it


def test_the_address_sets_a_cookie_and_the_token_leaves_the_address_bar(stack: Stack) -> None:
    answer = httpx.get(stack.url + "&status=running")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/?status=running"
    cookie = answer.headers["set-cookie"]
    assert f"={stack.token};" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    name = cookie.split("=", 1)[0]
    page = httpx.get(stack.base + "/", headers={"cookie": f"{name}={stack.token}"})
    assert page.status_code == 200 and "<h1>Runs</h1>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"


def test_a_host_header_other_than_the_consoles_is_refused(stack: Stack) -> None:
    port = stack.base.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "127.0.0.1", f"127.0.0.1.nip.io:{port}"):
        answer = httpx.get(stack.base + "/", headers={"host": host, "authorization": f"Bearer {stack.token}"})
        assert answer.status_code == 421, host
        assert "DNS rebinding" in answer.text
    with browser(stack, host=f"localhost:{port}") as client:
        assert client.get("/").status_code == 200


def test_a_state_change_needs_this_consoles_origin_and_its_csrf_field(stack: Stack) -> None:
    run_id = stack.start_run("gated")
    wait_until(lambda: stack.run(run_id)["status"] == "running", what="the run running")
    with browser(stack) as client:
        csrf = csrf_of(client.get(f"/runs/{run_id}").text)
        form = {"csrf": csrf, "back": f"/runs/{run_id}"}
        for headers in ({"origin": "http://evil.example"}, {"referer": "http://evil.example/page"}, {},
                        {"origin": "null"}):
            answer = client.post(f"/runs/{run_id}/pause", data=form, headers=headers)
            assert answer.status_code == 403, headers
            assert answer.text.startswith("refused: a change must come from this console's own pages")
        same = {"origin": stack.base}
        answer = client.post(f"/runs/{run_id}/pause", data={**form, "csrf": "0" * 64}, headers=same)
        assert answer.status_code == 403 and "CSRF" in answer.text
        assert not stack.run(run_id)["paused"]  # nothing of the above changed anything
        answer = client.post(f"/runs/{run_id}/pause", data=form, headers=same)
        assert answer.status_code == 303
        assert stack.run(run_id)["paused"]
        page = client.get(answer.headers["location"]).text
        assert f"{run_id}: pause accepted" in page
        # cancel cannot be taken back: without the confirmation page's field it leads there
        answer = client.post(f"/runs/{run_id}/cancel", data=form, headers=same)
        assert answer.status_code == 303 and answer.headers["location"] == f"/runs/{run_id}/confirm/cancel"
        assert stack.run(run_id)["queueStatus"] != "cancelled"
        confirm = client.get(answer.headers["location"]).text
        assert "It cannot be undone" in confirm
        answer = client.post(f"/runs/{run_id}/cancel", data={**form, "confirmed": "yes"}, headers=same)
        assert answer.status_code == 303
        assert stack.run(run_id)["status"] == "cancelled"
        again = client.post(f"/runs/{run_id}/pause", data=form, headers=same)
        refusal = client.get(again.headers["location"]).text
        assert re.search(r'class="notice bad"[^>]*>[^<]*(conflict|rejected)', refusal), refusal


def test_workflow_text_is_shown_as_text(stack: Stack) -> None:
    run_id = stack.start_run("deploy")
    stack.open_request(run_id)
    with browser(stack) as client:
        for path in ("/inbox", f"/runs/{run_id}"):
            html = client.get(path).text
            assert "<script>document.title" not in html
            assert "&lt;script&gt;document.title=&#39;owned&#39;&lt;/script&gt; Deploy build 42?" in html


def test_an_answer_is_recorded_as_the_console_and_the_first_answer_wins(stack: Stack) -> None:
    first, second = stack.start_run("deploy"), stack.start_run("deploy")
    mine, theirs = stack.open_request(first), stack.open_request(second)
    stack.call("decision.answer", payload={"requestId": theirs["requestId"], "choice": "no"})  # cli, first
    with browser(stack, origin=stack.base) as client:
        csrf = csrf_of(client.get("/inbox").text)
        for request in (mine, theirs):
            answer = client.post(f"/requests/{request['requestId']}/decide",
                                 data={"csrf": csrf, "back": "/inbox", "run": request["runId"], "choice": "yes"})
            assert answer.status_code == 303
            notice = client.get(answer.headers["location"]).text
            if request is mine:
                assert f"{mine['requestId']}: answered yes (run {first})" in notice
            else:
                assert "another answer won (no by " in notice, notice
    resolved = stack.call("interaction.list", payload={"runId": first, "open": False})["requests"][0]
    assert resolved["resolution"]["answeredBy"] == "ann"  # piwf ui --as ann
    lost = stack.call("interaction.list", payload={"runId": second, "open": False})["requests"][0]
    assert lost["resolution"]["choice"] == "no"
    wait_until(lambda: stack.run(first)["status"] == "completed", what="the run going on")
    with browser(stack) as client:
        html = client.get(f"/runs/{first}").text  # each step with its output (run.steps)
    assert "&#34;build&#34;: 42" in html and "&#34;answeredBy&#34;: &#34;ann&#34;" in html


def test_a_choice_that_takes_text_has_its_field_and_the_text_is_recorded(stack: Stack) -> None:
    run_id = stack.start_run("review")
    request = stack.open_request(run_id)
    with browser(stack, origin=stack.base) as client:
        html = client.get(f"/runs/{run_id}").text
        assert 'name="input.no"' in html and "Why hold?" in html and 'maxlength="200"' in html
        assert 'name="input.yes"' not in html
        answer = client.post(f"/requests/{request['requestId']}/decide", data={
            "csrf": csrf_of(html), "back": f"/runs/{run_id}", "run": run_id, "choice": "no",
            "input.no": "the docs are missing", "input.yes": "ignored"})
        assert answer.status_code == 303
    wait_until(lambda: stack.run(run_id)["status"] == "completed", what="the run going on")
    output = stack.run(run_id)["output"]
    assert (output["choice"], output["input"]) == ("no", "the docs are missing")


def test_a_sessions_request_is_read_only_unless_the_console_is_the_sessions(stack: Stack, tmp_path: Path) -> None:
    receipt = stack.call("run.start", payload={"workflow": "count", "projectPath": str(stack.project),
                                               "originSessionId": "sess-1"})
    request = stack.open_request(receipt["runId"])
    form = {"back": "/inbox", "run": receipt["runId"], "f.value": "3"}
    with browser(stack, origin=stack.base) as client:
        html = client.get("/inbox").text
        section = html[html.index(f'id="req-{request["requestId"]}"'):]
        assert "Read-only here" in section.split("</section>")[0]
        # This page has no form to take the console's csrf from unless another test left an
        # answerable request on it (the stack is the module's): the cancel confirmation has one.
        csrf = csrf_of(client.get(f"/runs/{receipt['runId']}/confirm/cancel").text)
        answer = client.post(f"/requests/{request['requestId']}/answer", data={**form, "csrf": csrf})
        assert "belongs to session sess-1" in client.get(answer.headers["location"]).text
    assert stack.call("interaction.list", payload={"runId": receipt["runId"]})["requests"][0]["lastSubmission"] is None
    # a second console, for that session, on a Unix socket
    sock = tmp_path / "ui.sock"
    other = stack.another_console(tmp_path, "--socket", str(sock), "--session", "sess-1")
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://localhost",
                          headers={"authorization": f"Bearer {other.token}", "origin": "http://localhost"}) as client:
            html = client.get("/inbox").text
            answer = client.post(f"/requests/{request['requestId']}/answer", data={**form, "csrf": csrf_of(html)})
            assert answer.status_code == 303
        wait_until(lambda: stack.run(receipt["runId"])["status"] == "completed", what="the ask answered")
    finally:
        other.stop()


def test_the_token_is_in_a_file_of_the_users_alone_and_on_no_command_line(stack: Stack) -> None:
    record = stack.record()
    assert record["url"] == stack.url and record["token"] == stack.token and record["answersAs"] == "ann"
    [path] = (stack.paths.root / "ui").glob("console-*.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stack.console is not None
    assert stack.token.encode() not in Path(f"/proc/{stack.console.pid}/cmdline").read_bytes()


def _changes(lines: Any) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def test_the_event_stream_outlives_a_host_restart(tmp_path: Path) -> None:
    """One watch for the console, told to every tab: the host going away and coming back
    is said on the stream, and what changes after is told as before (as piwf watch does)."""
    s = Stack(tmp_path)
    try:
        s.start_host()
        s.start_console()
        with browser(s) as client, client.stream("GET", "/events", timeout=60) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            changes = _changes(stream.iter_lines())
            assert s.host is not None
            s.host.send_signal(signal.SIGTERM)
            s.host.wait(30)
            assert next(changes) == {"version": 1, "runs": None, "host": False, "resources": True}
            page = client.get("/")
            assert page.status_code == 503 and "does not answer" in page.text
            s.start_host()
            assert next(changes) == {"version": 2, "runs": None, "host": True, "resources": True}
            run_id = s.start_run("count")
            assert run_id in next(change for change in changes if change["runs"])["runs"]
    finally:
        s.stop()


def test_bad_start_arguments_are_one_line_and_start_nothing(stack: Stack, tmp_path: Path) -> None:
    port = stack.base.rsplit(":", 1)[1]  # the stack's console holds it
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("")
    for args, said in ((["--port", port], f"cannot listen on 127.0.0.1:{port}: Address already in use"),
                       (["--socket", str(not_a_socket)], "the path exists and is not a socket"),
                       (["--as", "a\tb"], "--as must be printable text")):
        done = subprocess.run([sys.executable, "-m", "piwf", "ui", "--state-dir", str(stack.paths.root), *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        assert done.stdout == "" and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert len(list((stack.paths.root / "ui").glob("console-*.json"))) == 1  # the stack's own, alone


def test_every_open_tab_is_fed_by_the_consoles_one_watch(stack: Stack) -> None:
    """Ten tabs' event streams cost the host no connection: the console holds one for its
    requests and one for its run.watch, whatever the number of tabs."""
    with contextlib.ExitStack() as tabs, browser(stack) as client:
        streams = [tabs.enter_context(client.stream("GET", "/events", timeout=60)) for _ in range(10)]
        changes = [_changes(stream.iter_lines()) for stream in streams]
        run_id = stack.start_run("count")
        for tab in changes:
            assert run_id in next(change for change in tab if change["runs"])["runs"]
        connected = stack.call("host.status")["connectedClients"]
    assert connected <= 3  # the console's two, and this status request's own


def test_retry_asks_first_and_says_what_the_cli_says_and_the_list_filters(stack: Stack) -> None:
    run_id = stack.start_run("boom")
    wait_until(lambda: stack.run(run_id)["status"] == "failed", what="the run failing")
    with browser(stack, origin=stack.base) as client:
        html = client.get(f"/runs/{run_id}").text
        assert "ValueError: the fuse was lit" in html and f'href="/runs/{run_id}/confirm/retry"' in html
        assert 'id="action-pause"' not in html  # an ended run is not paused
        confirm = client.get(f"/runs/{run_id}/confirm/retry").text
        assert "accepted steps and applied effects are kept" in confirm
        form = {"csrf": csrf_of(confirm), "back": f"/runs/{run_id}"}
        asked = client.post(f"/runs/{run_id}/retry", data=form)
        assert asked.headers["location"] == f"/runs/{run_id}/confirm/retry"
        assert stack.run(run_id)["generation"] == 1
        done = client.post(f"/runs/{run_id}/retry", data={**form, "confirmed": "yes"})
        notice = client.get(done.headers["location"]).text
        assert f"{run_id}: retried (failed → queued, generation 2); it continues from node explode" in notice
        wait_until(lambda: stack.run(run_id)["status"] == "failed", what="the retried run failing again")
        failed = client.get("/?status=failed").text
        assert f'data-run="{run_id}"' in failed and 'data-state="completed"' not in failed
        assert f'data-run="{run_id}"' not in client.get("/?workflow=deploy").text
        assert "no runs match these filters" in client.get("/?held=1&workflow=boom").text
