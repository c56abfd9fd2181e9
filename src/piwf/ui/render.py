"""Pages from jinja2 templates shipped in the package, with autoescaping on for every
template: whatever a workflow wrote (a title, a label, an output, an error) is escaped
where it is put in a page, so a title ``<script>…`` shows as text. Nothing here marks
workflow text safe; the graph's SVG is built with the same escaping (``graph.py``).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import ChainableUndefined, Environment, PackageLoader
from starlette.requests import Request
from starlette.responses import HTMLResponse

from piwf.ui import words

_env = Environment(loader=PackageLoader("piwf.ui", "templates"), autoescape=True, undefined=ChainableUndefined,
                   trim_blocks=True, lstrip_blocks=True)


def _json(value: Any, limit: int = 4000) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "\n… (cut: piwf run show --json has it all)"


_env.filters["json"] = _json
_env.globals["words"] = words


def page(request: Request, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
    """The template rendered for ``request``: every page knows the console (its CSRF
    field, who it answers as, whether the host answers) and the notice to show, if any."""
    console = request.app.state.console
    notice = console.notices.pop(request.query_params.get("notice", ""), None)
    version = getattr(request.state, "feed_version", console.feed.version)
    html = _env.get_template(template).render(
        request=request, console=console, csrf=console.csrf, notice=notice, host_up=console.feed.host_up,
        version=version, **context)
    return HTMLResponse(html, status_code=status)
