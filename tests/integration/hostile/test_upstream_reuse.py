"""Backend connections: reuse (catalogue F10 and T30's replay finding) and forwarding headers.

- a backend that closed an idle kept-alive connection is noticed before the connection is
  reused: the next request goes out on a fresh connection and succeeds, sent once; idle
  connections the backend closed are swept from the pool without waiting for traffic;
- a POST fully written on a reused connection that the backend then drops is never sent
  again (the backend may already be generating): the client gets the 429, the backend saw the
  request once;
- T15 follow-up: an ``X-Forwarded-For`` the client names in ``Connection`` is dropped at this
  hop, so the backend sees only the socket peer.
"""

from __future__ import annotations

from typing import Any

import trio

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
HEADERS = [("Content-Type", "application/json")]
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def test_a_connection_the_backend_closed_while_idle_is_not_reused(
    start_upstream: Any, start_guard: Any, http: Any, figure: Any
) -> None:
    async def answer_once_then_close(stream: trio.SocketStream, up: Any) -> None:
        if await up.read_request(stream) is not None:
            await stream.send_all(OK)  # keep-alive by default, then close at once

    upstream = await start_upstream(answer_once_then_close)
    base, _ = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    for _ in range(3):
        reply = await http.request(base, "POST", "/v1/chat/completions", HEADERS, BODY)
        assert reply.status == 200
        await trio.sleep(0.05)  # the backend's close reaches the guard while idle
    assert upstream.requests == 3  # each sent once
    assert upstream.connections == 3
    figure("F10", "backend closed an idle kept-alive connection", "3/3 200, 0 replays", "no 429")


async def test_a_written_post_on_a_reused_connection_is_never_replayed(
    start_upstream: Any, start_guard: Any, http: Any, figure: Any
) -> None:
    async def drop_the_second(stream: trio.SocketStream, up: Any) -> None:
        if await up.read_request(stream) is not None:
            await stream.send_all(OK)
        if await up.read_request(stream) is not None:
            return  # read the whole second request, then drop the connection unanswered
        return

    upstream = await start_upstream(drop_the_second)
    base, _ = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    first = await http.request(base, "POST", "/v1/chat/completions", HEADERS, BODY)
    assert first.status == 200
    second = await http.request(base, "POST", "/v1/chat/completions", HEADERS, BODY)
    assert second.status == 429
    await trio.sleep(0.05)
    assert upstream.requests == 2  # the dropped POST was not sent a second time
    figure("T30", "POST dropped on a reused connection", "429, sent once", "never replayed")


async def test_idle_connections_the_backend_closed_are_swept_without_traffic(
    start_upstream: Any, start_guard: Any, http: Any, until: Any, figure: Any
) -> None:
    release = trio.Event()

    async def answer_then_close_later(stream: trio.SocketStream, up: Any) -> None:
        if await up.read_request(stream) is not None:
            await stream.send_all(OK)
            await release.wait()  # then close: the guard holds the connection idle meanwhile

    upstream = await start_upstream(answer_then_close_later)
    base, server = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    name = server.settings.backends[0].name
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(http.request, base, "POST", "/v1/chat/completions", HEADERS, BODY)
    assert server.pool.idle_count(name) == 4
    release.set()  # the backend closes all four (a restart, or its keep-alive timeout)
    started = trio.current_time()
    await until(lambda: server.pool.idle_count(name) == 0, timeout_s=10)
    took = trio.current_time() - started
    figure(
        "F10",
        "idle pool after the backend closed 4 connections",
        f"swept in {took:.1f} s",
        "no half-closed sockets kept",
    )


async def test_x_forwarded_for_named_in_connection_keeps_only_the_peer(
    start_upstream: Any, start_guard: Any, http: Any, recording_backend: Any
) -> None:
    upstream = await start_upstream(recording_backend([]))
    base, _ = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    for connection, expected in (
        ("keep-alive", b"x-forwarded-for: 10.9.9.9, 127.0.0.1"),
        ("keep-alive, X-Forwarded-For", b"x-forwarded-for: 127.0.0.1"),
    ):
        received = len(upstream.received)
        headers = [*HEADERS, ("X-Forwarded-For", "10.9.9.9"), ("Connection", connection)]
        reply = await http.request(base, "POST", "/v1/chat/completions", headers, BODY)
        assert reply.status == 200
        head = bytes(upstream.received[received:]).lower()
        assert expected in head, head
        assert head.count(b"x-forwarded-for") == 1
