"""The console's state changes (POST), each one host request as the CLI sends it: run
cancel, pause, resume, retry, resolve an ambiguous effect; a decision's answer; an ask's
value.

Each checks the form's CSRF field (the guard checked the token and the Origin), sends
its request with a ``requestId`` of its own, and answers with a redirect (303) to the
page it came from, which then shows what the action said once: the CLI's receipt line,
or the host's refusal as the host gave it (``conflict: decision ... was already
answered: another answer won (yes by cli:ann)``). Cancel and retry, which cannot be
taken back, go through a confirmation page first, as a person at a terminal would read
the command before pressing Enter.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from piwf.errors import HostReplied, HostTimeout, HostUnavailable
from piwf.ui import forms, words
from piwf.ui.render import page

FORM_LIMIT = 1024 * 1024  # an answer is at most what one host request carries


async def _form(request: Request) -> FormData | Response:
    """The form, or the refusal of a form without this console's CSRF field."""
    form = await request.form(max_files=0, max_fields=200, max_part_size=FORM_LIMIT)
    given = str(form.get("csrf", ""))
    if not hmac.compare_digest(given.encode(), request.app.state.console.csrf.encode()):
        return page(request, "error.html", status=403, title="refused",
                    reason="the form has no valid CSRF field: send it from this console's own page")
    return form


def _back(form: FormData, fallback: str) -> str:
    """Where the form came from: a path of this console (never another site)."""
    back = str(form.get("back", ""))
    return back if back.startswith("/") and not back.startswith("//") and "\\" not in back else fallback


def _done(http: Request, back: str, ok: bool, text: str, **extra: Any) -> Response:
    key = http.app.state.console.notices.add(ok, text, **extra)
    sep = "&" if "?" in back else "?"
    return RedirectResponse(f"{back}{sep}notice={key}", status_code=303)


async def _send(request: Request, operation: str, **kwargs: Any) -> tuple[bool, Any]:
    """(True, receipt) or (False, the refusal as one line)."""
    try:
        return True, await request.app.state.console.link.call(operation, **kwargs)
    except HostReplied as exc:
        return False, f"{exc.outcome}: {exc.error or 'no reason given'}"
    except (HostUnavailable, HostTimeout) as exc:
        return False, str(exc)


async def run_action(request: Request) -> Response:
    run_id, action = request.path_params["run_id"], request.path_params["action"]
    form = await _form(request)
    if isinstance(form, Response):
        return form
    back = _back(form, f"/runs/{run_id}")
    if action not in words.ACTIONS:
        return page(request, "error.html", status=404, title="no such action", reason=f"no action {action!r}")
    if action in words.CONFIRMED and form.get("confirmed") != "yes":
        return RedirectResponse(f"/runs/{run_id}/confirm/{action}", status_code=303)
    ok, said = await _send(request, f"run.{action}", run_id=run_id)
    return _done(request, back, ok, words.said(action, run_id, said) if ok else said)


async def resolve_effect(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    form = await _form(request)
    if isinstance(form, Response):
        return form
    back = _back(form, f"/runs/{run_id}")
    key, applied, text = str(form.get("key", "")), form.get("applied") == "yes", str(form.get("result", "")).strip()
    if text and not applied:
        return _done(request, back, False, "a result goes with 'it was applied'; nothing was sent")
    try:
        result = json.loads(text) if text else None
    except ValueError:
        return _done(request, back, False, "the result is not JSON (a JSON string needs its quotes); nothing was sent")
    ok, said = await _send(request, "effect.resolve", run_id=run_id,
                           payload={"key": key, "applied": applied, "result": result})
    if ok:
        said = (f"{run_id}: effect {key} resolved as {said['status']}"
                + (f"; still ambiguous: {', '.join(said['ambiguous'])}" if said["ambiguous"] else ""))
    return _done(request, back, ok, said)


async def _open_request(request: Request, form: FormData, request_id: str) -> tuple[dict[str, Any] | None, str]:
    """The open request the form answers, or None and why it cannot be answered here."""
    ok, found = await _send(request, "interaction.list", payload={"runId": str(form.get("run", "")), "open": True})
    if not ok:
        return None, found
    open_request = next((r for r in found["requests"] if r["requestId"] == request_id), None)
    if open_request is None:
        closed = await _send(request, "interaction.list", payload={"runId": str(form.get("run", "")), "open": False})
        gone = next((r for r in closed[1]["requests"] if r["requestId"] == request_id), None) if closed[0] else None
        return None, f"{request_id} takes no more answers: {_how_closed(gone)}; nothing was sent"
    if not request.app.state.console.may_answer(open_request):
        return None, (f"{request_id} belongs to session {open_request['originSessionId']}: this console answers it "
                      "only when started for that session (piwf ui --session ID); nothing was sent")
    return open_request, ""


def _how_closed(gone: dict[str, Any] | None) -> str:
    if gone is None:
        return "not found"
    res = gone.get("resolution")
    if gone["status"] == "settled" and res:
        got = res.get("choice") or json.dumps(res.get("value"))
        return f"another answer won ({got} by {res.get('answeredBy') or 'its deadline'} at {res['answeredAt']})"
    return f"it is {gone['status']}"


async def _answering(request: Request) -> tuple[FormData, str, dict[str, Any]] | Response:
    """The form, where to go back, and the open request it answers; or the page that says
    why it cannot be answered from here (nothing is sent then)."""
    form = await _form(request)
    if isinstance(form, Response):
        return form
    back = _back(form, "/inbox")
    found, why = await _open_request(request, form, request.path_params["request_id"])
    if found is None:
        return _done(request, back, False, why)
    return form, back, found


async def decide(request: Request) -> Response:
    answering = await _answering(request)
    if isinstance(answering, Response):
        return answering
    form, back, decision = answering
    choice = str(form.get("choice", ""))
    payload: dict[str, Any] = {"requestId": decision["requestId"], "choice": choice}
    if f"input.{choice}" in form:
        payload["input"] = str(form[f"input.{choice}"])
    ok, said = await _send(request, "decision.answer", payload=payload)  # a race lost: the host names the winner
    if ok:
        said = f"{decision['requestId']}: answered {said['choice']} (run {said['runId']})"
    return _done(request, back, ok, said)


async def answer(request: Request) -> Response:
    answering = await _answering(request)
    if isinstance(answering, Response):
        return answering
    form, back, ask = answering
    request_id = ask["requestId"]
    typed = {name: str(value) for name, value in form.items() if name.startswith(forms.PREFIX)}
    value, errors = forms.read_value(ask["schema"], typed)
    if errors:
        return _done(request, back, False, f"{request_id}: fix the fields marked; nothing was sent",
                     request=request_id, errors=errors, typed=typed)
    payload: dict[str, Any] = {"requestId": request_id, "value": value}
    if ask["originSessionId"] is not None:  # may_answer: this console was started for that session
        payload["sessionId"] = ask["originSessionId"]
    ok, said = await _send(request, "interaction.submit", payload=payload)
    if ok:
        said = f"{said['submissionId']}: submitted; the workflow validates it"
    return _done(request, back, ok, said, request=request_id, typed=typed)


ROUTES = [
    Route("/runs/{run_id}/effects/resolve", resolve_effect, methods=["POST"]),
    Route("/runs/{run_id}/{action}", run_action, methods=["POST"]),
    Route("/requests/{request_id}/decide", decide, methods=["POST"]),
    Route("/requests/{request_id}/answer", answer, methods=["POST"]),
]
