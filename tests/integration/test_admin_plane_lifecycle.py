"""The admin plane's limits and lifecycle over real sockets on 127.0.0.1: a viewer that stops
reading is dropped while the proxy keeps answering, a stopped plane closes its streams and
unhooks itself, and ``inference-guard serve`` with ``PIG_ADMIN_LISTEN`` (and a live recording:
both listen to the same request events) serves it beside the proxy and exits 0 on SIGTERM.

The viewers here speak WebSocket through wsproto over a plain socket, so that a test can stop
reading, shrink the socket's receive buffer, and see the server's own close.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio
import wsproto
from wsproto.events import AcceptConnection, CloseConnection, Ping, Request, TextMessage

from guard_adapters.admin_stream import keeps_admission
from guard_adapters.recording import open_for_reading, read_records
from guard_core import Arrived, Refused
from guard_trio._listeners import EventFanout, add_event_listener
from guard_trio.admin import DROPPED_CODE, GOING_AWAY_CODE, AdminPlane, serve_admin

TOKEN = "adm1n-token"
BEARER = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


class RawViewer:
    """A WebSocket client on wsproto: reads only when asked to."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self.pending: list[Any] = []

    @classmethod
    async def open(
        cls, port: int, *, query: str = "", receive_buffer: int | None = None
    ) -> RawViewer:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connect: it sets the window offered
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect(("127.0.0.1", port))
        viewer = cls(trio.SocketStream(sock))
        headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
        request = Request(
            host=f"127.0.0.1:{port}", target=f"/admin/events{query}", extra_headers=headers
        )
        await viewer.stream.send_all(viewer.ws.send(request))
        assert isinstance(await viewer.event(), AcceptConnection)
        return viewer

    async def event(self) -> Any:
        """The next event that is not a ping (a ping is answered)."""
        while True:
            while self.pending:
                event = self.pending.pop(0)
                if isinstance(event, Ping):
                    await self.stream.send_all(self.ws.send(event.response()))
                    continue
                return event
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.ws.receive_data(data)
            self.pending.extend(self.ws.events())

    async def aclose(self) -> None:
        await self.stream.aclose()


def guard_env(sim: str, **extra: str) -> dict[str, str]:
    return {
        "UPSTREAM": sim,
        "DYNAMIC_METRICS_URL": f"{sim}/metrics",
        "TOKEN": TOKEN,
        "DYNAMIC_POLL_INTERVAL_MS": "100",
        **extra,
    }


async def test_a_viewer_that_stops_reading_is_dropped_while_the_proxy_keeps_answering(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, _ = await start_sim()
    # Every request is refused at once: a cheap flood of admission messages.
    guard, server = await start_guard(guard_env(sim, GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0"))
    plane: AdminPlane = await nursery.start(
        lambda task_status: serve_admin(
            server, "127.0.0.1", 0, buffer=64, stall_timeout_s=3.0, task_status=task_status
        )
    )
    stalled = await RawViewer.open(plane.port, receive_buffer=4096)
    assert isinstance(await stalled.event(), TextMessage)  # the hello; then it stops reading
    # A viewer that keeps up: sending a message takes its writer a few scheduler rounds, more
    # than a refusal takes, so at this flood it asks for a quarter of the admissions.
    reading = await RawViewer.open(plane.port, query="?kinds=admission&sample=0.25")
    read_by_the_other: list[str] = []

    async def keep_reading() -> None:
        while True:
            try:
                event = await reading.event()
            except trio.ClosedResourceError:
                return  # closed at the end of the test
            if not isinstance(event, TextMessage):
                return
            message = json.loads(event.data)
            if message["type"] == "admission":
                read_by_the_other.append(message["id"])

    nursery.start_soon(keep_reading)
    await until(lambda: len(plane.hub.viewers) == 2)

    # The stream names each request by its X-Request-Id, which its arrival records.
    names: dict[int, str] = {}
    refused: list[str] = []

    def note(event: object) -> None:
        if isinstance(event, Arrived):
            names[event.request_id] = event.trace_id
        elif isinstance(event, Refused):
            refused.append(names.pop(event.request_id))

    add_event_listener(server.engine, note)
    connection = await http.connect(guard)
    sent, slowest = 0, 0.0
    with trio.fail_after(60):
        while plane.hub.dropped_total == 0 and sent < 20_000:
            started = trio.current_time()
            reply = await connection.request("POST", CHAT, BEARER, BODY)
            slowest = max(slowest, trio.current_time() - started)
            assert reply.status == 429
            sent += 1
        # The proxy went on answering, each request promptly, while the viewer was stuck.
        for _ in range(200):
            started = trio.current_time()
            assert (await connection.request("POST", CHAT, BEARER, BODY)).status == 429
            slowest = max(slowest, trio.current_time() - started)
    await connection.aclose()
    assert plane.hub.dropped_total == 1, f"no viewer dropped after {sent} refusals"
    assert slowest < 1.0
    state = json.loads((await http.request(plane.url, "GET", "/admin/state", BEARER)).body)
    assert state["viewers"] == 1  # the one that reads is still there
    # It got every admission its share keeps, in order.
    expected = [i for i in refused if keeps_admission(i, 0.25)]
    assert len(refused) == sent + 200
    await until(lambda: len(read_by_the_other) >= len(expected))
    assert read_by_the_other == expected

    # The stalled viewer reads again: what was in flight to it, then the close; never more
    # than its buffer and the sockets held, a small part of what it missed.
    received = 0
    with trio.fail_after(10):
        while True:
            event = await stalled.event()
            if isinstance(event, CloseConnection):
                break
            assert isinstance(event, TextMessage)
            received += 1
    assert event.code == DROPPED_CODE
    assert event.reason == "viewer too slow"
    assert 64 <= received < sent
    await stalled.aclose()
    await reading.aclose()


async def test_stopping_the_plane_closes_the_streams_and_unhooks_it(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard(guard_env(sim))
    hooks_before = (server.engine.on_event, list(server.poller.on_round))
    async with trio.open_nursery() as inner:
        plane: AdminPlane = await inner.start(serve_admin, server, "127.0.0.1", 0)
        assert server.engine.on_event == plane.hub.on_event  # no other listener: no fan-out
        assert len(server.poller.on_round) == len(hooks_before[1]) + 1
        viewer = await RawViewer.open(plane.port)
        assert isinstance(await viewer.event(), TextMessage)
        await until(lambda: len(plane.hub.viewers) == 1)
        plane.stop()
        with trio.fail_after(5):
            while not isinstance(event := await viewer.event(), CloseConnection):
                assert isinstance(event, TextMessage)
        assert event.code == GOING_AWAY_CODE
        await viewer.aclose()
    assert (server.engine.on_event, list(server.poller.on_round)) == hooks_before
    assert (await http.request(guard, "POST", CHAT, BEARER, BODY)).status == 200


async def test_a_viewer_that_never_reads_again_is_cut_off_after_the_stall_timeout(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    """Hypercorn's writes cannot be cancelled: the kernel's stall timeout (TCP_USER_TIMEOUT)
    aborts the connection of a viewer that takes none of the data waiting for it, which ends
    the write stuck on it; the plane then stops at once."""
    sim, _ = await start_sim()
    guard, server = await start_guard(guard_env(sim, GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0"))
    async with trio.open_nursery() as inner:
        plane: AdminPlane = await inner.start(
            lambda task_status: serve_admin(
                server, "127.0.0.1", 0, buffer=16, stall_timeout_s=1.0, task_status=task_status
            )
        )
        stalled = await RawViewer.open(plane.port, receive_buffer=4096)
        assert isinstance(await stalled.event(), TextMessage)
        connection = await http.connect(guard)
        with trio.fail_after(30):
            while plane.hub.dropped_total == 0:
                assert (await connection.request("POST", CHAT, BEARER, BODY)).status == 429
        await connection.aclose()
        await trio.sleep(1.0 + 1.0)  # past the stall timeout, reading nothing
        ended = None
        with trio.fail_after(5):
            try:
                while isinstance(event := await stalled.event(), TextMessage):
                    pass
                ended = event
            except trio.BrokenResourceError:
                ended = "reset"
        assert ended in ("reset", None)  # aborted: no close frame ever came
        await stalled.aclose()
        stopping = trio.current_time()
        inner.cancel_scope.cancel()
    assert trio.current_time() - stopping < 2.0


async def test_a_second_listener_joins_the_first_through_a_fan_out(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard(guard_env(sim))
    seen: list[object] = []
    server.engine.on_event = seen.append  # stands for the recorder
    plane: AdminPlane = await nursery.start(serve_admin, server, "127.0.0.1", 0)
    fanout = server.engine.on_event
    assert isinstance(fanout, EventFanout)
    assert fanout.listeners == [seen.append, plane.hub.on_event]
    viewer = await RawViewer.open(plane.port)
    assert isinstance(await viewer.event(), TextMessage)
    assert (await http.request(guard, "POST", CHAT, BEARER, BODY)).status == 200
    with trio.fail_after(5):
        while True:
            event = await viewer.event()
            assert isinstance(event, TextMessage)
            if json.loads(event.data)["type"] == "admission":
                break
    assert [type(e).__name__ for e in seen][:2] == ["Arrived", "Forwarded"]
    await viewer.aclose()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_serve_runs_the_admin_plane_beside_the_proxy_and_the_recorder(
    start_sim: Any, http: Any, tmp_path: Path
) -> None:
    sim, _ = await start_sim()
    port, admin_port = _free_port(), _free_port()
    recording = tmp_path / "live.jsonl"
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")},
        **guard_env(sim),
        "LISTEN": f"127.0.0.1:{port}",
        "PIG_ADMIN_LISTEN": f"127.0.0.1:{admin_port}",
        "PIG_RECORD_PATH": str(recording),
        "PIG_DRAIN_SECONDS": "2",
    }
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "guard_trio", "serve"], env=env, stderr=subprocess.DEVNULL
    )
    guard, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        with trio.fail_after(30):
            while True:
                try:
                    reply = await http.request(admin, "GET", "/admin/state", BEARER)
                    if reply.status == 200 and json.loads(reply.body)["source"] == "metrics":
                        break
                except OSError:
                    pass
                await trio.sleep(0.1)
            assert (await http.request(admin, "GET", "/admin/state")).status == 401
            viewer = await RawViewer.open(admin_port)
            hello = json.loads((await viewer.event()).data)
            assert (hello["type"], hello["backends"]) == ("hello", ["metrics1"])
            assert (await http.request(guard, "POST", CHAT, BEARER, BODY)).status == 200
            while True:
                message = json.loads((await viewer.event()).data)
                if message["type"] == "admission":
                    break
            assert message["outcome"] == "admitted"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
            await viewer.aclose()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    with open_for_reading(recording) as stream:
        items = list(read_records(stream, strict=True))
    kinds = [type(item).__name__ for item in items]
    assert "Arrived" in kinds
    assert "Forwarded" in kinds
