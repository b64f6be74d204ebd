"""How many streamed tokens ``inference-guard sim-backend`` delivers per second of its own CPU.

Run: ``python bench/bench_sim_backend.py [--streams 512] [--rate 50] [--seconds 20]``.

The server runs as a subprocess pinned to one core (when ``os.sched_setaffinity`` exists); this
process, pinned to the other cores, opens ``--streams`` streaming chat requests at once with a
raw trio + h11 client and counts content chunks as they arrive. ``--speed`` is chosen so that one
engine step with every stream decoding lasts ``1 / --rate`` seconds, and each request asks for
``rate * seconds`` tokens. Measurements cover the window in which every stream is decoding (from
the last first token to the first end). Prints a table; asserts nothing. The goal
(PRODUCT.md): 512 streams at 50 tok/s on one core.

The gaps are those the client sees between reads that carried tokens. When the client itself is
saturated (its CPU share near 100 %), it reads less often than the server writes, tokens per read
rise above one and the gaps grow: they then describe the client, not the server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import h11
import trio

from guard_adapters.engine_model import PROFILES

ROOT = Path(__file__).resolve().parent.parent
TOKEN = b'"delta":{"content":'  # one per content chunk; the role chunk does not match
DONE = b"data: [DONE]"
PROMPT = "Benchmark prompt text: " + "word " * 40  # about 55 tokens by the 4-characters rule


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cores: set[int]) -> str:
    if not hasattr(os, "sched_setaffinity") or not cores:
        return "not pinned"
    os.sched_setaffinity(pid, cores)
    return "core " + ",".join(map(str, sorted(cores)))


class Progress:
    """Set ``all_started`` once every stream has its first token, ``one_ended`` at the first end."""

    def __init__(self, streams: int) -> None:
        self.waiting_for_first = streams
        self.all_started = trio.Event()
        self.one_ended = trio.Event()


class Stream:
    """One streaming request; arrival time of every read that carried tokens."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.first_at: float | None = None
        self.end_at: float | None = None
        self.arrivals: list[tuple[float, int]] = []


async def run_stream(port: int, body: bytes, record: Stream) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        headers = [
            ("host", "127.0.0.1"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        await stream.send_all(
            conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )
        # Read the head with h11, then count tokens in the raw bytes (chunk framing included):
        # the client must stay cheaper than the server it measures.
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            assert isinstance(event, h11.Response), event
            break
        carry = conn.trailing_data[0]
        arrivals = record.arrivals
        now = trio.current_time
        keep = len(TOKEN) - 1
        while True:
            data = carry + await stream.receive_some(262144)
            if len(data) == len(carry):
                break
            tokens = data.count(TOKEN)
            if tokens:
                at = now()
                if record.first_at is None:
                    record.first_at = at
                    record.progress.waiting_for_first -= 1
                    if not record.progress.waiting_for_first:
                        record.progress.all_started.set()
                arrivals.append((at, tokens))
            if DONE in data:
                record.end_at = now()
                record.progress.one_ended.set()
                break
            carry = data[-keep:]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def drive(port: int, streams: int, tokens: int, server_pid: int) -> dict[str, float]:
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    progress = Progress(streams)
    records = [Stream(progress) for _ in range(streams)]
    marks: dict[str, float] = {}

    async def watch() -> None:
        # CPU readings at the start and the end of the window in which all streams decode.
        await progress.all_started.wait()
        marks["cpu0"], marks["t0"] = cpu_seconds(server_pid), trio.current_time()
        marks["own0"] = cpu_seconds(os.getpid())
        await progress.one_ended.wait()
        marks["cpu1"], marks["t1"] = cpu_seconds(server_pid), trio.current_time()
        marks["own1"] = cpu_seconds(os.getpid())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        for record in records:
            nursery.start_soon(run_stream, port, body, record)

    t0, t1 = marks["t0"], marks["t1"]
    delivered = 0
    gaps: list[float] = []
    per_read: list[int] = []
    for record in records:
        previous: float | None = None
        for at, count in record.arrivals:
            if t0 <= at <= t1:
                delivered += count
                per_read.append(count)
                if previous is not None:
                    gaps.append(at - previous)
            previous = at
    window = t1 - t0
    return {
        "window_s": window,
        "tokens_per_s": delivered / window,
        "per_stream_tokens_per_s": delivered / window / streams,
        "gap_p50_ms": 1000 * percentile(gaps, 0.5),
        "gap_p99_ms": 1000 * percentile(gaps, 0.99),
        "gap_max_ms": 1000 * max(gaps, default=float("nan")),
        "tokens_per_read": statistics.fmean(per_read) if per_read else float("nan"),
        "server_cpu_share": (marks["cpu1"] - marks["cpu0"]) / window,
        "server_cpu_us_per_token": 1e6 * (marks["cpu1"] - marks["cpu0"]) / max(delivered, 1),
        "client_cpu_share": (marks["own1"] - marks["own0"]) / window,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream wanted")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each stream")
    parser.add_argument("--profile", default="a100-qwen2-7b")
    args = parser.parse_args()

    tokens = round(args.rate * args.seconds)
    profile = PROFILES[args.profile]
    context = len(PROMPT) // 4 + tokens // 2
    step_s = profile.decode_step_s(args.streams, args.streams * context)
    speed = step_s * args.rate
    command = [
        sys.executable,
        "-m",
        "guard_trio",
        "sim-backend",
        "--port",
        "0",
        "--profile",
        args.profile,
        "--max-num-seqs",
        str(args.streams),
        "--max-output",
        str(tokens),
        "--speed",
        f"{speed:.4f}",
    ]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) as server:
        try:
            server_pinned = pin(server.pid, set(cores[:1]))
            client_pinned = pin(0, set(cores[1:]) or set(cores))
            assert server.stdout is not None
            line = server.stdout.readline()
            port = int(line.split("http://")[1].split(" ")[0].rpartition(":")[2])
            result = trio.run(drive, port, args.streams, tokens, server.pid)
        finally:
            server.terminate()
            server.wait(timeout=10)

    print(
        f"sim-backend benchmark: {args.streams} streams x {tokens} tokens, profile {args.profile}"
    )
    python = f"{platform.python_implementation()} {platform.python_version()}"
    print(f"{python} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"server {server_pinned}, client {client_pinned}, engine speed x{speed:.2f}\n")
    rows = [
        ("measured window", f"{result['window_s']:.1f} s"),
        ("tokens delivered per second", f"{result['tokens_per_s']:,.0f}"),
        ("per stream", f"{result['per_stream_tokens_per_s']:.1f} tok/s (wanted {args.rate:g})"),
        ("gap between reads p50", f"{result['gap_p50_ms']:.1f} ms"),
        ("gap between reads p99", f"{result['gap_p99_ms']:.1f} ms"),
        ("gap between reads max", f"{result['gap_max_ms']:.1f} ms"),
        ("tokens per read", f"{result['tokens_per_read']:.2f}"),
        ("server CPU (share of one core)", f"{100 * result['server_cpu_share']:.0f} %"),
        ("server CPU per token", f"{result['server_cpu_us_per_token']:.1f} us"),
        ("client CPU (share of its cores)", f"{100 * result['client_cpu_share']:.0f} %"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
