# ruff: noqa: PLC0415 - each process imports only what its part needs
"""Which gRPC layer the endpoint picker runs on, measured: h2 under trio against grpcio's server in
worker threads, each handing every message to the same picker code in the trio thread.

Each variant runs in its own process: a guard (static cap, so no call waits) with its picker on
a free port. One client process (grpcio, C core) drives ``--streams`` concurrent ext_proc calls
for ``--seconds``: each call sends the request headers, reads the answer (the backend's name),
sends the response headers, reads the answer and half-closes, as Envoy does for one request.
Printed: calls per CPU-second of the picker's process, and the client's p50 and p99 call time.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def _environ(port: int) -> dict[str, str]:
    return {
        "UPSTREAM": "http://127.0.0.1:9",
        "DYNAMIC_PIG_ENABLED": "false",
        "GLOBAL_LIMIT": "100000",
        "LISTEN": "127.0.0.1:0",
        "PIG_EPP_LISTEN": f"127.0.0.1:{port}",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
    }


def serve_h2(port: int) -> None:
    import trio

    from guard_adapters.config import load_config
    from guard_trio._picker import serve_picker
    from guard_trio._server import GuardServer

    async def main() -> None:
        settings = load_config(_environ(port))
        server = GuardServer(settings)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_picker, server, *settings.epp_listen)
            print("ready", flush=True)

    trio.run(main)


class _CallAdapter:
    """The picker's Call, for a message handed over from a grpcio thread: it collects what the
    picker sends, for the thread to yield."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, message: bytes) -> None:
        self.sent.append(message)

    def finish(self, *_args: Any) -> None:
        self.closed = True

    def flush_soon(self) -> None:
        return None


def serve_grpcio(port: int) -> None:
    from concurrent import futures

    import grpc
    import trio

    from guard_adapters.config import load_config
    from guard_trio._picker import Picker
    from guard_trio._server import GuardServer

    async def main() -> None:
        settings = load_config(_environ(port))
        server = GuardServer(settings)
        picker = Picker(server)
        token = trio.lowlevel.current_trio_token()

        def process(requests: Iterator[bytes], _context: Any) -> Iterator[bytes]:
            call: Any = _CallAdapter()  # stands in for the picker's Call
            exchange = trio.from_thread.run_sync(picker.services()[PROCESS], trio_token=token)
            for message in requests:
                trio.from_thread.run_sync(exchange.on_message, call, message, trio_token=token)
                yield from call.sent
                call.sent.clear()
                if call.closed:
                    return
            trio.from_thread.run_sync(exchange.on_end, call, trio_token=token)

        handler = grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            {"Process": grpc.stream_stream_rpc_method_handler(process)},
        )
        grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        grpc_server.add_generic_rpc_handlers((handler,))
        grpc_server.add_insecure_port(f"127.0.0.1:{port}")
        grpc_server.start()
        print("ready", flush=True)
        await trio.sleep_forever()

    trio.run(main)


def _messages() -> tuple[bytes, bytes]:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

    def headers(pairs: list[tuple[str, str]]) -> Any:
        return ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            )
        )

    request = ext_proc.ProcessingRequest(
        request_headers=headers(
            [
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                (":authority", "guard"),
                ("content-type", "application/json"),
                ("content-length", "120"),
            ]
        )
    )
    response = ext_proc.ProcessingRequest(
        response_headers=headers([(":status", "200"), ("content-type", "text/event-stream")])
    )
    return request.SerializeToString(), response.SerializeToString()


def drive(port: int, streams: int, seconds: float) -> dict[str, float]:
    import grpc

    first, second = _messages()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    method = channel.stream_stream(PROCESS)
    stop = time.monotonic() + seconds
    times: list[float] = []
    lock = threading.Lock()

    def one_client() -> None:
        mine: list[float] = []
        while time.monotonic() < stop:
            started = time.perf_counter()
            answers = method(iter([first, second]))
            got = sum(1 for _ in answers)
            if got != 2:
                raise RuntimeError(f"expected 2 answers, got {got}")
            mine.append(time.perf_counter() - started)
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=one_client) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    times.sort()
    return {
        "calls": len(times),
        "p50_ms": 1000 * times[len(times) // 2],
        "p99_ms": 1000 * times[int(len(times) * 0.99)],
    }


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def measure(variant: str, streams: int, seconds: float) -> dict[str, float]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", variant, "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{variant} did not start")
        drive(port, streams, 1.0)  # warm up
        before = _cpu_of(server.pid)
        result = drive(port, streams, seconds)
        cpu = _cpu_of(server.pid) - before
    finally:
        server.kill()
        server.wait()
    result["cpu_s"] = cpu
    result["calls_per_cpu_s"] = result["calls"] / cpu if cpu > 0 else float("nan")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--serve", choices=("h2", "grpcio"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (serve_h2 if args.serve == "h2" else serve_grpcio)(args.port)
        return 0
    print(f"picker transport: {args.streams} concurrent calls for {args.seconds:.0f} s each")
    print("| gRPC layer | calls | picker CPU s | calls per picker CPU-second | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant, label in (("h2", "h2 under trio"), ("grpcio", "grpcio threads -> trio")):
        r = measure(variant, args.streams, args.seconds)
        print(
            f"| {label} | {r['calls']:.0f} | {r['cpu_s']:.2f} | {r['calls_per_cpu_s']:,.0f}"
            f" | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"(client CPU {usage.ru_utime + usage.ru_stime:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
