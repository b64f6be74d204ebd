"""Bounded soak of the real guard with conservation checks (``nox -s soak``; catalogue row T41).

Reads: its flags only. Starts two subprocesses on 127.0.0.1, both of this interpreter: the
simulated vLLM (``python -m guard_trio sim-backend``) and the guard in front of it
(``python -m guard_trio serve``, dynamic mode, bearer token), and stops both before it exits.

Each round runs mixed load for ``--round-seconds``: streaming and non-streaming chat requests,
one in five premium, from as many concurrent clients as 70 % of the guard's published cap
(read from its ``/pig/metrics`` at the start of the round, at most ``--max-clients``), each
request on its own connection and carrying its own ``X-Request-Id``. The fault mix, at fixed
points of every round:

- client disconnects: 5 % of requests go away on purpose in a random phase (mid-body, before
  the response head, after it, mid-stream), half with FIN and half with RST;
- metrics failures: the backend's ``/metrics`` answers 500 for 15 % of the round;
- cap swings: for 20 % of the round the engine runs twice as slow and the load surges to 150 %
  of the cap, so the learned cap moves down and 429s appear (a static limit cannot be changed
  on a live guard, so the learned one is swung instead);
- an upstream crash: the backend is SIGKILLed at 65 % of the round, mid-stream for whatever is
  in flight, and restarted on the same port half a second later.

Per round one table row: requests sent; terminal outcomes by class (200, 429, other status,
cut = the connection closed before the response ended, abort = we went away on purpose);
``bad``, the requests without exactly one terminal outcome (a request still unresolved after
``--request-timeout`` counts here); the guard's in-flight, queue and rewrite-slot gauges 2 s
after the round; its open fds, split into upstream sockets (the keep-alive pool) and the rest;
sockets in CLOSE_WAIT towards the backend (``upCW``: idle pool sockets the backend closed, which
the pool drops only when it next takes one or after its idle timeout) and on the listening port
(``clwait``); RSS. Criteria, checked at the end (exit status 1
when any fails): ``bad`` is 0 in every round; every gauge is 0; fds other than the upstream pool
stay within the first round's count +3 and the downstream CLOSE_WAIT count is 0; the RSS slope
over the rounds after warm-up (from round 5 when there are at least 8 rounds, else from round
2) is at most 1 MiB per round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import IO

import attrs
import h11
import psutil  # type: ignore[import-untyped, import-not-found, unused-ignore]
import trio

TOKEN = "soak-token"
HOST = "127.0.0.1"
GAUGES = (
    "pig_inflight",
    "pig_tier_inflight",
    "pig_backend_inflight",
    "pig_queue_current",
    "pig_tier_waiting",
    "pig_backend_priority_rewrite_inflight",
    "pig_json_classifier_inflight",
)
ABORT_PHASES = ("mid_body", "before_head", "after_head", "mid_stream")
MIB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


# -- tiny HTTP helpers (one connection per call) --------------------------------------------------


async def _get(port: int, path: str, *, auth: bool = False, timeout_s: float = 5.0) -> bytes:
    return await _exchange(port, b"GET", path, b"", auth=auth, timeout_s=timeout_s)


async def _exchange(
    port: int, method: bytes, path: str, body: bytes, *, auth: bool = False, timeout_s: float = 5.0
) -> bytes:
    """Status line and body of one small exchange; raises OSError-like errors on failure."""
    headers = [("host", f"{HOST}:{port}"), ("connection", "close")]
    if auth:
        headers.append(("authorization", f"Bearer {TOKEN}"))
    if body:
        headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
    conn = h11.Connection(h11.CLIENT)
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            data = conn.send(h11.Request(method=method, target=path, headers=headers))
            data += conn.send(h11.Data(data=body)) if body else b""
            await stream.send_all(data + conn.send(h11.EndOfMessage()))
            out = b""
            status = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    out += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
    if status != 200:
        raise OSError(f"{method.decode()} {path}: status {status}")
    return out


_SAMPLE = re.compile(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def _sums(page: bytes) -> dict[str, float]:
    """Each metric name's values added over its label sets."""
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(page):
        try:
            out[name.decode()] = out.get(name.decode(), 0.0) + float(value)
        except ValueError:
            continue
    return out


# -- the two subprocesses --------------------------------------------------------------------------


@attrs.define
class Child:
    """A subprocess of this interpreter, its output in a log file."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cpu: int | None
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    def start(self) -> None:
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "guard_trio", *self.argv],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        if self.cpu is not None:
            os.sched_setaffinity(self.proc.pid, {self.cpu})

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None
        return self.proc.returncode


async def _wait_ready(port: int, path: str, child: Child, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while True:
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.argv[0]} exited early; see {child.log_path}")
            try:
                await _get(port, path, timeout_s=1.0)
                return
            except (OSError, trio.TooSlowError, h11.ProtocolError):
                await trio.sleep(0.1)


# -- the load --------------------------------------------------------------------------------------


@attrs.define
class Ledger:
    """Every request id with the terminal outcomes it got (exactly one is right)."""

    outcomes: dict[int, list[str]] = attrs.Factory(dict)
    next_id: int = 0

    def new(self) -> int:
        self.next_id += 1
        self.outcomes[self.next_id] = []
        return self.next_id

    def end(self, rid: int, outcome: str) -> None:
        self.outcomes[rid].append(outcome)


class Aborted(Exception):
    """We went away on purpose."""


def _abort(stream: trio.SocketStream, rng: random.Random) -> None:
    if rng.random() < 0.5:  # RST instead of FIN
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raise Aborted


async def _request(
    port: int, rid: int, *, streaming: bool, premium: bool, abort: str | None, rng: random.Random
) -> str:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "soak " * rng.randint(5, 60)}],
            "stream": streaming,
            "max_tokens": rng.randint(8, 64),
        }
    ).encode()
    headers = [
        ("host", f"{HOST}:{port}"),
        ("authorization", f"Bearer {TOKEN}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("x-request-id", f"soak-{rid}"),
        ("x-user-tier", "premium" if premium else "basic"),
    ]
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(HOST, port)
    try:
        head = conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
        if abort == "mid_body":
            await stream.send_all(head + conn.send(h11.Data(data=body[: len(body) // 2])))
            await trio.sleep(rng.uniform(0, 0.2))
            _abort(stream, rng)
        await stream.send_all(head + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        if abort == "before_head":
            with trio.move_on_after(rng.uniform(0, 0.5)):
                await trio.sleep_forever()
            _abort(stream, rng)
        status = 0
        events_seen = 0
        stop_after = rng.randint(1, 12)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if status and abort == "mid_stream" and data:
                    events_seen += data.count(b"\n\n")
                    if events_seen >= stop_after:
                        _abort(stream, rng)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                if abort == "after_head":
                    _abort(stream, rng)
            elif isinstance(event, h11.EndOfMessage):
                return "200" if status == 200 else "429" if status == 429 else "other"
            elif isinstance(event, h11.ConnectionClosed):
                return "cut"
    except Aborted:
        return "abort"
    except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return "cut"
    finally:
        await trio.aclose_forcefully(stream)


@attrs.define
class Load:
    port: int
    ledger: Ledger
    rng: random.Random
    request_timeout_s: float
    abort_share: float = 0.05
    surge: bool = False
    hung: int = 0

    async def one(self) -> None:
        rid = self.ledger.new()
        streaming = self.rng.random() < 0.6
        premium = self.rng.random() < 0.2
        abort = self.rng.choice(ABORT_PHASES) if self.rng.random() < self.abort_share else None
        if abort == "mid_stream" and not streaming:
            abort = "after_head"
        rng = random.Random(self.rng.random())
        with trio.move_on_after(self.request_timeout_s) as scope:
            try:
                outcome = await _request(
                    self.port, rid, streaming=streaming, premium=premium, abort=abort, rng=rng
                )
            except OSError:  # could not even connect
                outcome = "cut"
            self.ledger.end(rid, outcome)
        if scope.cancelled_caught:
            self.hung += 1  # no terminal outcome: counted as bad
        elif outcome == "429":  # back off as a client honouring Retry-After would
            await trio.sleep(self.rng.uniform(0.5, 1.0))

    async def worker(self, index: int, base: int, deadline: float) -> None:
        while trio.current_time() < deadline:
            if index >= base and not self.surge:
                await trio.sleep(0.05)
                continue
            await self.one()


# -- rounds ----------------------------------------------------------------------------------------


@attrs.define
class Row:
    round: int
    cap: float
    clients: int
    sent: int
    outcomes: Counter[str]
    bad: int
    gauges: dict[str, float]
    fds: int
    upstream_fds: int
    close_wait: int
    upstream_close_wait: int
    rss: int


@attrs.define
class Soak:
    args: argparse.Namespace
    guard_port: int
    backend_port: int
    backend: Child
    guard: Child
    rng: random.Random

    async def control(self, command: dict[str, object]) -> None:
        # The backend may be down (the crash window): the fault then simply does not apply.
        with contextlib.suppress(OSError, trio.TooSlowError, h11.ProtocolError):
            await _exchange(
                self.backend_port, b"POST", "/sim/control", json.dumps(command).encode()
            )

    async def guard_page(self) -> dict[str, float]:
        return _sums(await _get(self.guard_port, "/pig/metrics", auth=True))

    async def crash_backend(self) -> None:
        await trio.to_thread.run_sync(self.backend.kill)
        await trio.sleep(0.5)
        self.backend.start()
        await _wait_ready(self.backend_port, "/health", self.backend)

    async def faults(self, load: Load, seconds: float) -> None:
        start = trio.current_time()

        async def at(fraction: float) -> None:
            await trio.sleep_until(start + fraction * seconds)

        await at(0.10)
        await self.control({"metrics_fail": True})
        await at(0.25)
        await self.control({"metrics_fail": False})
        await at(0.35)
        await self.control({"slow_down": 2.0})
        load.surge = True
        await at(0.55)
        load.surge = False
        await self.control({"reset_faults": True})
        await at(0.65)
        await self.crash_backend()

    def resources(self) -> tuple[int, int, int, int, int]:
        """Open fds, upstream sockets, CLOSE_WAIT sockets on the listening port and upstream,
        RSS bytes."""
        assert self.guard.proc is not None
        process = psutil.Process(self.guard.proc.pid)
        connections = process.net_connections(kind="tcp")
        upstream = sum(1 for c in connections if c.raddr and c.raddr[1] == self.backend_port)
        close_wait = sum(
            1
            for c in connections
            if c.laddr and c.laddr[1] == self.guard_port and c.status == psutil.CONN_CLOSE_WAIT
        )
        upstream_close_wait = sum(
            1
            for c in connections
            if c.raddr and c.raddr[1] == self.backend_port and c.status == psutil.CONN_CLOSE_WAIT
        )
        rss = process.memory_info().rss
        return process.num_fds(), upstream, close_wait, upstream_close_wait, rss

    async def round(self, number: int, ledger: Ledger) -> Row:
        page = await self.guard_page()
        cap = page.get("pig_dynamic_global_limit", 0.0)
        base = max(2, min(self.args.max_clients, round(0.7 * cap)))
        surge = max(base + 1, min(self.args.max_clients * 2, round(1.5 * cap)))
        load = Load(self.guard_port, ledger, self.rng, self.args.request_timeout)
        first_id = ledger.next_id + 1
        seconds = self.args.round_seconds
        deadline = trio.current_time() + seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.faults, load, seconds)
            for index in range(surge):
                nursery.start_soon(load.worker, index, base, deadline)
        await trio.sleep(2.0)
        page = await self.guard_page()
        fds, upstream, close_wait, upstream_close_wait, rss = await trio.to_thread.run_sync(
            self.resources
        )
        ids = range(first_id, ledger.next_id + 1)
        outcomes: Counter[str] = Counter()
        bad = 0
        for rid in ids:
            got = ledger.outcomes[rid]
            bad += len(got) != 1
            outcomes.update(got)
        return Row(
            round=number,
            cap=cap,
            clients=base,
            sent=len(ids),
            outcomes=outcomes,
            bad=bad,
            gauges={name: page.get(name, 0.0) for name in GAUGES},
            fds=fds,
            upstream_fds=upstream,
            close_wait=close_wait,
            upstream_close_wait=upstream_close_wait,
            rss=rss,
        )


HEADER = (
    f"{'round':>5} {'cap':>5} {'cli':>4} {'sent':>6} {'200':>6} {'429':>5} {'other':>5}"
    f" {'cut':>5} {'abort':>5} {'bad':>4} {'infl':>4} {'queue':>5} {'rwslot':>6}"
    f" {'fds':>5} {'upfds':>5} {'upCW':>4} {'clwait':>6} {'rss MiB':>8}"
)


def _format(row: Row) -> str:
    g = row.gauges
    inflight = max(g["pig_inflight"], g["pig_tier_inflight"], g["pig_backend_inflight"])
    queue = max(g["pig_queue_current"], g["pig_tier_waiting"])
    slots = g["pig_backend_priority_rewrite_inflight"] + g["pig_json_classifier_inflight"]
    o = row.outcomes
    return (
        f"{row.round:>5} {row.cap:>5.0f} {row.clients:>4} {row.sent:>6} {o['200']:>6}"
        f" {o['429']:>5} {o['other']:>5} {o['cut']:>5} {o['abort']:>5} {row.bad:>4}"
        f" {inflight:>4.0f} {queue:>5.0f} {slots:>6.0f} {row.fds:>5} {row.upstream_fds:>5}"
        f" {row.upstream_close_wait:>4} {row.close_wait:>6} {row.rss / MIB:>8.1f}"
    )


def _slope(values: list[float]) -> float | None:
    """Least-squares slope per step, or None with fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def verdict(rows: list[Row], hung: int) -> list[str]:
    """The failed criteria, one line each (empty: all passed)."""
    failures = []
    if hung:
        failures.append(f"{hung} requests got no terminal outcome within the request timeout")
    base_fds = rows[0].fds - rows[0].upstream_fds
    for row in rows:
        if row.bad:
            failures.append(f"round {row.round}: {row.bad} requests without exactly one outcome")
        busy = {k: v for k, v in row.gauges.items() if v != 0}
        if busy:
            failures.append(f"round {row.round}: gauges not back to 0 after 2 s: {busy}")
        other_fds = row.fds - row.upstream_fds
        if other_fds > base_fds + 3:
            failures.append(
                f"round {row.round}: {other_fds} non-upstream fds, round 1 had {base_fds} (+3)"
            )
        if row.close_wait:
            failures.append(f"round {row.round}: {row.close_wait} downstream CLOSE_WAIT sockets")
    slope = _slope([r.rss / MIB for r in rows[_warm_up(len(rows)) :]])
    if slope is not None and slope > 1.0:
        failures.append(f"RSS slope {slope:.2f} MiB/round after warm-up (limit 1)")
    return failures


def _warm_up(rounds: int) -> int:
    return 4 if rounds >= 8 else 1


async def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    guard_port, backend_port = _free_port(), _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    pin = args.pin and (os.cpu_count() or 1) >= 2
    backend = Child(
        argv=[
            "sim-backend",
            "--port",
            str(backend_port),
            "--seed",
            str(args.seed),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--mean-output",
            "32",
            "--keep-alive",
            "2",
        ],
        env=dict(os.environ),
        log_path=workdir / "backend.log",
        cpu=1 if pin else None,
    )
    guard = Child(
        argv=["serve"],
        env={
            **os.environ,
            "LISTEN": f"{HOST}:{guard_port}",
            "UPSTREAM": f"http://{HOST}:{backend_port}",
            "DYNAMIC_METRICS_URL": f"http://{HOST}:{backend_port}/metrics",
            "DYNAMIC_POLL_INTERVAL_MS": "250",
            "TOKEN": TOKEN,
            "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
            "PIG_DRAIN_SECONDS": "5",
        },
        log_path=workdir / "guard.log",
        cpu=0 if pin else None,
    )
    if pin:
        os.sched_setaffinity(0, {1})
    runner = Soak(args, guard_port, backend_port, backend, guard, rng)
    rows: list[Row] = []
    ledger = Ledger()
    hung = 0
    print(
        f"soak: {args.rounds} rounds x {args.round_seconds:g} s, guard :{guard_port}"
        f"{' (CPU 0)' if pin else ''}, sim-backend :{backend_port}, logs in {workdir}",
        flush=True,
    )
    try:
        backend.start()
        await _wait_ready(backend_port, "/health", backend)
        guard.start()
        await _wait_ready(guard_port, "/healthz", guard)
        # Warm-up: light load for a few seconds so that the cap is learned before round 1.
        warm = Load(guard_port, Ledger(), rng, args.request_timeout, abort_share=0.0)
        until = trio.current_time() + min(5.0, args.round_seconds)
        async with trio.open_nursery() as nursery:
            for index in range(4):
                nursery.start_soon(warm.worker, index, 4, until)
        print(HEADER, flush=True)
        for number in range(1, args.rounds + 1):
            row = await runner.round(number, ledger)
            rows.append(row)
            print(_format(row), flush=True)
        hung = sum(1 for got in ledger.outcomes.values() if not got)
    finally:
        guard_status = await trio.to_thread.run_sync(guard.stop)
        await trio.to_thread.run_sync(backend.kill)
    failures = verdict(rows, hung) if rows else ["no round ran"]
    if guard_status != 0:
        failures.append(f"the guard exited with status {guard_status} on SIGTERM")
    if "Traceback" in (workdir / "guard.log").read_text(errors="replace"):
        failures.append(f"a traceback in the guard's log ({workdir / 'guard.log'})")
    slope = _slope([r.rss / MIB for r in rows[_warm_up(len(rows)) :]])
    fd_slope = _slope([float(r.fds - r.upstream_fds) for r in rows[_warm_up(len(rows)) :]])
    totals: Counter[str] = Counter()
    for row in rows:
        totals.update(row.outcomes)
    print(
        f"total: {sum(r.sent for r in rows)} requests, {dict(sorted(totals.items()))};"
        f" RSS slope {'n/a' if slope is None else f'{slope:+.2f}'} MiB/round,"
        f" non-upstream fd slope {'n/a' if fd_slope is None else f'{fd_slope:+.2f}'}/round"
        " (after warm-up)"
    )
    for failure in failures:
        print(f"FAIL {failure}")
    print("soak: PASS" if not failures else "soak: FAIL")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--round-seconds", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the load and faults")
    parser.add_argument("--max-clients", type=int, default=40, help="cap on the base clients")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="simulated engine batch")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="per request (s)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin CPUs")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.round_seconds <= 0:
        parser.error("--rounds must be >= 1 and --round-seconds > 0")
    return trio.run(soak, args)


if __name__ == "__main__":
    sys.exit(main())
