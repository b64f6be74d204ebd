"""The simulated backend's HTTP/1.1 side: connections, whole requests, plain responses.

Reads: bytes from one client connection; a *route*, the server's handler of one whole request.

Guarantees: a connection serves requests one after the other (keep-alive, idle ``keep_alive_s``,
30 s to read a request once it has begun, bodies up to 32 MiB) and ends after a response that
leaves h11 anywhere but ``DONE``. A malformed request gets h11's status hint, a handler's bug a
500 (printed to stderr), and neither takes other connections down. While a response is being
produced the socket is watched (:func:`watched`), so a client that closes is seen even when
nothing is being written; bytes it sends meanwhile are kept for the next request.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Final

import h11
import trio

from guard_trio.tools.sim_backend._errors import json_bytes

_READ_SIZE: Final = 65536
_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
_REQUEST_READ_S: Final = 30.0

JSON: Final = "application/json"
SSE_HEADERS: Final = [
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
]
NOT_FOUND: Final = b'{"detail":"Not Found"}'
NOT_ALLOWED: Final = b'{"detail":"Method Not Allowed"}'


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def is_loopback(host: str) -> bool:
    """Whether a peer address is a loopback address (IPv4, IPv6 or IPv4-mapped IPv6)."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def split_sse_events(transcript: bytes) -> list[bytes]:
    """Cut an SSE transcript after each blank line; joined back, the pieces are the input."""
    pieces: list[bytes] = []
    start = 0
    while True:
        end = transcript.find(b"\n\n", start)
        if end < 0:
            break
        end += 2
        while end < len(transcript) and transcript[end : end + 1] == b"\n":
            end += 1  # extra blank lines stay with the event they follow
        pieces.append(transcript[start:end])
        start = end
    if start < len(transcript):
        pieces.append(transcript[start:])
    return pieces


async def write(stream: trio.SocketStream, fd: int, data: bytes) -> None:
    """Write ``data``, straight into the socket buffer when it has room.

    ``send_all`` always passes through the scheduler; at one write per stream per engine step
    that trip is a large share of the cost of a token, and it is needed only when the kernel
    buffer is full (then the rest goes through ``send_all``).
    """
    try:
        written = os.write(fd, data)
    except BlockingIOError:
        written = 0
    except OSError as error:
        raise trio.BrokenResourceError(f"write failed: {error.strerror or error}") from error
    if written < len(data):
        await stream.send_all(memoryview(data)[written:])


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (what h11 would write for it)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Exchange:
    """One request/response on a connection."""

    __slots__ = ("conn", "peer_gone", "stream")

    def __init__(self, stream: trio.SocketStream, conn: h11.Connection) -> None:
        self.stream = stream
        self.conn = conn
        self.peer_gone = False


#: The handler of one whole request: the exchange, the request, its body and the peer's address.
Route = Callable[["Exchange", h11.Request, bytes, str], Awaitable[None]]


async def handle_connection(
    stream: trio.SocketStream, route: Route, *, keep_alive_s: float
) -> None:
    """Serve one client's requests through ``route`` until it leaves, idles out or errs."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
    try:
        peer = str(stream.socket.getpeername()[0])
    except OSError:
        return
    try:
        while True:
            request = await read_request(stream, conn, keep_alive_s=keep_alive_s)
            if request is None:
                return
            exchange = Exchange(stream, conn)
            await route(exchange, request[0], request[1], peer)
            if (
                exchange.peer_gone
                or conn.our_state is not h11.DONE
                or conn.their_state is not h11.DONE
            ):
                return
            conn.start_next_cycle()
    except h11.RemoteProtocolError as error:
        await refuse(stream, conn, error.error_status_hint, str(error))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        conn.send_failed()
    except Exception:  # a bug here must not take the other connections down
        traceback.print_exc(file=sys.stderr)
        await refuse(stream, conn, 500, "Internal Server Error")


async def refuse(stream: trio.SocketStream, conn: h11.Connection, status: int, detail: str) -> None:
    """A JSON ``detail`` error that closes the connection, if a response may still be sent."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = json_bytes({"detail": detail})
    headers = [
        ("content-type", JSON),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    try:
        await stream.send_all(_whole_response(conn, status, headers, body))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        conn.send_failed()


async def read_request(
    stream: trio.SocketStream, conn: h11.Connection, *, keep_alive_s: float
) -> tuple[h11.Request, bytes] | None:
    """The next whole request, or ``None`` when the client closed or idled out."""
    request: h11.Request | None = None
    body = bytearray()
    idle = conn.their_state is h11.IDLE and not conn.trailing_data[0]
    with trio.CancelScope(
        deadline=trio.current_time() + (keep_alive_s if idle else _REQUEST_READ_S)
    ) as scope:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(_READ_SIZE)
                if idle and data:
                    idle = False
                    scope.deadline = trio.current_time() + _REQUEST_READ_S
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_BODY_BYTES:
                    await refuse(stream, conn, 413, "Request body too large")
                    return None
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:  # ConnectionClosed or PAUSED
                return None
    if not idle:
        await refuse(stream, conn, 408, "Request timeout")
    return None


async def send(exchange: Exchange, status: int, body: bytes, content_type: str = JSON) -> None:
    """Answer with ``body`` as a whole (``content-length``); no content type when it is empty."""
    headers = [("content-length", str(len(body)))]
    if content_type:
        headers.append(("content-type", content_type))
    await exchange.stream.send_all(_whole_response(exchange.conn, status, headers, body))


def _whole_response(
    conn: h11.Connection, status: int, headers: list[tuple[str, str]], body: bytes
) -> bytes:
    data = conn.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
    if body:
        data += conn.send(h11.Data(data=body))
    return data + conn.send(h11.EndOfMessage())


async def watched(exchange: Exchange, work: Awaitable[None]) -> None:
    """Run ``work`` (a coroutine) while watching the socket; a close cancels the work."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_peer, exchange, nursery.cancel_scope)
        try:
            await work
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            exchange.peer_gone = True
            exchange.conn.send_failed()
        nursery.cancel_scope.cancel()


async def _watch_peer(exchange: Exchange, scope: trio.CancelScope) -> None:
    """Read while the response is produced: EOF or a reset means the client is gone."""
    buffered = 0
    while buffered <= _READ_SIZE:
        try:
            data = await exchange.stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            exchange.peer_gone = True
            scope.cancel()
            return
        buffered += len(data)
        exchange.conn.receive_data(data)  # a pipelined request, kept for the next cycle
