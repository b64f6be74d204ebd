"""What the backend receives: the trusted priority, compat cleanup, output-token classification."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import h11
import trio

from guard_trio._proxy import TOO_MANY_REQUESTS_BODY

CHAT = "/v1/chat/completions"


async def recording_backend(
    nursery: trio.Nursery,
) -> tuple[str, list[tuple[dict[bytes, bytes], bytes]]]:
    """A backend that answers {} and remembers each request's headers and body."""
    seen: list[tuple[dict[bytes, bytes], bytes]] = []

    async def handler(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        headers: dict[bytes, bytes] = {}
        body = bytearray()
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        return
                    connection.receive_data(data)
                elif isinstance(event, h11.Request):
                    headers = dict(event.headers)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    seen.append((headers, bytes(body)))
                    response = h11.Response(status_code=200, headers=[("Content-Length", "2")])
                    await stream.send_all(
                        connection.send(response)
                        + connection.send(h11.Data(data=b"{}"))
                        + connection.send(h11.EndOfMessage())
                    )
                    return

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", seen


def env(upstream: str, **extra: str) -> dict[str, str]:
    return {"UPSTREAM": upstream, "DYNAMIC_PIG_ENABLED": "false", **extra}


async def test_the_backend_gets_the_trusted_priority_for_each_tier(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, server = await start_guard(env(upstream))
    body = (
        b'{"model": "m", "priority": -1000, "extra_body": {"priority": -5}, '
        b'"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}'
    )
    for tier_headers in ([("X-User-Tier", "premium")], [("X-User-Tier", "basic")], []):
        assert (await http.request(guard, "POST", CHAT, tier_headers, body)).status == 200
    sent = [json.loads(b) for _, b in seen]
    assert [doc["priority"] for doc in sent] == [-100, 0, 0]
    assert [doc["extra_body"]["priority"] for doc in sent] == [-100, 0, 0]
    assert all("tool_calls" not in doc["messages"][0] for doc in sent)
    assert seen[0][1].startswith(b'{"priority":-100,')
    assert seen[0][0][b"content-length"] == str(len(seen[0][1])).encode()
    assert server.metrics.priority_rewrites.value == 3


async def test_premium_only_leaves_basic_bodies_byte_identical(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, _ = await start_guard(env(upstream, BACKEND_PRIORITY_MODE="premium_only"))
    body = b'{ "model" : "m",  "messages": [{"role":"user","content":"hi","tool_calls": [] }] }'
    await http.request(guard, "POST", CHAT, [], body)
    await http.request(guard, "POST", CHAT, [("X-User-Tier", "premium")], body)
    assert seen[0][1] == body
    assert json.loads(seen[1][1])["priority"] == -100


async def test_a_malformed_body_is_forwarded_unchanged_or_refused_when_fail_closed(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, server = await start_guard(env(upstream))
    broken = b'{"model": "m", "messages": [1, 2'
    assert (await http.request(guard, "POST", CHAT, [], broken)).status == 200
    assert seen[-1][1] == broken
    assert server.metrics.priority_failed.value == 1
    strict, _ = await start_guard(
        env(upstream, BACKEND_PRIORITY_FAIL_OPEN="false", OPENAI_COMPAT_FAIL_OPEN="false")
    )
    refused = await http.request(strict, "POST", CHAT, [], broken)
    assert (refused.status, refused.body) == (429, TOO_MANY_REQUESTS_BODY)
    assert len(seen) == 1


async def test_a_large_body_is_rewritten_on_the_way_through(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, _ = await start_guard(env(upstream))
    text = "word " * 700_000  # about 3.5 MB: past the 2 MiB buffer, so streamed
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "priority": 7}
    ).encode()
    assert (
        await http.request(guard, "POST", CHAT, [("X-User-Tier", "premium")], body)
    ).status == 200
    headers, received = seen[-1]
    assert b"content-length" not in headers
    assert headers[b"transfer-encoding"] == b"chunked"
    doc = json.loads(received)
    assert doc["priority"] == -100
    assert doc["messages"][0]["content"] == text


async def test_output_token_classification_sets_the_header_and_the_lane(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, _ = await start_guard(env(upstream, CLASSIFY_OUTPUT_TOKENS="true"))
    for tokens in (10, 2000, 5000, 9000):
        body = json.dumps({"model": "m", "max_tokens": tokens}).encode()
        await http.request(guard, "POST", CHAT, [("X-PIG-Output-Tokens", "1")], body)
    assert [h[b"x-pig-output-tokens"] for h, _ in seen] == [b"10", b"2000", b"5000", b"9000"]
    assert [h[b"x-pig-lane"] for h, _ in seen] == [
        b"default",
        b"medium_output",
        b"long_output",
        b"very_long_output",
    ]


async def test_a_large_buffered_body_is_rewritten_off_the_event_loop(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    upstream, seen = await recording_backend(nursery)
    guard, _ = await start_guard(env(upstream))
    messages = [
        {"role": "user", "content": f"message {i}", "tool_calls": []} for i in range(20_000)
    ]
    body = json.dumps({"model": "m", "messages": messages}).encode()  # about 1.1 MB: buffered
    assert (await http.request(guard, "POST", CHAT, [], body)).status == 200
    doc = json.loads(seen[-1][1])
    assert doc["priority"] == 0
    assert len(doc["messages"]) == 20_000
    assert all("tool_calls" not in m for m in doc["messages"])


async def test_adaptive_output_thresholds_are_learned_by_the_core(
    start_guard: Any, http: Any, nursery: trio.Nursery
) -> None:
    """The intents the guard classifies are core state: they move the lane of later requests
    and the metrics page shows them."""
    upstream, seen = await recording_backend(nursery)
    adaptive = {"ADAPTIVE_OUTPUT_CLASSIFICATION": "true", "ADAPTIVE_OUTPUT_MIN_SAMPLES": "4"}
    guard, server = await start_guard(env(upstream, CLASSIFY_OUTPUT_TOKENS="true", **adaptive))
    for tokens in (3000, 3000, 3000, 3000, 2000):
        body = json.dumps({"model": "m", "max_tokens": tokens}).encode()
        await http.request(guard, "POST", CHAT, [], body)
    # Learned from the intents so far, the medium lane starts at 3000: 2000 is default now.
    assert seen[-1][0][b"x-pig-lane"] == b"default"
    assert server.engine.state.traffic.adaptive.samples == (3000, 3000, 3000, 3000, 2000)
    page = server.metrics.exposition().decode()
    assert "pig_adaptive_output_samples 5.0" in page
    assert 'pig_effective_output_threshold_tokens{lane="medium_output"} 3000.0' in page
