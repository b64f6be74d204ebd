"""The picker decides as ``serve`` does: one sequence of requests, sent straight to a guard and
through Envoy to a picker with the same settings, gives the same request events in the same
order (the same admissions, waits and refusals with the same codes, the same releases)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from guard_core import FirstToken, RequestEvent
from tests.integration.conftest import HttpConnection, connect
from tests.integration.envoy_rig import start_envoy, start_picker

CHAT = "/v1/chat/completions"
SETTINGS = {
    "DYNAMIC_PIG_ENABLED": "false",
    "GLOBAL_LIMIT": "3",
    "PIG_QUEUE_WAIT_SECONDS": "0",
}


def body(max_tokens: int, *, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}],
        }
    ).encode()


def facts(events: list[RequestEvent]) -> list[tuple[Any, ...]]:
    """What was decided, without the times and engine numbers that differ between runs, and
    without first tokens (observations whose moment races the next request: counted apart)."""
    said = []
    for event in events:
        if isinstance(event, FirstToken):
            continue
        fields = {"code": getattr(event, "code", None), "tier": getattr(event, "tier", None)}
        status = getattr(event, "status", None)
        said.append((type(event).__name__, fields["tier"], fields["code"], status))
    return said


async def run_sequence(base: str, http: Any, settled: Any) -> list[int]:
    """Streams asked for by premium, basic and basic users, short requests by a basic and a
    premium user, then the first stream read to its end and one more basic request. (Every
    stream ends by itself: Envoy ends the picker's call alike whether the response ended or
    its client left, so the picker records the backend's status where serve records 499.)"""
    statuses: list[int] = []
    held: list[HttpConnection] = []
    for tier in ("premium", "basic", "basic"):
        connection = await connect(base)
        headers = [("Content-Type", "application/json"), ("X-User-Tier", tier)]
        await connection.send_request("POST", CHAT, headers, body(60, stream=True))
        head = await connection.response_head()
        statuses.append(head.status_code)
        if head.status_code == 200:
            held.append(connection)
        else:
            async for _ in connection.chunks():
                pass
            await connection.aclose()
        await settled()
    for tier in ("basic", "premium"):
        reply = await http.request(
            base,
            "POST",
            CHAT,
            [("Content-Type", "application/json"), ("X-User-Tier", tier)],
            body(4, stream=False),
        )
        statuses.append(reply.status)
        await settled()
    await read_to_the_end(held.pop(0))  # a stream that ends releases its slot
    await settled()
    reply = await http.request(
        base,
        "POST",
        CHAT,
        [("Content-Type", "application/json"), ("X-User-Tier", "basic")],
        body(4, stream=False),
    )
    statuses.append(reply.status)
    for connection in held:
        await read_to_the_end(connection)
    await settled()
    return statuses


async def read_to_the_end(connection: HttpConnection) -> None:
    async for _ in connection.chunks():
        pass
    await connection.aclose()


async def test_the_picker_decides_as_serve_does_for_the_same_requests(
    nursery: trio.Nursery, tmp_path: Path, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    backend, _sim = await start_sim(speed=0.5)
    served: list[RequestEvent] = []
    picked: list[RequestEvent] = []
    settings = {"UPSTREAM": backend, **SETTINGS}

    guard_url, guard = await start_guard(settings)
    guard.engine.on_event = served.append

    picker, picker_port, _url = await start_picker(nursery, settings, on_event=picked.append)
    # With the response body shown to the picker, it sees first tokens as serve does.
    front = await start_envoy(nursery, tmp_path, http, picker_port, stream_body=True)

    async def guard_settled() -> None:
        await trio.sleep(0.05)

    async def picker_settled() -> None:
        await trio.sleep(0.05)

    direct = await run_sequence(guard_url, http, guard_settled)
    await until(lambda: guard.engine.state.gate.inflight == 0)
    through_envoy = await run_sequence(front, http, picker_settled)
    await until(lambda: picker.engine.state.gate.inflight == 0)

    assert direct == through_envoy
    # The second basic stream would take the slot kept for premium; the premium request after
    # the basic refusal gets it.
    assert direct == [200, 200, 429, 429, 200, 200]
    assert facts(served) == facts(picked)
    first_tokens = [sum(isinstance(e, FirstToken) for e in run) for run in (served, picked)]
    assert first_tokens == [2, 2]  # one per admitted stream
    assert len(served) >= 12  # arrivals, forwards, refusals and finishes: a real sequence
