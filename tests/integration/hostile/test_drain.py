"""Drain on SIGTERM, with the guard as a real process (``python -m guard_trio serve``): rows T39
and T40 of ../shared/spec/reliability.md.

T39: 20 streams of about 3 s, SIGTERM 1 s in, drain deadline 5 s: new connections are refused
soon after the signal, an idle keep-alive connection is closed, every stream still completes
with ``[DONE]``, and the process exits 0 right after the last one.

T40: 20 streams of 30 s, same deadline: at about 5 s every client stream ends uncleanly (no
final chunk), the backend sees each of its connections closed, and the process exits
promptly. A second signal during the drain ends the process at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import attrs
import h11
import pytest
import trio

from tests.integration.hostile.conftest import CountingUpstream

CHAT = "/v1/chat/completions"
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@attrs.define
class SseBackend:
    """Streams ``events`` SSE events ``interval_s`` apart per request; notes when each upstream
    connection ends and whether its stream finished."""

    events: int
    interval_s: float
    closed_at: list[float] = attrs.field(factory=list)
    finished: int = 0
    cut: int = 0

    async def script(self, stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(event, h11.ConnectionClosed):
                    return
                if isinstance(event, h11.Request):
                    upstream.requests += 1
                    continue
                if not isinstance(event, h11.EndOfMessage):
                    continue
                head = h11.Response(
                    status_code=200, headers=[(b"content-type", b"text/event-stream")]
                )
                await stream.send_all(conn.send(head) or b"")
                try:
                    for _ in range(self.events):
                        await stream.send_all(conn.send(h11.Data(data=EVENT)) or b"")
                        await trio.sleep(self.interval_s)
                    tail = (conn.send(h11.Data(data=DONE)) or b"") + (
                        conn.send(h11.EndOfMessage()) or b""
                    )
                    await stream.send_all(tail)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.cut += 1
                    raise
                self.finished += 1
                conn.start_next_cycle()
        finally:
            self.closed_at.append(trio.current_time())


@attrs.define
class StreamResult:
    status: int | None = None
    clean: bool = False
    body: bytes = b""
    ended_at: float | None = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class GuardProcess:
    def __init__(self, upstream: str, drain_s: float) -> None:
        self.port = _free_port()
        self.base = ("127.0.0.1", self.port)
        self.env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")},
            "UPSTREAM": upstream,
            "DYNAMIC_PIG_ENABLED": "false",
            "LISTEN": f"127.0.0.1:{self.port}",
            "PIG_DRAIN_SECONDS": str(drain_s),
            "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
        }
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process: trio.Process | None = None

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "guard_trio", "serve"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        with trio.fail_after(20):
            while True:
                try:
                    probe = await trio.open_tcp_stream(*self.base)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await probe.aclose()
                return

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self.log.close()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


async def open_stream(base: tuple[str, int]) -> tuple[trio.SocketStream, h11.Connection]:
    stream = await trio.open_tcp_stream(*base)
    conn = h11.Connection(h11.CLIENT)
    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    request = h11.Request(
        method="POST",
        target=CHAT,
        headers=[
            ("Host", "guard"),
            ("Accept", "text/event-stream"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ],
    )
    await stream.send_all(
        (conn.send(request) or b"")
        + (conn.send(h11.Data(data=body)) or b"")
        + (conn.send(h11.EndOfMessage()) or b"")
    )
    return stream, conn


async def read_stream(
    stream: trio.SocketStream,
    conn: h11.Connection,
    result: StreamResult,
    headed: trio.Semaphore | None = None,
) -> None:
    """Read one response to its end; ``clean`` only with the final chunk."""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.Response):
                result.status = event.status_code
                if headed is not None:
                    headed.release()
            elif isinstance(event, h11.Data):
                result.body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                result.clean = True
                return
            else:
                return
    except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError):
        return
    finally:
        result.ended_at = trio.current_time()
        await trio.aclose_forcefully(stream)


async def refused_after(base: tuple[str, int], since: float, limit_s: float = 5.0) -> float:
    """Seconds from ``since`` until a new connection is refused."""
    with trio.fail_after(limit_s):
        while True:
            try:
                probe = await trio.open_tcp_stream(*base)
            except OSError:
                return trio.current_time() - since
            await trio.aclose_forcefully(probe)
            await trio.sleep(0.005)


async def start_streams(
    guard: GuardProcess, nursery: trio.Nursery, count: int
) -> list[StreamResult]:
    results = [StreamResult() for _ in range(count)]
    headed = trio.Semaphore(0)
    for result in results:
        stream, conn = await open_stream(guard.base)
        nursery.start_soon(read_stream, stream, conn, result, headed)
    with trio.fail_after(10):
        for _ in results:
            await headed.acquire()
    assert all(r.status == 200 for r in results)
    return results


async def test_t39_sigterm_lets_every_stream_finish(start_upstream: Any, figure: Any) -> None:
    backend = SseBackend(events=30, interval_s=0.1)  # about 3 s per stream
    upstream = await start_upstream(backend.script)
    guard = GuardProcess(upstream.base, drain_s=5)
    try:
        await guard.start()
        assert guard.process is not None
        async with trio.open_nursery() as nursery:
            began = trio.current_time()
            results = await start_streams(guard, nursery, 20)
            # An idle keep-alive connection: one finished request, then nothing.
            idle = await trio.open_tcp_stream(*guard.base)
            await idle.send_all(b"GET /healthz HTTP/1.1\r\nHost: guard\r\n\r\n")
            assert (await idle.receive_some(4096)).startswith(b"HTTP/1.1 200")
            await trio.sleep_until(began + 1.0)
            signalled = trio.current_time()
            guard.signal(signal.SIGTERM)
            refused_s = await refused_after(guard.base, signalled)
            idle_closed_s: float | None = None
            with trio.move_on_after(8):
                try:
                    while await idle.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass
                idle_closed_s = trio.current_time() - signalled
            await idle.aclose()
        with trio.fail_after(10):
            code = await guard.process.wait()
        exited = trio.current_time()
    finally:
        await guard.stop()
    last_end = max(r.ended_at or 0.0 for r in results)
    assert all(r.clean and r.body.endswith(DONE) for r in results), [
        (r.clean, r.body[-30:]) for r in results
    ]
    assert backend.finished == 20
    assert backend.cut == 0
    assert code == 0, guard.stderr()[-2000:]
    assert refused_s < 1.0
    assert idle_closed_s is not None
    assert idle_closed_s < 1.0
    assert exited - last_end < 3.0
    figure("T39", "new connection refused after SIGTERM", f"{refused_s * 1000:.0f} ms",
           "refused or closed <= 100 ms")  # fmt: skip
    figure("T39", "idle keep-alive closed after SIGTERM", f"{idle_closed_s * 1000:.0f} ms",
           "closed <= 100 ms")  # fmt: skip
    figure(
        "T39",
        "20 streams of 3 s, SIGTERM at 1 s, drain 5 s",
        f"20/20 [DONE]; exit {code} {(exited - last_end) * 1000:.0f} ms after the last",
        "all complete; exit 0 <= 0.5 s after the last stream",
    )


async def test_t40_the_drain_deadline_cuts_every_stream(start_upstream: Any, figure: Any) -> None:
    backend = SseBackend(events=300, interval_s=0.1)  # about 30 s per stream
    upstream = await start_upstream(backend.script)
    guard = GuardProcess(upstream.base, drain_s=5)
    try:
        await guard.start()
        assert guard.process is not None
        async with trio.open_nursery() as nursery:
            results = await start_streams(guard, nursery, 20)
            await trio.sleep(0.5)
            signalled = trio.current_time()
            guard.signal(signal.SIGTERM)
            with trio.fail_after(15):
                code = await guard.process.wait()
            exited = trio.current_time() - signalled
        with trio.fail_after(5):
            while len(backend.closed_at) < 20:  # noqa: ASYNC110 - the backend's own tasks
                await trio.sleep(0.01)
    finally:
        await guard.stop()
    ends = [(r.ended_at or 0.0) - signalled for r in results]
    assert not any(r.clean for r in results)
    assert all(r.body and not r.body.endswith(DONE) for r in results)
    assert min(ends) > 3.5, ends
    assert max(ends) < 8.0, ends
    upstream_closed = [t - signalled for t in backend.closed_at]
    assert max(upstream_closed) - max(ends) < 3.0, (upstream_closed, ends)
    assert exited < 9.0
    figure(
        "T40",
        "20 streams of 30 s, drain 5 s: client streams cut",
        f"20/20 unclean at {min(ends):.2f}-{max(ends):.2f} s after SIGTERM",
        "at 5 s +/- 0.5 s every client stream ends uncleanly",
    )
    figure(
        "T40",
        "backend connections closed",
        f"20/20 by {max(upstream_closed):.2f} s "
        f"({(max(upstream_closed) - max(ends)) * 1000:.0f} ms after the last client)",
        "every upstream sees peer-close <= 0.5 s later",
    )
    figure("T40", "process exit after SIGTERM", f"{exited:.2f} s, code {code}",
           "exit <= 6 s after SIGTERM")  # fmt: skip


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_t40_a_second_signal_exits_at_once(
    start_upstream: Any, figure: Any, second: int
) -> None:
    backend = SseBackend(events=300, interval_s=0.1)
    upstream = await start_upstream(backend.script)
    guard = GuardProcess(upstream.base, drain_s=30)
    try:
        await guard.start()
        assert guard.process is not None
        async with trio.open_nursery() as nursery:
            results = await start_streams(guard, nursery, 5)
            guard.signal(signal.SIGTERM)
            await trio.sleep(0.5)
            assert guard.process.returncode is None  # still draining
            again = trio.current_time()
            guard.signal(second)
            with trio.fail_after(10):
                code = await guard.process.wait()
            took = trio.current_time() - again
    finally:
        await guard.stop()
    assert not any(r.clean for r in results)
    assert took < 3.0
    figure("T40", f"second signal ({signal.Signals(second).name}) during drain",
           f"exit {code} after {took * 1000:.0f} ms", "forces exit <= 1 s")  # fmt: skip
