"""A small one-shot HTTP/1.1 client on trio and h11: metrics pages, dstack, evidence URLs.

Reads: an http or https URL (``fetch``), or any stream and a request (``exchange``).
Guarantees: the whole exchange ends within ``timeout_s`` (``trio.TooSlowError`` otherwise); a
body longer than ``max_bytes`` is refused with :class:`ResponseTooLarge` without reading further;
the connection is always closed (one request per connection: metrics polls are once a second).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from urllib.parse import urlsplit

import attrs
import h11
import trio

from guard_core import GuardError

__all__ = ("FetchError", "Response", "ResponseTooLarge", "exchange", "fetch", "open_stream")

_READ_SIZE = 65536


class FetchError(GuardError):
    """The page could not be fetched (connection, protocol or size)."""


class ResponseTooLarge(FetchError):
    pass


@attrs.frozen
class Response:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


def _target(url: str) -> tuple[str, str, int, str, bool]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host_header = parts.netloc.rpartition("@")[2]
    return parts.hostname, host_header, port, path, secure


async def open_stream(host: str, port: int, *, secure: bool) -> trio.abc.Stream:
    """A TCP (or TLS) stream to ``host:port``; connection failures are :class:`FetchError`."""
    try:
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise FetchError(f"connect to {host}:{port} failed: {exc.strerror or exc}") from None
    if secure:
        stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
    return stream


async def fetch(url: str, *, timeout_s: float = 2.0, max_bytes: int = 4 * 1024 * 1024) -> Response:
    """GET ``url`` and return the whole response."""
    hostname, host_header, port, path, secure = _target(url)
    headers = [
        (b"host", host_header.encode()),
        (b"accept", b"text/plain"),
        (b"user-agent", b"inference-guard"),
        (b"connection", b"close"),
    ]
    with trio.fail_after(timeout_s):
        stream = await open_stream(hostname, port, secure=secure)
        async with stream:
            return await exchange(
                stream, method=b"GET", target=path, headers=headers, max_bytes=max_bytes
            )
    raise AssertionError("unreachable")  # pragma: no cover - fail_after raises or we returned


async def exchange(
    stream: trio.abc.Stream,
    *,
    method: bytes,
    target: str,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes = b"",
    max_bytes: int,
) -> Response:
    """Send one request over ``stream`` and read the whole response (no connection reuse).

    Raises :class:`ResponseTooLarge` past ``max_bytes`` of body and :class:`FetchError` for any
    other connection or framing problem.
    """
    connection = h11.Connection(h11.CLIENT)
    try:
        events: list[h11.Event] = [h11.Request(method=method, target=target, headers=list(headers))]
        if body:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        await stream.send_all(b"".join(connection.send(event) or b"" for event in events))
        status, received = 0, bytearray()
        response_headers: tuple[tuple[bytes, bytes], ...] = ()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(bytes(await stream.receive_some(_READ_SIZE)))
            elif isinstance(event, h11.Response):
                status, response_headers = event.status_code, tuple(event.headers)
            elif isinstance(event, h11.Data):
                received += event.data
                if len(received) > max_bytes:
                    raise ResponseTooLarge(f"response body over {max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return Response(status, response_headers, bytes(received))
            elif isinstance(event, h11.ConnectionClosed):
                raise FetchError("connection closed before a complete response")
    except h11.ProtocolError as exc:
        raise FetchError(f"bad response: {exc}") from None
    except (trio.BrokenResourceError, OSError) as exc:
        raise FetchError(f"connection failed: {exc}") from None
