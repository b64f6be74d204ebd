"""Backends that fail under an admitted request (reliability catalogue rows T22, T23; F11, F7/F8).

- T22: the backend breaks mid-stream: (a) a RST after some events, (b) a FIN without the final
  chunk, (c) its process is SIGKILLed (``sse_backend_process.py``, next to this file), each under
  20 concurrent streams. Every client stream must end uncleanly (no terminating ``0\\r\\n\\r\\n``:
  a clean end would pass a truncated generation off as a complete one), promptly; no slot leaks;
  the failure is counted as an upstream error; the guard keeps serving.
- T23: the backend goes silent (a) before its response head: the client gets a 504 with an
  OpenAI-style JSON error at ``PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS``; (b) mid-stream: the client
  connection is cut at ``PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS`` after the last event. The upstream
  connection is closed in both cases.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import h11
import trio

from guard_core import Lane

CHAT = "/v1/chat/completions"
JSON_HEADERS = [("Content-Type", "application/json")]
BACKEND_PROCESS = Path(__file__).with_name("sse_backend_process.py")
STREAMS = 20
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)

Starter = Callable[..., Awaitable[Any]]


def chat_body(ident: str, *, stream: bool = True) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": ident}], "stream": stream}
    ).encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_event(index: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d "}}]}\n\n' % index


async def read_ident(stream: trio.SocketStream, upstream: Any) -> str | None:
    """Read one request (head and Content-Length body); the id in its first message."""
    data = await upstream.read_head(stream)
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        more = await stream.receive_some(65536)
        if not more:
            return None
        body += more
    return str(json.loads(body)["messages"][0]["content"])


@attrs.define
class Ledger:
    """Per request id: when the backend failed, sent its last event, saw the guard close."""

    failed_at: dict[str, float] = attrs.Factory(dict)
    last_event_at: dict[str, float] = attrs.Factory(dict)
    closed_at: dict[str, float] = attrs.Factory(dict)
    seen: list[str] = attrs.Factory(list)


async def note_close(stream: trio.SocketStream, ledger: Ledger, ident: str) -> None:
    """Wait (bounded) until the guard closes the connection, and note when."""
    with trio.move_on_after(20):
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        ledger.closed_at[ident] = trio.current_time()


@attrs.frozen
class StreamEnd:
    status: int
    events: int
    #: "clean" (terminating chunk seen) or "truncated" (closed or reset before it).
    how: str
    at: float


async def read_stream(
    connection: Any, *, on_events: Callable[[int], None] | None = None
) -> StreamEnd:
    head = await connection.response_head()
    events = 0
    try:
        while True:
            data = await connection.next_chunk()
            if data is None:
                return StreamEnd(head.status_code, events, "clean", trio.current_time())
            events += data.count(b"\n\n")
            if on_events is not None:
                on_events(events)
    except (h11.RemoteProtocolError, trio.BrokenResourceError):
        return StreamEnd(head.status_code, events, "truncated", trio.current_time())


def counters(server: Any) -> dict[str, int]:
    metrics = server.metrics
    return {
        "slots": server.engine.state.gate.inflight,
        "lane_inflight": sum(int(m.inflight.value) for m in metrics.lanes.values()),
        "backend_inflight": sum(n for _, n in server.engine.state.traffic.inflight),
        "active_requests": server.active_requests,
    }


async def wait_zero(server: Any, timeout_s: float = 5.0) -> float:
    started = trio.current_time()
    with trio.fail_after(timeout_s):
        while any(counters(server).values()):  # noqa: ASYNC110 - state of other tasks
            await trio.sleep(0.005)
    return trio.current_time() - started


def guard_environ(base: str, **extra: str) -> dict[str, str]:
    return {
        "UPSTREAM": base,
        "DYNAMIC_PIG_ENABLED": "false",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
        **extra,
    }


async def served_cleanly(http: Any, guard: str, ident: str) -> bool:
    connection = await http.connect(guard)
    try:
        await connection.send_request("POST", CHAT, JSON_HEADERS, chat_body(ident))
        end = await read_stream(connection)
    finally:
        await connection.aclose()
    return end.status == 200 and end.how == "clean" and end.events >= 3


# -- T22 (a) and (b) -----------------------------------------------------------------------------


async def crashing_script(stream: trio.SocketStream, upstream: Any, ledger: Ledger) -> None:
    """``rst-N-*``: N events then a RST; ``fin-N-*``: N events then a FIN without the last chunk;
    ``ok-*``: a short complete stream."""
    ident = await read_ident(stream, upstream)
    if ident is None:
        return
    ledger.seen.append(ident)
    kind, _, rest = ident.partition("-")
    events = 3 if kind == "ok" else int(rest.partition("-")[0])
    await stream.send_all(SSE_HEAD)
    for index in range(events):
        await stream.send_all(chunk(sse_event(index)))
        await trio.sleep(0.02)
    if kind == "ok":
        await stream.send_all(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return
    if kind == "rst":
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ledger.failed_at[ident] = trio.current_time()
    await stream.aclose()


async def run_crash_case(
    kind: str, start_upstream: Starter, start_guard: Starter, http: Any, figure: Any
) -> None:
    ledger = Ledger()

    async def script(stream: trio.SocketStream, upstream: Any) -> None:
        await crashing_script(stream, upstream, ledger)

    upstream = await start_upstream(script)
    guard, server = await start_guard(guard_environ(upstream.base))
    idents = [f"{kind}-{3 + (i * 7) % 20}-{i}" for i in range(STREAMS)]
    ends: dict[str, StreamEnd] = {}

    async def one(ident: str) -> None:
        connection = await http.connect(guard)
        try:
            await connection.send_request("POST", CHAT, JSON_HEADERS, chat_body(ident))
            ends[ident] = await read_stream(connection)
        finally:
            await connection.aclose()

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            for ident in idents:
                nursery.start_soon(one, ident)
        last_failure = max(ledger.failed_at.values())
        await wait_zero(server)
        freed_s = trio.current_time() - last_failure
        assert await served_cleanly(http, guard, "ok-after")
    delays = [ends[i].at - ledger.failed_at[i] for i in idents]
    clean = [i for i in idents if ends[i].how == "clean"]
    label = {"rst": "(a) RST after N events", "fin": "(b) FIN without final chunk"}[kind]
    figure(
        "T22",
        f"{label}, {STREAMS} streams",
        f"{len(clean)} clean ends; close max {max(delays) * 1000:.1f} ms",
        "0 clean ends; client closed <= 1 s",
    )
    figure("T22", f"{label}: slots back to 0", f"{freed_s * 1000:.0f} ms", "<= 1 s")
    assert not clean, f"truncated streams ended cleanly: {clean}"
    assert all(ends[i].status == 200 and ends[i].events >= 3 for i in idents)
    assert max(delays) <= 3.0
    assert freed_s <= 3.0
    assert server.metrics.proxy_upstream_errors.value == STREAMS
    # Never counted as a success: only the final "ok-after" request ended with a 2xx.
    assert server.metrics.lanes[Lane.GLOBAL].statuses[2] == 1


async def test_t22a_upstream_reset_mid_stream_truncates_every_client_stream(
    start_upstream: Starter, start_guard: Starter, http: Any, figure: Any
) -> None:
    await run_crash_case("rst", start_upstream, start_guard, http, figure)


async def test_t22b_upstream_fin_without_final_chunk_truncates_every_client_stream(
    start_upstream: Starter, start_guard: Starter, http: Any, figure: Any
) -> None:
    await run_crash_case("fin", start_upstream, start_guard, http, figure)


# -- T22 (c) -------------------------------------------------------------------------------------


async def start_backend_process(port: int = 0) -> tuple[trio.Process, int]:
    process = await trio.lowlevel.open_process(
        [sys.executable, str(BACKEND_PROCESS), str(port)], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    line = b""
    with trio.fail_after(10):
        while not line.endswith(b"\n"):
            data = await process.stdout.receive_some(64)
            assert data, "the backend process exited before listening"
            line += data
    return process, int(line)


async def stop_process(process: trio.Process) -> None:
    if process.returncode is None:
        process.kill()
    with trio.move_on_after(5) as scope:
        scope.shield = True
        await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


async def test_t22c_backend_process_killed_mid_stream(
    start_guard: Starter, http: Any, until: Any, figure: Any
) -> None:
    process, port = await start_backend_process()
    replacement: trio.Process | None = None
    try:
        guard, server = await start_guard(guard_environ(f"http://127.0.0.1:{port}"))
        counts: dict[str, int] = {}
        ends: dict[str, StreamEnd] = {}

        async def one(ident: str) -> None:
            connection = await http.connect(guard)
            try:
                await connection.send_request("POST", CHAT, JSON_HEADERS, chat_body(ident))
                ends[ident] = await read_stream(
                    connection, on_events=lambda n: counts.__setitem__(ident, n)
                )
            finally:
                await connection.aclose()

        idents = [f"long-{i}" for i in range(STREAMS)]
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for ident in idents:
                    nursery.start_soon(one, ident)
                await until(lambda: len(counts) == STREAMS and min(counts.values()) >= 3, 10.0)
                process.kill()
                killed_at = trio.current_time()
            await wait_zero(server)
            freed_s = trio.current_time() - killed_at
            # The guard keeps serving: a backend back on the same port gets the next request.
            replacement, _ = await start_backend_process(port)
            assert await served_cleanly(http, guard, "ok-after")
        delays = [ends[i].at - killed_at for i in idents]
        clean = [i for i in idents if ends[i].how == "clean"]
        figure(
            "T22",
            f"(c) backend SIGKILLed, {STREAMS} streams",
            f"{len(clean)} clean ends; close max {max(delays) * 1000:.1f} ms",
            "0 clean ends; client closed <= 1 s",
        )
        figure("T22", "(c) slots back to 0 after the kill", f"{freed_s * 1000:.0f} ms", "<= 1 s")
        assert not clean
        assert max(delays) <= 3.0
        assert freed_s <= 3.0
        assert server.metrics.proxy_upstream_errors.value == STREAMS
    finally:
        await stop_process(process)
        if replacement is not None:
            await stop_process(replacement)


# -- T23 -----------------------------------------------------------------------------------------

HEAD_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 2.0
#: How far ahead of the configured budget the guard's idle cut may come (its re-arm step).
IDLE_REARM_S = 0.5
TIMEOUTS = {
    "PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS": str(HEAD_TIMEOUT_S),
    "PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS": str(IDLE_TIMEOUT_S),
}


async def hanging_script(stream: trio.SocketStream, upstream: Any, ledger: Ledger) -> None:
    """``head-*``: read the request and never answer; ``mid-*``: the head and three events, then
    silence. Either way, note when the guard closes the connection."""
    ident = await read_ident(stream, upstream)
    if ident is None:
        return
    ledger.seen.append(ident)
    if ident.startswith("mid-"):
        await stream.send_all(SSE_HEAD)
        for index in range(3):
            await trio.sleep(0.05)
            await stream.send_all(chunk(sse_event(index)))
        ledger.last_event_at[ident] = trio.current_time()
    await note_close(stream, ledger, ident)


async def test_t23a_upstream_silent_before_head_gives_504_at_the_head_timeout(
    start_upstream: Starter, start_guard: Starter, http: Any, figure: Any
) -> None:
    ledger = Ledger()

    async def script(stream: trio.SocketStream, upstream: Any) -> None:
        await hanging_script(stream, upstream, ledger)

    upstream = await start_upstream(script)
    guard, server = await start_guard(guard_environ(upstream.base, **TIMEOUTS))
    replies: dict[str, tuple[float, Any]] = {}

    async def one(ident: str, stream: bool) -> None:
        connection = await http.connect(guard)
        try:
            sent = trio.current_time()
            with trio.move_on_after(HEAD_TIMEOUT_S * 3):
                reply = await connection.request(
                    "POST", CHAT, JSON_HEADERS, chat_body(ident, stream=stream)
                )
                replies[ident] = (trio.current_time() - sent, reply)
        finally:
            await connection.aclose()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "head-stream", True)
            nursery.start_soon(one, "head-json", False)
        await trio.sleep(0.5)  # time for the upstream close to be noticed, if it happened
    for ident in ("head-stream", "head-json"):
        assert ident in replies, f"{ident}: no answer within {HEAD_TIMEOUT_S * 3:.0f} s"
        elapsed, reply = replies[ident]
        figure(
            "T23",
            f"(a) silent before head, {ident}",
            f"{reply.status} after {elapsed:.2f} s",
            "504 at 3 s +-10 %",
        )
        assert reply.status == 504, reply
        assert reply.header("content-type").startswith(b"application/json")
        error = json.loads(reply.body)["error"]
        assert isinstance(error["message"], str)
        assert isinstance(error["type"], str)
        assert HEAD_TIMEOUT_S * 0.9 <= elapsed <= HEAD_TIMEOUT_S * 2
        closed = ledger.closed_at.get(ident)
        assert closed is not None, f"{ident}: the upstream connection stayed open"
    assert await wait_zero(server) <= 1.0


async def test_t23b_upstream_silent_mid_stream_is_cut_at_the_idle_timeout(
    start_upstream: Starter, start_guard: Starter, http: Any, figure: Any
) -> None:
    ledger = Ledger()

    async def script(stream: trio.SocketStream, upstream: Any) -> None:
        await hanging_script(stream, upstream, ledger)

    upstream = await start_upstream(script)
    guard, server = await start_guard(guard_environ(upstream.base, **TIMEOUTS))
    ident = "mid-stream"
    connection = await http.connect(guard)
    end: StreamEnd | None = None
    try:
        await connection.send_request("POST", CHAT, JSON_HEADERS, chat_body(ident))
        with trio.move_on_after(IDLE_TIMEOUT_S * 4):
            end = await read_stream(connection)
    finally:
        await connection.aclose()
    assert end is not None, f"the stream was still open {IDLE_TIMEOUT_S * 4:.0f} s later"
    after_s = end.at - ledger.last_event_at[ident]
    figure(
        "T23",
        "(b) silent mid-stream",
        f"{end.how} close {after_s:.2f} s after last event",
        "abortive close at 2 s +-10 %",
    )
    assert end.status == 200
    assert end.events == 3
    assert end.how == "truncated"
    # The guard moves its idle deadline at most every IDLE_REARM_S (one clock read per event),
    # so the cut comes between idle - IDLE_REARM_S and idle after the last byte.
    assert IDLE_TIMEOUT_S - IDLE_REARM_S - 0.05 <= after_s <= IDLE_TIMEOUT_S * 2
    with trio.fail_after(2):
        while ident not in ledger.closed_at:  # noqa: ASYNC110 - set by the backend task
            await trio.sleep(0.01)
    assert ledger.closed_at[ident] - end.at <= 1.0
    assert await wait_zero(server) <= 1.0
