"""The relay's fast paths are really taken, and stay correct.

- the stdlib socket under trio's ``SocketStream`` is found (a trio change that hides it would
  silently slow every stream down: this test fails instead);
- a chunked SSE response to an HTTP/1.1 client goes through ``copy_chunked`` (no h11 body
  parsing), byte-exact, and the backend connection is pooled again afterwards;
- an HTTP/1.0 client gets the same stream through h11's framing (close-delimited).
"""

from __future__ import annotations

import re
import socket
from typing import Any

import trio

from guard_trio import _copy, _proxy, _relay
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
    chunked, copy = _copy.copy_chunked, _copy.copy_body

    async def counting_chunked(*args: Any, **kwargs: Any) -> None:
        calls["chunked"] += 1
        await chunked(*args, **kwargs)

    async def counting_copy(*args: Any, **kwargs: Any) -> None:
        calls["h11"] += 1
        await copy(*args, **kwargs)

    # The relay calls the pumps by the names it imported from guard_trio._copy.
    monkeypatch.setattr(_relay, "copy_chunked", counting_chunked)
    monkeypatch.setattr(_relay, "copy_body", counting_copy)
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


# -- the refusal path: a request refused at once is answered from its head -------------------

_REFUSED = {"DYNAMIC_PIG_ENABLED": "false", "GLOBAL_LIMIT": "0", "PIG_QUEUE_WAIT_SECONDS": "0"}


def _post(body: bytes, *extra: bytes) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: guard\r\n" + b"".join(extra)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


_ID_LINE = re.compile(rb"\r\nx-request-id: ([^\r]*)")


async def _answers(
    sock: trio.SocketStream, count: int, ids: list[bytes] | None = None
) -> list[bytes]:
    """``count`` whole Content-Length answers, as the bytes that came but for the one
    ``X-Request-Id`` line each must have (its value goes to ``ids``)."""
    answers = await _raw_answers(sock, count)
    stripped = []
    for answer in answers:
        found = _ID_LINE.findall(answer.split(b"\r\n\r\n")[0])
        assert len(found) == 1, answer
        if ids is not None:
            ids.append(found[0])
        stripped.append(_ID_LINE.sub(b"", answer, count=1))
    return stripped


async def _raw_answers(sock: trio.SocketStream, count: int) -> list[bytes]:
    """``count`` whole Content-Length answers, as the bytes that came."""
    buffer, answers = b"", list[bytes]()
    with trio.fail_after(10):
        while len(answers) < count:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = buffer[:end].lower()
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(buffer) >= end + 4 + length:
                    answers.append(buffer[: end + 4 + length])
                    buffer = buffer[end + 4 + length :]
                    continue
            data = await sock.receive_some(65536)
            assert data, f"closed after {len(answers)} answers"
            buffer += data
    return answers


async def test_refusals_at_once_keep_the_connection_and_match_the_full_path(
    start_guard: Any, monkeypatch: Any
) -> None:
    fast_calls = {"simple": 0}
    admit_simple = _proxy.ProxyApp.admit_simple

    def counting(self: Any, request: Any, body: bytes = b"") -> Any:
        fast_calls["simple"] += 1
        return admit_simple(self, request, body)

    monkeypatch.setattr(_proxy.ProxyApp, "admit_simple", counting)
    base, server = await start_guard({"UPSTREAM": "http://127.0.0.1:9", **_REFUSED}, poll=False)
    host, port = base.removeprefix("http://").split(":")
    sock = await trio.open_tcp_stream(host, int(port))
    try:
        body = b'{"model":"m","messages":[]}'
        # Fifty refusals on one connection, pipelined ten at a time; then one that takes the
        # full path (a Connection header needs h11's judgement) on the same connection.
        ids: list[bytes] = []
        for _ in range(5):
            await sock.send_all(_post(body) * 10)
            answers = await _answers(sock, 10, ids)
            assert len(set(answers)) == 1
        assert len(set(ids)) == 50  # every answer names its own request
        fast = answers[0]
        await sock.send_all(_post(body, b"Connection: keep-alive\r\n"))
        (full,) = await _answers(sock, 1)
        assert fast == full  # the same bytes either way
        assert fast.startswith(b"HTTP/1.1 429 ")
        assert b"connection: close" not in fast.lower()
        await sock.send_all(_post(body))
        assert await _answers(sock, 1) == [fast]  # still open, still the fast answer
    finally:
        await sock.aclose()
    assert fast_calls["simple"] == 51  # the one with a Connection header took the full path
    assert server.metrics.rejected.value == 52  # each one counted once
    assert server.engine.state.gate.inflight == 0
