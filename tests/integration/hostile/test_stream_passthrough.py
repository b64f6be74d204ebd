"""Event streams pass through as they come, and a slow reader does not make the guard buffer
(reliability catalogue rows T25 and T27; faults F6 and F13).

- T25: 200 SSE events 20 ms apart, 30-300 bytes each, from a raw backend, as a chunked body
  (vLLM's framing) and as a close-delimited one. The backend notes when it sends each event,
  the client when each event is complete; per-event forwarding delay, the client's ITL and
  clumping (an event arriving in the same read as the previous one although the backend sent
  them at least 5 ms apart) are the figures. Every event must arrive intact and in order.
- T27: the backend streams 10 MiB as fast as the sockets let it; the client reads slowly for a
  few seconds, then closes. The guard runs as its own process (``python -m guard_trio serve``)
  so that its resident memory can be measured alone (``/proc/PID/status``); the backend's
  writes must block (it cannot send the whole body) and the guard's memory must stay flat.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio

CHAT = "/v1/chat/completions"
JSON_HEADERS = [("Content-Type", "application/json")]
Starter = Callable[..., Awaitable[Any]]

EVENTS = 200
ITL_S = 0.02


def chat_body(ident: str) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": ident}], "stream": True}
    ).encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(stream: trio.SocketStream, upstream: Any) -> bool:
    """Read one request head and its Content-Length body; False at EOF."""
    data = await upstream.read_head(stream)
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return False
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        more = await stream.receive_some(65536)
        if not more:
            return False
        body += more
    return True


def make_events(seed: int) -> list[bytes]:
    """``EVENTS`` distinct SSE events of 30 to 300 bytes each."""
    rng = random.Random(seed)
    events = []
    for index in range(EVENTS):
        size = rng.randint(30, 300)
        stem = b'data: {"i":%d,"p":"' % index
        tail = b'"}\n\n'
        events.append(stem + b"x" * max(0, size - len(stem) - len(tail)) + tail)
    return events


@attrs.define
class Received:
    head: h11.Response | None = None
    events: list[bytes] = attrs.Factory(list)
    #: Per event: when its last byte arrived, and the number of the socket read that brought it.
    at: list[float] = attrs.Factory(list)
    read_number: list[int] = attrs.Factory(list)
    ended_cleanly: bool = False


async def read_events(base: str, ident: str) -> Received:
    """POST a streaming request over a raw socket and time every SSE event as it completes."""
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    connection = h11.Connection(h11.CLIENT)
    received = Received()
    body = chat_body(ident)
    request = h11.Request(
        method="POST",
        target=CHAT,
        headers=[
            ("Host", f"{host}:{port}"),
            *JSON_HEADERS,
            ("Content-Length", str(len(body))),
        ],
    )
    events: list[h11.Event] = [request, h11.Data(data=body), h11.EndOfMessage()]
    await stream.send_all(b"".join(connection.send(event) or b"" for event in events))
    pending = b""
    reads = 0
    try:
        while True:
            data = await stream.receive_some(65536)
            now = trio.current_time()
            reads += 1
            connection.receive_data(data)
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Response):
                    received.head = event
                elif isinstance(event, h11.Data):
                    pending += bytes(event.data)
                    while b"\n\n" in pending:
                        one, _, pending = pending.partition(b"\n\n")
                        received.events.append(one + b"\n\n")
                        received.at.append(now)
                        received.read_number.append(reads)
                elif isinstance(event, h11.EndOfMessage):
                    received.ended_cleanly = not pending
                    return received
                else:
                    raise AssertionError(f"unexpected {event}")
    finally:
        await trio.aclose_forcefully(stream)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def paced_backend(
    events: list[bytes], sent_at: list[float], *, chunked: bool
) -> Callable[[trio.SocketStream, Any], Awaitable[None]]:
    """A backend that sends ``events`` ``ITL_S`` apart on an absolute schedule."""

    async def script(stream: trio.SocketStream, upstream: Any) -> None:
        if not await read_request(stream, upstream):
            return
        framing = b"transfer-encoding: chunked\r\n" if chunked else b"connection: close\r\n"
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + framing + b"\r\n"
        )
        start = trio.current_time() + ITL_S
        for index, event in enumerate(events):
            await trio.sleep_until(start + index * ITL_S)
            sent_at.append(trio.current_time())
            await stream.send_all(chunk(event) if chunked else event)
        if chunked:
            await stream.send_all(b"0\r\n\r\n")

    return script


async def run_paced_stream(
    chunked: bool, start_upstream: Starter, start_guard: Starter, until: Any
) -> tuple[list[bytes], list[float], Received]:
    events = make_events(25)
    sent_at: list[float] = []
    upstream = await start_upstream(paced_backend(events, sent_at, chunked=chunked))
    guard, server = await start_guard(
        {
            "UPSTREAM": upstream.base,
            "DYNAMIC_PIG_ENABLED": "false",
            "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
        }
    )
    with trio.fail_after(EVENTS * ITL_S * 4):
        received = await read_events(guard, "t25")
        await until(lambda: server.engine.state.gate.inflight == 0, 2.0)
    return events, sent_at, received


@attrs.frozen
class Timing:
    delay_p50: float
    delay_p99: float
    delay_max: float
    itl_median: float
    clumped: int


def timing(sent_at: list[float], received: Received) -> Timing:
    delays = [got - sent for got, sent in zip(received.at, sent_at, strict=True)]
    itls = [b - a for a, b in zip(received.at, received.at[1:], strict=False)]
    clumped = sum(
        1
        for i in range(1, len(sent_at))
        if received.read_number[i] == received.read_number[i - 1]
        and sent_at[i] - sent_at[i - 1] >= 0.005
    )
    return Timing(
        quantile(delays, 0.5),
        quantile(delays, 0.99),
        max(delays),
        quantile(itls, 0.5),
        clumped,
    )


async def test_t25_sse_events_pass_through_unbuffered_chunked(
    start_upstream: Starter, start_guard: Starter, until: Any, figure: Any
) -> None:
    await check_passthrough(True, start_upstream, start_guard, until, figure)


async def test_t25_sse_events_pass_through_unbuffered_close_delimited(
    start_upstream: Starter, start_guard: Starter, until: Any, figure: Any
) -> None:
    await check_passthrough(False, start_upstream, start_guard, until, figure)


async def check_passthrough(
    chunked: bool, start_upstream: Starter, start_guard: Starter, until: Any, figure: Any
) -> None:
    events, sent_at, received = await run_paced_stream(chunked, start_upstream, start_guard, until)
    framing = "chunked" if chunked else "close-delimited"
    # The SSE level: every event, intact, in order; nothing lost, merged or reordered.
    assert received.events == events
    assert received.ended_cleanly
    assert received.head is not None
    assert received.head.status_code == 200
    assert b"content-length" not in dict(received.head.headers)
    measured = timing(sent_at, received)
    figure(
        "T25",
        f"forwarding delay, {EVENTS} events ({framing})",
        f"p50 {measured.delay_p50 * 1000:.2f} p99 {measured.delay_p99 * 1000:.2f} ms",
        "p99 <= 5 ms",
    )
    figure(
        "T25",
        f"client ITL median ({framing})",
        f"{measured.itl_median * 1000:.2f} ms",
        "20 ms +- 2 ms",
    )
    figure(
        "T25",
        f"events clumped with the previous one ({framing})",
        f"{measured.clumped} of {EVENTS - 1}",
        "0 when upstream spacing >= 5 ms",
    )
    # Loose bounds for a loaded 2-core machine; a buffering guard misses them by far.
    assert measured.delay_p99 <= 0.05
    assert abs(measured.itl_median - ITL_S) <= 0.008
    assert measured.clumped <= 2


async def test_t25_sse_response_carries_anti_buffering_headers(
    start_upstream: Starter, start_guard: Starter, until: Any, figure: Any
) -> None:
    """The backend sends neither header; the guard's event stream must tell intermediaries
    (nginx) not to buffer it."""
    _events, _sent_at, received = await run_paced_stream(True, start_upstream, start_guard, until)
    assert received.head is not None
    headers = dict(received.head.headers)
    figure(
        "T25",
        "SSE headers: cache-control / x-accel-buffering",
        " / ".join(
            headers.get(name, b"absent").decode()
            for name in (b"cache-control", b"x-accel-buffering")
        ),
        "Cache-Control: no-cache, X-Accel-Buffering: no",
    )
    assert headers.get(b"cache-control") == b"no-cache"
    assert headers.get(b"x-accel-buffering") == b"no"


# -- T27 -----------------------------------------------------------------------------------------

BODY_BYTES = 10 * 1024 * 1024
SLOW_READ_S = 4.0
SLOW_READ_BYTES = 1024
SLOW_READ_EVERY_S = 0.05


@attrs.define
class Flood:
    sent: int = 0
    finished: bool = False
    closed_at: float | None = None


def flooding_backend(flood: Flood) -> Callable[[trio.SocketStream, Any], Awaitable[None]]:
    """``BODY_BYTES`` of SSE as fast as the socket takes it; counts the bytes it got out."""
    event = b"data: " + b"y" * (16 * 1024 - 8) + b"\n\n"
    piece = chunk(event)

    async def script(stream: trio.SocketStream, upstream: Any) -> None:
        if not await read_request(stream, upstream):
            return
        try:
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            while flood.sent < BODY_BYTES:
                await stream.send_all(piece)
                flood.sent += len(event)
            await stream.send_all(b"0\r\n\r\n")
            flood.finished = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            flood.closed_at = trio.current_time()
            return
        # Finished (the guard took everything): wait, bounded, for the guard to close.
        with trio.move_on_after(5):
            try:
                while await stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass
            flood.closed_at = trio.current_time()

    return script


def resident_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from Linux /proc")
async def test_t27_slow_reader_backpressure_bounds_guard_memory(
    start_upstream: Starter, http: Any, figure: Any
) -> None:
    flood = Flood()
    upstream = await start_upstream(flooding_backend(flood))
    port = free_port()
    guard = f"http://127.0.0.1:{port}"
    environ = {
        "PATH": os.environ.get("PATH", ""),
        "LISTEN": f"127.0.0.1:{port}",
        "UPSTREAM": upstream.base,
        "DYNAMIC_PIG_ENABLED": "false",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
        "ATTESTATION_ENABLED": "false",
    }
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "guard_trio", "serve"],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(30):
            while True:
                try:
                    if (await http.request(guard, "GET", "/healthz")).status == 200:
                        break
                except OSError:
                    pass
                assert process.returncode is None, "the guard process exited"
                await trio.sleep(0.1)
            baseline = resident_bytes(process.pid)
            peak = baseline
            host, _, _ = guard.removeprefix("http://").partition(":")
            client = await trio.open_tcp_stream(host, port)
            body = chat_body("t27")
            await client.send_all(
                b"POST %s HTTP/1.1\r\nHost: %s:%d\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s"
                % (CHAT.encode(), host.encode(), port, len(body), body)
            )
            read = 0
            started = trio.current_time()
            sent_midway = 0
            while trio.current_time() - started < SLOW_READ_S:
                read += len(await client.receive_some(SLOW_READ_BYTES))
                peak = max(peak, resident_bytes(process.pid))
                if not sent_midway and trio.current_time() - started >= SLOW_READ_S / 2:
                    sent_midway = flood.sent
                await trio.sleep(SLOW_READ_EVERY_S)
            sent_at_close = flood.sent
            closed = trio.current_time()
            await trio.aclose_forcefully(client)
            while flood.closed_at is None:  # noqa: ASYNC110 - set by the backend task
                await trio.sleep(0.01)
            upstream_close_s = flood.closed_at - closed
    finally:
        if process.returncode is None:
            process.terminate()
        with trio.move_on_after(10) as scope:
            scope.shield = True
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
    growth = peak - baseline
    mib = 1024 * 1024
    figure(
        "T27",
        "guard RSS growth, slow reader of a 10 MiB stream",
        f"{growth / mib:.2f} MiB (read {read // 1024} KiB)",
        "<= 4 MiB",
    )
    figure(
        "T27",
        "backend bytes sent before the client closed",
        f"{sent_at_close / mib:.2f} MiB of 10 (midway {sent_midway / mib:.2f})",
        "<= 8 MiB (the backend's writes block)",
    )
    figure(
        "T27",
        "upstream closed after the client closed",
        f"{upstream_close_s * 1000:.0f} ms",
        "<= 1 s",
    )
    assert not flood.finished
    assert sent_at_close <= 8 * mib
    # Blocked, not trickling: between mid-run and the close the backend got out little more than
    # the client read (socket buffers were already full).
    assert sent_at_close - sent_midway <= 2 * mib
    assert growth <= 8 * mib
    assert upstream_close_s <= 3.0
