"""Keep-alive HTTP/1.1 connections to the backends, one small pool per backend.

Reads: a backend's base URL (http or https), request heads and body chunks from the proxy.
Guarantees:
- a connection goes back to its pool only when its exchange finished cleanly and both sides
  may reuse it (h11 says so), with no byte left over after the response; any error, timeout,
  cancellation or desync closes it instead;
- at most ``max_idle`` idle connections are kept per backend, each for at most ``idle_timeout_s``;
  one that received anything while idle (stray bytes, or the backend's close) is never reused;
- at most ten interim (1xx) responses are skipped before the final head;
- the response head is always parsed by h11; the body can then be read through h11 (``Data``
  events) or, for the relay's fast path, as raw bytes (``receive_raw``), after which
  ``finish_raw_body`` puts h11 back in step;
- nothing here parses body contents;
- :class:`IdleGuard` ends a body copy that made no progress for its idle budget.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import h11
import trio

from guard_adapters.backends import UpstreamTarget
from guard_adapters.exchange import content_length
from guard_core import GuardError
from guard_trio._downstream import ResponseAborted, receive_fast, send_fast, stdlib_socket

__all__ = (
    "IdleGuard",
    "UpstreamConnection",
    "UpstreamError",
    "UpstreamPool",
)

_READ_SIZE = 65536
#: The end of a response head, as h11 finds it (it accepts bare LF line endings).
_HEAD_END = re.compile(rb"\n\r?\n")
_MAX_HEAD_BYTES = 64 * 1024
#: More 1xx responses than this before the final head is a broken backend.
_MAX_INTERIM = 10
#: ``receive_raw`` yields to the scheduler at least once every this many reads.
_YIELD_EVERY = 16


class UpstreamError(GuardError):
    """The backend could not be reached or broke the exchange. ``unsent``: not one byte of the
    request left for it (the connect failed, or the first write was refused)."""

    def __init__(self, message: str, *, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent


class UpstreamConnection:
    """One h11 client connection over a trio stream."""

    def __init__(self, target: UpstreamTarget, stream: trio.abc.Stream) -> None:
        self.target = target
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        #: Taken from the idle pool (it may have been closed by the backend meanwhile).
        self.reused = False
        #: Raw bytes read past the response head that h11 has not seen yet.
        self.unparsed = bytearray()
        #: Set when the body was read around h11 and something about it forbids reuse.
        self.poisoned = False
        #: Some byte of a request was written to the socket.
        self.sent_any = False
        #: The final response head was read; ``sized``: it declares one Content-Length (whose
        #: body h11 reads with a reader that cannot fail, only count).
        self.head_seen = self.sized = False
        self._sock = stdlib_socket(stream)
        self._eager_reads = 0
        self._interim = 0

    async def send(self, *events: h11.Event) -> None:
        data = b"".join([self.h11.send(event) or b"" for event in events])  # a list: one call
        if data:
            try:
                if not self.sent_any and self._sock is not None:
                    # The first write goes to the socket directly, so that a refusal (reset,
                    # broken pipe) is known to have taken no byte of the request.
                    try:
                        sent = self._sock.send(data)
                    except BlockingIOError:
                        sent = 0
                    self.sent_any = sent > 0
                    data = data[sent:]
                if data:
                    await send_fast(self.stream, self._sock, data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(
                    f"{self.target.name}: send failed ({exc})", unsent=not self.sent_any
                ) from None
            self.sent_any = True

    async def receive_raw(self) -> bytes | bytearray:
        """Bytes from the backend, h11 bypassed (``unparsed`` first); b"" at end of stream.

        After a read that filled the buffer, the next one first tries the socket at once,
        without a trip through trio's scheduler; every :data:`_YIELD_EVERY` such reads in a row
        it waits anyway, so that a backend that never pauses cannot starve the other streams.
        Otherwise it waits for the socket to be readable (one scheduler trip per read)."""
        if self.unparsed:
            data = bytes(self.unparsed)
            self.unparsed.clear()
            return data
        sock = self._sock
        try:
            if sock is not None and 0 < self._eager_reads < _YIELD_EVERY:
                # The last read filled the buffer or found bytes waiting: more may be there.
                try:
                    data = sock.recv(_READ_SIZE)
                except BlockingIOError:
                    pass
                else:
                    self._eager_reads += 1
                    return data
            data = await receive_fast(self.stream, sock)
            self._eager_reads = 1 if len(data) == _READ_SIZE else 0
            return data
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError(f"{self.target.name}: connection lost ({exc})") from None

    async def read_head(self) -> h11.Response:
        """The final response head, parsed by h11, reading only as far as the head goes: the
        body bytes already read stay in ``unparsed``, so the caller may read the body through
        h11 (:meth:`next_event`) or around it (:meth:`receive_raw`). Cancel-safe: bytes read
        before a cancellation are kept."""
        while True:
            end = _HEAD_END.search(self.unparsed)
            if end is None:
                if len(self.unparsed) > _MAX_HEAD_BYTES:
                    raise UpstreamError(f"{self.target.name}: response head too large")
                try:
                    data = await receive_fast(self.stream, self._sock)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError(f"{self.target.name}: connection lost ({exc})") from None
                if not data:
                    raise UpstreamError(f"{self.target.name}: closed before the response head")
                self.unparsed += data
                continue
            head = bytes(self.unparsed[: end.end()])
            del self.unparsed[: end.end()]
            self.h11.receive_data(head)
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"bad response from {self.target.name}: {exc}") from None
            if isinstance(event, h11.InformationalResponse):
                self._interim += 1
                if self._interim > _MAX_INTERIM:
                    raise UpstreamError(f"{self.target.name}: too many interim responses")
                continue
            if isinstance(event, h11.Response):
                self.head_seen, self.sized = True, content_length(event.headers) is not None
                return event
            raise UpstreamError(f"{self.target.name}: no response head")

    def finish_raw_body(self, trailer: bytes, *, clean: bool) -> None:
        """After a chunked body read with :meth:`receive_raw`: hand h11 the end of the body
        (``trailer``: the trailer section) so that it checks it and the connection can be
        reused; any doubt (``clean`` False, bytes after the body, a bad trailer) forbids reuse."""
        if not clean or self.unparsed:
            self.poisoned = True
            return
        self.h11.receive_data(b"0\r\n" + trailer)
        try:
            event = self.h11.next_event()
        except h11.RemoteProtocolError:
            event = None
        if not isinstance(event, h11.EndOfMessage):
            self.poisoned = True

    def buffered_event(self) -> object:
        """The next event from what was already read (h11.NEED_DATA when there is none)."""
        if self.unparsed:
            self.h11.receive_data(bytes(self.unparsed))
            self.unparsed.clear()
        try:
            return self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise UpstreamError(f"bad response from {self.target.name}: {exc}") from None

    def drain_buffered(self, data: bytes) -> tuple[bytes, bool]:
        """``data`` joined to the body bytes h11 already holds; True if the body ended too."""
        parts = [data]
        while True:
            event = self.h11.next_event()
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts), True
            else:  # NEED_DATA: nothing more buffered
                return b"".join(parts), False

    async def next_event(self) -> h11.Event:
        """The next response event; raises UpstreamError if the backend breaks the exchange."""
        if self.unparsed:
            self.h11.receive_data(bytes(self.unparsed))
            self.unparsed.clear()
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"bad response from {self.target.name}: {exc}") from None
            if event is h11.NEED_DATA:
                try:
                    data = await receive_fast(self.stream, self._sock)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError(f"{self.target.name}: connection lost ({exc})") from None
                self.h11.receive_data(bytes(data))
                continue
            if isinstance(event, h11.ConnectionClosed):
                raise UpstreamError(f"{self.target.name}: connection closed mid-response")
            assert not isinstance(event, type(h11.PAUSED))
            return event  # type: ignore[return-value]

    def quiet_while_idle(self) -> bool:
        """Nothing arrived while the connection sat in the pool: no stray bytes (a desync) and
        no close from the backend (its keep-alive timeout). TLS connections are not checked."""
        sock = self._sock
        if sock is None:
            return True
        try:
            sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # bytes, or b"" for a closed connection

    @property
    def reusable(self) -> bool:
        return (
            not self.poisoned
            and not self.unparsed
            and self.h11.our_state is h11.DONE
            and self.h11.their_state is h11.DONE
            # Bytes after the end of the response are a desync: never pool such a connection.
            and not self.h11.trailing_data[0]
        )

    async def aclose(self) -> None:
        with trio.move_on_after(0.5) as scope:
            scope.shield = True
            await trio.aclose_forcefully(self.stream)


class UpstreamPool:
    """Idle keep-alive connections per backend."""

    def __init__(
        self,
        *,
        max_idle: int = 512,
        idle_timeout_s: float = 90.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[str, deque[UpstreamConnection]] = {}

    async def _connect(self, target: UpstreamTarget) -> UpstreamConnection:
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream: trio.abc.Stream = await trio.open_tcp_stream(target.host, target.port)
                if target.scheme == "https":
                    context = ssl.create_default_context()
                    stream = trio.SSLStream(stream, context, server_hostname=target.host)
                    await stream.do_handshake()
        except trio.TooSlowError:
            raise UpstreamError(f"{target.name}: connect timed out", unsent=True) from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise UpstreamError(f"{target.name}: connect failed ({exc})", unsent=True) from None
        return UpstreamConnection(target, stream)

    def _take_idle(self, target: UpstreamTarget) -> UpstreamConnection | None:
        idle = self._idle.get(target.name)
        now = trio.current_time()
        while idle:
            connection = idle.pop()
            if self._still_usable(connection, now):
                connection.reused = True
                return connection
        return None

    def _still_usable(self, connection: UpstreamConnection, now: float) -> bool:
        """Not idle for too long, and nothing arrived from the backend meanwhile; a connection
        that fails this is closed (in the background)."""
        if now - connection.idle_since <= self.idle_timeout_s and connection.quiet_while_idle():
            return True
        trio.lowlevel.spawn_system_task(connection.aclose)
        return False

    def sweep(self) -> int:
        """Close idle connections that expired or that the backend closed (or wrote to) while
        they waited; returns how many. Called periodically, so a backend restart does not leave
        a pool of half-closed sockets behind until each is taken."""
        closed = 0
        now = trio.current_time()
        for idle in self._idle.values():
            kept = [c for c in idle if self._still_usable(c, now)]
            closed += len(idle) - len(kept)
            idle.clear()
            idle.extend(kept)
        return closed

    async def sweep_every(self, interval_s: float) -> None:
        """:meth:`sweep` forever, every ``interval_s`` seconds."""
        while True:
            await trio.sleep(interval_s)
            self.sweep()

    @asynccontextmanager
    async def connection(
        self, target: UpstreamTarget, *, fresh: bool = False
    ) -> AsyncIterator[UpstreamConnection]:
        """A connection for one exchange; returned to the pool only if it ended cleanly."""
        connection = None if fresh else self._take_idle(target)
        if connection is None:
            connection = await self._connect(target)
        try:
            yield connection
        except BaseException:
            await connection.aclose()
            raise
        if connection.reusable:
            connection.h11.start_next_cycle()
            connection.sent_any = connection.head_seen = False
            connection.idle_since = trio.current_time()
            idle = self._idle.setdefault(target.name, deque())
            if len(idle) < self.max_idle:
                idle.append(connection)
                return
        await connection.aclose()

    def idle_count(self, name: str) -> int:
        """Idle connections kept for the backend ``name``."""
        return len(self._idle.get(name, ()))

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                await idle.pop().aclose()


class IdleGuard:
    """Cancels a body copy when neither side made progress for ``idle_s`` seconds.

    One cancel scope per copy whose deadline moves forward at most twice a second, so the cost
    per relayed event is one clock read. When it fires the copy ends with
    :class:`ResponseAborted`: both connections are closed.
    """

    __slots__ = ("_armed_at", "_idle_s", "_scope", "_step_s")

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        #: The deadline moves at most once per step; it may fire up to one step late, never
        #: early (5 % of the budget, at most half a second).
        self._step_s = min(0.5, idle_s / 20)
        self._armed_at = 0.0
        self._scope = trio.CancelScope()

    def __enter__(self) -> IdleGuard:
        now = trio.current_time()
        self._armed_at = now
        self._scope.deadline = now + self._idle_s + self._step_s
        self._scope.__enter__()
        return self

    def progress(self) -> None:
        now = trio.current_time()
        if now - self._armed_at > self._step_s:
            self._armed_at = now
            self._scope.deadline = now + self._idle_s + self._step_s

    def __exit__(self, *exc_info: object) -> bool:
        suppressed = self._scope.__exit__(*exc_info)  # type: ignore[arg-type]
        if self._scope.cancelled_caught:
            raise ResponseAborted("no progress on the response within the idle timeout")
        return bool(suppressed)
