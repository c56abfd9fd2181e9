"""Wake-ups between the hosts sharing a PostgreSQL store: LISTEN/NOTIFY, coalesced, with
polling as the fallback (``piwf.store.api.Store.announce`` / ``serve_wakeups``).

A host announces a topic (``Wakeup``) after the commit that made work for others: a run
to claim, a resource due, a change watchers wait for, a deadline to keep. Announcing only
marks the topic; a sender task sends one ``NOTIFY`` per marked topic at most every
``coalesce_s`` (outside any transaction, on a connection of its own), so a host
committing a thousand steps a second sends a few notifications, and no commit waits on
PostgreSQL's notification queue. A listener task keeps ``LISTEN`` on another connection,
in a thread, and wakes the host for each topic another host announced (its own are
skipped: each payload names its sender).

Nothing here is needed for correctness: a lost notification (a connection down, a
restart) costs at most one poll interval, and after the listening connection comes back
every topic is woken once, since some may have been missed. Poll-only mode (``listen=
False``, for connection poolers in transaction mode, which do not keep ``LISTEN``) still
sends, for the hosts that do listen.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import trio
from psycopg import sql

from piwf.store.api.types import Wakeup
from piwf.store.postgres.db import session_of

log = logging.getLogger("piwf.store.postgres")

COALESCE_S = 0.02  # at most one NOTIFY per topic this often
RETRY_S = 1.0  # a lost connection is opened again after this long
LISTEN_TICK_S = 0.5  # how often the listening thread looks whether it should stop
NOTIFY_SQL = "SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS payload"


def channel_for(schema: str) -> str:
    """The notification channel of the installation in ``schema``: several installations
    sharing a database do not wake one another."""
    return f"piwf_{schema}"[:63]


class Wakeups:
    """One store's announcements and its listener; ``connect()`` opens an autocommit
    connection to the store's database."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channel: str, *, listen: bool = True,
                 coalesce_s: float = COALESCE_S, retry_s: float = RETRY_S) -> None:
        self.connect = connect
        self.channel = channel
        self.listen = listen
        self.coalesce_s = coalesce_s
        self.retry_s = retry_s
        self.sender_id = secrets.token_hex(8)
        self.sent = 0  # statistics: notifications sent
        self._pending: set[Wakeup] = set()
        self._marked = trio.Event()

    def announce(self, topic: Wakeup) -> None:
        self._pending.add(topic)
        self._marked.set()

    async def serve(self, wake: Callable[[Wakeup], None], *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_forever)
            if self.listen:
                await nursery.start(self._listen_forever, wake)
            task_status.started()

    # --- sending ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Send what is still marked, now (blocking: call in a thread). For a host that stops:
        the runs and resources it released are announced after its sender has gone."""
        if self._pending:
            topics, self._pending = sorted(self._pending), set()
            conn = self._send(None, topics)
            if conn is not None:
                conn.close()

    async def _send_forever(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while True:
                await self._marked.wait()
                self._marked = trio.Event()
                topics, self._pending = sorted(self._pending), set()
                conn = await trio.to_thread.run_sync(self._send, conn, topics)
                await trio.sleep(self.coalesce_s)
        finally:
            if conn is not None:
                conn.close()

    def _send(self, conn: psycopg.Connection[Any] | None, topics: list[Wakeup]) -> psycopg.Connection[Any] | None:
        """Send ``topics`` (in a thread); the connection to use next time (None: open a new one)."""
        try:
            conn = conn if conn is not None and not conn.closed else self.connect()
            # One statement (one round trip, one transaction) for all of them, prepared once
            # and sent as the store's statements are (db.Session: psycopg's cursor cost more
            # CPU for this one statement than the store's dozens each run).
            session_of(conn).run(NOTIFY_SQL, (self.channel, [f"{self.sender_id} {topic}" for topic in topics]))
            self.sent += len(topics)
            return conn
        except psycopg.Error as exc:  # the others' polls make up for it
            log.debug("a wake-up was not sent (%s): the other hosts will see it at their next poll", exc)
            if conn is not None:
                conn.close()
            return None

    # --- listening -------------------------------------------------------------------------

    async def _listen_forever(self, wake: Callable[[Wakeup], None], *,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                conn = await trio.to_thread.run_sync(self._open_listening)
            except psycopg.Error as exc:
                log.warning("cannot listen for other hosts' wake-ups (%s); polling until it can", exc)
                conn = None
            if not started:  # listening (or polling, if it cannot yet): the host goes on
                task_status.started()
                started = True
            if conn is not None:
                for topic in Wakeup:  # what was announced while nobody listened
                    wake(topic)
                await self._listen(conn, wake)
            await trio.sleep(self.retry_s)

    def _open_listening(self) -> psycopg.Connection[Any]:
        conn = self.connect()
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    async def _listen(self, conn: psycopg.Connection[Any], wake: Callable[[Wakeup], None]) -> None:
        """Until the connection is lost (or the task cancelled): wake for each topic heard."""
        stop = threading.Event()
        try:
            await trio.to_thread.run_sync(self._hear, conn, wake, stop, abandon_on_cancel=True)
        finally:
            stop.set()  # the thread closes the connection within LISTEN_TICK_S

    def _hear(self, conn: psycopg.Connection[Any], wake: Callable[[Wakeup], None], stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                for note in conn.notifies(timeout=LISTEN_TICK_S):
                    topic = self._topic(note.payload)
                    if topic is not None and not stop.is_set():
                        trio.from_thread.run_sync(wake, topic)
        except psycopg.Error as exc:
            log.warning("lost the connection listening for other hosts' wake-ups (%s); polling meanwhile", exc)
        except trio.RunFinishedError:  # the host is gone
            pass
        finally:
            conn.close()

    def _topic(self, payload: str) -> Wakeup | None:
        sender, _, name = payload.partition(" ")
        if sender == self.sender_id:
            return None
        try:
            return Wakeup(name)
        except ValueError:
            return None
