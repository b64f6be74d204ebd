"""The client side of one connection: h11 as a server over a trio stream.

Reads: bytes from the client socket.
Guarantees:
- a request head larger than 16 KiB or with more than 100 header lines is refused with 431,
  a head that does not arrive within ``header_timeout_s`` with 408, a request carrying both
  Content-Length and Transfer-Encoding with 400, and any other malformed head with h11's status
  hint; the connection is closed after each of these;
- a client that goes away is noticed both while we write (:class:`ClientGone`) and, through
  :meth:`Downstream.watch_for_disconnect`, while we wait for admission or for the backend;
- bytes a client pipelines behind its request are kept for the next request, not lost.
"""

from __future__ import annotations

from http import HTTPStatus

import attrs
import h11
import trio

from guard_core import GuardError

__all__ = (
    "MAX_HEADERS",
    "MAX_HEADER_BYTES",
    "ClientGone",
    "Downstream",
    "RefusedRequest",
    "ResponseAborted",
)

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
_READ_SIZE = 65536


class ClientGone(GuardError):
    """The client closed its connection or a write to it failed."""


class ResponseAborted(GuardError):
    """A response already started cannot be completed: the client connection must be closed."""


@attrs.frozen
class RefusedRequest(Exception):
    """A request refused before routing: answer ``status`` and close."""

    status: int
    reason: str


class Downstream:
    def __init__(self, stream: trio.abc.Stream, peer: str) -> None:
        self.stream = stream
        self.peer = peer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.gone = False

    async def _receive(self) -> None:
        try:
            data = await self.stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.gone = True
        self.h11.receive_data(bytes(data))

    async def next_event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                await self._receive()
                continue
            return event  # type: ignore[return-value]

    async def next_request(self, header_timeout_s: float) -> h11.Request | None:
        """The next request head, or None when the client closed the connection cleanly."""
        try:
            with trio.fail_after(header_timeout_s):
                event = await self.next_event()
        except trio.TooSlowError:
            raise RefusedRequest(408, "request head timed out") from None
        except h11.RemoteProtocolError as exc:
            raise RefusedRequest(exc.error_status_hint, str(exc)) from None
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):  # pragma: no cover - h11 guarantees the order
            raise RefusedRequest(400, "unexpected event")
        headers = event.headers
        if len(headers) > MAX_HEADERS:
            raise RefusedRequest(431, "too many header lines")
        if sum(len(name) + len(value) + 4 for name, value in headers) > MAX_HEADER_BYTES:
            raise RefusedRequest(431, "request head too large")
        names = {name for name, _ in headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise RefusedRequest(400, "both Content-Length and Transfer-Encoding")
        return event

    async def send(self, *events: h11.Event) -> None:
        data = b"".join(self.h11.send(event) or b"" for event in events)
        if not data:
            return
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.gone = True
            self.h11.send_failed()
            raise ClientGone("client went away") from None

    async def respond(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> None:
        """A whole response in one write."""
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        events: list[h11.Event] = [
            h11.Response(status_code=status, headers=headers, reason=_reason(status))
        ]
        if body:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        await self.send(*events)

    async def watch_for_disconnect(self, scope: trio.CancelScope) -> None:
        """Read while nothing else does; cancel ``scope`` when the client closes."""
        while not self.gone:
            await self._receive()
        scope.cancel()

    @property
    def can_respond(self) -> bool:
        return not self.gone and self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def close(self) -> None:
        with trio.move_on_after(0.5) as scope:
            scope.shield = True
            await trio.aclose_forcefully(self.stream)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
