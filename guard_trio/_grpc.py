"""A small gRPC server: h2 over trio, one task per connection, calls handled as callbacks.

Reads: HTTP/2 connections from gRPC clients (Envoy's ext_proc filter, health probes).
Guarantees:
- each connection is one task running h2's state machine; a call (an HTTP/2 stream) is a
  :class:`Call` handed to the handler its ``:path`` names, told each whole message
  (:class:`~guard_adapters.grpc_wire.MessageReader`), its end (the client half-closed) or its
  reset, in order, without a task of its own: a handler that must wait starts one itself;
- an unknown method is answered ``UNIMPLEMENTED``, a stream that breaks gRPC's framing
  ``INTERNAL``; neither touches other calls;
- what a call sends goes out in order; a write the socket takes at once skips the scheduler,
  the rest waits for room; data beyond the peer's flow-control window waits for its update;
- every call still open when its connection ends is told it was reset, so a handler can free
  what it holds: nothing is left open when a connection goes away.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio

from guard_adapters.grpc_wire import (
    GRPC_HEADERS,
    GrpcStatus,
    GrpcWireError,
    MessageReader,
    frame,
    trailers,
)
from guard_trio._downstream import receive_fast, send_fast, stdlib_socket

__all__ = ("Call", "CallHandler", "GrpcServer")

log = logging.getLogger("inference_guard.grpc")

_H2_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None, validate_inbound_headers=False
)


class CallHandler(Protocol):
    """What a service does with one call; every method runs synchronously in the connection's
    task, so it must not block (start a task to wait)."""

    def on_message(self, call: Call, message: bytes) -> None: ...

    def on_end(self, call: Call) -> None: ...

    def on_reset(self, call: Call) -> None: ...


class Call:
    """One gRPC call on a connection: what the handler sends with, and its id."""

    __slots__ = ("_connection", "_headers_sent", "closed", "handler", "reader", "stream_id")

    def __init__(self, connection: GrpcConnection, stream_id: int, handler: CallHandler) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self.handler = handler
        self.reader = MessageReader()
        self._headers_sent = False
        #: The call ended (finished by us, or reset): nothing more is sent.
        self.closed = False

    def send(self, message: bytes) -> None:
        """Queue one message (the response head first, the first time)."""
        if self.closed:
            return
        self._connection.queue(self, frame(message), head=not self._headers_sent)
        self._headers_sent = True

    def finish(self, status: GrpcStatus = GrpcStatus.OK, message: str = "") -> None:
        """End the call with its trailers."""
        if self.closed:
            return
        self.closed = True
        self._connection.end(self, status, message, head=not self._headers_sent)

    def flush_soon(self) -> None:
        """From a task other than the connection's: have what was queued written now."""
        self._connection.wake.set()


class GrpcConnection:
    """One client connection (see the module rules)."""

    def __init__(
        self, stream: trio.SocketStream, services: Mapping[str, Callable[[], CallHandler]]
    ) -> None:
        self.stream = stream
        self.services = services
        self.h2 = h2.connection.H2Connection(config=_H2_CONFIG)
        self.calls: dict[int, Call] = {}
        self._sock = stdlib_socket(stream)
        #: Set when a task other than the reader queued data to write.
        self.wake = trio.Event()
        #: Data waiting for the peer's window, per stream: (bytes, end the stream after).
        self._blocked: dict[int, list[tuple[bytes, list[tuple[bytes, bytes]] | None]]] = {}
        self._out = bytearray()
        self._writing = False

    # -- what calls send -------------------------------------------------------------------------

    def queue(self, call: Call, data: bytes, *, head: bool) -> None:
        try:
            if head:
                self.h2.send_headers(call.stream_id, list(GRPC_HEADERS))
            self._send_data(call.stream_id, data, None)
        except h2.exceptions.ProtocolError:  # the peer reset or closed the stream meanwhile
            self._reset(call)

    def end(self, call: Call, status: GrpcStatus, message: str, *, head: bool) -> None:
        self.calls.pop(call.stream_id, None)
        try:
            if head:
                self.h2.send_headers(call.stream_id, list(GRPC_HEADERS))
            self._send_data(call.stream_id, b"", trailers(status, message))
        except h2.exceptions.ProtocolError:  # the peer reset or closed the stream meanwhile
            self._blocked.pop(call.stream_id, None)

    def _send_data(
        self, stream_id: int, data: bytes, ending: list[tuple[bytes, bytes]] | None
    ) -> None:
        blocked = self._blocked.get(stream_id)
        if blocked is not None:
            blocked.append((data, ending))
            return
        try:
            if data:
                window = self.h2.local_flow_control_window(stream_id)
                if window < len(data):
                    self._blocked[stream_id] = [(data, ending)]
                    return
                self.h2.send_data(stream_id, data)
            if ending is not None:
                self.h2.send_headers(stream_id, ending, end_stream=True)
        except h2.exceptions.ProtocolError:  # closed meanwhile: nothing more goes out on it
            self._blocked.pop(stream_id, None)

    def _unblock(self, stream_id: int | None) -> None:
        """The peer's window grew (for one stream, or for the connection: all of them)."""
        for blocked_id in [stream_id] if stream_id else list(self._blocked):
            for data, ending in self._blocked.pop(blocked_id, None) or ():
                self._send_data(blocked_id, data, ending)

    async def flush(self) -> None:
        """Write what h2 has to send; one task writes at a time, the others leave theirs to it."""
        self._out += self.h2.data_to_send()
        if self._writing:
            return
        self._writing = True
        try:
            while self._out:
                data = bytes(self._out)
                self._out.clear()
                await send_fast(self.stream, self._sock, data)
        finally:
            self._writing = False

    # -- the connection's task -----------------------------------------------------------------

    async def serve(self) -> None:
        self.h2.initiate_connection()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_woken)
                await self.flush()
                await self._read()
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:  # a bug must cost this connection, never the server
            log.exception("gRPC connection ended by an internal error")
        finally:
            for call in list(self.calls.values()):
                self._reset(call)
            with trio.move_on_after(0.5) as scope:
                scope.shield = True
                await trio.aclose_forcefully(self.stream)

    async def _read(self) -> None:
        while True:
            data = await receive_fast(self.stream, self._sock)
            if not data:
                return
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                log.info("gRPC connection closed on a protocol error: %s", exc)
                await self.flush()
                return
            for event in events:
                if self._handle(event):
                    await self.flush()
                    return
            await self.flush()

    async def _write_woken(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            await self.flush()

    def _handle(self, event: h2.events.Event) -> bool:
        """Dispatch one h2 event; True when the connection is over."""
        if isinstance(event, h2.events.RequestReceived):
            headers = dict(event.headers or ())
            path = headers.get(b":path", b"").decode("latin-1")
            stream_id = event.stream_id
            assert stream_id is not None
            make = self.services.get(path)
            if make is None:
                call = Call(self, stream_id, _Refusing())
                call.finish(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
                return False
            self.calls[stream_id] = Call(self, stream_id, make())
        elif isinstance(event, h2.events.DataReceived):
            stream_id = event.stream_id
            assert stream_id is not None
            if event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
            receiving = self.calls.get(stream_id)
            if receiving is not None:
                self._deliver(receiving, event.data or b"")
        elif isinstance(event, h2.events.StreamEnded):
            ending = self.calls.get(event.stream_id or 0)
            if ending is not None and not ending.closed:
                self._safely(ending, ending.handler.on_end)
        elif isinstance(event, h2.events.StreamReset):
            reset = self.calls.get(event.stream_id or 0)
            if reset is not None:
                self._reset(reset)
        elif isinstance(event, h2.events.WindowUpdated):
            self._unblock(event.stream_id or None)
        elif isinstance(event, h2.events.ConnectionTerminated):
            return True
        return False

    def _deliver(self, call: Call, data: bytes) -> None:
        """Hand ``call``'s handler every message ``data`` completes; a framing error ends the
        call with ``INTERNAL`` and tells the handler it was reset."""
        try:
            messages = call.reader.feed(data)
        except GrpcWireError as exc:
            call.finish(GrpcStatus.INTERNAL, str(exc))
            call.handler.on_reset(call)
            return
        for message in messages:
            if call.closed:
                return
            self._safely(call, call.handler.on_message, message)

    def _safely(self, call: Call, callback: Callable[..., None], *args: bytes) -> None:
        """Run a handler's callback; one that raises ends its own call (``INTERNAL``, and the
        handler is told of the reset so it frees what it holds), not the connection."""
        try:
            callback(call, *args)
        except Exception:
            log.exception("gRPC call %d ended by an internal error", call.stream_id)
            if not call.closed:
                call.finish(GrpcStatus.INTERNAL, "internal error")
            with contextlib.suppress(Exception):
                call.handler.on_reset(call)

    def _reset(self, call: Call) -> None:
        self.calls.pop(call.stream_id, None)
        self._blocked.pop(call.stream_id, None)
        if not call.closed:
            call.closed = True
            try:
                call.handler.on_reset(call)
            except Exception:
                log.exception("gRPC call %d: its reset raised", call.stream_id)


class _Refusing:
    """The handler of a call to an unknown method, already finished."""

    def on_message(self, call: Call, message: bytes) -> None:
        return None

    def on_end(self, call: Call) -> None:
        return None

    def on_reset(self, call: Call) -> None:
        return None


class GrpcServer:
    """Serves the given methods (``/package.Service/Method`` -> a handler factory) on a socket."""

    def __init__(self, services: Mapping[str, Callable[[], CallHandler]]) -> None:
        self.services = dict(services)
        self.connections: set[GrpcConnection] = set()

    async def handle(self, stream: trio.SocketStream) -> None:
        connection = GrpcConnection(stream, self.services)
        self.connections.add(connection)
        try:
            await connection.serve()
        finally:
            self.connections.discard(connection)

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        bound = listeners[0].socket.getsockname()
        task_status.started((str(bound[0]), int(bound[1])))
        await trio.serve_listeners(self.handle, listeners)
