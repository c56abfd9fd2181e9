"""``piwf ui``: the web console, a client of the host like the CLI (docs/ui.md).

It talks to the host over its socket with the public protocol only (``piwf.client``),
so it has no privilege and puts no load on the host that the CLI could not: one
connection for its reads and writes, one ``run.watch`` long poll that feeds every open
tab (``feed.py``). Pages are starlette routes (``pages.py``, ``actions.py``) rendered by
jinja2 with autoescaping (``render.py``), served by hypercorn's trio worker
(``console.py``) behind the token, Host, Origin and CSRF checks of ``guard.py``.

Needs the optional dependencies: ``pip install 'piwf[ui]'``.
"""
