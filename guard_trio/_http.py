"""A small HTTP/1.1 GET client on trio and h11, for metrics pages.

Reads: an http or https URL.
Guarantees: the whole exchange ends within ``timeout_s`` (``trio.TooSlowError`` otherwise); a
body longer than ``max_bytes`` is refused with :class:`ResponseTooLarge` without reading further;
the connection is always closed (one request per connection: metrics polls are once a second).
"""

from __future__ import annotations

import ssl
from urllib.parse import urlsplit

import attrs
import h11
import trio

from guard_core import GuardError

__all__ = ("FetchError", "Response", "ResponseTooLarge", "fetch")

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


async def fetch(url: str, *, timeout_s: float = 2.0, max_bytes: int = 4 * 1024 * 1024) -> Response:
    """GET ``url`` and return the whole response."""
    hostname, host_header, port, path, secure = _target(url)
    with trio.fail_after(timeout_s):
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(hostname, port)
        except OSError as exc:
            raise FetchError(
                f"connect to {hostname}:{port} failed: {exc.strerror or exc}"
            ) from None
        if secure:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=hostname)
        async with stream:
            return await _exchange(stream, host_header, path, max_bytes)
    raise AssertionError("unreachable")  # pragma: no cover - fail_after raises or we returned


async def _exchange(stream: trio.abc.Stream, host: str, path: str, max_bytes: int) -> Response:
    connection = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="GET",
        target=path,
        headers=[
            ("Host", host),
            ("Accept", "text/plain"),
            ("User-Agent", "inference-guard"),
            ("Connection", "close"),
        ],
    )
    try:
        await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
        status, body = 0, bytearray()
        headers: tuple[tuple[bytes, bytes], ...] = ()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(bytes(await stream.receive_some(_READ_SIZE)))
                continue
            if isinstance(event, h11.Response):
                status, headers = event.status_code, tuple(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise ResponseTooLarge(f"response body over {max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return Response(status, headers, bytes(body))
    except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
        raise FetchError(f"bad response: {exc}") from None
