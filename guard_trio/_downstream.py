"""The client side of one connection: h11 as a server over a trio stream.

Reads: bytes from the client socket.
Guarantees:
- a request head larger than 16 KiB or with more than 100 header lines is refused with 431,
  a head that does not arrive within ``header_timeout_s`` with 408, a request carrying both
  Content-Length and Transfer-Encoding with 400, and any other malformed head with h11's status
  hint; so are, with 400, what h11 accepts but a proxy must not pass on: an HTTP version other
  than 1.0 and 1.1, Transfer-Encoding on HTTP/1.0, CONNECT or any target that is not
  origin-form (``/...``), an ``Upgrade`` header, and a header name with underscores that aliases
  a framing, hop-by-hop or guard header (``Content_Length``, ``X_PIG_Tier``); the connection is
  closed after each of these;
- a client that goes away is noticed both while we write (:class:`ClientGone`) and, while a
  request is watched (:meth:`Downstream.watch`, until :meth:`Downstream.unwatch`), while we wait
  for admission or for the backend: the connection's one watcher task cancels the request's
  scope (one task per connection, started by its first watched request, not one per request);
- bytes a client pipelines behind its request are kept for the next request, not lost (at
  most 64 KiB are read ahead while a request is in flight);
- request bodies are read only through :meth:`Downstream.body_event`, under
  :class:`BodyLimits`: a declared length over the cap is refused before any body byte is read
  (:meth:`Downstream.begin_body`), a body that grows past the cap, stalls longer than the idle
  timeout or outlasts the total deadline raises :class:`BodyRefused` (413, 408), and
  ``100 Continue`` goes out only when a body is actually wanted;
- a final response sent while the request body is still unread carries ``Connection: close``,
  and the connection is closed after it (the unread bytes are drained, bounded, and never
  parsed as a request).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import h11
import trio

from guard_adapters.answers import (
    BodyLimits,
    BodyRefused,
    RefusedRequest,
    declared_length,
    stamped,
    whole_response,
    with_close,
)
from guard_adapters.exchange import EARLY_DRAIN_BYTES
from guard_adapters.http_head import (
    MAX_REQUEST_HEAD_BYTES,
    SimpleRequest,
    head_problem,
    read_simple_request,
)
from guard_adapters.outcome import ExchangeNotes
from guard_core import GuardError

__all__ = (
    "ClientGone",
    "Downstream",
    "ResponseAborted",
)

_READ_SIZE = 65536
#: While a request is in flight, stop reading ahead once this much of the next one is buffered.
_MAX_READ_AHEAD = 64 * 1024
#: Before closing a connection whose body was left unread: how long and how much to drain, so
#: that the client reads our response before the close resets the connection.
_LINGER_S = 1.0
_LINGER_BYTES = 256 * 1024


class ClientGone(GuardError):
    """The client closed its connection or a write to it failed."""


class ResponseAborted(GuardError):
    """A response already started cannot be completed: the client connection must be closed."""


class Downstream:
    def __init__(
        self, stream: trio.abc.Stream, peer: str, limits: BodyLimits | None = None
    ) -> None:
        self.stream = stream
        self.peer = peer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
        self.gone = False
        #: What the guard noted of the exchange in progress (:mod:`guard_adapters.outcome`);
        #: its ``trace_id`` is the ``X-Request-Id`` every response head carries.
        self.notes = ExchangeNotes()
        #: The notes' outcome is yet to be handed on (:meth:`ProxyApp.end_exchange`).
        self.exchange_open = False
        #: The non-blocking stdlib socket under a plain TCP stream, for :meth:`send_raw`.
        self._sock = stdlib_socket(stream)
        self.limits = limits or BodyLimits()
        #: The largest body the fast reader answers from (drained unread when refused).
        self._simple_body_limit = min(EARLY_DRAIN_BYTES, self.limits.max_bytes)
        #: The connection closes after the current response (which says ``Connection: close``).
        self.closing = False
        self._declared: int | None = 0
        self._body_read = 0
        self._body_deadline: float | None = None
        #: Set once the current request has been read to its end (or the client closed).
        self._request_read = trio.Event()
        #: Bytes the simple-request reader holds: read, not yet answered nor handed to h11.
        self._raw = b""
        #: While :meth:`next_simple` waits for the next request: since when.
        self.idle_since: float | None = None
        #: When the latest :meth:`next_simple` began to wait (None: it found bytes waiting).
        self.wait_started: float | None = None
        #: The connection's scope, which :meth:`stop_idle_wait` cancels (the server sets it).
        self.idle_scope: trio.CancelScope | None = None
        #: Where the connection's watcher task runs (the server sets it; None: never watched).
        self.tasks: trio.Nursery | None = None
        #: The watched request's scope (:meth:`watch`), where the watcher task waits for one
        #: (None until the first), and the scope of its reading (which :meth:`unwatch` cancels).
        self._watched: trio.CancelScope | None = None
        self._watcher: trio.lowlevel.ParkingLot | None = None
        self._watch_reading = trio.CancelScope()

    async def _receive(self) -> None:
        try:
            data = await receive_fast(self.stream, self._sock)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.gone = True
        self.h11.receive_data(bytes(data))

    async def next_event(self) -> h11.Event:
        while True:
            event = self.ready_event()
            if event is not None:
                return event
            await self._receive()

    def ready_event(self) -> h11.Event | None:
        """The next event when what was read already holds it (no wait, no timer), else None."""
        event = self.h11.next_event()
        if event is h11.NEED_DATA:
            return None
        if isinstance(event, h11.Request):
            self._request_read = trio.Event()
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            self._request_read.set()
        return event  # type: ignore[return-value]

    async def next_request(self, header_timeout_s: float) -> h11.Request | None:
        """The next request head, or None when the client closed the connection cleanly."""
        try:
            event = self.ready_event()
            if event is None:
                with trio.fail_after(header_timeout_s):
                    event = await self.next_event()
        except trio.TooSlowError:
            if not self.h11.trailing_data[0]:
                return None  # an idle keep-alive connection: close it without a response
            raise RefusedRequest(408, "request head timed out") from None
        except h11.RemoteProtocolError as exc:
            raise RefusedRequest(exc.error_status_hint, str(exc)) from None
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):  # pragma: no cover - h11 guarantees the order
            raise RefusedRequest(400, "unexpected event")
        problem = head_problem(event.method, event.target, event.http_version, event.headers)
        if problem is not None:
            raise RefusedRequest(*problem)
        return event

    async def next_simple(self) -> SimpleRequest | None:
        """The next request when it is simple and already whole, head and body, in what has
        arrived (:func:`~guard_adapters.http_head.read_simple_request`). Otherwise None:
        whatever was read is in h11's buffer for :meth:`next_request`. A simple request stays
        pending here until it is answered (:meth:`answer_simple`) or handed to h11
        (:meth:`defer_simple`).

        The wait for the first byte has no timer of its own (a cancel scope per request is most
        of a refusal's scheduling cost): while it lasts, :attr:`idle_since` says since when,
        and the server's sweep ends it through :meth:`stop_idle_wait`."""
        if self.h11.trailing_data[0] or self.h11.their_state is not h11.IDLE:
            return None
        self.wait_started = None
        if not self._raw:
            self.idle_since = self.wait_started = trio.current_time()
            try:
                data = await receive_next(self.stream, self._sock)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            finally:
                self.idle_since = None
            if not data:
                self.gone = True
                self.h11.receive_data(b"")
                return None  # h11 reads the close: next_request says so
            self._raw = data
        request = read_simple_request(self._raw)
        if request is None or request.body_length > self._simple_body_limit:
            self.defer_simple()
            return None
        return request

    def stop_idle_wait(self) -> bool:
        """End the wait of :meth:`next_simple` (an idle timeout, a drain) unless bytes are already
        there to be read; then it ends by itself with them. Whether it was ended."""
        if self.idle_since is None or self.idle_scope is None:
            return False
        if self._sock is not None:
            try:
                if self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return False  # a request is arriving: it is served, not cut
            except OSError:
                pass  # nothing there yet, or a broken connection: ending the wait ends it
        self.idle_scope.cancel()
        return True

    def simple_body(self, request: SimpleRequest) -> bytes:
        """The pending simple request's body, whole (the fast reader took only such)."""
        return self._raw[request.head_end : request.head_end + request.body_length]

    def defer_simple(self) -> None:
        """Hand the pending simple request (and what follows it) to h11, unanswered."""
        self.h11.receive_data(self._raw)
        self._raw = b""

    async def answer_simple(self, request: SimpleRequest, response: bytes) -> None:
        """Answer the pending simple request with a whole response (its body is dropped, unread);
        the connection stays open for the next request."""
        self._raw = self._raw[request.head_end + request.body_length :]
        await self.send_raw(response)

    def begin_body(self, request: h11.Request) -> None:
        """Start the body accounting of ``request``; a declared length over the cap is refused
        here, before any byte of the body is read (:class:`BodyRefused` 413)."""
        self._declared = declared_length(request.headers)
        self._body_read = 0
        self._body_deadline = None
        if self._declared is not None and self._declared > self.limits.max_bytes:
            raise BodyRefused(413, "declared body length over the cap")

    async def body_event(self) -> h11.Event:
        """The next event of the request body (``Data``, ``EndOfMessage`` or
        ``ConnectionClosed``) under the body limits; a client waiting for ``100 Continue`` gets
        it first, since the caller wants the body."""
        if self.h11.they_are_waiting_for_100_continue:
            await self.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            )
        now = trio.current_time()
        if self._body_deadline is None:
            self._body_deadline = now + self.limits.total_timeout_s
        try:
            event = self.ready_event()
            if event is None:
                wait = min(self.limits.idle_timeout_s, self._body_deadline - now)
                with trio.fail_after(max(wait, 0.0)):
                    event = await self.next_event()
        except trio.TooSlowError:
            raise BodyRefused(408, "request body timed out") from None
        except h11.RemoteProtocolError as exc:
            raise BodyRefused(exc.error_status_hint, f"bad request body: {exc}") from None
        if isinstance(event, h11.Data):
            self._body_read += len(event.data)
            if self._body_read > self.limits.max_bytes:
                raise BodyRefused(413, "request body over the cap")
        return event

    async def read_body(self, limit: int) -> tuple[list[bytes], bool]:
        """Read the body until more than ``limit`` bytes (or its end) came, under the body
        limits; returns (chunks, complete)."""
        chunks, end = await read_up_to(self.body_event, limit)
        if isinstance(end, h11.ConnectionClosed):
            raise ClientGone("client closed while sending its body")
        return chunks, end is not None

    async def skip_body(self) -> None:
        """The body is not wanted: read and drop it when it is short (declared at most
        :data:`EARLY_DRAIN_BYTES`, and no ``100 Continue`` awaited); otherwise leave it unread
        and close the connection after the response."""
        if self.h11.their_state is not h11.SEND_BODY:
            return
        declared = self._declared
        if (
            self.h11.they_are_waiting_for_100_continue
            or declared is None
            or declared - self._body_read > EARLY_DRAIN_BYTES
        ):
            self.closing = True
            return
        while not isinstance(await self.body_event(), h11.EndOfMessage | h11.ConnectionClosed):
            pass

    async def send(self, *events: h11.Event) -> None:
        if (self.closing or self.h11.their_state is h11.SEND_BODY) and any(
            isinstance(event, h11.Response) for event in events
        ):
            # An early response: the unread body would be parsed as the next request.
            self.closing = True
            events = tuple(with_close(event) for event in events)
        data = b"".join([self.h11.send(event) or b"" for event in events])  # a list: one call
        if data:
            await self.send_raw(data)

    async def respond(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> None:
        """A whole response in one write."""
        if self.exchange_open:
            self.notes.status = status
        await self.send(*whole_response(status, stamped(headers, self.notes.trace_id), body))

    def head(
        self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b""
    ) -> h11.Response:
        """The response head for ``headers``, with the request's ``X-Request-Id``."""
        if self.exchange_open:
            self.notes.status = status
        return h11.Response(
            status_code=status, headers=stamped(headers, self.notes.trace_id), reason=reason
        )

    def frame(self, *events: h11.Event) -> bytes:
        """The bytes h11 would send for ``events`` (its state advances): for a caller that
        joins them with raw body bytes in one :meth:`send_raw`."""
        return b"".join([self.h11.send(event) or b"" for event in events])

    async def send_raw(self, data: bytes) -> None:
        """Bytes already framed for the response in progress (the relay's fast path).

        What the socket takes at once is written without a trip through trio's scheduler; the
        rest (a slow reader) goes through ``send_all``, which waits for room."""
        try:
            await send_fast(self.stream, self._sock, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.gone = True
            self.h11.send_failed()
            raise ClientGone("client went away") from None

    def watch(self, scope: trio.CancelScope) -> None:
        """Until :meth:`unwatch`: cancel ``scope`` when the client closes the connection.

        While the request body is still being read (streamed to the backend), its reader is the
        one that notices a close; the watcher reads once the body has ended, and keeps at most
        64 KiB of what the client pipelines behind it (the rest waits in the socket). The
        connection's watcher task starts with its first watched request and serves every later
        one: watching costs a wake-up, not a task and a nursery per request.
        """
        self._watched = scope
        if self._watcher is None:
            assert self.tasks is not None, "the server gives each connection its task nursery"
            self._watcher = trio.lowlevel.ParkingLot()
            self.tasks.start_soon(self._watch, self._watcher)
        self._watcher.unpark()

    def unwatch(self) -> None:
        """Stop watching: the watcher's read (if it is in one) ends now, before anything else
        can read the socket (trio withdraws a cancelled wait at once)."""
        self._watched = None
        self._watch_reading.cancel()

    async def _watch(self, parked: trio.lowlevel.ParkingLot) -> None:
        """The connection's watcher task: for each watched request, read until the client
        closes (then cancel the request's scope) or the request is unwatched.

        A wake-up trio has already granted is not withdrawn by :meth:`unwatch`'s cancel, so the
        read checks that its request is still watched between the wake-up and the ``recv``
        (with no checkpoint between): else it could take the next request from under the
        connection's own reader."""
        while not self.gone:
            while (scope := self._watched) is None:
                await parked.park()
            with trio.CancelScope() as self._watch_reading:
                if not self._request_read.is_set():
                    await self._request_read.wait()
                while not self.gone:
                    sock = self._sock
                    if sock is None or len(self.h11.trailing_data[0]) > _MAX_READ_AHEAD:
                        await trio.sleep_forever()  # nothing to wait on, or far enough ahead
                    await trio.lowlevel.wait_readable(sock)
                    if self._watched is not scope:
                        break  # its request is over: the bytes are the next request's
                    try:
                        data = sock.recv(_READ_SIZE)
                    except BlockingIOError:  # woken without data: wait again
                        continue
                    except OSError:  # a reset: the client is gone too
                        data = b""
                    self.gone = not data
                    self.h11.receive_data(data)
            if self.gone and scope is self._watched:
                scope.cancel()

    @property
    def can_respond(self) -> bool:
        return not self.gone and self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def close(self) -> None:
        try:
            if not self.gone and self.h11.their_state in (h11.SEND_BODY, h11.ERROR):
                await self._linger()
        finally:
            with trio.move_on_after(0.5) as scope:
                scope.shield = True
                await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        """Half-close, then drop what the client still sends (bounded), so that closing with
        unread bytes does not reset the connection before the client has read our response."""
        with trio.move_on_after(_LINGER_S):
            try:
                if isinstance(self.stream, trio.abc.HalfCloseableStream):
                    await self.stream.send_eof()
                drained = 0
                while drained < _LINGER_BYTES:
                    data = await self.stream.receive_some(_READ_SIZE)
                    if not data:
                        return
                    drained += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return


async def read_up_to(
    next_event: Callable[[], Awaitable[h11.Event]], limit: int
) -> tuple[list[bytes], h11.Event | None]:
    """A body's chunks from ``next_event`` until more than ``limit`` bytes came (the end is
    then None) or its last event came (``EndOfMessage`` or ``ConnectionClosed``)."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        event = await next_event()
        if isinstance(event, h11.Data):
            chunks.append(bytes(event.data))
            size += len(event.data)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return chunks, event
    return chunks, None


async def send_fast(stream: trio.abc.Stream, sock: socket.socket | None, data: bytes) -> None:
    """``stream.send_all(data)``, except that what the socket takes at once is written without
    a trip through trio's scheduler; the rest (a slow reader) waits for room as usual."""
    if sock is not None:
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        data = data[sent:]
    await stream.send_all(data)


async def receive_fast(stream: trio.abc.Stream, sock: socket.socket | None) -> bytes:
    """``stream.receive_some()``, as one wait for readability and one ``recv`` (trio's own
    version tries the ``recv`` first and passes through the scheduler once more after it)."""
    if sock is None:
        return bytes(await stream.receive_some(_READ_SIZE))
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(_READ_SIZE)
        except BlockingIOError:  # woken without data: wait again
            continue


async def receive_next(stream: trio.abc.Stream, sock: socket.socket | None) -> bytes:
    """:func:`receive_fast` for a client's next request: after every other ready task has run
    once, its bytes have often arrived (under load, that is most of the time), and one ``recv``
    then takes them without registering for readiness and waiting (two ``epoll_ctl`` calls and a
    wake-up through the scheduler)."""
    if sock is not None:
        await trio.lowlevel.checkpoint()
        try:
            return sock.recv(_READ_SIZE)
        except BlockingIOError:
            pass
    return await receive_fast(stream, sock)


def stdlib_socket(stream: object) -> socket.socket | None:
    """The stdlib socket under a trio ``SocketStream`` (None for TLS or other streams).

    trio keeps it non-blocking; reading the private attribute is checked by
    ``tests/integration/test_fast_paths.py`` so that a trio change fails loudly."""
    sock = getattr(getattr(stream, "socket", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None
