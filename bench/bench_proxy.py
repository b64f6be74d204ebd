"""What the guard adds on the wire: small POSTs and SSE streams, direct vs guard vs nginx.

Run: ``python bench/bench_proxy.py [--quick] [--smoke] [--runs N] [--no-nginx]`` (also part of
``nox -s bench``; bench_peers.py reuses this file for sglang-router and LiteLLM).

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
- the load generator (``wrk`` for the POSTs when it is installed, with a Lua script for the body
  and the percentiles, else this process), pinned with the backend to the other cores.

The same phases (POSTs at 32 and 128 connections and at one; 200 and 512 streams) run against
the backend directly, through the guard, and through Debian's nginx as a plain reverse proxy
(a config written to a scratch folder: one process on the guard's core, HTTP/1.1 with kept-alive
upstream connections, ``proxy_buffering off``), skipped with a line when nginx is not installed.
One-way delay of an event is its arrival time at the client minus the backend's timestamp in it
(CLOCK_MONOTONIC is shared by all processes), so "added delay" compares the same quantity on
every path. The CPU of the process in front (guard or nginx) comes from ``/proc/<pid>/stat``
and its memory from ``/proc/<pid>/status`` (VmRSS) before the streams open and while they are
all held. Prints tables with the goals of PRODUCT.md beside the figures (marked only in the
guard's columns); asserts nothing and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
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
# The same chunk for peers that parse and re-serialise events (LiteLLM): sequence number and
# timestamp ride in the content, the one field every OpenAI-compatible proxy passes on unchanged.
PEER_EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"s%d t%.6f "},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
PEER_MARK = re.compile(rb"s(\d+) t(\d+\.\d+) ")
DONE_BLOCK = b"data: [DONE]"
DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

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

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval_s: float,
        page: bytes,
        *,
        event: bytes = EVENT,
        model_path: str = "",
    ) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.event = event
        self.streams: dict[BackendConnection, None] = {}
        self.sent = 0
        self.answer = response(b"200 OK", b"application/json", ANSWER)
        self.metrics = response(b"200 OK", b"text/plain; version=0.0.4; charset=utf-8", page)
        self.info = info_pages(model_path)
        self.next_tick = loop.time() + interval_s
        loop.call_at(self.next_tick, self.tick)

    def tick(self) -> None:
        """One decode step: one event for every open stream, written back to back."""
        clock = time.monotonic
        event = self.event
        ended = []
        for connection in self.streams:
            seq = connection.seq
            payload = event % (seq, clock())
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


def info_pages(model_path: str) -> dict[bytes, bytes]:
    """What routers probe on a worker before they send it traffic (sglang-router: health, server
    and model info, load). ``model_path`` names a local, empty directory, so that a router which
    loads a tokenizer from the worker's model path fails locally instead of going to a hub."""
    model = {"model_path": model_path or "bench", "tokenizer_path": model_path or "bench"}
    server = {
        **model,
        "served_model_name": "bench",
        "is_generation": True,
        "max_total_num_tokens": 1 << 20,
        "dp_size": 1,
        "tp_size": 1,
        "version": "bench",
    }
    models = {
        "object": "list",
        "data": [{"id": "bench", "object": "model", "created": 0, "owned_by": "bench"}],
    }
    pages = {
        b"/server_info": server,
        b"/get_server_info": server,
        b"/model_info": {**model, "is_generation": True},
        b"/get_model_info": {**model, "is_generation": True},
        b"/get_load": [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}],
        b"/v1/models": models,
    }
    out = {
        target: response(b"200 OK", b"application/json", json.dumps(page).encode())
        for target, page in pages.items()
    }
    for target in (b"/health", b"/health_generate", b"/ping"):
        out[target] = response(b"200 OK", b"text/plain", b"ok\n")
    return out


class BackendConnection(asyncio.Protocol):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.buffer = b""
        self.seq = 0
        self.limit = 0
        self.write: Callable[[bytes], object] = lambda data: None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
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
            if not self.handle(buffer[:end], buffer[end + 4 : total]):
                return
            buffer = buffer[total:]
        self.buffer = buffer

    def handle(self, head: bytes, body: bytes) -> bool:
        """Answer one request; False when the connection is closed (not HTTP/1.x: sglang-router
        opens one with the HTTP/2 preface to find out whether the worker speaks gRPC)."""
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self.write(
                b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
            )
            assert self.transport is not None
            self.transport.close()
            return False
        method, target, _ = parts
        backend = self.backend
        if method == b"POST" and target.startswith(CHAT):
            if STREAM_TRUE.search(body):
                match = MAX_TOKENS.search(body)
                self.seq, self.limit = 0, int(match[1]) if match else 1000
                self.write(SSE_HEAD)
                backend.streams[self] = None
            else:
                self.write(backend.answer)
        elif method == b"GET" and target == b"/metrics":
            self.write(backend.metrics)
        elif method == b"GET" and target in backend.info:
            self.write(backend.info[target])
        elif method == b"POST" and target == b"/bench/finish":
            sent = backend.finish()
            self.write(response(b"200 OK", b"application/json", b'{"sent":%d}' % sent))
        else:
            sys.stderr.write(f"bench backend: 404 for {head[:200]!r}\n")
            self.write(response(b"404 Not Found", b"text/plain", b"not found\n"))
        return True


def serve_backend(interval_ms: float, *, peer_events: bool = False, model_path: str = "") -> int:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        backend = Backend(
            loop,
            interval_ms / 1000,
            METRICS_PAGE.read_bytes(),
            event=PEER_EVENT if peer_events else EVENT,
            model_path=model_path,
        )
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


def post_request(port: int, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    extra = b"".join(f"{name}: {value}\r\n".encode() for name, value in headers)
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (CHAT, port, extra, len(POST_BODY), POST_BODY)
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
    headers: Sequence[tuple[str, str]] = (),
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    run = PostRun(limit, loop.create_future())
    request = post_request(port, headers)
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

#: wrk's Lua hooks: the POST (body and headers) and, when the run is done, one JSON line with the
#: counts and the latency percentiles in microseconds, so nothing depends on wrk's text layout.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
%(headers)s
%(count)s
done = function(summary, latency, requests)
  local e = summary.errors
  local c = counts()
  io.write(string.format(
    "WRK-JSON {\\"requests\\":%%d,\\"duration_us\\":%%d,\\"p50_us\\":%%.1f,\\"p99_us\\":%%.1f,"
    .. "\\"p999_us\\":%%.1f,\\"status\\":%%d,\\"connect\\":%%d,\\"read\\":%%d,"
    .. "\\"write\\":%%d,\\"timeout\\":%%d,\\"refused\\":%%d,\\"closed\\":%%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), e.status, e.connect, e.read, e.write, e.timeout, c[1], c[2]))
end
"""

#: Without counting, wrk skips the per-response Lua call (its fastest mode).
WRK_NO_COUNT = "counts = function() return {-1, -1} end"

#: The refusal flood: each thread counts its 429s and the answers that close the connection.
WRK_COUNT = """\
local threads = {}
setup = function(thread) table.insert(threads, thread) end
refused, closed = 0, 0
response = function(status, headers, body)
  if status == 429 then refused = refused + 1 end
  local c = headers["Connection"] or headers["connection"]
  if c == "close" then closed = closed + 1 end
end
counts = function()
  local r, c = 0, 0
  for _, t in ipairs(threads) do r = r + t:get("refused"); c = c + t:get("closed") end
  return {r, c}
end"""


def wrk_post(
    wrk: str,
    port: int,
    *,
    connections: int,
    seconds: float,
    pids: dict[str, int],
    cores: set[int],
    headers: Sequence[tuple[str, str]] = (),
    count: bool = False,
) -> dict[str, float] | None:
    """One wrk run (after a one-second warm-up run); None when its output cannot be read.

    ``count``: also count the 429s and the answers that close the connection (slower for wrk).
    """
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "post.lua"
        extra = "\n".join(f'wrk.headers["{name}"] = "{value}"' for name, value in headers)
        script.write_text(
            WRK_SCRIPT
            % {
                "body": POST_BODY.decode(),
                "headers": extra,
                "count": WRK_COUNT if count else WRK_NO_COUNT,
            }
        )
        url = f"http://127.0.0.1:{port}{CHAT.decode()}"

        def command(duration: int) -> list[str]:
            # a long timeout: a slow peer's answers count with their latency, not as errors
            options = ["-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "10s", "-s"]
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
    found = re.search(r"^WRK-JSON (\{.*\})$", out, re.M)
    if found is None:
        sys.stderr.write(f"could not read wrk's output:\n{out}\n")
        return None
    figures = json.loads(found[1])
    errors = sum(figures[key] for key in ("status", "connect", "read", "write", "timeout"))
    counted = {"refused": figures["refused"], "closed": figures["closed"]} if count else {}
    return {
        **usage,
        **counted,
        "requests": figures["requests"],
        "rps": figures["requests"] / (figures["duration_us"] / 1e6),
        "p50_ms": figures["p50_us"] / 1000,
        "p99_ms": figures["p99_us"] / 1000,
        "p999_ms": figures["p999_us"] / 1000,
        "errors": errors,
    }


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
    """One streaming request: de-chunks the body, checks every event, records its delay.

    Strict (default): every block must be the backend's event byte for byte, else it counts as
    damaged or merged. ``loose`` (for peers that re-serialise events): a block counts when it
    carries exactly one sequence mark, two marks in one block is a merge, and blocks without a
    mark (a role or usage chunk a peer adds, comments) are ignored; a mangled event then shows
    up as a lost one.
    """

    def __init__(self, run: StreamRun, request: bytes, *, loose: bool = False) -> None:
        self.run = run
        self.loose = loose
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
        loose = self.loose
        for block in blocks:
            if loose:
                marks = PEER_MARK.findall(block)
                match = marks[0] if len(marks) == 1 else None
                if match is None and block != DONE_BLOCK:
                    run.malformed += len(marks) > 1
                    continue
            else:
                match = match_block(block)
                if match is not None:
                    match = (match[1], match[2])
            if match is None:
                if block == DONE_BLOCK:
                    self.finished = True
                    run.end(clean=True)
                    if self.transport is not None:
                        self.transport.close()
                else:
                    run.malformed += 1
                continue
            seq = int(match[0])
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
                run.delays.append(now - float(match[1]))


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
    headers: Sequence[tuple[str, str]] = (),
    loose: bool = False,
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
    extra = b"".join(f"{name}: {value}\r\n".encode() for name, value in headers)
    request = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n" % (
        CHAT,
        port,
    ) + b"accept: text/event-stream\r\n%scontent-length: %d\r\n\r\n%s" % (extra, len(body), body)
    opened: list[StreamConnection] = []
    t_open = time.monotonic()
    for _ in range(streams):
        _, protocol = await loop.create_connection(
            lambda: StreamConnection(run, request, loose=loose), "127.0.0.1", port
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
def process(
    command: list[str], *, cores: set[int] | None = None, **kwargs: Any
) -> Iterator[subprocess.Popen[Any]]:
    """A subprocess that is stopped (SIGTERM, then SIGKILL) whatever happens; with ``cores``,
    it starts pinned to them (like ``taskset``), so every thread it ever makes is pinned too."""
    if cores and hasattr(os, "sched_setaffinity"):
        kwargs["preexec_fn"] = lambda: os.sched_setaffinity(0, cores)
    kwargs.setdefault("cwd", ROOT)
    child = subprocess.Popen(command, **kwargs)
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


def free_port() -> int:
    """A port nothing listens on now (for servers that cannot be told to pick their own)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until_listening(
    port: int, child: subprocess.Popen[Any], timeout_s: float, log: Path | None = None
) -> None:
    """Until something accepts on ``port``; RuntimeError (with the log's tail) if ``child`` exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            break
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log and log.exists() else []
    exited = child.poll()
    state = (
        f"exited with {exited}" if exited is not None else f"not listening after {timeout_s:g} s"
    )
    raise RuntimeError(" | ".join([state, *tail])[:600])


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
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 0.1, 2.0, 2.0
            self.post_limit: int | None = 200
            self.post_connections = [32]
            self.streams = [8]
            self.settle_s, self.stream_seconds = 0.2, 1.0
        elif args.quick:
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 0.5, 2.0, 1.5
            self.post_limit = None
            self.post_connections = [32, 128]
            self.streams = [128]
            self.settle_s, self.stream_seconds = 0.5, 5.0
        else:
            self.post_warmup_s, self.post_seconds, self.post_one_seconds = 1.0, 4.0, 3.0
            self.post_limit = None
            self.post_connections = [32, 128]
            self.streams = [200, 512]
            self.settle_s, self.stream_seconds = 1.0, 15.0
        if args.streams is not None:
            self.streams = [int(n) for n in args.streams.split(",") if n.strip()]
        if getattr(args, "connections", None):
            self.post_connections = [int(n) for n in args.connections.split(",") if n.strip()]
        self.post = args.only != "sse"
        self.post_one = self.post and not getattr(args, "no_post_one", False)
        if args.only == "post":
            self.streams = []
        if args.seconds:
            self.stream_seconds = args.seconds
        if getattr(args, "post_seconds", None):
            self.post_seconds = self.post_one_seconds = args.post_seconds

    def post_phases(self) -> list[tuple[str, int, float]]:
        """(phase name, connections, measured seconds) of every POST phase."""
        if not self.post:
            return []
        phases = [(f"post{n}", n, self.post_seconds) for n in self.post_connections]
        if self.post_one:
            phases.append(("post1", 1, self.post_one_seconds))
        return phases


def run_target(
    plan: Plan, port: int, backend_port: int, pids: dict[str, int], setup: Setup
) -> dict[str, dict[str, float]]:
    """Every phase against one target (the backend itself, or a guard or other proxy in front of
    it, whose pid is ``pids["guard"]``)."""
    results: dict[str, dict[str, float]] = {}
    headers = setup.request_headers
    for name, connections, seconds in plan.post_phases():
        measured = None
        if setup.wrk is not None:
            measured = wrk_post(
                setup.wrk,
                port,
                connections=connections,
                seconds=seconds,
                pids=pids,
                cores=setup.client_cores,
                headers=headers,
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
                    headers=headers,
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
                headers=headers,
                loose=setup.loose_events,
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
    cells = [["", *columns, "goal for the guard (PRODUCT.md)"]]
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
            goal_applies = column.startswith("guard")
            if goal is not None and goal_applies and text != "-" and not goal(value):
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


def post_rows(plan: Plan) -> list[Row]:
    ms, count, seconds = fmt(3, " ms"), fmt(0), fmt(2, " s")
    rows: list[Row] = []
    for name, n, _ in plan.post_phases():
        if n == 1:
            continue
        rows += [
            (f"{n} connections: requests/s", name, "rps", count, None, ""),
            ("  latency p50", name, "p50_ms", ms, None, ""),
            ("  latency p99", name, "p99_ms", ms, None, ""),
            ("  added p50", name, "added:p50_ms", ms, None, ""),
            ("  added p99", name, "added:p99_ms", ms, None, ""),
            (
                "  requests per guard CPU-second",
                name,
                "guard_per_cpu_s",
                count,
                _ge(6000),
                ">= 6,000",
            ),
            ("  guard CPU per 10,000 requests", name, "guard_cpu_per_10k_s", seconds, None, ""),
            ("  guard CPU share", name, "guard_share", _percent, None, ""),
            ("  guard waiting for its core", name, "guard_wait_share", _percent, None, ""),
            ("  backend CPU share", name, "backend_share", _percent, None, ""),
            ("  generator CPU share", name, "client_share", _percent, None, ""),
            ("  non-2xx or unreadable answers, socket errors", name, "errors", count, _le(0), "0"),
        ]
    if plan.post_one:
        rows += [
            ("1 connection: requests/s", "post1", "rps", count, None, ""),
            ("  latency p50", "post1", "p50_ms", ms, None, ""),
            ("  latency p99", "post1", "p99_ms", ms, None, ""),
            ("  added p50", "post1", "added:p50_ms", ms, _le(0.2), "<= 0.2 ms"),
            ("  guard waiting for its core", "post1", "guard_wait_share", _percent, None, ""),
            (
                "  non-2xx or unreadable answers, socket errors",
                "post1",
                "errors",
                count,
                _le(0),
                "0",
            ),
        ]
    return rows


def refusal_rows() -> list[Row]:
    """The refusal flood: small POSTs on kept-alive connections, every one answered 429."""
    count, ms = fmt(0), fmt(3, " ms")
    phase = "flood"
    return [
        (f"{REFUSAL_CONNECTIONS} connections: 429s/s", phase, "rps", count, None, ""),
        ("  latency p50", phase, "p50_ms", ms, None, ""),
        ("  latency p99", phase, "p99_ms", ms, None, ""),
        ("  429s per CPU-second", phase, "guard_per_cpu_s", count, _ge(20000), ">= 20,000"),
        ("  CPU share", phase, "guard_share", _percent, None, ""),
        (
            "  answers that closed the connection, per 1,000",
            phase,
            "closed_per_1k",
            fmt(1),
            _le(0),
            "0",
        ),
        ("  answers other than 429", phase, "not_refused", count, _le(0), "0"),
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


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this file shares with bench_peers.py."""
    parser.add_argument("--quick", action="store_true", help="128 streams x 5 s, 2 s of POSTs")
    parser.add_argument(
        "--smoke", action="store_true", help="a few seconds in all: 8 streams x 1 s, 200 POSTs"
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    parser.add_argument("--streams", help="comma-separated stream counts (default 200,512)")
    parser.add_argument("--seconds", type=float, help="measured seconds of each stream phase")
    parser.add_argument("--post-seconds", type=float, help="measured seconds of each POST phase")
    parser.add_argument(
        "--connections", help="comma-separated POST connection counts (default 32,128)"
    )
    parser.add_argument("--interval-ms", type=float, default=20.0, help="time between events")
    parser.add_argument(
        "--generator",
        choices=("auto", "wrk", "builtin"),
        default="auto",
        help="POST load generator: wrk when installed (auto), or the built-in client",
    )
    parser.add_argument("--only", choices=("post", "sse"), help="run only these phases")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--no-dynamic", action="store_true", help="skip the dynamic-mode guard")
    parser.add_argument("--no-nginx", action="store_true", help="skip the nginx column")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the trio+h11 floor column (bench/naive_proxy.py: a proxy doing nothing else)",
    )
    parser.add_argument(
        "--no-refusals", action="store_true", help="skip the refusal flood (every request a 429)"
    )
    parser.add_argument(
        "--admin-viewer",
        action="store_true",
        help="add a column: the dynamic guard with its admin plane on and one stream viewer that"
        " subscribes to everything and never reads",
    )
    parser.add_argument(
        "--profile-guard", metavar="DIR", help="run the guard under cProfile, write DIR/*.prof"
    )
    parser.add_argument("--serve-backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-events", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default="", help=argparse.SUPPRESS)
    args, ignored = parser.parse_known_args()  # nox -s bench hands bench_peers' options too
    if ignored:
        print(f"bench_proxy: ignoring options it does not take: {' '.join(ignored)}")
    return args


# nginx as a plain reverse proxy, tuned as one would in front of SSE: HTTP/1.1 and kept-alive
# connections to the backend, no response buffering. One process (no master, no daemon) so that
# its CPU and memory are those of one pid, pinned to the guard's core.
#: What both nginx configurations share: one process, its files in a scratch folder, no logs.
_NGINX_COMMON = """\
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 65536;
pid %(dir)s/nginx.pid;
error_log %(dir)s/error.log warn;
events {
    worker_connections 16384;
}
http {
    access_log off;
    client_body_temp_path %(dir)s/client_body;
    proxy_temp_path %(dir)s/proxy;
    fastcgi_temp_path %(dir)s/fastcgi;
    uwsgi_temp_path %(dir)s/uwsgi;
    scgi_temp_path %(dir)s/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
"""
NGINX_CONF = (
    _NGINX_COMMON
    + """\
    upstream backend {
        server 127.0.0.1:%(backend_port)d;
        keepalive 1024;
        keepalive_requests 1000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:%(port)d backlog=4096;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
        }
    }
}
"""
)

#: nginx answering every request itself with the guard's 429 (the refusal flood's reference).
NGINX_REFUSING_CONF = (
    _NGINX_COMMON
    + """\
    server {
        listen 127.0.0.1:%(port)d backlog=4096;
        location / {
            default_type application/json;
            add_header Retry-After 1 always;
            return 429 '%(body)s';
        }
    }
}
"""
)

REFUSAL_BODY = (
    '{"error":{"message":"Too many requests","type":"TooManyRequestsError",'
    '"param":null,"code":429}}'
)
REFUSAL_CONNECTIONS = 32
#: The column of bench/naive_proxy.py: what trio and h11 alone allow, the guard's floor.
FLOOR = "trio+h11 floor"
#: ``--admin-viewer``'s column, and the token its guard's admin plane wants.
STALLED_VIEWER = "guard + stalled viewer"
ADMIN_TOKEN = "bench-admin-token"


def _admin_viewers(port: int) -> int:
    """How many viewers the guard's admin plane has now (-1 when it cannot be read)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/admin/state",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return int(json.loads(answer.read())["viewers"])
    except (OSError, ValueError, KeyError):
        return -1


Results = dict[str, dict[str, float]]
Target = Callable[["Plan", subprocess.Popen[Any], int], Results]


class Setup:
    """Cores, the POST generator, and how each target in front of the backend is started.

    ``columns`` are the targets in table order, ``direct`` first; ``targets`` starts each of the
    others and runs every phase through it. A target that cannot start is dropped with a line in
    ``notes``, never failing the run.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.pinning = len(cores) > 1
        self.guard_cores = set(cores[:1])
        self.client_cores = set(cores[1:]) or set(cores)
        self.client_pinned = pin(0, self.client_cores) if self.pinning else "not pinned"
        self.guard_pinned = "not pinned"
        self.wrk = shutil.which("wrk") if args.generator != "builtin" else None
        self.notes: list[str] = []
        if self.wrk:
            self.generator = f"wrk ({self.wrk}), 1 thread, Lua script for the body and percentiles"
        else:
            self.generator = "built-in asyncio keep-alive client in the benchmark process"
            if args.generator != "builtin":
                self.generator += " (wrk is not installed)"
                self.notes.append("wrk: not installed (Debian: apt-get install wrk)")
        self.request_headers: tuple[tuple[str, str], ...] = ()
        self.loose_events = False
        self.backend_args: list[str] = []
        self.columns = ["direct", "guard static"]
        if not getattr(args, "no_dynamic", True):
            self.columns.append("guard dynamic")
        self.targets: dict[str, Target] = {
            mode: functools.partial(self.through_guard, mode) for mode in self.columns[1:]
        }
        if getattr(args, "admin_viewer", False):
            self.columns.append(STALLED_VIEWER)
            self.targets[STALLED_VIEWER] = self.through_guard_with_stalled_viewer
        self.admin_port = 0
        self.refusals: dict[str, Results] = {}
        self.nginx: str | None = None
        if not getattr(args, "no_floor", True):
            # The floor of the guard's own stack (bench/naive_proxy.py): trio and h11, nothing else.
            self.columns.append(FLOOR)
            self.targets[FLOOR] = self.through_floor
        if not getattr(args, "no_nginx", True):
            self.nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
            if self.nginx:
                self.columns.append("nginx")
                self.targets["nginx"] = self.through_nginx
            else:
                self.notes.append(
                    "nginx: skipped, not installed (Debian: apt-get install nginx-light)"
                )

    def guard_env(self, mode: str, backend_port: int) -> dict[str, str]:
        keep = ("PATH", "HOME", "PYTHONPATH", "LANG")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(GUARD_ENV, UPSTREAM=f"http://127.0.0.1:{backend_port}")
        if mode == "guard refusing":
            env.update(GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0")
        if mode == STALLED_VIEWER:
            self.admin_port = free_port()
            env.update(
                PIG_ADMIN_LISTEN=f"127.0.0.1:{self.admin_port}",
                TOKEN=ADMIN_TOKEN,
                API_AUTH_ENABLED="false",
            )
        if mode in ("guard dynamic", STALLED_VIEWER):
            env.update(
                DYNAMIC_PIG_ENABLED="true",
                DYNAMIC_PIG_ENFORCE="false",
                DYNAMIC_METRICS_URL=f"http://127.0.0.1:{backend_port}/metrics",
            )
        return env

    def guard_command(self, mode: str) -> list[str]:
        command = [sys.executable, "-m", "guard_trio", "serve"]
        if getattr(self.args, "profile_guard", None):
            directory = Path(self.args.profile_guard)
            directory.mkdir(parents=True, exist_ok=True)
            out = directory / f"{mode.replace(' ', '-')}.prof"
            command[1:2] = ["-m", "cProfile", "-o", str(out), "-m"]
        return command

    @contextlib.contextmanager
    def running_guard(self, mode: str, backend_port: int) -> Iterator[tuple[int, int]]:
        """A guard in ``mode`` in front of the backend, pinned: (its port, its pid). On the way
        out it is stopped with SIGTERM (it drains, then exits and writes its profile, if any)."""
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
                yield wait_for_port(log, guard), guard.pid
                guard.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    guard.wait(timeout=10)

    @contextlib.contextmanager
    def running_nginx(self, conf_text: str, **fields: object) -> Iterator[tuple[int, int]]:
        """nginx with ``conf_text`` (``%`` fields: ``dir``, ``port`` and ``fields``), pinned to
        the guard's core: (its port, its pid)."""
        assert self.nginx is not None
        with tempfile.TemporaryDirectory() as scratch:
            port = free_port()
            conf = Path(scratch) / "nginx.conf"
            conf.write_text(conf_text % {"dir": scratch, "port": port, **fields})
            log = Path(scratch) / "error.log"
            command = [self.nginx, "-p", scratch, "-c", str(conf), "-e", str(log)]
            cores = self.guard_cores if self.pinning else None
            with process(
                command, cores=cores, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            ) as nginx:
                wait_until_listening(port, nginx, 15, log)
                yield port, nginx.pid

    def through_guard(
        self, mode: str, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> Results:
        with self.running_guard(mode, backend_port) as (port, pid):
            return run_target(
                plan, port, backend_port, {"backend": backend.pid, "guard": pid}, self
            )

    def through_guard_with_stalled_viewer(
        self, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> Results:
        """The dynamic guard with a viewer of its admin stream that never reads: the proxy must
        not wait on it (the viewer is dropped once its buffer is full)."""
        with self.running_guard(STALLED_VIEWER, backend_port) as (port, pid):
            url = f"ws://127.0.0.1:{self.admin_port}/admin/events"
            viewer = [sys.executable, str(Path(__file__).with_name("bench_admin.py"))]
            viewer += ["--as-viewers", url, "0", "1", "3600"]
            with process(viewer, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
                deadline = time.monotonic() + 10
                while _admin_viewers(self.admin_port) < 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                results = run_target(
                    plan, port, backend_port, {"backend": backend.pid, "guard": pid}, self
                )
                left = _admin_viewers(self.admin_port)
                self.notes.append(
                    f"{STALLED_VIEWER}: the viewer that never reads was "
                    + ("dropped by the end" if left == 0 else f"still attached ({left} viewer)")
                )
            return results

    def through_nginx(
        self, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> Results:
        with self.running_nginx(NGINX_CONF, backend_port=backend_port) as (port, pid):
            return run_target(
                plan, port, backend_port, {"backend": backend.pid, "guard": pid}, self
            )

    def through_floor(
        self, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> Results:
        command = [sys.executable, str(Path(__file__).with_name("naive_proxy.py"))]
        with tempfile.TemporaryDirectory() as scratch:
            log = Path(scratch) / "floor.log"
            with (
                log.open("wb") as log_file,
                process([*command, str(backend_port)], stdout=log_file, stderr=log_file) as floor,
            ):
                if self.pinning:
                    pin(floor.pid, self.guard_cores)
                port = wait_for_port(log, floor)
                pids = {"backend": backend.pid, "guard": floor.pid}
                return run_target(plan, port, backend_port, pids, self)

    def backend_command(self) -> list[str]:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-backend"]
        return [*command, "--interval-ms", str(self.args.interval_ms), *self.backend_args]

    def measure(self, plan: Plan) -> dict[str, Results]:
        all_runs: dict[str, list[Results]] = {c: [] for c in self.columns}
        with process(self.backend_command(), stdout=subprocess.PIPE, text=True) as backend:
            if self.pinning:
                pin(backend.pid, self.client_cores)
            assert backend.stdout is not None
            backend_port = int(backend.stdout.readline().rpartition(":")[2])
            for _ in range(self.args.runs):
                pids = {"backend": backend.pid}
                all_runs["direct"].append(run_target(plan, backend_port, backend_port, pids, self))
                for column in self.columns[1:]:
                    if column not in all_runs:
                        continue
                    try:
                        all_runs[column].append(self.targets[column](plan, backend, backend_port))
                    except Exception as exc:  # a target that fails is dropped, never the run
                        reason = str(exc).strip().splitlines() or [type(exc).__name__]
                        self.notes.append(f"{column}: skipped, it failed: {reason[0][:300]}")
                        del all_runs[column]
            self.refusals = self.measure_refusals(plan, backend, backend_port)
        self.columns = [c for c in self.columns if c in all_runs]
        return {column: combine(runs) for column, runs in all_runs.items()}

    def measure_refusals(
        self, plan: Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> dict[str, Results]:
        """The refusal flood: every request answered 429 by the guard (static, GLOBAL_LIMIT=0,
        no wait), and by nginx answering the same 429 itself, for reference."""
        if not plan.post or self.wrk is None or getattr(self.args, "no_refusals", True):
            return {}
        refusals: dict[str, Results] = {}

        def flood(port: int, pids: dict[str, int]) -> dict[str, float]:
            assert self.wrk is not None
            measured = wrk_post(
                self.wrk,
                port,
                connections=REFUSAL_CONNECTIONS,
                seconds=plan.post_seconds,
                pids=pids,
                cores=self.client_cores,
                count=True,
            )
            if measured is None:
                raise RuntimeError("wrk's output could not be read")
            cpu = measured["guard_cpu_s"]
            measured["guard_per_cpu_s"] = measured["refused"] / cpu if cpu > 0 else math.nan
            measured["closed_per_1k"] = 1000 * measured["closed"] / max(measured["requests"], 1)
            measured["not_refused"] = measured["requests"] - measured["refused"]
            return measured

        try:
            with self.running_guard("guard refusing", backend_port) as (port, pid):
                refusals["guard refusing"] = {"flood": flood(port, {"guard": pid})}
            if self.nginx:
                with self.running_nginx(NGINX_REFUSING_CONF, body=REFUSAL_BODY) as (port, pid):
                    refusals["nginx refusing"] = {"flood": flood(port, {"guard": pid})}
        except Exception as exc:  # a failed flood is a note, never the run
            self.notes.append(f"refusal flood: skipped, it failed: {str(exc)[:300]}")
        return refusals


def tool_version(command: list[str]) -> str:
    """The first line ``command`` prints (to stdout or stderr), or '' if it cannot run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (
        (done.stdout + done.stderr).strip().splitlines()[0]
        if (done.stdout + done.stderr).strip()
        else ""
    )


def print_header(setup: Setup, plan: Plan, title: str, header: dict[str, float]) -> None:
    """What every table of this file and of bench_peers.py stands on: builds, cores, load."""
    args = setup.args
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    print(f"{title} ({name} mode, {args.runs} run(s), {header['elapsed']:.0f} s)")
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
        f"{len(ANSWER)}-byte JSON answer; connections: "
        + ", ".join(str(n) for _, n, _ in plan.post_phases())
    )
    event = PEER_EVENT if setup.loose_events else EVENT
    print(
        f"streams: one {len(event % (0, 0.0))}-byte event per stream every "
        f"{args.interval_ms:g} ms, all streams in one burst; {plan.stream_seconds:g} s measured "
        f"after {plan.settle_s:g} s settling"
    )


def report(setup: Setup, plan: Plan, results: dict[str, Results], header: dict[str, float]) -> None:
    print_header(setup, plan, "bench_proxy", header)
    print("guard static: DYNAMIC_PIG_ENABLED=false GLOBAL_LIMIT=100000")
    if "guard dynamic" in setup.columns:
        print(
            "guard dynamic: DYNAMIC_PIG_ENABLED=true DYNAMIC_PIG_ENFORCE=false GLOBAL_LIMIT=100000"
            " (the learner polls the backend's /metrics, a real idle vLLM 0.10 page, every"
            " second; the gate keeps GLOBAL_LIMIT)"
        )
    if "nginx" in setup.columns and setup.nginx:
        version = tool_version([setup.nginx, "-v"]).removeprefix("nginx version: ")
        print(
            f"nginx: {version or setup.nginx}, plain reverse proxy, one process pinned to the"
            " guard's core, proxy_http_version 1.1, upstream keepalive, proxy_buffering off;"
            " its rows named 'guard' describe that nginx process"
        )
    if FLOOR in setup.columns:
        print(
            f"{FLOOR}: bench/naive_proxy.py, trio and h11 both ways and nothing else (no"
            " admission, routing, accounting, timeouts or disconnect watch), pinned to the"
            " guard's core: the most the guard's stack allows on this machine"
        )
    for note in setup.notes:
        print(f"SKIP {note}" if "skipped" in note or "not installed" in note else note)
    print()
    if plan.post:
        print("\n".join(table("Small non-streaming POST", setup.columns, results, post_rows(plan))))
    if setup.refusals:
        print()
        columns = list(setup.refusals)
        print("\n".join(table("Refusal flood", columns, setup.refusals, refusal_rows())))
    for streams in plan.streams:
        title = f"SSE streaming, {streams} streams x {plan.rate:g} events/s"
        print()
        print("\n".join(table(title, setup.columns, results, stream_rows(streams))))


def measure_with_load(setup: Setup, plan: Plan) -> tuple[dict[str, Results], dict[str, float]]:
    """``setup.measure(plan)``, with what every table's header says of it: how long it took and
    the load average before and after."""
    started, load_before = time.monotonic(), os.getloadavg()[0]
    results = setup.measure(plan)
    header = {
        "elapsed": time.monotonic() - started,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    return results, header


def raise_file_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the children


def main() -> int:
    args = parse_args()
    if args.serve_backend:
        return serve_backend(
            args.interval_ms, peer_events=args.peer_events, model_path=args.model_path
        )
    raise_file_limit()
    plan = Plan(args)
    setup = Setup(args)
    results, header = measure_with_load(setup, plan)
    report(setup, plan, results, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
