"""What the guard adds on the wire: small POSTs and SSE streams, direct vs through the guard.

Run: ``python bench/bench_proxy.py [--quick] [--smoke] [--runs N]``.

Three processes per measurement, on a machine with at least two cores:

- a minimal backend (this file with ``--serve-backend``: asyncio protocols, no HTTP library)
  that answers a small fixed JSON to a non-streaming ``POST /v1/chat/completions`` and, for
  ``"stream": true``, writes one SSE event to every open stream every 20 ms (all streams in one
  burst, like a decode step), each event carrying its sequence number and the monotonic clock
  reading taken just before its write; ``GET /metrics`` serves a real vLLM page (for the
  dynamic mode) and ``POST /bench/finish`` ends every stream with ``data: [DONE]`` and says how
  many events it wrote;
- ``inference-guard serve`` (static mode: admission never refuses; and dynamic mode polling
  the backend's ``/metrics``), pinned to the first core;
- the load generator (``wrk`` for the POSTs when it is installed, else this process), pinned
  with the backend to the other cores.

The same phases run against the backend directly and through the guard. One-way delay of an
event is its arrival time at the client minus the backend's timestamp in it (CLOCK_MONOTONIC is
shared by all processes), so "added delay" compares the same quantity on both paths. The guard's
CPU comes from ``/proc/<pid>/stat`` and its memory from ``/proc/<pid>/status`` (VmRSS) before
the streams open and while they are all held. Prints tables with the goals of PRODUCT.md
beside the figures; asserts nothing and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench_sim_backend import cpu_seconds, percentile, pin

ROOT = Path(__file__).resolve().parent.parent
METRICS_PAGE = ROOT / "tests/fixtures/metrics/vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom"
CHAT = b"/v1/chat/completions"

POST_BODY = json.dumps(
    {
        "model": "bench",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name one river, one stone and one sea, nothing else."},
        ],
        "max_tokens": 16,
        "temperature": 0,
    },
    separators=(",", ":"),
).encode()
ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Rhine, flint, Baltic."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 30, "completion_tokens": 6, "total_tokens": 36},
    },
    separators=(",", ":"),
).encode()

# One SSE event as vLLM writes a content chunk, with a sequence number and a timestamp in front.
EVENT = (
    b'data: {"seq":%d,"ts":%.6f,"id":"chatcmpl-bench","object":"chat.completion.chunk",'
    b'"created":0,"model":"bench","choices":[{"index":0,"delta":{"content":" tok"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
_head, _rest = EVENT.split(b"%d", 1)
_middle, _tail = _rest.split(b"%.6f", 1)
#: The whole event block (without its blank line): anything else is a damaged or merged event.
EVENT_BLOCK = re.compile(
    re.escape(_head)
    + rb"(\d+)"
    + re.escape(_middle)
    + rb"(\d+\.\d+)"
    + re.escape(_tail.removesuffix(b"\n\n"))
)
DONE_BLOCK = b"data: [DONE]"
DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
MAX_TOKENS = re.compile(rb'"max_tokens":(\d+)')

GUARD_ENV = {
    "DYNAMIC_PIG_ENABLED": "false",
    "GLOBAL_LIMIT": "100000",
    "LISTEN": "127.0.0.1:0",
    "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
    "PIG_DRAIN_SECONDS": "2",
}


def response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
        b"%d\r\n\r\n" % len(body) + body
    )


# -- the backend (runs in its own process) -------------------------------------------------------


class Backend:
    """Open streams and the decode-step ticker."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float, page: bytes) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.streams: dict[BackendConnection, None] = {}
        self.sent = 0
        self.answer = response(b"200 OK", b"application/json", ANSWER)
        self.metrics = response(b"200 OK", b"text/plain; version=0.0.4; charset=utf-8", page)
        self.next_tick = loop.time() + interval_s
        loop.call_at(self.next_tick, self.tick)

    def tick(self) -> None:
        """One decode step: one event for every open stream, written back to back."""
        clock = time.monotonic
        ended = []
        for connection in self.streams:
            seq = connection.seq
            payload = EVENT % (seq, clock())
            connection.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            connection.seq = seq + 1
            if connection.seq >= connection.limit:
                ended.append(connection)
        self.sent += len(self.streams)
        for connection in ended:
            self.end(connection)
        self.next_tick += self.interval_s
        now = self.loop.time()
        if self.next_tick < now:  # a late step: keep the phase, skip what was missed
            self.next_tick += math.ceil((now - self.next_tick) / self.interval_s) * self.interval_s
        self.loop.call_at(self.next_tick, self.tick)

    def end(self, connection: BackendConnection) -> None:
        del self.streams[connection]
        connection.write(DONE_CHUNK)

    def finish(self) -> int:
        """End every open stream; the number of events written since the previous call."""
        for connection in list(self.streams):
            self.end(connection)
        sent, self.sent = self.sent, 0
        return sent


class BackendConnection(asyncio.Protocol):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.buffer = b""
        self.seq = 0
        self.limit = 0
        self.write: Callable[[bytes], object] = lambda data: None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.write = transport.write

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend.streams.pop(self, None)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            match = CONTENT_LENGTH.search(buffer, 0, end + 2)
            total = end + 4 + (int(match[1]) if match else 0)
            if len(buffer) < total:
                break
            self.handle(buffer[:end], buffer[end + 4 : total])
            buffer = buffer[total:]
        self.buffer = buffer

    def handle(self, head: bytes, body: bytes) -> None:
        method, target, _ = head[: head.find(b"\r\n")].split(b" ", 2)
        backend = self.backend
        if method == b"POST" and target.startswith(CHAT):
            if b'"stream":true' in body:
                match = MAX_TOKENS.search(body)
                self.seq, self.limit = 0, int(match[1]) if match else 1000
                self.write(SSE_HEAD)
                backend.streams[self] = None
            else:
                self.write(backend.answer)
        elif method == b"GET" and target == b"/metrics":
            self.write(backend.metrics)
        elif method == b"POST" and target == b"/bench/finish":
            sent = backend.finish()
            self.write(response(b"200 OK", b"application/json", b'{"sent":%d}' % sent))
        else:
            self.write(response(b"404 Not Found", b"text/plain", b"not found\n"))


def serve_backend(interval_ms: float) -> int:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        backend = Backend(loop, interval_ms / 1000, METRICS_PAGE.read_bytes())
        server = await loop.create_server(
            lambda: BackendConnection(backend), "127.0.0.1", 0, backlog=4096
        )
        port = server.sockets[0].getsockname()[1]
        print(f"backend listening on 127.0.0.1:{port}", flush=True)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        server.close()

    asyncio.run(serve())
    return 0


# -- measuring other processes -------------------------------------------------------------------


def vmrss_kib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1])
    return math.nan


def run_queue_seconds(pid: int) -> float:
    """Time a process spent runnable but waiting for a CPU (``/proc/<pid>/schedstat``)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


class CpuProbe:
    """CPU seconds of named processes (and of this one) between construction and :meth:`stop`,
    and how long each waited for a CPU while it had work (other load on its core)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {**pids, "client": os.getpid()}
        self.start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.waits = {name: run_queue_seconds(pid) for name, pid in self.pids.items()}
        self.t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.t0
        out = {"window_s": elapsed}
        for name, pid in self.pids.items():
            used = cpu_seconds(pid) - self.start[name]
            out[f"{name}_cpu_s"] = used
            out[f"{name}_share"] = used / elapsed
            out[f"{name}_wait_share"] = (run_queue_seconds(pid) - self.waits[name]) / elapsed
        return out


# -- small POSTs: the built-in generator ---------------------------------------------------------


def post_request(port: int) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (CHAT, port, len(POST_BODY), POST_BODY)
    )


class PostRun:
    def __init__(self, limit: int | None, done: asyncio.Future[None]) -> None:
        self.limit = limit
        self.done = done
        self.measuring = False
        self.stopping = False
        self.latencies = array("d")
        self.errors = 0


class PostConnection(asyncio.Protocol):
    """One keep-alive connection sending the next request as soon as the answer is complete."""

    def __init__(self, run: PostRun, request: bytes) -> None:
        self.run = run
        self.request = request
        self.buffer = b""
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.fire()

    def fire(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            self.buffer = buffer
            return
        match = CONTENT_LENGTH.search(buffer, 0, end + 2)
        run = self.run
        if match is None:  # not an answer this client can frame: give up on this connection
            run.errors += 1
            assert self.transport is not None
            self.transport.close()
            return
        total = end + 4 + int(match[1])
        if len(buffer) < total:
            self.buffer = buffer
            return
        self.buffer = buffer[total:]
        ok = buffer.startswith(b"HTTP/1.1 200 ")
        if not ok:
            run.errors += 1
        if run.measuring:
            run.latencies.append(time.perf_counter() - self.sent_at)
            if run.limit is not None and len(run.latencies) >= run.limit:
                run.measuring = False
                if not run.done.done():
                    run.done.set_result(None)
        if not run.stopping:
            self.fire()


async def builtin_post(
    port: int,
    *,
    connections: int,
    warmup_s: float,
    seconds: float,
    limit: int | None,
    pids: dict[str, int],
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    run = PostRun(limit, loop.create_future())
    request = post_request(port)
    opened: list[PostConnection] = []
    for _ in range(connections):
        _, protocol = await loop.create_connection(
            lambda: PostConnection(run, request), "127.0.0.1", port
        )
        opened.append(protocol)
    await asyncio.sleep(warmup_s)
    probe = CpuProbe(pids)
    run.measuring = True
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(run.done), seconds)
    run.measuring = False
    usage = probe.stop()
    run.stopping = True
    for protocol in opened:
        if protocol.transport is not None:
            protocol.transport.close()
    await asyncio.sleep(0.05)
    latencies = list(run.latencies)
    return {
        **usage,
        "requests": len(latencies),
        "rps": len(latencies) / usage["window_s"],
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "errors": run.errors,
    }


# -- small POSTs: wrk ----------------------------------------------------------------------------

_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def wrk_post(
    wrk: str,
    port: int,
    *,
    connections: int,
    seconds: float,
    pids: dict[str, int],
    cores: set[int],
) -> dict[str, float] | None:
    """One wrk run (after a one-second warm-up run); None when its output cannot be read."""
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = [[{POST_BODY.decode()}]]\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        url = f"http://127.0.0.1:{port}{CHAT.decode()}"

        def command(duration: int) -> list[str]:
            options = ["-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s"]
            return [wrk, *options, str(script), url]

        def run(duration: int) -> str:
            with subprocess.Popen(
                command(duration), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as process:
                with contextlib.suppress(OSError):
                    pin(process.pid, cores)
                try:
                    out, _ = process.communicate(timeout=duration + 30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    out, _ = process.communicate()
                return out

        run(1)
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        probe = CpuProbe(pids)
        out = run(max(1, round(seconds)))
        usage = probe.stop()
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    usage["client_cpu_s"] = wrk_cpu
    usage["client_share"] = wrk_cpu / usage["window_s"]
    try:
        requests = int(re.search(r"(\d+) requests in", out)[1])  # type: ignore[index]
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])  # type: ignore[index]
        latency = {
            q: float(value) * _WRK_UNITS[unit]
            for q, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
        }
        errors = sum(
            int(n)
            for pattern in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: (.*)$")
            for found in re.findall(pattern, out, re.M)
            for n in re.findall(r"\d+", found)
        )
        return {
            **usage,
            "requests": requests,
            "rps": rps,
            "p50_ms": latency["50"],
            "p99_ms": latency["99"],
            "errors": errors,
        }
    except (TypeError, KeyError, ValueError):
        sys.stderr.write(f"could not read wrk's output:\n{out}\n")
        return None


# -- SSE streams ---------------------------------------------------------------------------------


class StreamRun:
    def __init__(self, streams: int, loop: asyncio.AbstractEventLoop) -> None:
        self.streams = streams
        self.started = 0
        self.ended = 0
        self.all_started: asyncio.Future[None] = loop.create_future()
        self.all_ended: asyncio.Future[None] = loop.create_future()
        self.measuring = False
        self.window_events = 0
        self.delays = array("d")
        self.received = 0
        self.malformed = 0
        self.reordered = 0
        self.gaps = 0
        self.broken = 0
        self.refused = 0

    def start(self) -> None:
        self.started += 1
        if self.started == self.streams and not self.all_started.done():
            self.all_started.set_result(None)

    def end(self, *, clean: bool) -> None:
        self.ended += 1
        if not clean:
            self.broken += 1
        if self.ended == self.streams and not self.all_ended.done():
            self.all_ended.set_result(None)


class StreamConnection(asyncio.Protocol):
    """One streaming request: de-chunks the body, checks every event, records its delay."""

    def __init__(self, run: StreamRun, request: bytes) -> None:
        self.run = run
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.head_done = False
        self.raw = b""  # bytes not yet de-chunked
        self.remaining = 0  # bytes left in the current chunk
        self.need_crlf = False
        self.text = b""  # de-chunked bytes not yet cut into events
        self.next_seq = 0
        self.finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished:
            self.finished = True
            self.run.end(clean=False)

    def fail(self) -> None:
        if not self.finished:
            self.finished = True
            self.run.end(clean=False)
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.head_done:
            data = self.raw + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.raw = data
                return
            head = data[:end].lower()
            if not head.startswith(b"http/1.1 200") or b"transfer-encoding: chunked" not in head:
                self.run.refused += 1
                self.fail()
                return
            self.head_done = True
            data, self.raw = data[end + 4 :], b""
        try:
            body = self.dechunk(data)
        except ValueError:
            self.run.malformed += 1
            self.fail()
            return
        if body:
            self.events(now, body)

    def dechunk(self, data: bytes) -> bytes:
        buffer = self.raw + data if self.raw else data
        size = len(buffer)
        pos = 0
        out = []
        while pos < size:
            if self.remaining:
                take = min(self.remaining, size - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self.remaining -= take
                if self.remaining:
                    break
                self.need_crlf = True
                continue
            if self.need_crlf:
                if size - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                pos += 2
                self.need_crlf = False
                continue
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                break
            length = int(buffer[pos:line_end].split(b";", 1)[0], 16)
            pos = line_end + 2
            if length == 0:  # the last chunk; no trailers expected
                pos = size
                break
            self.remaining = length
        self.raw = buffer[pos:]
        return b"".join(out)

    def events(self, now: float, body: bytes) -> None:
        run = self.run
        blocks = (self.text + body).split(b"\n\n")
        self.text = blocks.pop()
        match_block = EVENT_BLOCK.fullmatch
        for block in blocks:
            match = match_block(block)
            if match is None:
                if block == DONE_BLOCK:
                    self.finished = True
                    run.end(clean=True)
                    if self.transport is not None:
                        self.transport.close()
                else:
                    run.malformed += 1
                continue
            seq = int(match[1])
            if seq != self.next_seq:
                if seq > self.next_seq:
                    run.gaps += seq - self.next_seq
                else:
                    run.reordered += 1
                    continue
            if seq == 0:
                run.start()
            self.next_seq = seq + 1
            run.received += 1
            if run.measuring:
                run.window_events += 1
                run.delays.append(now - float(match[2]))


async def finish_streams(backend_port: int) -> int:
    """``POST /bench/finish`` on the backend: every stream ends; the events it wrote."""
    reader, writer = await asyncio.open_connection("127.0.0.1", backend_port)
    try:
        writer.write(b"POST /bench/finish HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        match = CONTENT_LENGTH.search(head)
        body = await reader.readexactly(int(match[1]) if match else 0)
        sent: int = json.loads(body)["sent"]
        return sent
    finally:
        writer.close()


async def stream_phase(
    port: int,
    backend_port: int,
    *,
    streams: int,
    rate: float,
    settle_s: float,
    seconds: float,
    pids: dict[str, int],
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    run = StreamRun(streams, loop)
    guard = pids.get("guard")
    rss0 = vmrss_kib(guard) if guard else math.nan
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "Stream tokens for the benchmark."}],
            "max_tokens": round(rate * (settle_s + seconds + 120)),  # a safety cap only
            "stream": True,
        },
        separators=(",", ":"),
    ).encode()
    request = (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (CHAT, port, len(body), body)
    )
    opened: list[StreamConnection] = []
    t_open = time.monotonic()
    for _ in range(streams):
        _, protocol = await loop.create_connection(
            lambda: StreamConnection(run, request), "127.0.0.1", port
        )
        opened.append(protocol)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(run.all_started), 30)
    ramp_s = time.monotonic() - t_open
    await asyncio.sleep(settle_s)
    probe = CpuProbe(pids)
    run.measuring = True
    await asyncio.sleep(seconds)
    run.measuring = False
    usage = probe.stop()
    rss1 = vmrss_kib(guard) if guard else math.nan
    sent = await finish_streams(backend_port)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(run.all_ended), 30)
    for protocol in opened:
        if protocol.transport is not None:
            protocol.transport.close()
    await asyncio.sleep(0.05)
    delays = list(run.delays)
    window_events = run.window_events
    out = {
        **usage,
        "streams": streams,
        "started": run.started,
        "ramp_s": ramp_s,
        "wanted_per_s": streams * rate,
        "events_per_s": window_events / usage["window_s"],
        "delay_p50_ms": 1000 * percentile(delays, 0.5),
        "delay_p99_ms": 1000 * percentile(delays, 0.99),
        "delay_max_ms": 1000 * max(delays, default=math.nan),
        "sent": sent,
        "received": run.received,
        "lost": max(0, sent - run.received),
        "reordered": run.reordered,
        "malformed": run.malformed,
        # cut short, or still without [DONE] 30 s after the backend ended every stream
        "broken": run.broken - run.refused + (streams - run.ended),
        "refused": run.refused,
        "rss_before_kib": rss0,
        "rss_during_kib": rss1,
        "rss_per_stream_kib": (rss1 - rss0) / streams,
    }
    if guard:
        cpu = usage["guard_cpu_s"]
        out["guard_events_per_cpu_s"] = window_events / cpu if cpu > 0 else math.nan
        out["guard_cpu_per_10k_events_s"] = 1e4 * cpu / max(window_events, 1)
    return out


# -- processes -----------------------------------------------------------------------------------


@contextlib.contextmanager
def process(command: list[str], **kwargs: Any) -> Iterator[subprocess.Popen[Any]]:
    """A subprocess that is stopped (SIGTERM, then SIGKILL) whatever happens."""
    child = subprocess.Popen(command, cwd=ROOT, **kwargs)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def wait_for_port(log: Path, child: subprocess.Popen[Any], timeout_s: float = 30) -> int:
    """The port ``inference-guard serve`` logged that it listens on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"listening on [^\s:]+:(\d+)", text)
        if found:
            return int(found[1])
        if child.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"the guard did not start:\n{log.read_text(errors='replace')[-3000:]}")


# -- one run of every phase against one target ---------------------------------------------------


class Plan:
    def __init__(self, args: argparse.Namespace) -> None:
        self.rate = 1000 / args.interval_ms
        if args.smoke:
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 0.1, 3.0, 3.0
            self.post_limit: int | None = 200
            self.streams = [8]
            self.settle_s, self.stream_seconds = 0.2, 1.0
        elif args.quick:
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 0.5, 2.0, 1.5
            self.post_limit = None
            self.streams = [128]
            self.settle_s, self.stream_seconds = 0.5, 5.0
        else:
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 1.0, 4.0, 3.0
            self.post_limit = None
            self.streams = [200, 512]
            self.settle_s, self.stream_seconds = 1.0, 15.0
        if args.streams is not None:
            self.streams = [int(n) for n in args.streams.split(",") if n.strip()]
        self.post = args.only != "sse"
        if args.only == "post":
            self.streams = []
        if args.seconds:
            self.stream_seconds = args.seconds


def run_target(
    plan: Plan, port: int, backend_port: int, pids: dict[str, int], setup: Setup
) -> dict[str, dict[str, float]]:
    """Every phase against one target (the backend itself or a guard in front of it)."""
    results: dict[str, dict[str, float]] = {}
    posts = (("post32", 32, plan.post_seconds), ("post1", 1, plan.post_one_seconds))
    for name, connections, seconds in posts if plan.post else ():
        measured = None
        if setup.wrk is not None:
            measured = wrk_post(
                setup.wrk,
                port,
                connections=connections,
                seconds=seconds,
                pids=pids,
                cores=setup.client_cores,
            )
        if measured is None:
            measured = asyncio.run(
                builtin_post(
                    port,
                    connections=connections,
                    warmup_s=plan.post_warmup_s,
                    seconds=seconds,
                    limit=plan.post_limit,
                    pids=pids,
                )
            )
        if "guard_cpu_s" in measured:
            cpu = measured["guard_cpu_s"]
            measured["guard_per_cpu_s"] = measured["requests"] / cpu if cpu > 0 else math.nan
            measured["guard_cpu_per_10k_s"] = 1e4 * cpu / max(measured["requests"], 1)
        results[name] = measured
    for streams in plan.streams:
        results[f"sse{streams}"] = asyncio.run(
            stream_phase(
                port,
                backend_port,
                streams=streams,
                rate=plan.rate,
                settle_s=plan.settle_s,
                seconds=plan.stream_seconds,
                pids=pids,
            )
        )
    return results


def combine(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Median of each figure over the runs; counts of damaged events are summed."""
    summed = {"lost", "reordered", "malformed", "broken", "refused", "errors"}
    out: dict[str, dict[str, float]] = {}
    for phase in runs[0]:
        figures: dict[str, float] = {}
        for key in runs[0][phase]:
            values = [r[phase][key] for r in runs]
            figures[key] = sum(values) if key in summed else statistics.median(values)
        out[phase] = figures
    return out


# -- the tables ----------------------------------------------------------------------------------

Row = tuple[str, str, str, Callable[[float], str], Callable[[float], bool] | None, str]


def fmt(digits: int, suffix: str = "") -> Callable[[float], str]:
    def show(value: float) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value:,.{digits}f}{suffix}"

    return show


def table(
    title: str,
    columns: Sequence[str],
    results: dict[str, dict[str, dict[str, float]]],
    rows: Sequence[Row],
) -> list[str]:
    """``rows``: label, phase, key (or ``added:KEY``), format, goal test, goal text."""
    cells = [["", *columns, "goal (PRODUCT.md)"]]
    missed = False
    for label, phase, key, show, goal, goal_text in rows:
        line = [label]
        for column in columns:
            figures = results[column].get(phase, {})
            if key.startswith("added:"):
                base = key.partition(":")[2]
                direct = results["direct"].get(phase, {}).get(base, math.nan)
                value = figures.get(base, math.nan) - direct if column != "direct" else math.nan
            else:
                value = figures.get(key, math.nan)
            text = show(value)
            if goal is not None and column != "direct" and text != "-" and not goal(value):
                text += " *"
                missed = True
            line.append(text)
        line.append(goal_text)
        cells.append(line)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [title, "-" * len(title)]
    for row in cells:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:-1], strict=True)]
        parts.append(row[-1])
        lines.append("  ".join(parts).rstrip())
    if missed:
        lines.append("* goal not met")
    return lines


def post_rows() -> list[Row]:
    ms, count, seconds = fmt(3, " ms"), fmt(0), fmt(2, " s")
    return [
        ("requests/s, 32 connections", "post32", "rps", count, None, ""),
        ("latency p50, 32 connections", "post32", "p50_ms", ms, None, ""),
        ("latency p99, 32 connections", "post32", "p99_ms", ms, None, ""),
        (
            "requests per guard CPU-second",
            "post32",
            "guard_per_cpu_s",
            count,
            _ge(6000),
            ">= 6,000",
        ),
        ("guard CPU per 10,000 requests", "post32", "guard_cpu_per_10k_s", seconds, None, ""),
        ("guard CPU share, 32 connections", "post32", "guard_share", _percent, None, ""),
        ("guard waiting for its core", "post32", "guard_wait_share", _percent, None, ""),
        ("backend CPU share, 32 connections", "post32", "backend_share", _percent, None, ""),
        ("generator CPU share, 32 connections", "post32", "client_share", _percent, None, ""),
        ("requests/s, 1 connection", "post1", "rps", count, None, ""),
        (
            "guard waiting for its core, 1 connection",
            "post1",
            "guard_wait_share",
            _percent,
            None,
            "",
        ),
        ("latency p50, 1 connection", "post1", "p50_ms", ms, None, ""),
        ("latency p99, 1 connection", "post1", "p99_ms", ms, None, ""),
        ("added p50, 1 connection", "post1", "added:p50_ms", ms, _le(0.2), "<= 0.2 ms"),
        ("non-200 or unreadable answers", "post32", "errors", count, _le(0), "0"),
        ("  same, 1 connection", "post1", "errors", count, _le(0), "0"),
    ]


def stream_rows(streams: int) -> list[Row]:
    phase = f"sse{streams}"
    ms, count, kib = fmt(2, " ms"), fmt(0), fmt(1, " KiB")
    p99_goal = {200: (2.0, "<= 2 ms"), 512: (10.0, "<= 10 ms")}.get(streams)
    p99_test = _le(p99_goal[0]) if p99_goal else None
    p99_text = p99_goal[1] if p99_goal else ""
    per_cpu = "guard_events_per_cpu_s"
    return [
        (f"{streams} streams: events/s delivered", phase, "events_per_s", count, None, ""),
        ("  events/s wanted", phase, "wanted_per_s", count, None, ""),
        ("  one-way delay p50", phase, "delay_p50_ms", ms, None, ""),
        ("  one-way delay p99", phase, "delay_p99_ms", ms, None, ""),
        ("  one-way delay max", phase, "delay_max_ms", ms, None, ""),
        ("  added delay p50", phase, "added:delay_p50_ms", ms, None, ""),
        ("  added delay p99", phase, "added:delay_p99_ms", ms, p99_test, p99_text),
        ("  events per guard CPU-second", phase, per_cpu, count, _ge(30000), ">= 30,000"),
        (
            "  guard CPU per 10,000 events",
            phase,
            "guard_cpu_per_10k_events_s",
            fmt(3, " s"),
            None,
            "",
        ),
        ("  guard CPU share", phase, "guard_share", _percent, None, ""),
        ("  guard waiting for its core", phase, "guard_wait_share", _percent, None, ""),
        ("  backend CPU share", phase, "backend_share", _percent, None, ""),
        ("  generator CPU share", phase, "client_share", _percent, None, ""),
        ("  generator waiting for its core", phase, "client_wait_share", _percent, None, ""),
        ("  guard RSS before streams", phase, "rss_before_kib", fmt(0, " KiB"), None, ""),
        ("  guard RSS growth per held stream", phase, "rss_per_stream_kib", kib, None, "reported"),
        ("  lost events", phase, "lost", count, _le(0), "0"),
        ("  reordered events", phase, "reordered", count, _le(0), "0"),
        ("  merged or damaged events", phase, "malformed", count, _le(0), "0"),
        ("  streams refused (not 200 + chunked)", phase, "refused", count, _le(0), "0"),
        ("  streams cut before [DONE]", phase, "broken", count, _le(0), "0"),
        ("  ramp-up: all streams open and started", phase, "ramp_s", fmt(2, " s"), None, ""),
    ]


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.0f} %"


def _ge(limit: float) -> Callable[[float], bool]:
    return lambda value: value >= limit


def _le(limit: float) -> Callable[[float], bool]:
    return lambda value: value <= limit


# -- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 streams x 5 s, 2 s of POSTs")
    parser.add_argument(
        "--smoke", action="store_true", help="a few seconds in all: 8 streams x 1 s, 200 POSTs"
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    parser.add_argument("--streams", help="comma-separated stream counts (default 200,512)")
    parser.add_argument("--seconds", type=float, help="measured seconds of each stream phase")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="time between events")
    parser.add_argument(
        "--generator",
        choices=("auto", "wrk", "builtin"),
        default="auto",
        help="POST load generator: wrk when installed (auto), or the built-in client",
    )
    parser.add_argument("--no-dynamic", action="store_true", help="skip the dynamic-mode guard")
    parser.add_argument("--only", choices=("post", "sse"), help="run only these phases")
    parser.add_argument(
        "--profile-guard", metavar="DIR", help="run the guard under cProfile, write DIR/*.prof"
    )
    parser.add_argument("--serve-backend", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


class Setup:
    """Cores, the POST generator, and how the guard is started in each mode."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.pinning = len(cores) > 1
        self.guard_cores = set(cores[:1])
        self.client_cores = set(cores[1:]) or set(cores)
        self.client_pinned = pin(0, self.client_cores) if self.pinning else "not pinned"
        self.guard_pinned = "not pinned"
        self.wrk = shutil.which("wrk") if args.generator != "builtin" else None
        if self.wrk:
            self.generator = f"wrk ({self.wrk}), 1 thread"
        else:
            self.generator = "built-in asyncio keep-alive client in the benchmark process"
            if args.generator != "builtin":
                self.generator += " (wrk is not installed)"
        self.columns = ["direct", "guard static"]
        if not args.no_dynamic:
            self.columns.append("guard dynamic")

    def guard_env(self, mode: str, backend_port: int) -> dict[str, str]:
        keep = ("PATH", "HOME", "PYTHONPATH", "LANG")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(GUARD_ENV, UPSTREAM=f"http://127.0.0.1:{backend_port}")
        if mode == "guard dynamic":
            env.update(
                DYNAMIC_PIG_ENABLED="true",
                DYNAMIC_PIG_ENFORCE="false",
                DYNAMIC_METRICS_URL=f"http://127.0.0.1:{backend_port}/metrics",
            )
        return env

    def guard_command(self, mode: str) -> list[str]:
        command = [sys.executable, "-m", "guard_trio", "serve"]
        if self.args.profile_guard:
            directory = Path(self.args.profile_guard)
            directory.mkdir(parents=True, exist_ok=True)
            out = directory / f"{mode.replace(' ', '-')}.prof"
            command[1:2] = ["-m", "cProfile", "-o", str(out), "-m"]
        return command

    def through_guard(
        self, mode: str, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> dict[str, dict[str, float]]:
        env = self.guard_env(mode, backend_port)
        with tempfile.TemporaryDirectory() as scratch:
            log = Path(scratch) / "guard.log"
            with (
                log.open("wb") as log_file,
                process(
                    self.guard_command(mode), env=env, stdout=log_file, stderr=log_file
                ) as guard,
            ):
                if self.pinning:
                    self.guard_pinned = pin(guard.pid, self.guard_cores)
                port = wait_for_port(log, guard)
                pids = {"backend": backend.pid, "guard": guard.pid}
                results = run_target(plan, port, backend_port, pids, self)
                guard.terminate()  # drains, then exits (and writes its profile, if any)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    guard.wait(timeout=10)
        return results

    def measure(self, plan: Plan) -> dict[str, dict[str, dict[str, float]]]:
        all_runs: dict[str, list[dict[str, dict[str, float]]]] = {c: [] for c in self.columns}
        backend_command = [sys.executable, str(Path(__file__).resolve()), "--serve-backend"]
        backend_command += ["--interval-ms", str(self.args.interval_ms)]
        with process(backend_command, stdout=subprocess.PIPE, text=True) as backend:
            if self.pinning:
                pin(backend.pid, self.client_cores)
            assert backend.stdout is not None
            backend_port = int(backend.stdout.readline().rpartition(":")[2])
            for _ in range(self.args.runs):
                pids = {"backend": backend.pid}
                all_runs["direct"].append(run_target(plan, backend_port, backend_port, pids, self))
                for mode in self.columns[1:]:
                    all_runs[mode].append(self.through_guard(mode, plan, backend, backend_port))
        return {column: combine(runs) for column, runs in all_runs.items()}


def report(
    setup: Setup,
    plan: Plan,
    results: dict[str, dict[str, dict[str, float]]],
    header: dict[str, float],
) -> None:
    args = setup.args
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    print(f"bench_proxy ({name} mode, {args.runs} run(s), {header['elapsed']:.0f} s)")
    print(f"Python: {platform.python_implementation()} {sys.version.splitlines()[0]}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; guard {setup.guard_pinned}, "
        f"backend and load generator {setup.client_pinned}"
    )
    print(
        f"load average {header['load_before']:.2f} before, {header['load_after']:.2f} after"
        " (other work on the machine skews wall-clock figures more than per-CPU-second ones)"
    )
    print(f"POST load generator: {setup.generator}")
    print(
        f"small POST: {len(POST_BODY)}-byte JSON body to {CHAT.decode()}, "
        f"{len(ANSWER)}-byte JSON answer"
    )
    print(
        f"streams: one {len(EVENT % (0, 0.0))}-byte event per stream every "
        f"{args.interval_ms:g} ms, all streams in one burst; {plan.stream_seconds:g} s measured "
        f"after {plan.settle_s:g} s settling"
    )
    print("guard static: DYNAMIC_PIG_ENABLED=false GLOBAL_LIMIT=100000")
    if "guard dynamic" in setup.columns:
        print(
            "guard dynamic: DYNAMIC_PIG_ENABLED=true DYNAMIC_PIG_ENFORCE=false GLOBAL_LIMIT=100000"
            " (the learner polls the backend's /metrics, a real idle vLLM 0.10 page, every"
            " second; the gate keeps GLOBAL_LIMIT)"
        )
    print()
    if plan.post:
        print("\n".join(table("Small non-streaming POST", setup.columns, results, post_rows())))
    for streams in plan.streams:
        title = f"SSE streaming, {streams} streams x {plan.rate:g} events/s"
        print()
        print("\n".join(table(title, setup.columns, results, stream_rows(streams))))


def main() -> int:
    args = parse_args()
    if args.serve_backend:
        return serve_backend(args.interval_ms)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the children
    plan = Plan(args)
    setup = Setup(args)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    results = setup.measure(plan)
    header = {
        "elapsed": time.monotonic() - started,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    report(setup, plan, results, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
