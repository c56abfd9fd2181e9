"""``piwf ui`` in a real browser: Debian's headless chromium driven through selenium and
its chromedriver, against a real host and a real console process (one of each, and one
browser, for the module). Without chromium and chromedriver the module is skipped with
one line; with ``CI=true`` that is a failure (``.ci/run`` installs them).

``PIWF_UI_SCREENSHOTS=docs/`` saves the screenshots docs/ui.md shows (run page, inbox,
controller page) into that directory."""

from __future__ import annotations

import getpass
import http.server
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from .ui_support import Stack, wait_until

pytest.importorskip("piwf.ui.console")  # the ui extra (part of the test extra)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    ElementNotInteractableException, NoSuchElementException, StaleElementReferenceException,
)
from selenium.webdriver.common.by import By  # noqa: E402 - after the skip above
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOW_TO_RUN = "the browser tests need Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1000")
MIRROR = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "controllers.md").read_text(), re.S).group(1)


def _chromium() -> tuple[str, str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and no chromium: {HOW_TO_RUN}")
        pytest.skip(HOW_TO_RUN)
    return binary, driver


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("ui-browser"))
    controller = s.project / ".piwf" / "controllers" / "mirror.py"
    controller.parent.mkdir(parents=True)
    controller.write_text(MIRROR)
    try:
        s.start_host()
        s.start_console()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tempfile.mkdtemp(prefix="piwf-ui-chromium-")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        driver.get(stack.url)  # the address piwf ui printed: sets the cookie
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def until(driver: Any, condition: Any, timeout: float = 30) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def screenshot(driver: Any, name: str) -> None:
    where = os.environ.get("PIWF_UI_SCREENSHOTS")
    if where:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(height + 40, 700), 2400))
        driver.save_screenshot(str(Path(where) / name))
        driver.set_window_size(1280, 1000)


def attribute(driver: Any, selector: str, name: str) -> str | None:
    """An attribute of the first element ``selector`` finds, read in one step (the live
    updates replace the page's elements at any moment)."""
    return driver.execute_script(  # type: ignore[no-any-return]
        "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null",
        selector, name)


def text_of(driver: Any, selector: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", selector))


def row_state(driver: Any, run_id: str) -> str | None:
    return attribute(driver, f'tr[data-run="{run_id}"]', "data-state")


def test_the_run_list_updates_live_when_a_run_ends(stack: Stack, browser: Any) -> None:
    run_id = stack.start_run("gated")
    browser.get(stack.base + "/")
    until(browser, lambda d: row_state(d, run_id) == "running")
    browser.execute_script("window.piwfSamePage = true")  # gone if the page were loaded again
    (stack.project / "gate").touch()
    until(browser, lambda d: row_state(d, run_id) == "completed")
    assert browser.execute_script("return window.piwfSamePage") is True  # updated in place, not reloaded
    assert stack.run(run_id)["status"] == "completed"


def test_a_run_pages_graph_shows_the_waiting_node(stack: Stack, browser: Any) -> None:
    run_id = stack.start_run("deploy")
    stack.open_request(run_id)
    browser.get(f"{stack.base}/runs/{run_id}")
    until(browser, lambda d: attribute(d, 'svg.graph g[data-node="approve"]', "data-state") == "waiting")
    assert attribute(browser, 'svg.graph g[data-node="build"]', "data-state") == "accepted"
    assert attribute(browser, 'svg.graph g[data-node="deploy"]', "data-state") == "not reached"  # the definition's
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.graph path.edge.taken")) == 1  # build → approve
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.graph path.edge")) == 3
    screenshot(browser, "ui-run.png")


def test_a_decision_answered_by_a_click_lets_the_run_go_on(stack: Stack, browser: Any) -> None:
    run_id = stack.start_run("deploy")
    request = stack.open_request(run_id)
    stack.open_request(stack.start_run("count"))  # an ask beside it, for the inbox's screenshot
    browser.get(stack.base + "/inbox")
    section = f"#req-{request['requestId']}"
    until(browser, lambda d: text_of(d, f"{section} .title"))
    assert text_of(browser, f"{section} .title") == "<script>document.title='owned'</script> Deploy build 42?"
    assert browser.title == "Inbox · piwf ui"  # the title's script did not run
    screenshot(browser, "ui-inbox.png")
    press(browser, f'{section} button[data-choice="yes"]')
    until(browser, lambda d: text_of(d, ".notice") == f"{request['requestId']}: answered yes (run {run_id})")
    wait_until(lambda: stack.run(run_id)["status"] == "completed", what="the run going on")
    answer = stack.run(run_id)["output"]["deployed"]
    assert (answer["choice"], answer["answeredBy"]) == ("yes", f"ui:{getpass.getuser()}")  # as the user it runs as


LIVE = (StaleElementReferenceException, ElementNotInteractableException, NoSuchElementException)


def press(driver: Any, selector: str) -> None:
    """Click the element (again if a live update replaced it just then)."""
    def clicked(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()
        return True
    WebDriverWait(driver, 30, poll_frequency=0.05, ignored_exceptions=LIVE).until(clicked)


def _submit(driver: Any, request_id: str, text: str) -> None:
    """Type ``text`` into the ask's field and press Submit (again from the start if a live
    update replaced the form meanwhile)."""
    def typed(d: Any) -> bool:
        field = d.find_element(By.ID, f"{request_id}-f.value")
        field.clear()
        field.send_keys(text)
        d.find_element(By.CSS_SELECTOR, f"#req-{request_id} form.ask button[type=submit]").click()
        return True
    WebDriverWait(driver, 30, poll_frequency=0.05, ignored_exceptions=LIVE).until(typed)


def _refusal(driver: Any, request_id: str) -> str:
    return text_of(driver, f"#req-{request_id} .refusal")


def test_an_ask_form_refuses_a_bad_value_with_the_workflows_reason_and_takes_a_good_one(
        stack: Stack, browser: Any) -> None:
    run_id = stack.start_run("count")
    request_id = stack.open_request(run_id)["requestId"]
    browser.get(f"{stack.base}/runs/{run_id}")
    _submit(browser, request_id, "three")  # not even a whole number: refused by the form, nothing sent
    until(browser, lambda d: "'three' is not a whole number" in _refusal(d, request_id))
    assert stack.open_request(run_id)["lastSubmission"] is None
    _submit(browser, request_id, "12")  # a whole number the workflow refuses, with its reason
    until(browser, lambda d: _refusal(d, request_id) == "refused by the workflow: at most 10, please")
    assert browser.execute_script("return document.getElementById(arguments[0]).value", f"{request_id}-f.value") == "12"
    _submit(browser, request_id, "7")
    wait_until(lambda: stack.run(run_id)["status"] == "completed", what="the ask accepted")
    assert stack.run(run_id)["output"] == {"copies": 7}


def test_without_the_token_the_browser_is_refused(stack: Stack, browser: Any) -> None:
    browser.delete_all_cookies()
    try:
        browser.get(stack.base + "/inbox")
        body = browser.find_element(By.TAG_NAME, "body").text
        assert body.startswith("refused: no valid token")
        assert "Inbox" not in body
    finally:
        browser.get(stack.url)  # the printed address sets the cookie again


class _Attacker(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_change_sent_from_another_origin_is_refused(stack: Stack, browser: Any) -> None:
    run_id = stack.start_run("deploy")
    stack.open_request(run_id)
    browser.get(f"{stack.base}/runs/{run_id}")
    csrf = until(browser, lambda d: attribute(d, 'input[name="csrf"]', "value"))  # even with the right field
    _Attacker.page = (f'<form id="f" method="post" action="{stack.base}/runs/{run_id}/pause">'
                      f'<input type="hidden" name="csrf" value="{csrf}"></form>'
                      '<script>document.getElementById("f").submit()</script>').encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)  # chromium keeps idle sockets open
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        browser.get(f"http://127.0.0.1:{server.server_address[1]}/")
        until(browser, lambda d: "refused: a change must come from this console's own pages" in text_of(d, "body"))
    finally:
        server.shutdown()
        server.server_close()
    assert not stack.run(run_id)["paused"]


def test_a_controller_page_shows_spec_status_conditions_and_events(stack: Stack, browser: Any) -> None:
    target = {"projectPath": str(stack.project), "controller": "mirror", "key": "greeting"}
    stack.call("controller.apply", payload={**target, "spec": {"text": "hello"}})
    wait_until(lambda: stack.call("controller.get", payload=target)["ready"] == "True", what="the resource ready")
    browser.get(stack.base + "/controllers")
    press(browser, 'a[href^="/controller?"]')
    until(browser, lambda d: "Synced" in text_of(d, "main"))
    text = text_of(browser, "main")
    assert '"text": "hello"' in text and '"written": "hello"' in text and "reconcile_finished" in text
    assert browser.current_url.endswith("/controller?" + urlencode(
        {"project": target["projectPath"], "name": "mirror", "key": "greeting"}))
    screenshot(browser, "ui-controller.png")


def test_a_controller_page_follows_a_resource_that_changes_without_any_run(stack: Stack, browser: Any) -> None:
    """An apply and the reconcile that follows change the resource alone (the mirror
    controller starts no run): the open page shows both, updated in place."""
    target = {"projectPath": str(stack.project), "controller": "mirror", "key": "farewell"}
    stack.call("controller.apply", payload={**target, "spec": {"text": "hello"}})
    wait_until(lambda: stack.call("controller.get", payload=target)["ready"] == "True", what="the resource ready")
    browser.get(stack.base + "/controller?" + urlencode({"project": target["projectPath"], "name": "mirror",
                                                          "key": "farewell"}))
    until(browser, lambda d: '"written": "hello"' in text_of(d, "main"))
    browser.execute_script("window.piwfSamePage = true")  # gone if the page were loaded again
    stack.call("controller.apply", payload={**target, "spec": {"text": "goodbye"}})
    until(browser, lambda d: '"written": "goodbye"' in text_of(d, "main"))
    assert '"text": "goodbye"' in text_of(browser, "main")
    assert browser.execute_script("return window.piwfSamePage") is True
