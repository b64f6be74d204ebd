"""Protocol switches, request-target forms and hop-by-hop headers (catalogue rows T13, T15).

- T13: ``Upgrade`` (websocket, h2c), ``CONNECT``, the HTTP/2 preface and absolute-form targets
  are answered with a 4xx and the connection closed, before any backend connection; h11 would
  otherwise leave such a connection PAUSED forever. An absolute-form target never chooses where
  a request goes: a sentinel listener named by one sees no connection.
- T15: headers named by ``Connection``, and ``Keep-Alive``, ``TE``, ``Trailer``, ``Upgrade``,
  ``Proxy-Authorization``, ``Proxy-Connection`` never reach the backend, nor do client
  ``X-PIG-*`` headers; ``X-Forwarded-For`` reaches it once, with the socket peer appended.
  The backend's own hop-by-hop headers never reach the client either.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import trio

from tests.integration.hostile.conftest import CountingUpstream, raw_exchange

CHAT = b"/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
OK_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
PEER = b"127.0.0.1"


def environ(upstream: str) -> dict[str, str]:
    return {
        "UPSTREAM": upstream,
        "DYNAMIC_PIG_ENABLED": "false",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
    }


@attrs.define
class Received:
    request_line: bytes
    headers: list[tuple[bytes, bytes]]

    def values(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


def recording(log: list[Received], response: bytes = OK_RESPONSE) -> Any:
    """A backend that records each request head, reads its Content-Length body and answers."""

    async def script(stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        buffer = b""
        while True:
            data = await upstream.read_head(stream)
            buffer += data
            if b"\r\n\r\n" not in buffer:
                return
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            headers = []
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers.append((name.strip().lower(), value.strip()))
            received = Received(lines[0], headers)
            log.append(received)
            length = int((received.values(b"content-length") or [b"0"])[0])
            while len(buffer) < length:
                more = await stream.receive_some(65536)
                if not more:
                    return
                buffer += more
            buffer = buffer[length:]
            await stream.send_all(response)

    return script


@attrs.frozen
class Reply:
    data: bytes

    @property
    def status(self) -> int | None:
        return int(self.data[9:12]) if self.data.startswith(b"HTTP/1.1 ") else None


async def one_response(base: str, data: bytes) -> Reply:
    """Send ``data`` on a fresh connection and read one whole response (Content-Length or
    chunked), or until the guard closes; at most 5 s."""
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    try:
        await stream.send_all(data)
        with trio.move_on_after(5.0):
            while not _complete(received):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                received += chunk
    finally:
        await trio.aclose_forcefully(stream)
    return Reply(received)


def _complete(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if length is not None:
        return len(body) >= int(length.group(1))
    return body.endswith(b"0\r\n\r\n")


# -- T13 ------------------------------------------------------------------------------------------

H = b"Host: guard\r\n"
T13_CASES = {
    "websocket upgrade (GET)": b"GET /v1/models HTTP/1.1\r\n" + H + b"Upgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n",
    "websocket upgrade (admitted POST)": b"POST /v1/chat/completions HTTP/1.1\r\n"
    + H
    + b"Upgrade: websocket\r\nConnection: Upgrade\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    + BODY,
    "h2c upgrade": b"GET /v1/models HTTP/1.1\r\n" + H + b"Upgrade: h2c\r\n"
    b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n",
    "h2c upgrade with a body": b"POST /v1/other HTTP/1.1\r\n" + H + b"Upgrade: h2c\r\n"
    b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    b"Content-Length: 3\r\n\r\nabc",
    "upgrade without Connection": b"GET /v1/models HTTP/1.1\r\n" + H + b"Upgrade: foo/2\r\n\r\n",
    "h2 prior-knowledge preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "CONNECT authority-form": b"CONNECT 169.254.169.254:443 HTTP/1.1\r\n"
    b"Host: 169.254.169.254:443\r\n\r\n",
    "CONNECT origin-form": b"CONNECT /v1/models HTTP/1.1\r\n" + H + b"\r\n",
    "absolute-form to the metadata service": b"GET http://169.254.169.254/latest HTTP/1.1\r\n"
    + H
    + b"\r\n",
    "absolute-form admitted path": b"POST http://evil.example/v1/chat/completions HTTP/1.1\r\n"
    + H
    + b"Content-Length: %d\r\n\r\n" % len(BODY)
    + BODY,
    "absolute-form https": b"GET https://evil.example:8443/v1/models HTTP/1.1\r\n" + H + b"\r\n",
    "asterisk-form": b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n",
}


@pytest.mark.parametrize("case", list(T13_CASES))
async def test_t13_switches_and_foreign_targets_are_refused_before_any_backend(
    case: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    upstream = await start_upstream(recording([]))
    guard, _ = await start_guard(environ(upstream.base))
    with trio.fail_after(10):  # a PAUSED connection would hang here
        result = await raw_exchange(guard, T13_CASES[case], quiet_s=3.0, total_s=5.0)
    assert result.status in (400, 405, 501), result.data[:200]
    assert result.statuses() == [result.status]
    assert b"101 " not in result.data
    assert result.closed, "the connection stayed open"
    assert result.closed_after_s is not None
    assert result.closed_after_s < 1.0  # catalogue: 100 ms
    assert upstream.connections == 0
    figure(
        "T13",
        case,
        f"{result.status}, closed in {result.closed_after_s * 1000:.1f} ms",
        "4xx within 100 ms and close, 0 upstream",
    )


async def test_t13_absolute_form_never_routes_by_its_host(
    start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    """A sentinel backend named only in the request target must see nothing at all."""
    upstream = await start_upstream(recording([]))
    sentinel = await start_upstream(recording([]))
    guard, _ = await start_guard(environ(upstream.base))
    authority = sentinel.base.removeprefix("http://").encode()
    statuses = []
    for method, path, body in ((b"GET", b"/v1/models", b""), (b"POST", CHAT, BODY)):
        request = (
            method
            + b" http://"
            + authority
            + path
            + b" HTTP/1.1\r\nHost: "
            + authority
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        result = await raw_exchange(guard, request, quiet_s=3.0, total_s=5.0)
        statuses.append(result.status)
        assert result.status is not None
        assert 400 <= result.status < 500
        assert result.closed
    assert sentinel.connections == 0
    assert upstream.connections == 0
    figure(
        "T13",
        "absolute-form naming a sentinel backend",
        f"{statuses}, sentinel 0, upstream 0",
        "never routed by the target's host",
    )


# -- T15 ------------------------------------------------------------------------------------------


@attrs.frozen
class Variant:
    name: str
    headers: tuple[tuple[bytes, bytes], ...]
    #: Header names that must not reach the backend.
    absent: tuple[bytes, ...] = ()
    #: X-Forwarded-For values the client sent, in order (the guard appends the peer).
    forwarded_for: tuple[bytes, ...] = ()
    #: The client's X-Forwarded-For is named by Connection: it may be dropped or kept.
    xff_optional: bool = False


SECRET = (b"X-Secret", b"must-not-pass")
T15_VARIANTS = [
    Variant(
        "Connection names X-Secret (with keep-alive)",
        ((b"Connection", b"keep-alive, X-Secret"), SECRET),
        (b"x-secret", b"connection"),
    ),
    Variant(
        "Connection names X-Secret alone",
        ((b"Connection", b"X-Secret"), SECRET),
        (b"x-secret", b"connection"),
    ),
    Variant(
        "Connection odd spacing and case",
        ((b"Connection", b"  x-SECRET ,KEEP-ALIVE,"), SECRET, (b"Keep-Alive", b"timeout=5")),
        (b"x-secret", b"keep-alive", b"connection"),
    ),
    Variant(
        "two Connection lines",
        ((b"Connection", b"X-One"), (b"X-One", b"1"), (b"Connection", b"X-Two"), (b"X-Two", b"2")),
        (b"x-one", b"x-two", b"connection"),
    ),
    Variant(
        "Connection named header sent first",
        (SECRET, (b"Connection", b"X-Secret")),
        (b"x-secret", b"connection"),
    ),
    Variant("Keep-Alive", ((b"Keep-Alive", b"timeout=5, max=100"),), (b"keep-alive",)),
    Variant("TE: trailers", ((b"TE", b"trailers"),), (b"te",)),
    Variant("TE: trailers, gzip", ((b"TE", b"trailers, gzip"),), (b"te",)),
    Variant("TE: gzip", ((b"te", b"gzip"),), (b"te",)),
    Variant("Trailer", ((b"Trailer", b"X-Checksum"),), (b"trailer",)),
    Variant(
        "Proxy-Authorization",
        ((b"Proxy-Authorization", b"Basic dXNlcjpwYXNz"),),
        (b"proxy-authorization",),
    ),
    Variant("Proxy-Connection", ((b"Proxy-Connection", b"keep-alive"),), (b"proxy-connection",)),
    Variant("Proxy-Authenticate", ((b"Proxy-Authenticate", b"Basic"),), (b"proxy-authenticate",)),
    Variant(
        "everything at once",
        (
            (b"Connection", b"keep-alive, X-Secret, Proxy-Connection"),
            SECRET,
            (b"Keep-Alive", b"timeout=5"),
            (b"TE", b"trailers"),
            (b"Trailer", b"X-T"),
            (b"Proxy-Authorization", b"Basic x"),
            (b"Proxy-Connection", b"keep-alive"),
        ),
        (
            b"x-secret",
            b"connection",
            b"keep-alive",
            b"te",
            b"trailer",
            b"proxy-authorization",
            b"proxy-connection",
        ),
    ),
    Variant(
        "client X-PIG-* headers",
        (
            (b"X-PIG-Tier", b"forged"),
            (b"X-PIG-Backend", b"forged"),
            (b"X-PIG-Lane", b"forged"),
            (b"X-PIG-Output-Tokens", b"forged"),
            (b"x-pig-anything", b"forged"),
            (b"X-Pig-Tier", b"forged"),
        ),
        (b"x-pig-output-tokens", b"x-pig-anything"),
    ),
    Variant(
        "client X-Forwarded-For",
        ((b"X-Forwarded-For", b"1.2.3.4"),),
        forwarded_for=(b"1.2.3.4",),
    ),
    Variant(
        "two client X-Forwarded-For lines",
        ((b"X-Forwarded-For", b"1.2.3.4, 5.6.7.8"), (b"x-forwarded-for", b"9.9.9.9")),
        forwarded_for=(b"1.2.3.4, 5.6.7.8", b"9.9.9.9"),
    ),
    Variant(
        "Connection names X-Forwarded-For",
        ((b"Connection", b"X-Forwarded-For"), (b"X-Forwarded-For", b"1.2.3.4")),
        (b"connection",),
        xff_optional=True,
    ),
]
ROUTES = {"admitted": (b"POST", CHAT), "passthrough": (b"GET", b"/v1/models")}


def build(method: bytes, path: bytes, headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    body = BODY if method == b"POST" else b""
    lines = [(b"Host", b"guard"), *headers]
    if method == b"POST":
        lines.append((b"Content-Length", str(len(body)).encode()))
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\n"
        + b"".join(name + b": " + value + b"\r\n" for name, value in lines)
        + b"\r\n"
        + body
    )


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("variant", T15_VARIANTS, ids=[v.name for v in T15_VARIANTS])
async def test_t15_hop_by_hop_and_pig_headers_never_reach_the_backend(
    variant: Variant, route: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    log: list[Received] = []
    upstream = await start_upstream(recording(log))
    guard, _ = await start_guard(environ(upstream.base))
    method, path = ROUTES[route]
    result = await one_response(guard, build(method, path, variant.headers))
    assert result.status == 200, result.data[:200]
    assert len(log) == 1
    seen = log[0]
    names = {name for name, _ in seen.headers}
    leaked = sorted(name for name in variant.absent if name in names)
    assert not leaked, seen.headers
    assert b"must-not-pass" not in b"".join(v for _, v in seen.headers)
    for name, value in seen.headers:
        if name.startswith(b"x-pig-"):
            assert value != b"forged", name
            assert name in (b"x-pig-backend", b"x-pig-tier", b"x-pig-lane"), name
    assert len(seen.values(b"x-pig-backend")) == 1
    if route == "admitted":
        assert len(seen.values(b"x-pig-tier")) == 1
    xff = seen.values(b"x-forwarded-for")
    assert len(xff) == 1, xff
    parts = [part.strip() for part in xff[0].split(b",")]
    assert parts[-1] == PEER
    if not variant.xff_optional:
        expected = [p.strip() for value in variant.forwarded_for for p in value.split(b",")]
        assert parts[:-1] == expected
    figure(
        "T15",
        f"{variant.name} ({route})",
        f"0 of {len(variant.absent)} leaked; XFF {xff[0].decode()[:18]}",
        "0 hop-by-hop / X-PIG-* reach the backend",
    )


async def test_t15_underscore_aliases_of_guard_headers_are_refused(
    start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    """``X_PIG_Tier`` would read as ``X-PIG-Tier`` to a backend that folds ``_`` into ``-``."""
    log: list[Received] = []
    upstream = await start_upstream(recording(log))
    guard, _ = await start_guard(environ(upstream.base))
    for name in (b"X_PIG_Tier", b"x_forwarded_for", b"Proxy_Connection", b"X_User_Tier"):
        result = await raw_exchange(guard, build(b"GET", b"/v1/models", ((name, b"v"),)))
        assert result.status == 400, (name, result.data[:200])
        assert result.closed
    # Underscores elsewhere are ordinary end-to-end headers.
    result = await raw_exchange(guard, build(b"GET", b"/v1/models", ((b"X_Custom", b"v"),)))
    assert result.status == 200
    assert upstream.requests == 1
    assert log[0].values(b"x_custom") == [b"v"]
    figure("T15", "underscore aliases of guard headers", "400 x4, X_Custom passes", "never reach")


UPSTREAM_HOP_BY_HOP = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/plain\r\n"
    b"Connection: keep-alive, X-Up-Secret\r\n"
    b"X-Up-Secret: leaked\r\n"
    b"Keep-Alive: timeout=5\r\n"
    b"Proxy-Connection: keep-alive\r\n"
    b"Upgrade: h2c\r\n"
    b"Trailer: X-T\r\n"
    b"Proxy-Authenticate: Basic\r\n"
    b"X-End-To-End: kept\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n"
)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_t15_backend_hop_by_hop_headers_never_reach_the_client(
    route: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    log: list[Received] = []
    upstream = await start_upstream(recording(log, UPSTREAM_HOP_BY_HOP))
    guard, _ = await start_guard(environ(upstream.base))
    method, path = ROUTES[route]
    result = await one_response(guard, build(method, path, ()))
    assert result.status == 200, result.data[:300]
    head = result.data.partition(b"\r\n\r\n")[0].lower()
    for leaked in (b"x-up-secret", b"keep-alive", b"proxy-connection", b"upgrade", b"trailer"):
        assert not re.search(rb"\r\n" + leaked + rb":", head), (leaked, head)
    assert b"proxy-authenticate" not in head
    assert b"x-end-to-end: kept" in head
    assert b"x-up-secret" not in head
    figure("T15", f"backend hop-by-hop headers ({route})", "0 reach the client", "0 verbatim")
