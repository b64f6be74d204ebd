"""Request head limits (reliability catalogue row T3).

h11 applies its 16 KiB ``max_incomplete_event_size`` only to a head that is still incomplete,
so a 60 KB head that arrives in one read, or thousands of header lines, pass h11 untouched
(spec 2.1). The guard enforces its own limits: 16 KiB of head and 100 header lines. Each case
must get a 431 quickly, the connection closed, and nothing may reach the backend; heads at the
limits still go through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from guard_adapters.http_head import MAX_REQUEST_HEAD_BYTES as MAX_HEADER_BYTES
from guard_adapters.http_head import MAX_REQUEST_HEADERS as MAX_HEADERS
from tests.integration.hostile.conftest import CountingUpstream, raw_exchange

OK_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
ROUTES = {"admitted": b"POST /v1/chat/completions", "passthrough": b"GET /v1/models"}


async def answer_ok(stream: trio.SocketStream, upstream: CountingUpstream) -> None:
    """Reads a head (bodies here are empty) and answers 200, for as long as the guard asks."""
    while True:
        head = await upstream.read_head(stream)
        if b"\r\n\r\n" not in head:
            return
        await stream.send_all(OK_RESPONSE)


def environ(upstream: str) -> dict[str, str]:
    return {
        "UPSTREAM": upstream,
        "DYNAMIC_PIG_ENABLED": "false",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
    }


def head(start: bytes, lines: list[bytes]) -> bytes:
    framing = [b"Content-Length: 0"] if start.startswith(b"POST") else []
    return (
        start
        + b" HTTP/1.1\r\n"
        + b"".join(line + b"\r\n" for line in [b"Host: guard", *framing, *lines])
        + b"\r\n"
    )


def many_lines(start: bytes, total: int) -> bytes:
    """A head with exactly ``total`` header lines."""
    fixed = 2 if start.startswith(b"POST") else 1
    return head(start, [b"X-H%d: v" % i for i in range(total - fixed)])


def oversized_field(start: bytes) -> bytes:
    """(a) one header field of 16,385 bytes."""
    return head(start, [b"X-Big: " + b"a" * (16_385 - len(b"X-Big: "))])


def block_60k(start: bytes) -> bytes:
    """(c) a 60 KB head made of 30 fields of 2 KB, sent in one send() (h11 alone accepts it)."""
    return head(start, [b"X-F%02d: " % i + b"b" * 2_000 for i in range(30)])


def block_200k(start: bytes) -> bytes:
    """(d) a 200 KB head: h11 sees 64 KiB reads with no end of head."""
    return head(start, [b"X-G%03d: " % i + b"c" * 2_000 for i in range(100)])


CASES: dict[str, Callable[[bytes], bytes]] = {
    "a: one 16,385-byte header": oversized_field,
    "b: 101 header lines": lambda start: many_lines(start, MAX_HEADERS + 1),
    "c: 60 KB head in one send": block_60k,
    "d: 200 KB head": block_200k,
    "3,000 header lines": lambda start: many_lines(start, 3_000),
    "16 KiB request target": lambda start: head(
        start.replace(b" /v1/", b" /v1/" + b"p" * MAX_HEADER_BYTES + b"/"), []
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("case", list(CASES))
async def test_t3_oversized_heads_get_431_and_never_reach_the_backend(
    case: str, route: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    upstream = await start_upstream(answer_ok)
    guard, _ = await start_guard(environ(upstream.base))
    data = CASES[case](ROUTES[route])
    if case.startswith("c"):
        assert 60_000 <= len(data) < 65_536  # one read of the guard's 64 KiB buffer
    result = await raw_exchange(guard, data, quiet_s=3.0, total_s=5.0)
    assert result.status == 431, result.data[:200]
    assert result.statuses() == [431]
    assert result.closed
    assert result.first_byte_s is not None
    assert result.first_byte_s < 1.0  # catalogue: 100 ms; generous on a loaded 2-core machine
    assert upstream.connections == 0
    closed = result.closed_after_s
    figure(
        "T3",
        f"{case} ({route})",
        f"431 in {result.first_byte_s * 1000:.1f} ms, closed"
        + (f" {closed * 1000:.0f} ms" if closed is not None else ""),
        "431 within 100 ms, closed, 0 upstream",
    )


@pytest.mark.parametrize("route", list(ROUTES))
async def test_t3_heads_at_the_limits_still_pass(
    route: str, start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    upstream = await start_upstream(answer_ok)
    guard, _ = await start_guard(environ(upstream.base))
    start = ROUTES[route]
    at_count = many_lines(start, MAX_HEADERS)
    # About 15 KiB of head: below the limit with room for the request line.
    near_bytes = head(start, [b"X-F%02d: " % i + b"d" * 1_000 for i in range(15)])
    assert len(near_bytes) < MAX_HEADER_BYTES
    for data in (at_count, near_bytes):
        result = await raw_exchange(guard, data, quiet_s=0.5, total_s=5.0)
        assert result.status == 200, result.data[:200]
    assert upstream.requests == 2
    figure(
        "T3",
        f"100 lines and a 15 KiB head ({route})",
        "200, both forwarded",
        "limits are not stricter than 16 KiB / 100",
    )
