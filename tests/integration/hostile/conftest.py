"""Shared pieces of the hostile-input tests (../shared/spec/reliability.md, rows T1-T40).

- :func:`figure`: each test records the figure it measured next to the catalogue's criterion;
  the table is printed at the end of the run (and written as JSON lines to the file named by
  ``HOSTILE_FIGURES`` when that variable is set), so the numbers in the closing note come from
  a command anyone can run. Tests assert behaviour with generous bounds; the figures are the
  measurements.
- :func:`raw_exchange`: send raw bytes to a server and read until it closes or goes quiet.
- :class:`CountingUpstream`: a raw TCP backend on 127.0.0.1 that counts connections and
  requests and answers each connection through a caller-supplied script.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

_FIGURES: list[dict[str, str]] = []


@attrs.frozen
class RawResult:
    data: bytes
    #: True when the server closed the connection (EOF or reset) before ``quiet_s`` of silence.
    closed: bool
    #: Seconds from the end of our send to the first byte received (None if nothing came).
    first_byte_s: float | None
    #: Seconds from the end of our send to the close (None if it stayed open).
    closed_after_s: float | None

    @property
    def status(self) -> int | None:
        """The status code of the first response in ``data``."""
        if not self.data.startswith(b"HTTP/1."):
            return None
        return int(self.data.split(b" ", 2)[1])

    def statuses(self) -> list[int]:
        """The status codes of every final response head in ``data`` (100 Continue excluded)."""
        found = []
        for line in self.data.split(b"\r\n"):
            if line.startswith(b"HTTP/1.") and len(line.split(b" ")) >= 2:
                code = int(line.split(b" ")[1])
                if code >= 200:
                    found.append(code)
        return found


async def raw_exchange(
    base: str,
    data: bytes | list[bytes],
    *,
    quiet_s: float = 1.0,
    total_s: float = 10.0,
    pause_s: float = 0.0,
) -> RawResult:
    """Send ``data`` (pieces separated by ``pause_s``), then read until close, ``quiet_s`` of
    silence or ``total_s`` in all."""
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    received = bytearray()
    closed = False
    first: float | None = None
    closed_at: float | None = None
    try:
        pieces = [data] if isinstance(data, bytes) else data
        for index, piece in enumerate(pieces):
            if index and pause_s:
                await trio.sleep(pause_s)
            try:
                await stream.send_all(piece)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                closed = True
                break
        sent = time.perf_counter()
        with trio.move_on_after(total_s):
            while not closed:
                with trio.move_on_after(quiet_s) as quiet:
                    try:
                        chunk = await stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        chunk = b""
                    if not chunk:
                        closed = True
                        closed_at = time.perf_counter() - sent
                        break
                    if first is None:
                        first = time.perf_counter() - sent
                    received += chunk
                if quiet.cancelled_caught:
                    break
    finally:
        await trio.aclose_forcefully(stream)
    return RawResult(bytes(received), closed, first, closed_at)


ConnectionScript = Callable[[trio.SocketStream, "CountingUpstream"], Awaitable[None]]


class CountingUpstream:
    """A raw backend: counts connections and request heads, runs ``script`` per connection."""

    def __init__(self, script: ConnectionScript) -> None:
        self.script = script
        self.connections = 0
        self.open_connections = 0
        self.requests = 0
        self.received = bytearray()
        self.base = ""

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        task_status.started(self.base)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        self.open_connections += 1
        try:
            await self.script(stream, self)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.open_connections -= 1
            await trio.aclose_forcefully(stream)

    async def read_head(self, stream: trio.SocketStream) -> bytes:
        """Read one request head (and count it); returns the head bytes plus any extra read."""
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return bytes(buffer)
            buffer += chunk
        self.requests += 1
        self.received += buffer
        return bytes(buffer)

    async def read_request(self, stream: trio.SocketStream) -> bytes | None:
        """Read one request with a Content-Length body (or none); returns the body, or None
        at the end of the stream."""
        head, found, rest = (await self.read_head(stream)).partition(b"\r\n\r\n")
        if not found:
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = bytearray(rest)
        while len(body) < length:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return None
            body += chunk
        return bytes(body[:length])


@pytest.fixture
def start_upstream(
    nursery: trio.Nursery,
) -> Callable[[ConnectionScript], Awaitable[CountingUpstream]]:
    async def start(script: ConnectionScript) -> CountingUpstream:
        upstream = CountingUpstream(script)
        await nursery.start(upstream.serve)
        return upstream

    return start


_OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


def ok_backend(bodies: list[bytes]) -> ConnectionScript:
    """A keep-alive backend that records each Content-Length request body and answers 200."""

    async def script(stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        while (body := await upstream.read_request(stream)) is not None:
            bodies.append(body)
            await stream.send_all(_OK)

    return script


@pytest.fixture
def recording_backend() -> Callable[[list[bytes]], ConnectionScript]:
    """``recording_backend(bodies)``: see :func:`ok_backend`."""
    return ok_backend


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``figure("T3", "one 16,385-byte header", "431 in 2.1 ms", "431 within 100 ms")``."""

    def record(row: str, case: str, measured: str, criterion: str) -> None:
        entry = {
            "row": row,
            "case": case,
            "measured": measured,
            "criterion": criterion,
            "test": request.node.nodeid.rsplit("/", 1)[-1],
        }
        _FIGURES.append(entry)
        path = os.environ.get("HOSTILE_FIGURES")
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(entry) + "\n")

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("hostile-input figures (reliability catalogue)")

    def order(entry: dict[str, str]) -> tuple[str, int, str]:
        row = entry["row"]
        digits = row.lstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        return (row[: len(row) - len(digits)], int(digits or 0), entry["case"])

    for entry in sorted(_FIGURES, key=order):
        terminalreporter.write_line(
            f"{entry['row']:<4} {entry['case'][:48]:<48} {entry['measured'][:34]:<34} "
            f"[{entry['criterion']}]"
        )
