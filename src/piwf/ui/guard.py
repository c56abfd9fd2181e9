"""What every request to the console passes before a page sees it (docs/ui.md, "Safe by
default"), as one ASGI middleware:

- the Host header names this console (``127.0.0.1:PORT`` or ``localhost:PORT``): a page
  of another site whose name was rebound to 127.0.0.1 (DNS rebinding) sends its own name
  and is refused;
- the token: ``?token=`` (then a cookie is set from it and the token leaves the address
  bar), the cookie, or ``Authorization: Bearer``; compared in constant time;
- a state change (any method but GET and HEAD) carries an ``Origin`` (or, lacking one, a
  ``Referer``) of this console; the CSRF field of its form is checked by the action
  (``Guard.csrf``, derived from the token, so it never appears without it);
- every answer has headers that keep it to itself: a Content-Security-Policy allowing
  only this console's own script and style (no inline script, nothing from elsewhere),
  no framing, no sniffing, no caching.

A refusal is one line of plain text with status 403 (421 for a wrong Host), and nothing
behind it runs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = ("GET", "HEAD")
HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),  # a form's POST keeps its Origin (no-referrer would send "null")
    (b"cache-control", b"no-store"),
]


def new_token() -> str:
    return secrets.token_urlsafe(32)


class Guard:
    """The checks above, in front of ``app``; ``hosts`` are the Host header values this
    console answers to (``127.0.0.1:PORT``, ``localhost:PORT``)."""

    def __init__(self, app: ASGIApp, *, token: str, hosts: Iterable[str], cookie: str) -> None:
        self.app = app
        self.token = token
        self.hosts = frozenset(hosts)
        self.origins = frozenset(f"http://{host}" for host in self.hosts)
        self.cookie = cookie
        self.csrf = hmac.new(token.encode(), b"piwf-ui-csrf", hashlib.sha256).hexdigest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, text = refusal
            await _plain(send, status, text)
            return
        if scope["type"] == "http" and scope["method"] in SAFE_METHODS and self._given_token(scope):
            await self._set_cookie(scope, send)  # and take the token out of the address bar
            return
        await self.app(scope, receive, _with_headers(send))

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host", "")
        if host not in self.hosts:
            return 421, (f"refused: this console answers to {' or '.join(sorted(self.hosts))}, not Host {host!r} "
                         "(a page of another site reaching it through its own name: DNS rebinding)")
        if not self._has_token(scope, headers):
            return 403, ("refused: no valid token; open the address `piwf ui` printed (its token is also in the "
                         "console's file in the state directory)")
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS and not self._same_origin(headers):
            origin = headers.get("origin") or headers.get("referer") or "none"
            return 403, f"refused: a change must come from this console's own pages, not from origin {origin!r}"
        return None

    def _has_token(self, scope: Scope, headers: Headers) -> bool:
        given = [self._given_token(scope) or ""]
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header is no token, not an error page
            cookie = SimpleCookie()
        if self.cookie in cookie:
            given.append(cookie[self.cookie].value)
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given.append(auth[7:].strip())
        return any(hmac.compare_digest(value.encode(), self.token.encode()) for value in given if value)

    def _given_token(self, scope: Scope) -> str | None:
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        value = str(query.get("token", ""))
        if value and hmac.compare_digest(value.encode(), self.token.encode()):
            return value
        return None

    def _same_origin(self, headers: Headers) -> bool:
        origin = headers.get("origin")
        if origin is None and (referer := headers.get("referer")):
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}"
        return origin in self.origins

    async def _set_cookie(self, scope: Scope, send: Send) -> None:
        query = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k != "token"]
        location = scope.get("path", "/") + (f"?{urlencode(query)}" if query else "")
        cookie = f"{self.cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/"
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode()), *HEADERS,
            (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def _with_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            message = {**message, "headers": [*message.get("headers", []),
                                              *(h for h in HEADERS if h[0] not in names)]}
        await send(message)
    return sending


async def _plain(send: Send, status: int, text: str) -> None:
    body = (text + "\n").encode()
    headers: list[Any] = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                          *HEADERS]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
