"""Host protocol clients: ``Client`` (blocking, for the CLI) and ``AsyncClient`` (trio).

A client retries nothing by itself; to retry safely, send the same ``requestId`` (or the
same ``idempotencyKey``) again and the host answers from its command log.

Both speak the wire format of ``piwf.wire`` (``HostRequest`` out, ``HostResponse`` back)
through the standard library's ``json``: a one-shot command (``piwf status``, ``piwf run
show``) would otherwise spend more time loading msgspec than talking to the host. A
request is built as ``HostRequest`` would encode it (``request_fields``; a test compares
the two), and an answer is read into a ``Reply``, checked as ``HostResponse`` is.
"""

from __future__ import annotations

import json
import os
import select
import socket

from piwf.errors import HostTimeout, HostUnavailable, ProtocolError, RequestTooLarge
from piwf.framing import HOST_REQUEST, HOST_RESPONSE, MAX_LINE, LineBuffer, Outcome, check_nesting

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (or msgspec): see above
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from piwf.paths import StatePaths
    from piwf.wire import HostRequest


def new_id() -> str:
    """A fresh request id: 32 hex digits (as ``uuid4().hex``, without loading ``uuid``)."""
    return os.urandom(16).hex()


def request_fields(
    operation: str, *, client_id: str, run_id: str | None = None, payload: dict[str, Any] | None = None,
    expected_revision: int | None = None, request_id: str | None = None, idempotency_key: str | None = None,
) -> dict[str, Any]:
    """A request's fields as ``HostRequest`` encodes them (``omit_defaults``: a field at
    its default is left out)."""
    request_id = request_id or new_id()
    fields: dict[str, Any] = {"schema": HOST_REQUEST, "requestId": request_id, "clientId": client_id,
                              "idempotencyKey": idempotency_key or request_id, "operation": operation}
    if run_id is not None:
        fields["runId"] = run_id
    if expected_revision is not None:
        fields["expectedRevision"] = expected_revision
    if payload:
        fields["payload"] = payload
    return fields


def make_request(
    operation: str, *, client_id: str, run_id: str | None = None, payload: dict[str, Any] | None = None,
    expected_revision: int | None = None, request_id: str | None = None, idempotency_key: str | None = None,
) -> HostRequest:
    """The request as a ``HostRequest`` Struct."""
    from piwf.wire import HostRequest

    return HostRequest(**request_fields(operation, client_id=client_id, run_id=run_id, payload=payload,
                                        expected_revision=expected_revision, request_id=request_id,
                                        idempotency_key=idempotency_key))


def _drop_none(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


class InteractionCalls:
    """The people-in-the-loop operations as methods (DESIGN.md §7); each returns what
    ``call`` returns (awaitable on ``AsyncClient``). ``request_id`` / ``idempotency_key``
    make a retry safe, as with any write (the interaction's own id comes first, by
    position: ``request_id=`` names the command)."""

    call: Callable[..., Any]  # Client.call, or AsyncClient.call (awaitable)

    def list_interactions(self, *, session_id: str | None = None, run_id: str | None = None,
                          open: bool = True, limit: int = 100) -> Any:
        return self.call("interaction.list", payload=_drop_none(sessionId=session_id, runId=run_id, open=open,
                                                                 limit=limit))

    def answer_decision(self, request_id: str, choice: str, /, *, input: str | None = None,
                        expected_revision: int | None = None, **ids: Any) -> Any:
        return self.call("decision.answer", payload=_drop_none(requestId=request_id, choice=choice, input=input,
                                                                expectedRevision=expected_revision), **ids)

    def submit_interaction(self, request_id: str, value: Any, /, *, session_id: str | None = None,
                           expected_revision: int | None = None, **ids: Any) -> Any:
        payload = _drop_none(requestId=request_id, sessionId=session_id, expectedRevision=expected_revision)
        return self.call("interaction.submit", payload={**payload, "value": value}, **ids)

    def update_interaction(self, request_id: str, expected_revision: int, action: str, /, *,
                           entry_id: str | None = None, progress: str | None = None, **ids: Any) -> Any:
        return self.call("interaction.update", payload=_drop_none(
            requestId=request_id, expectedRevision=expected_revision, action=action, entryId=entry_id,
            progress=progress), **ids)


class DeliveryCalls:
    """Delivery to sessions as methods (DESIGN.md §8; docs/sessions.md): claim a
    notification or a turn, show it, then deliver or resolve it with the claim's id."""

    call: Callable[..., Any]  # Client.call, or AsyncClient.call (awaitable)

    def claim_notification(self, session_id: str, **ids: Any) -> Any:
        return self.call("notification.claim", payload={"sessionId": session_id}, **ids)

    def deliver_notification(self, notification_id: str, claim_id: str, **ids: Any) -> Any:
        return self.call("notification.deliver", payload={"notificationId": notification_id, "claimId": claim_id},
                         **ids)

    def claim_turn(self, session_id: str, **ids: Any) -> Any:
        return self.call("turn.claim", payload={"sessionId": session_id}, **ids)

    def resolve_turn(self, turn_id: str, claim_id: str, resolution: str = "presented", **ids: Any) -> Any:
        return self.call("turn.resolve", payload={"turnId": turn_id, "claimId": claim_id, "resolution": resolution},
                         **ids)

    def queue_followup(self, run_id: str, request_key: str, prompt: str, **ids: Any) -> Any:
        return self.call("followup.queue", run_id=run_id, payload={"requestKey": request_key, "prompt": prompt},
                         **ids)

    def remove_followup(self, run_id: str | None, followup_id: str, **ids: Any) -> Any:
        """``run_id`` may be None: the follow-up is found by its own id."""
        return self.call("followup.remove", run_id=run_id, payload={"followUpId": followup_id}, **ids)

    def list_followups(self, *, session_id: str | None = None, run_id: str | None = None, limit: int = 100) -> Any:
        return self.call("followup.list", payload=_drop_none(sessionId=session_id, runId=run_id, limit=limit))

    def list_delivery(self, *, session_id: str | None = None, run_id: str | None = None, limit: int = 100) -> Any:
        return self.call("delivery.list", payload=_drop_none(sessionId=session_id, runId=run_id, limit=limit))

    def watch(self, *, after: int | None = None, run_id: str | None = None, timeout_ms: int = 30_000,
              limit: int = 200, runs_after: str | None = None) -> Any:
        """``run.watch``: a snapshot (no ``after``; a later page of it with ``runs_after``), or
        what changed after the cursor."""
        return self.call("run.watch", run_id=run_id, payload=_drop_none(after=after, timeoutMs=timeout_ms,
                                                                        limit=limit, runsAfter=runs_after))


class Reply:
    """A host's answer: ``piwf.wire.HostResponse``'s fields, read with ``json`` and checked
    as msgspec checks that Struct (``requestId`` and ``outcome`` required, each field of its
    type; fields it does not know are ignored)."""

    __slots__ = ("error", "outcome", "receipt", "requestId", "revision", "schema")

    def __init__(self, requestId: str, outcome: Outcome, schema: str = HOST_RESPONSE,
                 revision: int | None = None, receipt: Any = None, error: str | None = None) -> None:
        self.requestId, self.outcome, self.schema = requestId, outcome, schema
        self.revision, self.receipt, self.error = revision, receipt, error

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reply) and all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    def __repr__(self) -> str:
        return "Reply(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__slots__) + ")"

    @classmethod
    def read(cls, value: object) -> Reply:
        """``value`` (decoded JSON) as a Reply; a ProtocolError saying what is wrong otherwise."""
        if not isinstance(value, dict):
            raise ProtocolError(f"unreadable host response: expected an object, got {_json_type(value)}")
        for name, kind, required, nullable in _REPLY_FIELDS:
            if name not in value:
                if required:
                    raise ProtocolError(f"unreadable host response: object missing required field {name!r}")
                continue
            field = value[name]
            if not ((field is None and nullable) or (isinstance(field, kind) and not isinstance(field, bool))):
                raise ProtocolError(f"unreadable host response: expected {_JSON_TYPES[kind]}, got "
                                    f"{_json_type(field)} - at $.{name}")
        try:
            outcome = Outcome(value["outcome"])
        except ValueError:
            raise ProtocolError(f"unreadable host response: invalid outcome {value['outcome']!r} - at "
                                "$.outcome") from None
        return cls(value["requestId"], outcome, value.get("schema", HOST_RESPONSE), value.get("revision"),
                   value.get("receipt"), value.get("error"))


# HostResponse's fields and their types (name, type, required, may be null); receipt is any JSON.
_REPLY_FIELDS = (("requestId", str, True, False), ("outcome", str, True, False), ("schema", str, False, False),
                 ("revision", int, False, True), ("error", str, False, True))
_JSON_TYPES = {str: "str", int: "int", float: "float", bool: "bool", dict: "object", list: "array",
               type(None): "null"}


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _line(fields: dict[str, Any]) -> bytes:
    """The request as one line; refused here when the host would refuse it for its size
    (a retry could never succeed)."""
    line = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise RequestTooLarge(f"the {fields['operation']} request is {len(line)} bytes; a request line is at most "
                              f"{MAX_LINE} bytes (1 MiB): nothing was sent")
    return line


def _struct_fields(request: HostRequest) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(request)  # type: ignore[no-any-return]  # a Struct's fields, defaults left out


def _decode(line: bytes) -> Reply:
    check_nesting(line)
    try:
        value = json.loads(line)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ProtocolError(f"unreadable host response: {exc}") from exc
    return Reply.read(value)


class Client(InteractionCalls, DeliveryCalls):
    def __init__(self, paths: StatePaths, *, client_id: str | None = None, timeout: float | None = 30.0) -> None:
        self.paths = paths
        self.client_id = client_id or f"cli-{os.getpid()}-{new_id()[:6]}"
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buffer = LineBuffer(MAX_LINE * 16)
        self._lines: list[bytes] = []
        self._answered_any = False  # bytes came back for the line being sent

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        if self._sock is not None and not self._closed_by_host():
            return
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.paths.socket_name)
        except TimeoutError as exc:  # the listen backlog is full: nobody is accepting
            sock.close()
            raise self._timed_out("accept the connection") from exc
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise HostUnavailable(f"no piwf host is serving {self.paths.name} (start one with `piwf serve`)") from exc
        except OSError as exc:
            sock.close()
            raise HostUnavailable(f"cannot reach the piwf host at {self.paths.socket_name}: {exc}") from exc
        self._sock = sock

    def _closed_by_host(self) -> bool:
        """Between requests the host says nothing unless it is closing the connection (it
        made room for another client, an idle one timed out): then connect again."""
        assert self._sock is not None
        if self._lines:
            return False
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer = LineBuffer(MAX_LINE * 16)  # a reply cut short must not prefix the next one
        self._lines = []

    def send_line(self, line: bytes) -> bytes:
        """Send raw bytes (one line) and return the raw response line.

        A connection kept from an earlier request that the host closed meanwhile (it made
        room for another client after answering a long poll, or timed out an idle one)
        before this line reached it is connected again and the line sent once more: the
        host reads nothing from a connection it is closing, and a request sent twice with
        its ``requestId`` is answered from the command log anyway."""
        reused = self._sock is not None
        try:
            return self._send_line(line)
        except HostTimeout:
            raise
        except HostUnavailable:
            if not reused or self._answered_any:
                raise
            return self._send_line(line)

    def _send_line(self, line: bytes) -> bytes:
        self.connect()
        self._answered_any = False
        assert self._sock is not None
        try:
            self._sock.sendall(line)
        except TimeoutError as exc:
            self.close()
            raise self._timed_out("read the request") from exc
        except OSError as exc:  # the host went away mid-request: whether it committed is unknown
            self.close()
            raise HostUnavailable(f"lost the connection to the host: {exc}; retry with the same requestId") from exc
        return self.read_line()

    def read_line(self) -> bytes:
        assert self._sock is not None
        while not self._lines:
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError as exc:  # closed: a late reply must not answer the next request
                self.close()
                raise self._timed_out("answer") from exc
            except OSError as exc:
                self.close()
                raise HostUnavailable(f"lost the connection to the host: {exc}") from exc
            if not chunk:
                self.close()
                raise HostUnavailable("the host closed the connection")
            self._answered_any = True
            self._lines.extend(self._buffer.feed(chunk))
        return self._lines.pop(0)

    def send(self, request: HostRequest) -> Reply:
        return self.send_fields(_struct_fields(request))

    def send_fields(self, fields: dict[str, Any]) -> Reply:
        """Send a request given as its fields (``request_fields``) and read the answer."""
        line = _line(fields)
        reused = self._sock is not None
        response = _decode(self.send_line(line))
        if reused and response.requestId == "" and response.outcome == "unavailable":
            # the host's line as it closed the kept connection (to make room), not an answer
            self.close()
            response = _decode(self.send_line(line))
        return response

    def call(self, operation: str, **kwargs: Any) -> Reply:
        return self.send_fields(request_fields(operation, client_id=self.client_id, **kwargs))

    def _timed_out(self, what: str) -> HostTimeout:
        return HostTimeout(f"the piwf host serving {self.paths.name} did not {what} within {self.timeout:g} s "
                           "(frozen or overloaded? `piwf status` says)")


class AsyncClient(InteractionCalls, DeliveryCalls):
    """The same protocol over a trio stream, for tests and tools."""

    def __init__(self, paths: StatePaths, *, client_id: str | None = None) -> None:
        self.paths = paths
        self.client_id = client_id or f"async-{new_id()[:8]}"
        self._stream: Any = None
        self._buffer = LineBuffer(MAX_LINE * 16)
        self._lines: list[bytes] = []

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        import trio

        try:
            self._stream = await trio.open_unix_socket(str(self.paths.socket))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HostUnavailable(f"no piwf host is serving {self.paths.root}") from exc

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def send_line(self, line: bytes) -> bytes:
        import trio  # loaded already: this client runs on trio (the CLI's blocking one does not)

        try:
            await self._stream.send_all(line)
        except trio.BrokenResourceError as exc:  # the host went away: a broken pipe, a reset
            raise HostUnavailable("the host closed the connection") from exc
        return await self.read_line()

    async def read_line(self) -> bytes:
        import trio

        while not self._lines:
            try:
                chunk = await self._stream.receive_some(65536)
            except trio.BrokenResourceError as exc:
                raise HostUnavailable("the host closed the connection") from exc
            if not chunk:
                raise HostUnavailable("the host closed the connection")
            self._lines.extend(self._buffer.feed(chunk))
        return self._lines.pop(0)

    async def send(self, request: HostRequest) -> Reply:
        return await self.send_fields(_struct_fields(request))

    async def send_fields(self, fields: dict[str, Any]) -> Reply:
        return _decode(await self.send_line(_line(fields)))

    async def call(self, operation: str, **kwargs: Any) -> Reply:
        return await self.send_fields(request_fields(operation, client_id=self.client_id, **kwargs))
