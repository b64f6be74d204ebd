"""The floor of the guard's stack: a reverse proxy of trio and h11 that does nothing else.

Run: ``python bench/naive_proxy.py UPSTREAM_PORT`` (bench_proxy.py starts it for its
``trio+h11 floor`` column). It listens on a free port of 127.0.0.1 and logs
``listening on 127.0.0.1:PORT`` on stderr, as ``inference-guard serve`` does.

Each client connection gets its own kept-alive upstream connection. A request's head and body
go up as h11 builds them (hop-by-hop headers dropped); the response head comes back through h11
and its body event by event, each chunk written as soon as it is read. A chunked body (an SSE
stream) to an HTTP/1.1 client is copied as raw bytes instead, as the guard's own fast path does
(its end found by a naive check, after which the connection closes). There is no
admission, routing, accounting, timeout, disconnect watch or error handling beyond closing both
sides. So its requests per CPU-second are what trio and h11 allow on this machine, before the
guard does any of its own work: the figure the shell cannot beat while it is h11 over trio.
"""

from __future__ import annotations

import contextlib
import sys

import h11
import trio

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"})
_READ = 65536


def _forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name not in _HOP_BY_HOP]


async def _next(conn: h11.Connection, stream: trio.SocketStream) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]
        conn.receive_data(await stream.receive_some(_READ))


def _chunked(response: h11.Response) -> bool:
    return any(
        name == b"transfer-encoding" and value.lower() == b"chunked"
        for name, value in response.headers
    )


async def _copy_chunked(
    up: h11.Connection, up_stream: trio.SocketStream, client: trio.SocketStream
) -> None:
    """A chunked body to an HTTP/1.1 client as raw bytes, as the guard's fast path copies it,
    until a read ends with the last chunk (the naive framing check a floor can afford)."""
    data = bytes(up.trailing_data[0])
    while not data.endswith(b"0\r\n\r\n"):
        if data:
            await client.send_all(data)
        data = bytes(await up_stream.receive_some(_READ))
        if not data:
            return
    await client.send_all(data)


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    await stream.send_all(conn.send(event) or b"")


async def _copy_body(
    source: h11.Connection,
    source_stream: trio.SocketStream,
    sink: h11.Connection,
    sink_stream: trio.SocketStream,
) -> bool:
    """A message's body through h11, chunk by chunk, then its end; False if it was cut."""
    while not isinstance(event := await _next(source, source_stream), h11.EndOfMessage):
        if not isinstance(event, h11.Data):
            return False
        await _send(sink_stream, sink, event)
    await _send(sink_stream, sink, h11.EndOfMessage())
    return True


async def _serve(client: trio.SocketStream, upstream_port: int) -> None:
    down = h11.Connection(h11.SERVER)
    up_stream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
    up = h11.Connection(h11.CLIENT)
    async with client, up_stream:
        while True:
            request = await _next(down, client)
            if not isinstance(request, h11.Request):
                return
            headers = _forwardable(list(request.headers))
            head = h11.Request(method=request.method, target=request.target, headers=headers)
            await _send(up_stream, up, head)
            if not await _copy_body(down, client, up, up_stream):
                return
            response = await _next(up, up_stream)
            if not isinstance(response, h11.Response):
                return
            headers = _forwardable(list(response.headers))
            reply = h11.Response(
                status_code=response.status_code, headers=headers, reason=response.reason
            )
            await _send(client, down, reply)
            if _chunked(response) and request.http_version == b"1.1":
                await _copy_chunked(up, up_stream, client)
                return  # h11 did not see the body: this connection is not reused
            if not await _copy_body(up, up_stream, down, client):
                return
            if down.our_state is not h11.DONE or up.our_state is not h11.DONE:
                return
            down.start_next_cycle()
            up.start_next_cycle()


async def main(upstream_port: int) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    port = listeners[0].socket.getsockname()[1]
    print(f"naive proxy listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)

    async def handler(client: trio.SocketStream) -> None:
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, OSError)
        with contextlib.suppress(*gone):
            await _serve(client, upstream_port)

    await trio.serve_listeners(handler, listeners)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]))
