"""Shared fixtures for tests over real sockets on 127.0.0.1: a simulated backend, a guard, and a
small HTTP client (trio + h11) that can read responses whole or as a stream."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio

from guard_adapters.config import load_config
from guard_trio._server import GuardServer
from guard_trio.tools.sim_backend import SimBackend, SimBackendConfig


@attrs.frozen
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def header(self, name: str) -> bytes | None:
        return self.headers.get(name.lower().encode())


class HttpConnection:
    """One keep-alive client connection."""

    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self.stream = stream
        self.host = host
        self.h11 = h11.Connection(h11.CLIENT)

    async def _event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
                continue
            return event  # type: ignore[return-value]

    async def send_request(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
    ) -> None:
        all_headers = [("Host", self.host), *headers]
        if method != "GET" or body:
            all_headers.append(("Content-Length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=path, headers=all_headers)) or b""
        if body:
            data += self.h11.send(h11.Data(data=body)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(data)

    async def response_head(self) -> h11.Response:
        event = await self._event()
        while isinstance(event, h11.InformationalResponse):
            event = await self._event()
        assert isinstance(event, h11.Response), event
        return event

    async def next_chunk(self) -> bytes | None:
        """The next body chunk, or None at the end of the response."""
        event = await self._event()
        if isinstance(event, h11.Data):
            return bytes(event.data)
        assert isinstance(event, h11.EndOfMessage), event
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            event = await self._event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise AssertionError(f"unexpected {event}")

    async def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> Reply:
        await self.send_request(method, path, headers or [], body)
        head = await self.response_head()
        data = b"".join([chunk async for chunk in self.chunks()])
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        return Reply(head.status_code, dict(head.headers), data)

    async def aclose(self) -> None:
        await self.stream.aclose()


ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float = 120) -> str:
    """Run ``bench/<script>`` with ``args`` from the repository root, as a smoke test does: it
    must exit 0 (its output's tails say why not); its standard output."""
    result = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


async def connect(base: str) -> HttpConnection:
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    return HttpConnection(stream, f"{host}:{port}")


async def request(
    base: str,
    method: str,
    path: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> Reply:
    connection = await connect(base)
    try:
        return await connection.request(method, path, headers, body)
    finally:
        await connection.aclose()


@pytest.fixture
def http() -> Any:
    """The client helpers, as a namespace: ``http.request(...)``, ``await http.connect(base)``."""

    class Helpers:
        pass

    helpers = Helpers()
    helpers.request = request  # type: ignore[attr-defined]
    helpers.connect = connect  # type: ignore[attr-defined]
    return helpers


StartSim = Callable[..., Awaitable[tuple[str, SimBackend]]]
StartGuard = Callable[..., Awaitable[tuple[str, GuardServer]]]


@pytest.fixture
def start_sim(nursery: trio.Nursery) -> StartSim:
    async def start(**overrides: Any) -> tuple[str, SimBackend]:
        config = SimBackendConfig(host="127.0.0.1", port=0, **overrides)
        backend = SimBackend(config)
        host, port = await nursery.start(backend.serve)
        return f"http://{host}:{port}", backend

    return start


@pytest.fixture
def start_guard(nursery: trio.Nursery) -> StartGuard:
    async def start(environ: dict[str, str], *, poll: bool = True) -> tuple[str, GuardServer]:
        settings = load_config({"LISTEN": "127.0.0.1:0", **environ})
        server = GuardServer(settings)
        host, port = await nursery.start(server.serve)
        if poll and settings.dynamic_enabled:
            await wait_for(lambda: server.poller.rounds >= 1)
        return f"http://{host}:{port}", server

    return start


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` every 10 ms (it reads state owned by other tasks)."""
    with trio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 - the state has no event to wait on
            await trio.sleep(0.01)


@pytest.fixture
def until() -> Callable[..., Awaitable[None]]:
    return wait_for
