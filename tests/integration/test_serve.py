"""``serve`` over real sockets: routing, auth, admission, streaming, errors, disconnects."""

from __future__ import annotations

import json
from typing import Any

import trio

from guard_trio._proxy import TOO_MANY_REQUESTS_BODY

TOKEN = "s3cret"
AUTH = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"


def chat_body(max_tokens: int = 4, *, stream: bool = False, **extra: Any) -> bytes:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    body.update(extra)
    return json.dumps(body).encode()


def guard_env(sim: str, **extra: str) -> dict[str, str]:
    return {"UPSTREAM": sim, "DYNAMIC_METRICS_URL": f"{sim}/metrics", "TOKEN": TOKEN, **extra}


async def test_healthz_and_the_auth_matrix(start_sim: Any, start_guard: Any, http: Any) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(guard_env(sim))
    reply = await http.request(guard, "GET", "/healthz")
    assert (reply.status, reply.body) == (200, b"ok\n")
    for path in ("/pig/metrics", "/v1/metrics", "/v1/upstream-status"):
        denied = await http.request(guard, "GET", path)
        assert (denied.status, denied.body) == (401, b"unauthorized\n")
        wrong = await http.request(guard, "GET", path, [("Authorization", "Bearer nope")])
        assert wrong.status == 401
        twice = await http.request(guard, "GET", path, AUTH + AUTH)
        assert twice.status == 401
        allowed = await http.request(guard, "GET", path, AUTH)
        assert allowed.status == 200
    for method in ("GET", "POST"):
        attest = await http.request(guard, method, "/v1/attestation/report")
        assert attest.status == 401
        assert json.loads(attest.body)["error"]["type"] == "AuthenticationError"
    assert (await http.request(guard, "POST", "/v1/attestation/report", AUTH)).status == 405
    # No dstack agent and no GPU here: the report fails closed.
    unavailable = await http.request(guard, "GET", "/v1/attestation/report", AUTH)
    assert unavailable.status == 500
    assert json.loads(unavailable.body)["detail"]
    chat = await http.request(
        guard, "POST", CHAT, [("Content-Type", "application/json")], chat_body()
    )
    assert chat.status == 401
    assert json.loads(chat.body)["error"]["code"] == 401
    ok = await http.request(guard, "POST", CHAT, AUTH, chat_body())
    assert ok.status == 200
    # GET to a generation path is not auth-checked and passes through without QoS.
    models = await http.request(guard, "GET", "/v1/models")
    assert models.status == 200


async def test_upstream_status_digit_after_a_healthy_poll(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(guard_env(sim))
    reply = await http.request(guard, "GET", "/v1/upstream-status", AUTH)
    assert (reply.status, reply.body) == (200, b"0\n")


async def test_before_the_first_poll_admitted_requests_get_429_at_once(
    start_guard: Any, http: Any
) -> None:
    # The metrics URL answers nothing: the guard stays closed and says so at once.
    guard, _server = await start_guard(
        {"UPSTREAM": "http://127.0.0.1:9", "DYNAMIC_METRICS_URL": "http://127.0.0.1:9/metrics"},
        poll=False,
    )
    start = trio.current_time()
    reply = await http.request(guard, "POST", CHAT, [], chat_body())
    assert reply.status == 429
    assert reply.body == TOO_MANY_REQUESTS_BODY
    assert reply.header("retry-after") == b"1"
    assert reply.header("content-type") == b"application/json"
    assert trio.current_time() - start < 0.4


async def test_streaming_passes_through_and_feeds_semantic_ttft(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard(guard_env(sim))
    connection = await http.connect(guard)
    await connection.send_request(
        "POST", CHAT, [*AUTH, ("X-User-Tier", "premium")], chat_body(8, stream=True)
    )
    head = await connection.response_head()
    assert head.status_code == 200
    body = b"".join([chunk async for chunk in connection.chunks()])
    await connection.aclose()
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b'"content"') >= 8
    semantic = server.engine.state.learner.semantic_ttft
    assert semantic is not None
    assert semantic.count == 1
    # The guard releases the slot right after its last write; the client may see the end first.
    await until(lambda: server.engine.state.gate.inflight == 0, 1.0)


async def test_overload_gets_the_exact_429_with_retry_after(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(
        guard_env(sim, GLOBAL_LIMIT="1", DYNAMIC_PIG_ENABLED="false", PIG_QUEUE_WAIT_SECONDS="0")
    )
    holder = await http.connect(guard)
    await holder.send_request("POST", CHAT, AUTH, chat_body(400, stream=True))
    assert (await holder.response_head()).status_code == 200
    refused = await http.request(guard, "POST", CHAT, AUTH, chat_body())
    assert refused.status == 429
    assert refused.body == TOO_MANY_REQUESTS_BODY
    assert refused.header("retry-after") == b"1"
    await holder.aclose()


async def test_client_pig_headers_are_removed_and_trusted_ones_added(
    start_guard: Any, http: Any, nursery: Any
) -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def echo(stream: trio.SocketStream) -> None:
        import h11

        connection = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    connection.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    seen.append(list(event.headers))
                if isinstance(event, h11.EndOfMessage):
                    body = b"{}"
                    await stream.send_all(
                        connection.send(
                            h11.Response(
                                status_code=200,
                                headers=[
                                    ("Content-Length", "2"),
                                    ("Content-Type", "application/json"),
                                ],
                            )
                        )
                        + connection.send(h11.Data(data=body))
                        + connection.send(h11.EndOfMessage())
                    )
                    return

    from functools import partial

    listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    guard, _ = await start_guard(
        {"UPSTREAM": f"http://127.0.0.1:{port}", "DYNAMIC_PIG_ENABLED": "false"}
    )
    reply = await http.request(
        guard,
        "POST",
        CHAT,
        [
            ("X-User-Tier", "premium"),
            ("X-PIG-Tier", "forged"),
            ("X-PIG-Output-Tokens", "1"),
            ("Connection", "keep-alive, x-drop"),
            ("X-Drop", "1"),
        ],
        b"{}",
    )
    assert reply.status == 200
    headers = dict(seen[0])
    assert headers[b"x-pig-tier"] == b"premium"
    assert headers[b"x-pig-backend"] == b"backend1"
    assert b"x-pig-output-tokens" not in headers
    assert b"x-drop" not in headers
    assert headers[b"host"] == f"127.0.0.1:{port}".encode()
    assert headers[b"x-forwarded-for"] == b"127.0.0.1"


async def test_client_caused_500_becomes_400(start_sim: Any, start_guard: Any, http: Any) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(guard_env(sim))
    reply = await http.request(
        guard, "POST", CHAT, AUTH, chat_body(sim_error="context_length_exceeded")
    )
    assert reply.status == 400
    error = json.loads(reply.body)["error"]
    assert error["type"] == "BadRequestError"
    assert "maximum context length" in error["message"]


async def test_a_client_leaving_mid_stream_frees_the_slot_and_the_backend(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, backend = await start_sim()
    guard, server = await start_guard(guard_env(sim))
    connection = await http.connect(guard)
    await connection.send_request("POST", CHAT, AUTH, chat_body(2000, stream=True))
    assert (await connection.response_head()).status_code == 200
    assert await connection.next_chunk()
    assert server.engine.state.gate.inflight == 1
    await until(lambda: backend.engine_metrics().running == 1)
    await connection.aclose()
    start = trio.current_time()
    await until(lambda: server.engine.state.gate.inflight == 0, 2.0)
    await until(lambda: backend.engine_metrics().running == 0, 2.0)
    assert trio.current_time() - start < 0.5


async def test_hostile_heads_are_refused(start_sim: Any, start_guard: Any, http: Any) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(guard_env(sim))
    host, port = guard.removeprefix("http://").split(":")

    async def raw(data: bytes) -> bytes:
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(data)
            received = b""
            with trio.move_on_after(2):
                while chunk := await stream.receive_some(65536):
                    received += chunk
            return received

    both = await raw(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    assert both.startswith(b"HTTP/1.1 400")
    many = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: y\r\n" % i for i in range(101))
        + b"\r\n"
    )
    assert (await raw(many)).startswith(b"HTTP/1.1 431")
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 17000 + b"\r\n\r\n"
    assert (await raw(big)).startswith(b"HTTP/1.1 431")
    garbage = await raw(b"NOT HTTP AT ALL\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400")


async def test_an_unreachable_backend_answers_429_on_every_path(
    start_guard: Any, http: Any
) -> None:
    guard, _ = await start_guard({"UPSTREAM": "http://127.0.0.1:9", "DYNAMIC_PIG_ENABLED": "false"})
    for method, path, body in (("POST", CHAT, chat_body()), ("GET", "/v1/models", b"")):
        reply = await http.request(guard, method, path, [], body)
        assert reply.status == 429
        assert reply.body == TOO_MANY_REQUESTS_BODY


async def test_proxy_timeout_before_the_response_head_is_a_429(
    start_guard: Any, http: Any, nursery: Any, until: Any
) -> None:
    from functools import partial

    async def silent(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    guard, server = await start_guard(
        {
            "UPSTREAM": f"http://127.0.0.1:{port}",
            "DYNAMIC_PIG_ENABLED": "false",
            "PROXY_TIMEOUT_SECONDS": "1",
        }
    )
    start = trio.current_time()
    reply = await http.request(guard, "POST", CHAT, [], chat_body())
    assert reply.status == 429
    assert 0.9 <= trio.current_time() - start < 3
    await until(lambda: server.engine.state.gate.inflight == 0, 1.0)


def metric_value(page: bytes, metric: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


async def test_pig_metrics_follow_the_traffic(start_sim: Any, start_guard: Any, http: Any) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard(
        guard_env(sim, GLOBAL_LIMIT="1", PIG_QUEUE_WAIT_SECONDS="0"), poll=True
    )
    holder = await http.connect(guard)
    await holder.send_request(
        "POST", CHAT, [*AUTH, ("X-User-Tier", "premium")], chat_body(300, stream=True)
    )
    assert (await holder.response_head()).status_code == 200
    refused = await http.request(guard, "POST", CHAT, AUTH, chat_body())
    assert refused.status == 429
    page = (await http.request(guard, "GET", "/pig/metrics", AUTH)).body
    assert metric_value(page, "pig_tier_requests_total", tier="premium", decision="accepted") == 1
    assert metric_value(page, "pig_tier_requests_total", tier="basic", decision="rejected") == 1
    assert metric_value(page, "pig_rejected_total") == 1
    assert metric_value(page, "pig_tier_inflight", tier="premium") == 1
    assert metric_value(page, "pig_dynamic_poll_total", result="ok") >= 1  # type: ignore[operator]
    assert metric_value(page, "pig_dynamic_global_limit") == 1
    assert metric_value(page, "pig_backend_inflight", name="backend1") == 1
    await holder.aclose()
    status = server.status()
    assert status.startswith("pig_status v=")
    assert "limit=1" in status


async def test_the_lane_header_follows_the_body_size(
    start_guard: Any, http: Any, nursery: Any
) -> None:
    from functools import partial

    import h11

    lanes: list[bytes] = []

    async def echo(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        return
                    connection.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    lanes.append(dict(event.headers)[b"x-pig-lane"])
                if isinstance(event, h11.EndOfMessage):
                    response = h11.Response(status_code=200, headers=[("Content-Length", "0")])
                    await stream.send_all(
                        connection.send(response) + connection.send(h11.EndOfMessage())
                    )
                    return

    listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    guard, _ = await start_guard(
        {"UPSTREAM": f"http://127.0.0.1:{port}", "DYNAMIC_PIG_ENABLED": "false"}
    )
    for size in (10, 60_000, 100_000, 600_000):
        assert (await http.request(guard, "POST", CHAT, [], b"x" * size)).status == 200
    assert lanes == [b"default", b"medium_body", b"long_body", b"very_long_body"]


async def test_sse_keepalive_comments_fill_upstream_silence(
    start_guard: Any, http: Any, nursery: Any
) -> None:
    from functools import partial

    import h11

    async def slow_sse(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        async with stream:
            while not isinstance(event := connection.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some(65536))
            head = h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream")])
            await stream.send_all(
                connection.send(head) + connection.send(h11.Data(data=b"data: 1\n\n"))
            )
            await trio.sleep(2.3)
            await stream.send_all(
                connection.send(h11.Data(data=b"data: 2\n\n")) + connection.send(h11.EndOfMessage())
            )

    listeners = await nursery.start(partial(trio.serve_tcp, slow_sse, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    guard, server = await start_guard(
        {
            "UPSTREAM": f"http://127.0.0.1:{port}",
            "DYNAMIC_PIG_ENABLED": "false",
            "SSE_KEEPALIVE_ENABLED": "true",
        }
    )
    reply = await http.request(guard, "POST", CHAT, [("Accept", "text/event-stream")], b"{}")
    assert reply.body == b"data: 1\n\n: keep-alive\n\ndata: 2\n\n"
    assert server.metrics.sse_keepalive_streams.value == 1
    assert server.metrics.sse_keepalive_comments.value == 1


async def test_early_bridge_opens_a_stream_while_the_backend_is_slow(
    start_guard: Any, http: Any, nursery: Any, until: Any
) -> None:
    from functools import partial

    import h11

    behaviour: dict[str, str] = {}

    async def late(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        async with stream:
            while not isinstance(event := connection.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some(65536))
            await trio.sleep(0.8)
            if behaviour["mode"] == "close":
                return
            if behaviour["mode"] == "404":
                head = h11.Response(status_code=404, headers=[("Content-Length", "9")])
                await stream.send_all(
                    connection.send(head)
                    + connection.send(h11.Data(data=b"not here\n"))
                    + connection.send(h11.EndOfMessage())
                )
                return
            head = h11.Response(
                status_code=200,
                headers=[("Content-Type", "text/event-stream"), ("X-Upstream", "1")],
            )
            await stream.send_all(
                connection.send(head)
                + connection.send(
                    h11.Data(data=b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
                )
                + connection.send(h11.EndOfMessage())
            )

    listeners = await nursery.start(partial(trio.serve_tcp, late, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    guard, server = await start_guard(
        {
            "UPSTREAM": f"http://127.0.0.1:{port}",
            "DYNAMIC_PIG_ENABLED": "false",
            "SSE_EARLY_BRIDGE_ENABLED": "true",
        }
    )
    body = b'{"stream": true}'

    behaviour["mode"] = "ok"
    connection = await http.connect(guard)
    start = trio.current_time()
    await connection.send_request("POST", CHAT, [], body)
    head = await connection.response_head()
    assert head.status_code == 200
    assert trio.current_time() - start < 0.75  # the bridge opened before the backend answered
    assert dict(head.headers)[b"content-type"] == b"text/event-stream"
    assert b"x-upstream" not in dict(head.headers)
    streamed = b"".join([chunk async for chunk in connection.chunks()])
    await connection.aclose()
    assert streamed == b': keep-alive\n\ndata: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    assert server.metrics.sse_bridge_streams.value == 1
    semantic = server.engine.state.learner.semantic_ttft
    assert semantic is not None
    assert semantic.count == 1

    behaviour["mode"] = "404"
    reply = await http.request(guard, "POST", CHAT, [], body)
    assert (reply.status, reply.body) == (200, b": keep-alive\n\n")
    assert server.metrics.sse_bridge_invalid_upstream.value == 1

    behaviour["mode"] = "close"
    reply = await http.request(guard, "POST", CHAT, [], body)
    assert (reply.status, reply.body) == (200, b": keep-alive\n\n")
    # The exchange ends (and is counted) once the broken backend connection is closed too,
    # which may come just after the client has its last byte.
    await until(lambda: server.metrics.sse_bridge_upstream_errors.value >= 1)
    assert server.metrics.sse_bridge_upstream_errors.value == 1

    # A request that does not ask for a stream never gets the bridge.
    behaviour["mode"] = "ok"
    plain = await http.request(guard, "POST", CHAT, [], b"{}")
    assert plain.header("x-upstream") == b"1"


async def test_v1_metrics_appends_each_backend_page(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(guard_env(sim))
    page = (await http.request(guard, "GET", "/v1/metrics", AUTH)).body
    local, _, backends = page.partition(b"\n# --- Backend Metrics ---\n")
    assert b"pig_dynamic_global_limit" in local
    assert f"# --- backend backend1 {sim}/metrics ---".encode() in backends
    assert b"vllm:num_requests_running" in backends


async def test_a_slow_request_head_gets_408(start_sim: Any, http: Any, nursery: Any) -> None:
    from guard_adapters.config import load_config
    from guard_trio._server import GuardServer

    sim, _ = await start_sim()
    settings = load_config(
        {"LISTEN": "127.0.0.1:0", "UPSTREAM": sim, "DYNAMIC_PIG_ENABLED": "false"}
    )
    server = GuardServer(settings, header_timeout_s=0.3)
    host, port = await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        received = b""
        with trio.fail_after(3):
            while chunk := await stream.receive_some(65536):
                received += chunk
    assert received.startswith(b"HTTP/1.1 408")
