"""Admission control against the running proxy: rows T28, T29 and T30 of
../shared/spec/reliability.md.

T28: with a cap of 8 and the short wait on, 64 simultaneous requests to a backend that holds
each for 2 s never put a 9th request on the backend (its own concurrency, sampled every 10 ms
and counted exactly), and every request gets exactly one answer, 200 or 429.

T29: with the cap saturated and no wait, a request is refused from its head alone: the 429
comes back while the client has sent only a sliver of its 1 MiB body, nothing reads or parses
the body (counted), and the connection closes since body bytes remain unread. A burst of full
1 MiB requests is refused quickly.

T30: a Hypothesis state machine drives the real proxy (on a trio loop in a worker thread)
through random interleavings of streamed and plain requests, client aborts while queued,
before the response head or mid-stream, backend failures and completions, and cap changes.
After every step, once settled, the guard's slots in use equal the requests live on the
backend; at the end of each example everything is back to zero.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import h11
import pytest
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from guard_adapters.config import load_config
from guard_core import (
    DecisionPublished,
    DecisionSource,
    LimitReason,
    LoadState,
    PublishedDecision,
    apply_guard_event,
)
from guard_trio import _proxy
from guard_trio._server import GuardServer
from tests.integration.hostile.conftest import CountingUpstream

CHAT = "/v1/chat/completions"
MiB = 1024 * 1024


def chat_body(*, stream: bool = False, pad: int = 0) -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * pad}],
        "max_tokens": 8,
        "stream": stream,
    }
    return json.dumps(body).encode()


def _response(conn: h11.Connection, status: int, body: bytes) -> bytes:
    head = h11.Response(
        status_code=status,
        headers=[(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    )
    return b"".join(conn.send(e) or b"" for e in (head, h11.Data(data=body), h11.EndOfMessage()))


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await stream.receive_some(65536)
        conn.receive_data(data)  # b"" marks the end of the stream


# -- T28 -----------------------------------------------------------------------------------------


class HoldingBackend:
    """Holds every request for ``hold_s``; counts its concurrency exactly and by sampling."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.live = 0
        self.max_live = 0
        self.max_sampled = 0
        self.samples = 0
        self.served = 0

    async def script(self, stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = await _next_event(conn, stream)
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Request):
                upstream.requests += 1
                continue
            if not isinstance(event, h11.EndOfMessage):
                continue
            self.live += 1
            self.max_live = max(self.max_live, self.live)
            try:
                await trio.sleep(self.hold_s)
                await stream.send_all(_response(conn, 200, b'{"ok":true}'))
                self.served += 1
            finally:
                self.live -= 1
            if conn.our_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def sample(self) -> None:
        while True:
            self.max_sampled = max(self.max_sampled, self.live)
            self.samples += 1
            await trio.sleep(0.01)


async def test_t28_admission_never_exceeds_the_cap(
    start_upstream: Any, start_guard: Any, http: Any, nursery: trio.Nursery, figure: Any
) -> None:
    backend = HoldingBackend(hold_s=2.0)
    upstream = await start_upstream(backend.script)
    nursery.start_soon(backend.sample)
    base, server = await start_guard(
        {
            "UPSTREAM": upstream.base,
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "8",
            "PIG_QUEUE_WAIT_SECONDS": "0.5",
        }
    )
    replies: list[tuple[int, bytes | None, float]] = []
    problems: list[str] = []
    go = trio.Event()

    async def client(index: int) -> None:
        tier = "premium" if index % 2 else "basic"
        connection = await http.connect(base)
        try:
            await go.wait()
            started = time.perf_counter()
            reply = await connection.request(
                "POST", CHAT, [("X-User-Tier", tier)], chat_body(pad=64)
            )
            replies.append(
                (reply.status, reply.header("retry-after"), time.perf_counter() - started)
            )
            # Exactly one response: nothing else comes on the connection.
            with trio.move_on_after(0.05):
                extra = await connection.stream.receive_some(1024)
                if extra:
                    problems.append(f"{index}: bytes after the response: {extra[:40]!r}")
        finally:
            await connection.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as clients:
            for index in range(64):
                clients.start_soon(client, index)
            await trio.sleep(0.2)  # every connection open before the burst
            go.set()
        await wait_until(lambda: server.engine.state.gate.inflight == 0, 1.0)

    statuses = [status for status, _, _ in replies]
    ok = statuses.count(200)
    refused = [took for status, _, took in replies if status == 429]
    assert not problems, problems
    assert len(replies) == 64, statuses
    assert ok + len(refused) == 64, statuses
    assert backend.max_live <= 8
    assert backend.max_sampled <= 8
    assert ok >= 8  # the cap was used
    assert all(retry == b"1" for status, retry, _ in replies if status == 429)
    assert upstream.requests == ok == backend.served  # no refused request reached the backend
    gate = server.engine.state.gate
    assert (gate.inflight, gate.waiting) == (0, 0)
    figure(
        "T28",
        "64 requests, cap 8, 2 s hold, wait 0.5 s",
        f"max backend concurrency {backend.max_live} (sampled {backend.max_sampled}); "
        f"{ok} x 200 + {len(refused)} x 429",
        "max concurrency <= 8; 64 = 200s + 429s",
    )
    figure(
        "T28",
        "429 latency (after the short wait)",
        f"median {statistics.median(refused) * 1000:.0f} ms, max {max(refused) * 1000:.0f} ms",
        "429 within 50 ms (Q=8 model); here every waiter waits <= 0.5 s",
    )


async def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 - state owned by other tasks
            await trio.sleep(0.01)


# -- T29 -----------------------------------------------------------------------------------------


async def test_t29_refusal_is_decided_before_the_body_is_read(
    start_upstream: Any,
    start_guard: Any,
    http: Any,
    figure: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = HoldingBackend(hold_s=60.0)
    upstream = await start_upstream(backend.script)
    base, server = await start_guard(
        {
            "UPSTREAM": upstream.base,
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "1",
            "PIG_QUEUE_WAIT_SECONDS": "0",
            "CLASSIFY_OUTPUT_TOKENS": "true",
        }
    )
    parses = 0
    body_reads = 0
    real_intent = _proxy.output_token_intent  # type: ignore[attr-defined]
    real_read = server.app.read_body

    def counting_intent(*args: Any, **kwargs: Any) -> Any:
        nonlocal parses
        parses += 1
        return real_intent(*args, **kwargs)

    async def counting_read(*args: Any, **kwargs: Any) -> Any:
        nonlocal body_reads
        body_reads += 1
        return await real_read(*args, **kwargs)

    monkeypatch.setattr(_proxy, "output_token_intent", counting_intent)
    monkeypatch.setattr(server.app, "read_body", counting_read)

    holder = await http.connect(base)
    await holder.send_request("POST", CHAT, [], chat_body())
    await wait_until(lambda: backend.live == 1, 5.0)
    assert (parses, body_reads) == (1, 1)  # the admitted one was read and classified
    parses = body_reads = 0

    # A head announcing 1 MiB and only 1 KiB of it: the answer must not wait for the rest.
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MiB}\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    await stream.send_all(head + b"{" + b" " * 1023)
    received = b""
    with trio.move_on_after(5.0):
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            received += chunk
    early_s = time.perf_counter() - started
    await trio.aclose_forcefully(stream)
    assert received.startswith(b"HTTP/1.1 429 "), received[:200]
    assert b"\r\nconnection: close\r\n" in received.lower()
    assert b"retry-after: 1" in received.lower()
    assert early_s < 3.0  # the connection closed at once (within the bounded linger)
    figure("T29", "429 with 1 KiB of a 1 MiB body sent", f"{early_s * 1000:.1f} ms to close",
           "decided before the body is read")  # fmt: skip

    # A burst of full 1 MiB requests, 8 at a time, each client sending while it reads.
    payload = b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"' + (
        b"y" * (MiB - 80)
    )
    payload += b'"}]}'
    latencies: list[float] = []
    statuses: list[int | None] = []
    cpu_before = time.process_time()
    wall_before = time.perf_counter()

    async def one() -> None:
        client = await trio.open_tcp_stream(host, int(port))
        request = (
            f"POST {CHAT} HTTP/1.1\r\nHost: guard\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        sent_at = time.perf_counter()
        first: float | None = None
        data = b""

        async def send() -> None:
            # The guard closes after answering: a broken send is expected.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await client.send_all(request + payload)

        try:
            async with trio.open_nursery() as inner:
                inner.start_soon(send)
                with trio.move_on_after(10.0):
                    while True:
                        try:
                            chunk = await client.receive_some(65536)
                        except trio.BrokenResourceError:
                            break
                        if not chunk:
                            break
                        if first is None:
                            first = time.perf_counter() - sent_at
                        data += chunk
                inner.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(client)
        statuses.append(int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1") else None)
        if first is not None:
            latencies.append(first)

    with trio.fail_after(60):
        for _ in range(8):
            async with trio.open_nursery() as burst:
                for _ in range(8):
                    burst.start_soon(one)
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    assert statuses == [429] * 64, statuses
    assert (parses, body_reads) == (0, 0)
    assert upstream.requests == 1
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert p99 < 1.0  # generous: the catalogue asks 20 ms on a quiet core
    figure(
        "T29",
        "64 x 1 MiB while saturated, 8 concurrent",
        f"p50 {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; "
        f"0 parses, 0 body reads",
        "429 p99 <= 20 ms; 0 JSON parses",
    )
    figure(
        "T29",
        "CPU during the burst (client and guard)",
        f"{cpu:.2f} s CPU over {wall:.2f} s",
        "proxy CPU < 100 % of a core",
    )
    await holder.aclose()


# -- T30 -----------------------------------------------------------------------------------------

GLOBAL_LIMIT = 4


@attrs.define(eq=False)
class BackendRequest:
    """One request as the backend sees it."""

    client_id: int
    streaming: bool
    command: str = ""
    wake: trio.Event = attrs.field(factory=trio.Event)
    ended: bool = False


@attrs.define(eq=False)
class Client:
    client_id: int
    streaming: bool
    tier: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: sent, head, chunk, done, cut (the connection ended mid-response), aborted
    phase: str = "connecting"
    status: int | None = None
    responses: int = 0
    finished: bool = False


class World:
    """The guard, a scripted backend and the clients, on a trio loop in a worker thread."""

    def __init__(self) -> None:
        #: Every request the backend received, in order (a replay shows up twice).
        self.backend: list[BackendRequest] = []
        self.reached: set[int] = set()
        self.clients: dict[int, Client] = {}
        self.ids = 0
        self.problems: list[str] = []
        self.checks = 0
        self.replays = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._error: BaseException | None = None

    # -- lifecycle (called from the test thread) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError(f"the world did not start: {self._error!r}")

    def stop(self) -> None:
        if self._ready.is_set():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync) inside the loop: a consistent view of everything."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def run_async(self, afn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    async def _main(self) -> None:
        try:
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                self.upstream = CountingUpstream(self._backend_script)
                await nursery.start(self.upstream.serve)
                settings = load_config(
                    {
                        "LISTEN": "127.0.0.1:0",
                        "UPSTREAM": self.upstream.base,
                        "DYNAMIC_METRICS_URL": self.upstream.base + "/metrics",
                        "DYNAMIC_POLL_INTERVAL_MS": "3600000",
                        "GLOBAL_LIMIT": str(GLOBAL_LIMIT),
                        "PIG_QUEUE_WAIT_SECONDS": "0.5",
                        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
                    }
                )
                self.server = GuardServer(settings)
                host, port = await nursery.start(self.server.serve)
                self.host, self.port = host, port
                await wait_until(lambda: self.server.poller.rounds >= 1, 10)
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except BaseException as exc:  # reported by start()
            self._error = exc
            raise

    # -- the backend -----------------------------------------------------------------------------

    async def _backend_script(self, stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = await _next_event(conn, stream)
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                continue
            request = event
            while not isinstance(event, h11.EndOfMessage):
                event = await _next_event(conn, stream)
                if isinstance(event, h11.ConnectionClosed):
                    return
            if request.target == b"/metrics":  # the poll: answer nothing usable
                await stream.send_all(_response(conn, 503, b"no"))
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
                continue
            upstream.requests += 1
            headers = dict(request.headers)
            client_id = int(headers[b"x-test-id"])
            entry = BackendRequest(client_id, b"event-stream" in headers.get(b"accept", b""))
            if client_id in self.reached:
                self.replays += 1  # the guard sent it again on a fresh connection
            self.reached.add(client_id)
            self.backend.append(entry)
            try:
                keep = await self._serve_one(conn, stream, entry)
            finally:
                entry.ended = True
            if not keep:
                return
            conn.start_next_cycle()

    async def _serve_one(
        self, conn: h11.Connection, stream: trio.SocketStream, entry: BackendRequest
    ) -> bool:
        if entry.streaming:
            head = h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
            first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
            await stream.send_all(
                (conn.send(head) or b"") + (conn.send(h11.Data(data=first)) or b"")
            )
        async with trio.open_nursery() as watch:

            async def peer_closed() -> None:
                while await stream.receive_some(65536):
                    pass
                entry.command = "peer-closed"
                entry.wake.set()

            watch.start_soon(peer_closed)
            await entry.wake.wait()
            watch.cancel_scope.cancel()
        if entry.command == "complete":
            if entry.streaming:
                tail = conn.send(h11.Data(data=b"data: [DONE]\n\n")) or b""
                await stream.send_all(tail + (conn.send(h11.EndOfMessage()) or b""))
            else:
                await stream.send_all(_response(conn, 200, b'{"ok":true}'))
            return conn.our_state is h11.DONE
        return False  # failed, or the guard closed the connection: the script closes it

    def live_on_backend(self) -> int:
        return sum(not entry.ended for entry in self.backend)

    # -- the clients -----------------------------------------------------------------------------

    def start_client(self, streaming: bool, tier: str) -> Client:
        self.ids += 1
        client = Client(self.ids, streaming, tier)
        self.clients[client.client_id] = client
        self.nursery.start_soon(self._client, client)
        return client

    async def _client(self, client: Client) -> None:
        stream: trio.SocketStream | None = None
        with client.scope:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
                conn = h11.Connection(h11.CLIENT)
                body = chat_body(stream=client.streaming)
                headers = [
                    ("Host", "guard"),
                    ("Content-Length", str(len(body))),
                    ("X-Test-Id", str(client.client_id)),
                    ("X-User-Tier", client.tier),
                ]
                if client.streaming:
                    headers.append(("Accept", "text/event-stream"))
                request = h11.Request(method="POST", target=CHAT, headers=headers)
                await stream.send_all(
                    (conn.send(request) or b"")
                    + (conn.send(h11.Data(data=body)) or b"")
                    + (conn.send(h11.EndOfMessage()) or b"")
                )
                client.phase = "sent"
                while True:
                    event = await _next_event(conn, stream)
                    if isinstance(event, h11.Response):
                        client.responses += 1
                        client.status = event.status_code
                        client.phase = "head"
                    elif isinstance(event, h11.Data):
                        client.phase = "chunk"
                    elif isinstance(event, h11.EndOfMessage):
                        client.phase = "done"
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        client.phase = "cut"
                        break
            except (trio.BrokenResourceError, h11.RemoteProtocolError, OSError):
                client.phase = "cut"
            finally:
                if stream is not None:
                    await trio.aclose_forcefully(stream)
        if client.scope.cancelled_caught:
            client.phase = "aborted"
        client.finished = True

    def set_cap(self, cap: int) -> None:
        engine = self.server.engine
        decision = PublishedDecision(
            at=engine.seconds_since_start(),
            source=DecisionSource.METRICS,
            cap=cap,
            state=LoadState.GREEN,
            final_reason=LimitReason.THROUGHPUT,
            backend_count=1,
        )
        engine.state = apply_guard_event(engine.state, DecisionPublished(decision)).state
        engine.retry_waiters()  # waiters re-check, as after a poll

    def snapshot(self) -> tuple[int, int, int]:
        gate = self.server.engine.state.gate
        return gate.inflight, gate.waiting, self.live_on_backend()


class SlotAccounting(RuleBasedStateMachine):
    world: World

    def __init__(self) -> None:
        super().__init__()
        self.mine: list[Client] = []

    @initialize(
        cap=st.integers(1, GLOBAL_LIMIT),
        kinds=st.lists(
            st.tuples(st.booleans(), st.sampled_from(["basic", "premium"])), min_size=1, max_size=6
        ),
    )
    def open_intake(self, cap: int, kinds: list[tuple[bool, str]]) -> None:
        """A cap, and a first wave of requests (so that every example has traffic, whichever
        rules Hypothesis enables for it)."""
        self.world.run(self.world.set_cap, cap)
        self._start(kinds)

    # -- helpers ----------------------------------------------------------------------------------

    def _pick(self, index: int, phases: tuple[str, ...], *, at_backend: bool | None) -> Any:
        world = self.world

        def choose() -> Any:
            found = [
                c
                for c in self.mine
                if c.phase in phases
                and not c.finished
                and (at_backend is None or (c.client_id in world.reached) == at_backend)
            ]
            return found[index % len(found)] if found else None

        return world.run(choose)

    def _settle(self) -> tuple[int, int, int]:
        """Wait until the guard and the backend agree (two equal readings 20 ms apart)."""
        deadline = time.monotonic() + 3.0
        last: tuple[int, int, int] | None = None
        while True:
            now: tuple[int, int, int] = self.world.run(self.world.snapshot)
            if now[0] == now[2] and now == last:
                return now
            if time.monotonic() > deadline:
                message = f"slots {now[0]} != backend live {now[2]} (waiting {now[1]})"
                self.world.problems.append(message)
                raise AssertionError(message)
            last = now
            time.sleep(0.02)

    # -- rules ------------------------------------------------------------------------------------

    @rule(
        kinds=st.lists(
            st.tuples(st.booleans(), st.sampled_from(["basic", "premium"])), min_size=1, max_size=3
        )
    )
    def start_requests(self, kinds: list[tuple[bool, str]]) -> None:
        """One to three requests (streamed or not, either tier) arrive together."""
        self._start(kinds)

    def _start(self, kinds: list[tuple[bool, str]]) -> None:
        started = [self.world.run(self.world.start_client, *kind) for kind in kinds]
        self.mine.extend(started)
        world = self.world
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # until each is at the backend, answered or waiting
            if world.run(lambda: all(c.client_id in world.reached or c.responses for c in started)):
                break
            time.sleep(0.005)

    @rule(phase=st.sampled_from(["queued", "before head", "mid-stream"]), index=st.integers(0, 50))
    def client_aborts(self, phase: str, index: int) -> None:
        if phase == "queued":
            client = self._pick(index, ("sent",), at_backend=False)
        elif phase == "before head":
            client = self._pick(index, ("sent",), at_backend=True)
        else:
            client = self._pick(index, ("head", "chunk"), at_backend=True)
        if client is not None:
            self.world.run(client.scope.cancel)

    @rule(command=st.sampled_from(["complete", "fail"]), index=st.integers(0, 50))
    def backend_acts(self, command: str, index: int) -> None:
        """The backend finishes one live request, or drops its connection."""
        world = self.world

        def act() -> None:
            live = [e for e in world.backend if not e.ended and not e.command]
            if live:
                entry = live[index % len(live)]
                entry.command = command
                entry.wake.set()

        world.run(act)

    @rule(cap=st.integers(0, GLOBAL_LIMIT))
    def cap_changes(self, cap: int) -> None:
        self.world.run(self.world.set_cap, cap)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def slots_equal_backend_live_requests(self) -> None:
        inflight, _waiting, _live = self._settle()
        self.world.checks += 1
        assert 0 <= inflight <= GLOBAL_LIMIT
        assert not self.world.problems, self.world.problems
        for client in self.mine:
            assert client.responses <= 1, client

    def teardown(self) -> None:
        world = self.world

        def finish_all() -> None:
            for entry in world.backend:
                if not entry.ended and not entry.command:
                    entry.command = "complete"
                    entry.wake.set()

        world.run(finish_all)
        deadline = time.monotonic() + 5.0
        while not world.run(lambda: all(c.finished for c in self.mine)):
            assert time.monotonic() < deadline, [c for c in self.mine if not c.finished]
            world.run(finish_all)
            time.sleep(0.01)
        inflight, waiting, live = self._settle()
        assert (inflight, waiting, live) == (0, 0, 0)
        for client in self.mine:
            # A client that was not aborted got exactly one answer, or saw its stream cut.
            if client.phase != "aborted":
                assert client.responses == 1 or client.phase == "cut", client


def test_t30_slot_accounting_under_random_interleavings(figure: Any) -> None:
    world = World()
    world.start()
    try:
        SlotAccounting.world = world
        started = time.perf_counter()
        try:
            run_state_machine_as_test(
                SlotAccounting,
                settings=settings(
                    # CI runs a short sample; T30_EXAMPLES=200 T30_STEPS=30 is the catalogue's
                    # full size (about 10 minutes here).
                    max_examples=int(os.environ.get("T30_EXAMPLES", "15")),
                    stateful_step_count=int(os.environ.get("T30_STEPS", "15")),
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow],
                    database=None,
                    phases=[Phase.generate],  # a live system does not replay exactly: no shrink
                ),
            )
        except BaseException:
            # A leak persists in the shared proxy, so Hypothesis's replay can look flaky; the
            # first violation seen is the finding.
            if world.problems:
                raise AssertionError(f"first violation: {world.problems[0]}") from None
            raise
        took = time.perf_counter() - started
        clients = list(world.clients.values())
        phases = sorted({c.phase for c in clients})
        figure(
            "T30",
            "state machine vs running proxy",
            f"{len(clients)} requests, {world.checks} settled checks, 0 violations, "
            f"{world.replays} replays, end phases {phases}, {took:.0f} s",
            "0 invariant violations; slots = queue = in-flight = 0 at teardown",
        )
        assert world.upstream.requests == len(world.backend)
    finally:
        world.stop()
