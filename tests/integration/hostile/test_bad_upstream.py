"""Malformed backend responses (reliability catalogue row T16; spec 2.2, response-side desync).

The fake backend answers the first connection with a bad response: bad header bytes, obs-fold,
bare LF, Content-Length with Transfer-Encoding and junk after the body, conflicting lengths, a
garbage status line, a run of ``103`` interim responses, a body longer than its length, an
unsolicited second response, an oversized head, or an early answer while the request body is
still coming. Then it keeps that connection open and counts any further request that arrives
on it: a connection whose response was bad must never be reused.

Each bad response must give the client a clean error at once (PIG's 429 body, or a 502 without
internal detail). Three kinds may instead be relayed, in canonical form: what h11 repairs on
parsing (obs-fold, bare LF: the client sees neither), Content-Length with chunked (read as
chunked with the length dropped, as HAProxy does), and the early response (passed through).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

from guard_trio._proxy import TOO_MANY_REQUESTS_BODY
from tests.integration.hostile.conftest import CountingUpstream

OK_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
CHAT = b"/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'

Send = Callable[[trio.SocketStream], Awaitable[None]]


def environ(upstream: str) -> dict[str, str]:
    return {
        "UPSTREAM": upstream,
        "DYNAMIC_PIG_ENABLED": "false",
        "PROXY_TIMEOUT_SECONDS": "20",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
    }


def once(data: bytes) -> Send:
    async def send(stream: trio.SocketStream) -> None:
        await stream.send_all(data)

    return send


async def interim_flood(stream: trio.SocketStream) -> None:
    """``103 Early Hints`` for up to 6 s (a hostile backend never stops), then a final 200."""
    deadline = trio.current_time() + 6.0
    sent = 0
    while trio.current_time() < deadline and sent < 200_000:
        await stream.send_all(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n" * 50)
        sent += 50
        await trio.sleep(0.001)
    await stream.send_all(OK_RESPONSE)


async def late_second_response(stream: trio.SocketStream) -> None:
    """A clean response, then, once the guard may have pooled the connection, another one."""
    await stream.send_all(OK_RESPONSE)
    await trio.sleep(0.2)
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\npoisoned")


@attrs.frozen
class BadResponse:
    name: str
    send: Send
    #: "error": only a clean error is acceptable; "canonical": a clean error, or a 200 relayed
    #: with ``expect_body`` and nothing of the defect visible; "early": passed through.
    kind: str = "error"
    expect_body: bytes = b"ok"
    #: Reuse of the connection is a defect even when the response was relayed.
    never_reuse: bool = True


CASES = [
    BadResponse(
        "bare CR in a header value",
        once(b"HTTP/1.1 200 OK\r\nX-A: a\rInjected: b\r\nContent-Length: 2\r\n\r\nok"),
    ),
    BadResponse(
        "NUL in a header value",
        once(b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok"),
    ),
    BadResponse(
        "space before the colon",
        once(b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok"),
    ),
    BadResponse(
        "obs-fold",
        once(b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\nok"),
        kind="canonical",
        never_reuse=False,
    ),
    BadResponse(
        "bare-LF head",
        once(b"HTTP/1.1 200 OK\nX-A: b\nContent-Length: 2\n\nok"),
        kind="canonical",
        never_reuse=False,
    ),
    BadResponse(
        "CL+TE with trailing junk",
        once(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\nJUNK"
        ),
        kind="canonical",
    ),
    BadResponse(
        "conflicting Content-Lengths",
        once(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!"),
    ),
    BadResponse(
        "negative Content-Length",
        once(b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nok"),
    ),
    BadResponse(
        "Transfer-Encoding gzip, chunked",
        once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"),
    ),
    BadResponse("garbage status line", once(b"HTTX/1.1 2OO NOPE\r\n\r\n")),
    BadResponse("not HTTP at all", once(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")),
    BadResponse(
        "bad chunk size",
        once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n"),
    ),
    BadResponse(
        "200 x 103 then 200",
        once(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 200 + OK_RESPONSE),
        kind="canonical",
        never_reuse=False,
    ),
    BadResponse(
        "endless 103 interim responses",
        interim_flood,
    ),
    BadResponse(
        "body longer than its Content-Length",
        once(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA-BYTES"),
        kind="canonical",
    ),
    BadResponse(
        "unsolicited second response",
        once(OK_RESPONSE + b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\npoisoned"),
        kind="canonical",
    ),
    BadResponse(
        "late unsolicited second response",
        late_second_response,
        kind="canonical",
    ),
    BadResponse(
        "response head of 200 KB",
        once(b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\nok"),
    ),
]


class Backend:
    """Connection 1 gets ``case``'s response; later connections answer 200. Further request
    heads arriving on connection 1 are counted as reuse."""

    def __init__(self, case: BadResponse) -> None:
        self.case = case
        self.reused_heads = 0
        self.bad_sent_at: float | None = None

    async def script(self, stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        if upstream.connections > 1:
            while b"\r\n\r\n" in await upstream.read_head(stream):
                await stream.send_all(OK_RESPONSE)
            return
        first = await upstream.read_head(stream)
        if b"\r\n\r\n" not in first:
            return
        self.bad_sent_at = time.perf_counter()
        await self.case.send(stream)
        while b"\r\n\r\n" in await upstream.read_head(stream):
            self.reused_heads += 1
            await stream.send_all(OK_RESPONSE)


@attrs.frozen
class Outcome:
    data: bytes
    closed: bool
    seconds: float

    @property
    def status(self) -> int | None:
        return int(self.data[9:12]) if self.data.startswith(b"HTTP/1.1 ") else None

    @property
    def head(self) -> bytes:
        return self.data.partition(b"\r\n\r\n")[0]

    @property
    def body(self) -> bytes:
        """The response body, de-chunked when the guard sent it chunked."""
        head, _, rest = self.data.partition(b"\r\n\r\n")
        if not re.search(rb"(?i)\r\ntransfer-encoding: *chunked", head):
            return rest
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2 :]
        return out


def _complete(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if length is not None:
        return len(body) >= int(length.group(1))
    return body.endswith(b"0\r\n\r\n")


async def request(base: str, data: bytes, timeout_s: float = 15.0) -> Outcome:
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    closed = False
    started = time.perf_counter()
    try:
        await stream.send_all(data)
        with trio.move_on_after(timeout_s):
            while not _complete(received):
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                received += chunk
    finally:
        await trio.aclose_forcefully(stream)
    return Outcome(received, closed, time.perf_counter() - started)


ROUTES = {
    "passthrough": b"GET /v1/models HTTP/1.1\r\nHost: guard\r\n\r\n",
    "admitted": b"POST "
    + CHAT
    + b" HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    % len(BODY)
    + BODY,
}


def clean_error(outcome: Outcome) -> bool:
    if outcome.status == 429:
        return outcome.body == TOO_MANY_REQUESTS_BODY
    if outcome.status == 502:
        lowered = outcome.body.lower()
        return not any(word in lowered for word in (b"h11", b"traceback", b"bad response"))
    return False


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[c.name for c in CASES],
)
async def test_t16_bad_upstream_responses(
    case: BadResponse, route: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    backend = Backend(case)
    upstream = await start_upstream(backend.script)
    guard, _ = await start_guard(environ(upstream.base))
    first = await request(guard, ROUTES[route])
    assert first.data or first.closed
    error = clean_error(first)
    if case.kind == "error" or not error:
        assert error or case.kind != "error", (first.status, first.data[:300])
    if not error:
        assert first.status == 200, first.data[:300]
        assert first.body == case.expect_body, first.data[:300]
        lowered = first.head.lower()
        assert b"\n " not in first.head  # no obs-fold
        assert b"\n\t" not in first.head
        assert first.head.count(b"\n") == first.head.count(b"\r\n")  # no bare LF
        assert len(re.findall(rb"\r\n(content-length|transfer-encoding):", lowered)) == 1
        assert b"content-length: 5" not in lowered  # CL+TE: the length is dropped
        assert b"poisoned" not in first.data
        assert b"103" not in first.head
    # Catalogue: 502 within 1 s. Generous here; the figure records the real delay.
    assert first.seconds < 5.0, first.seconds
    # The next request must not travel on the tainted connection.
    await trio.sleep(0.3)  # bytes a backend sends late have arrived by now
    second = await request(guard, ROUTES[route])
    assert second.status == 200, second.data[:300]
    assert second.body == b"ok"
    assert b"poisoned" not in second.data
    if case.never_reuse or error:
        assert backend.reused_heads == 0, "a tainted upstream connection was reused"
    assert upstream.connections >= (2 if (case.never_reuse or error) else 1)
    outcome = f"{first.status}" if error else "relayed"
    figure(
        "T16",
        f"{case.name} ({route})",
        f"{outcome} in {first.seconds * 1000:.0f} ms; reuse {backend.reused_heads}",
        "502/429 within 1 s; no reuse",
    )


async def test_t16_early_response_is_passed_through(
    start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    """The backend answers as soon as it has the head, then reads the 1 MiB body."""
    body = b"x" * (1 << 20)

    async def early(stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        while True:
            data = await upstream.read_head(stream)
            head, found, rest = data.partition(b"\r\n\r\n")
            if not found:
                return
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nearly"
            )
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            while len(rest) < length:
                more = await stream.receive_some(65536)
                if not more:
                    return
                rest += more

    upstream = await start_upstream(early)
    guard, _ = await start_guard(environ(upstream.base))
    raw = b"POST /v1/upload HTTP/1.1\r\nHost: guard\r\nContent-Length: %d\r\n\r\n" % len(body)
    outcome = await request(guard, raw + body)
    assert outcome.status == 200, outcome.data[:300]
    assert outcome.body == b"early"
    again = await request(guard, raw + body)
    assert again.status == 200
    assert again.body == b"early"
    figure(
        "T16",
        "early response before the body is complete",
        f"{outcome.status} in {outcome.seconds * 1000:.0f} ms",
        "passed through correctly",
    )
