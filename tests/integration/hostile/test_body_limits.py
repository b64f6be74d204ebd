"""T8 (oversized bodies) of ../shared/spec/reliability.md, against a guard on 127.0.0.1.

- (a) a declared Content-Length over ``PIG_MAX_BODY_BYTES`` gets the JSON 413 from the head
  alone (no body byte is sent), then the connection closes; no backend sees it, on every route;
- (b) a chunked body is counted as it arrives: at the cap nothing happens yet, one more 64 KiB
  piece brings the 413 and the close;
- (c) several bodies just under the cap in parallel are all served, and the process grows far
  less than the catalogue's bound (scaled: 32 parallel 8 MiB bodies instead of 100).
"""

from __future__ import annotations

import json
import time
from typing import Any

import trio

from guard_trio._server import GuardServer

TOKEN = "hostile-token"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
CHAT = b"/v1/chat/completions"
MIB = 1024 * 1024
_REPLY = b'{"ok":true}'


class Backend:
    """A backend that reads whole requests (Content-Length or chunked) and answers a small 200;
    it keeps only the sizes of the bodies it received."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def script(self, stream: trio.SocketStream, upstream: Any) -> None:
        reader = _Reader(stream)
        while True:
            head = await reader.until(b"\r\n\r\n")
            if head is None:
                return
            upstream.requests += 1
            upstream.received += head
            size = await reader.body(head)
            if size is None:
                return
            self.sizes.append(size)
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(_REPLY), _REPLY)
            )


class _Reader:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def _more(self) -> bool:
        chunk = await self.stream.receive_some(1 << 20)
        self.buffer += chunk
        return bool(chunk)

    async def until(self, mark: bytes) -> bytes | None:
        while (end := self.buffer.find(mark)) < 0:
            if not await self._more():
                return None
        data = bytes(self.buffer[: end + len(mark)])
        del self.buffer[: end + len(mark)]
        return data

    async def exactly(self, count: int) -> bool:
        while len(self.buffer) < count:
            if not await self._more():
                return False
        del self.buffer[:count]
        return True

    async def body(self, head: bytes) -> int | None:
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            total = 0
            while True:
                line = await self.until(b"\r\n")
                if line is None:
                    return None
                size = int(line.split(b";")[0], 16)
                if not await self.exactly(size + 2):
                    return None
                total += size
                if size == 0:
                    return total
        length = 0
        for line in lower.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return length if await self.exactly(length) else None


async def _guard(start_guard: Any, upstream: str, **extra: str) -> tuple[str, GuardServer]:
    environ = {
        "UPSTREAM": upstream,
        "DYNAMIC_PIG_ENABLED": "false",
        "TOKEN": TOKEN,
        **extra,
    }
    return await start_guard(environ)  # type: ignore[no-any-return]


async def _open(base: str) -> trio.SocketStream:
    host, port = base.removeprefix("http://").split(":")
    return await trio.open_tcp_stream(host, int(port))


async def _read_until_close(stream: trio.SocketStream, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``limit_s`` passes (False)."""
    data = bytearray()
    with trio.move_on_after(limit_s):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                return bytes(data), True
            data += chunk
    return bytes(data), False


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def test_a_declared_length_over_the_cap_is_refused_from_the_head_alone(
    start_guard: Any, start_upstream: Any, figure: Any
) -> None:
    backend = Backend()
    upstream = await start_upstream(backend.script)
    guard, _ = await _guard(start_guard, upstream.base)
    routes = [
        (b"POST", CHAT),
        (b"POST", b"/v1/completions"),
        (b"POST", b"/v1/models"),
        (b"GET", b"/healthz"),
        (b"POST", b"/pig/metrics"),
    ]
    timings = []
    for method, path in routes:
        stream = await _open(guard)
        async with stream:
            head = b"%s %s HTTP/1.1\r\nHost: g\r\n%sContent-Type: application/json\r\n" % (
                method,
                path,
                AUTH,
            )
            head += b"Content-Length: %d\r\n\r\n" % (9 * MIB)  # over the 8 MiB default cap
            sent = time.perf_counter()
            await stream.send_all(head)  # and not one byte of the body
            data, closed = await _read_until_close(stream, 5.0)
            timings.append(time.perf_counter() - sent)
        response_head, _, body = data.partition(b"\r\n\r\n")
        assert response_head.startswith(b"HTTP/1.1 413 "), (path, data[:200])
        assert b"connection: close" in response_head.lower()
        assert json.loads(body)["error"]["code"] == 413
        assert closed, path
    assert upstream.connections == 0
    assert upstream.requests == 0
    figure(
        "T8",
        "(a) CL 9 MiB, cap 8 MiB, 5 routes",
        f"413+close <= {max(timings) * 1000:.1f} ms, 0 upstream",
        "413 <= 50 ms without reading the body, then close",
    )
    assert max(timings) < 1.0  # 20x the catalogue's 50 ms: a loaded 2-core machine


async def test_a_chunked_body_is_counted_and_refused_once_past_the_cap(
    start_guard: Any, start_upstream: Any, figure: Any
) -> None:
    backend = Backend()
    upstream = await start_upstream(backend.script)
    cap = MIB
    guard, _ = await _guard(start_guard, upstream.base, PIG_MAX_BODY_BYTES=str(cap))
    stream = await _open(guard)
    piece = 16 * 1024
    chunk = b"%x\r\n%s\r\n" % (piece, b"a" * piece)
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\n%s"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % AUTH
        )
        for _ in range(cap // piece):  # exactly the cap: still acceptable
            await stream.send_all(chunk)
        early = b""
        with trio.move_on_after(0.5):
            early = await stream.receive_some(65536)
        assert early == b"", early[:200]  # no answer while the body is at the cap
        sent_at_cap = cap
        over = 64 * 1024
        sent = time.perf_counter()
        await stream.send_all(b"%x\r\n%s\r\n" % (over, b"b" * over))
        data, closed = await _read_until_close(stream, 5.0)
        elapsed = time.perf_counter() - sent
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]
    assert b"connection: close" in data.lower()
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 413
    assert closed
    assert backend.sizes == []  # the backend never received a whole request
    figure(
        "T8",
        "(b) chunked body growing past a 1 MiB cap",
        f"413+close at cap+64K ({elapsed * 1000:.0f} ms)",
        "413 after <= cap + 64 KiB read",
    )
    assert sent_at_cap + over <= cap + 64 * 1024


async def test_parallel_bodies_near_the_cap_are_served_without_growing_the_process(
    start_guard: Any, start_upstream: Any, figure: Any
) -> None:
    backend = Backend()
    upstream = await start_upstream(backend.script)
    guard, server = await _guard(start_guard, upstream.base)
    cap = server.body_limits.max_bytes
    parallel = 32
    filler = b"x" * (256 * 1024)
    prefix = b'{"model":"m","messages":[{"role":"user","content":"'
    suffix = b'"}],"max_tokens":1}'
    size = cap - 1024
    statuses: list[int] = []
    rss = [_rss_bytes()]
    baseline = rss[0]

    async def sample() -> None:
        while True:
            rss.append(_rss_bytes())
            await trio.sleep(0.05)

    async def client() -> None:
        stream = await _open(guard)
        async with stream:
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\n%s"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (AUTH, size, prefix)
            )
            left = size - len(prefix) - len(suffix)
            while left > 0:
                await stream.send_all(filler[: min(left, len(filler))])
                left -= len(filler)
            await stream.send_all(suffix)
            data, _ = await _read_until_close(stream, 1.0)
            statuses.append(int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0)

    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            async with trio.open_nursery() as clients:
                for _ in range(parallel):
                    clients.start_soon(client)
            nursery.cancel_scope.cancel()
    growth = max(rss) - baseline
    bound = 4 * cap * 4  # the catalogue's bound with four concurrent large-body readers
    figure(
        "T8",
        f"(c) {parallel} parallel bodies of cap - 1 KiB",
        f"{statuses.count(200)}/{parallel} 200, RSS +{growth / MIB:.0f} MiB",
        "no OOM; RSS growth <= 4 x 8 MiB x reader concurrency",
    )
    assert statuses == [200] * parallel
    assert sorted(backend.sizes)[0] >= size - 1024  # whole bodies reached the backend
    assert growth <= bound, growth
