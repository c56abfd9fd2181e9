"""The console's connection to the host: one ``AsyncClient`` for every page's reads and
writes, taken one request at a time, so however many tabs are open the console holds one
connection for them (and ``feed.py`` one more for its ``run.watch``).

A request whose connection was lost (the host restarted, or closed an idle connection)
is sent once more on a new one with the same ``requestId``: the host answers a write it
already committed from its command log, so a retried action is never done twice.
"""

from __future__ import annotations

from typing import Any

import trio

from piwf.client import AsyncClient, make_request
from piwf.errors import HostReplied, HostTimeout, HostUnavailable
from piwf.paths import StatePaths

ANSWER_S = 30.0  # the host answers a short request within 10 s (its own limit); this is the console's


class HostLink:
    """Requests to the host, one at a time, each answered or raised as ``HostReplied``
    (the outcome and the host's reason), ``HostUnavailable`` or ``HostTimeout``."""

    def __init__(self, paths: StatePaths, client_id: str) -> None:
        self.paths = paths
        self.client_id = client_id
        self._client: AsyncClient | None = None
        self._lock = trio.Lock()

    async def call(self, operation: str, **kwargs: Any) -> Any:
        """The receipt of an accepted (or adopted) request."""
        request = make_request(operation, client_id=self.client_id, **kwargs)
        async with self._lock:
            with trio.move_on_after(ANSWER_S) as scope:
                response = await self._send(request)
        if scope.cancelled_caught:
            await self._drop()
            raise HostTimeout(f"the piwf host serving {self.paths.root} did not answer {operation} within "
                              f"{ANSWER_S:g} s")
        if response.outcome not in ("accepted", "adopted"):
            raise HostReplied(response.outcome, response.error)
        return response.receipt

    async def _send(self, request: Any) -> Any:
        for attempt in range(2):
            try:
                client = await self._connected()
                response = await client.send(request)
            except HostUnavailable:
                await self._drop()
                if attempt:
                    raise
                continue
            if response.requestId == "" and response.outcome == "unavailable" and not attempt:
                await self._drop()  # the host's line as it closed this connection: not an answer
                continue
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connected(self) -> AsyncClient:
        if self._client is None:
            client = AsyncClient(self.paths, client_id=self.client_id)
            try:
                await client.connect()
            except OSError as exc:
                raise HostUnavailable(f"cannot reach the piwf host at {self.paths.socket}: {exc}") from exc
            self._client = client
        return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def aclose(self) -> None:
        await self._drop()
