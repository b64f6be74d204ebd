"""The relay's fast paths are really taken, and stay correct.

- the stdlib socket under trio's ``SocketStream`` is found (a trio change that hides it would
  silently slow every stream down: this test fails instead);
- a chunked SSE response to an HTTP/1.1 client goes through ``copy_chunked`` (no h11 body
  parsing), byte-exact, and the backend connection is pooled again afterwards;
- an HTTP/1.0 client gets the same stream through h11's framing (close-delimited).
"""

from __future__ import annotations

import socket
from typing import Any

import trio

from guard_trio import _proxy
from guard_trio._downstream import stdlib_socket

STREAM_BODY = b'{"model":"m","stream":true,"max_tokens":12,"messages":[]}'


async def test_the_stdlib_socket_under_a_trio_stream_is_found() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        sock = stdlib_socket(client)
        assert isinstance(sock, socket.socket)
        assert sock.getblocking() is False
        assert stdlib_socket(object()) is None
    finally:
        await client.aclose()
        await listener.aclose()


async def test_a_chunked_stream_takes_the_fast_path_and_pools_the_backend_connection(
    start_sim: Any, start_guard: Any, http: Any, monkeypatch: Any
) -> None:
    calls = {"chunked": 0, "h11": 0}
    chunked, copy = _proxy.ProxyApp.copy_chunked, _proxy.ProxyApp.copy_body

    async def counting_chunked(self: Any, *args: Any, **kwargs: Any) -> None:
        calls["chunked"] += 1
        await chunked(self, *args, **kwargs)

    async def counting_copy(self: Any, *args: Any, **kwargs: Any) -> None:
        calls["h11"] += 1
        await copy(self, *args, **kwargs)

    monkeypatch.setattr(_proxy.ProxyApp, "copy_chunked", counting_chunked)
    monkeypatch.setattr(_proxy.ProxyApp, "copy_body", counting_copy)
    backend, _sim = await start_sim(seed=3)
    base, server = await start_guard({"UPSTREAM": backend}, poll=False)
    headers = [("Content-Type", "application/json")]
    name = server.settings.backends[0].name
    for _ in range(2):
        reply = await http.request(base, "POST", "/v1/chat/completions", headers, STREAM_BODY)
        assert reply.status == 200
        assert reply.body.rstrip().endswith(b"data: [DONE]")
        assert reply.body.count(b"data: ") >= 12
        # The exchange ended cleanly: its backend connection went back to the pool.
        assert server.pool.idle_count(name) == 1
    assert calls == {"chunked": 2, "h11": 0}


async def test_an_http_1_0_client_gets_the_stream_through_h11(
    start_sim: Any, start_guard: Any
) -> None:
    backend, _ = await start_sim(seed=3)
    base, _server = await start_guard({"UPSTREAM": backend}, poll=False)
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    request = (
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(STREAM_BODY), STREAM_BODY)
    )
    await stream.send_all(request)
    received = bytearray()
    with trio.fail_after(20):
        while chunk := await stream.receive_some(65536):
            received += chunk
    await stream.aclose()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert body.rstrip().endswith(b"data: [DONE]")
