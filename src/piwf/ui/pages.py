"""The console's pages (GET): runs, a run, the inbox, controllers, a resource; and the
event stream that tells each open tab what changed (fed by the one ``run.watch``).

Each page reads what it shows from the host when it is asked for, so a page is never
staler than its request; ``static/ui.js`` asks for it again when the stream says one of
its runs changed.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import nullcontext
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from piwf.errors import HostReplied, HostTimeout, HostUnavailable
from piwf.ui import forms, graph, words
from piwf.ui.render import page
from piwf.wire import Outcome

PING_S = 15  # an event stream says something this often, so a tab gone away is noticed
CONTROLLERS = "controllers"  # a page's data-watch: it shows resources (and their child runs)
RUNS_SHOWN = 100
EVENTS_SHOWN = 200
STEPS_SHOWN = 300
EVENT_PAGES = 20  # a run page reads at most this many pages of 1000 events
Handler = Callable[[Request], Awaitable[Response]]
# a page the host refused, by the host's outcome (its wire spelling: notFound, not not_found)
HTTP_STATUS = {Outcome.NOT_FOUND.value: 404, Outcome.REJECTED.value: 400, Outcome.CONFLICT.value: 409,
               Outcome.UNAVAILABLE.value: 503}


def host_errors(handler: Handler) -> Handler:
    """A page the host could not answer for: the host's reason, with its status."""
    async def guarded(request: Request) -> Response:
        # the feed's version before the page reads the host: any change the page may have
        # missed is newer, and its event stream starts from here (static/ui.js)
        request.state.feed_version = request.app.state.console.feed.version
        try:
            return await handler(request)
        except (HostUnavailable, HostTimeout) as exc:
            return page(request, "error.html", status=503, title="the host does not answer", reason=str(exc))
        except HostReplied as exc:
            status = HTTP_STATUS.get(str(exc.outcome), 502)
            return page(request, "error.html", status=status, title=exc.outcome, reason=exc.error or "")
    guarded.__name__ = handler.__name__
    return guarded


def _call(request: Request) -> Callable[..., Awaitable[Any]]:
    return request.app.state.console.link.call  # type: ignore[no-any-return]


def run_filters(request: Request) -> dict[str, Any]:
    """``run list``'s filters from the query: status, workflow, session, held."""
    q = request.query_params
    found: dict[str, Any] = {}
    if q.get("status") in words.STATUSES:
        found["status"] = q["status"]
    if q.get("workflow"):
        found["workflow"] = q["workflow"]
    if q.get("session"):
        found["originSessionId"] = q["session"]
    if q.get("held") == "1":
        found["held"] = True
    return found


@host_errors
async def runs_page(request: Request) -> Response:
    filters = run_filters(request)
    runs = await _call(request)("run.list", payload={**filters, "limit": RUNS_SHOWN})
    return page(request, "runs.html", runs=runs, filters=filters, query=request.query_params, watch="*",
                statuses=words.STATUSES)


async def _optional(call: Callable[..., Awaitable[Any]], operation: str, **kwargs: Any) -> Any:
    """A read a page can do without (a workflow without settings, an older host)."""
    try:
        return await call(operation, **kwargs)
    except HostReplied:
        return None


async def run_graph(call: Callable[..., Awaitable[Any]], run: dict[str, Any]) -> tuple[graph.Graph, str]:
    """The graph the run executes, as recorded for it (``run.graph``), and what to say
    about it; a host without that operation gives the path taken, from the run's steps."""
    recorded = await _optional(call, "run.graph", run_id=run["runId"])
    if recorded is None:
        return graph.from_steps(run), "the host records no graph: the path the run took, from its steps"
    return graph.from_run_graph(recorded), "" if recorded.get("known", True) else str(recorded.get("reason") or "")


async def run_steps(call: Callable[..., Awaitable[Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's steps with their outputs and errors (``run.steps``, the first pages), or
    ``run.status``'s steps without them on a host that lacks the operation."""
    steps: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None and len(steps) < STEPS_SHOWN:
        page = await _optional(call, "run.steps", run_id=run["runId"], payload={"offset": offset, "limit": 100})
        if page is None:
            return list(run["steps"])
        steps += page["steps"]
        offset = page["next"]
    return steps


async def latest_events(call: Callable[..., Awaitable[Any]], run_id: str) -> tuple[list[dict[str, Any]], bool]:
    """The run's latest ``EVENTS_SHOWN`` events (paging to the end of its trace, at most
    ``EVENT_PAGES`` pages), and whether there are earlier ones."""
    kept: deque[dict[str, Any]] = deque(maxlen=EVENTS_SHOWN)
    after: int | None = 0
    pages = seen = 0
    while after is not None and pages < EVENT_PAGES:
        found = await call("run.events", run_id=run_id, payload={"after": after, "limit": 1000})
        kept.extend(found["events"])
        seen += len(found["events"])
        after, pages = found["nextAfter"], pages + 1
    return list(kept), seen > len(kept) or after is not None


@host_errors
async def run_page(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    call = _call(request)
    run = await call("run.status", run_id=run_id)
    events, more_events = await latest_events(call, run_id)
    settings = await _optional(call, "workflow.settings", run_id=run_id)
    closed = await call("interaction.list", payload={"runId": run_id, "open": False, "limit": 100})
    drawn, graph_note = await run_graph(call, run)
    return page(request, "run.html", run=run, steps=await run_steps(call, run), events=events, more_events=more_events,
                settings=settings, requests=closed["requests"], svg=graph.svg(drawn), graph_note=graph_note,
                watch=run_id, forms=forms, actions=words.actions(run))


@host_errors
async def inbox_page(request: Request) -> Response:
    show_all = request.query_params.get("all") == "1"
    found = await _call(request)("interaction.list", payload={"open": not show_all, "limit": 200})
    return page(request, "inbox.html", requests=found["requests"], show_all=show_all, watch="*", forms=forms)


@host_errors
async def controllers_page(request: Request) -> Response:
    resources = await _call(request)("controller.list", payload={})
    return page(request, "controllers.html", resources=resources, watch=CONTROLLERS)


def resource_target(request: Request) -> dict[str, str]:
    q = request.query_params
    return {"projectPath": q.get("project", ""), "controller": q.get("name", ""), "key": q.get("key", "")}


@host_errors
async def controller_page(request: Request) -> Response:
    resource = await _call(request)("controller.get", payload=resource_target(request))
    child = (resource.get("status") or {}).get("workflowRun") or {}
    return page(request, "controller.html", r=resource, child=child, watch=CONTROLLERS)


@host_errors
async def confirm_page(request: Request) -> Response:
    run_id, action = request.path_params["run_id"], request.path_params["action"]
    if action not in words.ACTIONS:
        return page(request, "error.html", status=404, title="no such action", reason=f"no action {action!r}")
    run = await _call(request)("run.status", run_id=run_id)
    return page(request, "confirm.html", run=run, action=action, watch=run_id)


async def events(request: Request) -> Response:
    """Server-sent events: one ``data:`` line per change the feed saw after version
    ``since`` (the page's: what it was read at) or, without it, after the stream began —
    the runs it touched, or null: anything may have changed — and a comment line as a
    ping in between."""
    feed = request.app.state.console.feed
    since = request.query_params.get("since", "")
    start = int(since) if since.isdigit() and int(since) <= feed.version else feed.version

    showing = feed.showing_resources() if request.query_params.get("watch") == CONTROLLERS else nullcontext()

    async def stream() -> AsyncIterator[str]:
        seen = start
        yield "retry: 1000\n\n"
        with showing:
            while True:
                change = None
                with trio.move_on_after(PING_S):
                    change = await feed.next_change(seen)
                if change is None:
                    yield ": ping\n\n"
                    continue
                seen = change.version
                yield f"data: {json.dumps(_as_json(change))}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})


def _as_json(change: Any) -> dict[str, Any]:
    return {"version": change.version, "runs": change.runs, "host": change.host, "resources": change.resources}


ROUTES = [
    Route("/", runs_page),
    Route("/runs/{run_id}", run_page),
    Route("/runs/{run_id}/confirm/{action}", confirm_page),
    Route("/inbox", inbox_page),
    Route("/controllers", controllers_page),
    Route("/controller", controller_page),
    Route("/events", events),
    Mount("/static", app=StaticFiles(packages=[("piwf.ui", "static")]), name="static"),
]
