"""The admin plane over real sockets: a simulated backend, a guard, and its admin plane on
127.0.0.1, read with plain HTTP and a real WebSocket client (trio-websocket).

Checks: ``/admin/state`` says what the guard published; every route wants the token (bearer
or Basic), unknown routes are 404 and other methods 405; the stream sends hello, one decision
per poll round and one admission per request outcome (admitted, refused after a wait, refused
at once, abandoned); ``kinds`` and ``sample`` filter it. The slow viewer, stopping and
``serve`` with the setting are in test_admin_plane_lifecycle.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from guard_adapters.admin_auth import CHALLENGE
from guard_adapters.admin_stream import keeps_admission
from guard_core.gate import current_limit
from guard_trio.admin import AdminPlane, serve_admin

TOKEN = "adm1n-token"
BEARER = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


def basic(password: str, user: str = "operator") -> list[tuple[str, str]]:
    encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
    return [("Authorization", f"Basic {encoded}")]


def guard_env(sim: str, **extra: str) -> dict[str, str]:
    return {
        "UPSTREAM": sim,
        "DYNAMIC_METRICS_URL": f"{sim}/metrics",
        "TOKEN": TOKEN,
        "DYNAMIC_POLL_INTERVAL_MS": "100",
        **extra,
    }


async def start_plane(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, **extra: str
) -> tuple[str, Any, AdminPlane]:
    sim, _ = await start_sim()
    guard, server = await start_guard(guard_env(sim, **extra))
    plane: AdminPlane = await nursery.start(serve_admin, server, "127.0.0.1", 0)
    return guard, server, plane


def ws_url(plane: AdminPlane, query: str = "") -> str:
    return f"ws://127.0.0.1:{plane.port}/admin/events{query}"


@asynccontextmanager
async def viewer(plane: AdminPlane, query: str = "") -> AsyncIterator[WebSocketConnection]:
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    async with open_websocket_url(ws_url(plane, query), extra_headers=headers) as ws:
        yield ws


async def next_message(ws: WebSocketConnection, kind: str, timeout_s: float = 5.0) -> Any:
    """The next message of ``kind`` (others are skipped), within ``timeout_s``."""
    with trio.fail_after(timeout_s):
        while True:
            message = json.loads(await ws.get_message())
            assert message["v"] == 1
            if message["type"] == kind:
                return message


async def messages_for(ws: WebSocketConnection, seconds: float) -> list[Any]:
    """Every message that arrives within ``seconds``."""
    got: list[Any] = []
    with trio.move_on_after(seconds):
        while True:
            got.append(json.loads(await ws.get_message()))
    return got


async def test_the_state_says_what_the_guard_published(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any
) -> None:
    # One poll only (the interval is long), so the state cannot move under the request.
    _, server, plane = await start_plane(
        nursery, start_sim, start_guard, DYNAMIC_POLL_INTERVAL_MS="600000"
    )
    reply = await http.request(plane.url, "GET", "/admin/state", BEARER)
    assert reply.status == 200
    assert reply.header("content-type") == b"application/json"
    assert reply.header("cache-control") == b"no-store"
    document = json.loads(reply.body)
    state = server.engine.state
    decision = state.published.decision
    assert (document["v"], document["type"], document["policy"]) == (1, "state", "pig")
    assert document["cap"] == current_limit(state.gate)[0] == decision.cap
    assert document["state"] == str(decision.state)
    assert document["limit_reason"] == str(decision.final_reason)
    assert document["source"] == "metrics"
    assert document["decision_at"] == decision.at
    assert document["in_flight"] == state.gate.inflight == 0
    assert document["running"] == decision.running
    assert [b["name"] for b in document["backends"]] == ["metrics1"]
    assert document["backends"][0]["failed"] is False
    assert document["admitted"] == {"basic": 0, "premium": 0}
    assert document["viewers"] == 0
    assert document["at"] >= decision.at


async def test_the_state_reads_the_guard_at_request_time(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any
) -> None:
    guard, _, plane = await start_plane(nursery, start_sim, start_guard)
    for tier, expected in (
        ("premium", {"basic": 0, "premium": 1}),
        ("", {"basic": 1, "premium": 1}),
    ):
        headers = [*BEARER, ("X-User-Tier", tier)] if tier else BEARER
        assert (await http.request(guard, "POST", CHAT, headers, BODY)).status == 200
        document = json.loads((await http.request(plane.url, "GET", "/admin/state", BEARER)).body)
        assert document["admitted"] == expected


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/admin/state", [], 401),
        ("GET", "/admin/state", [("Authorization", "Bearer wrong")], 401),
        ("GET", "/admin/state", basic("wrong"), 401),
        ("GET", "/admin/", [], 401),
        ("GET", "/admin/events", [], 401),
        ("GET", "/admin/state", basic(TOKEN), 200),
        ("HEAD", "/admin/state", BEARER, 200),
        ("GET", "/admin/state", basic(TOKEN, user=""), 200),
        ("GET", "/admin/", basic(TOKEN), 200),
        ("GET", "/admin", BEARER, 308),
        ("GET", "/admin/events", BEARER, 426),
        ("GET", "/admin/nothing", BEARER, 404),
        ("GET", "/admin/state/", BEARER, 404),
        ("GET", "/admin/%73tate", BEARER, 404),
        ("GET", "/", BEARER, 404),
        ("GET", "/v1/chat/completions", BEARER, 404),
        ("POST", "/admin/state", BEARER, 405),
        ("PUT", "/admin/", BEARER, 405),
        ("DELETE", "/admin/events", [], 405),
    ],
)
async def test_routes_methods_and_auth(
    nursery: trio.Nursery,
    start_sim: Any,
    start_guard: Any,
    http: Any,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    status: int,
) -> None:
    _, _, plane = await start_plane(nursery, start_sim, start_guard)
    reply = await http.request(plane.url, method, path, headers)
    assert reply.status == status, reply.body
    if status == 401:
        assert reply.header("www-authenticate") == CHALLENGE
        assert TOKEN.encode() not in reply.body
    if status == 405:
        assert reply.header("allow") == b"GET, HEAD"
    if status == 308:
        assert reply.header("location") == b"/admin/"


async def test_the_page_is_self_contained(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any
) -> None:
    _, _, plane = await start_plane(nursery, start_sim, start_guard)
    reply = await http.request(plane.url, "GET", "/admin/", BEARER)
    assert reply.header("content-type") == b"text/html; charset=utf-8"
    policy = reply.header("content-security-policy") or b""
    assert b"default-src 'none'" in policy
    assert b"connect-src 'self'" in policy
    page = reply.body.decode()
    assert "/admin/events" in page
    assert "<canvas" in page
    for outside in ("http://", "https://", "//cdn", "<link", "src="):
        assert outside not in page, outside


#: A WebSocket handshake's own headers (RFC 6455), sent by the plain HTTP client: a refused
#: handshake is an ordinary HTTP answer, read as one.
UPGRADE = [
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Key", base64.b64encode(b"0123456789abcdef").decode()),
    ("Sec-WebSocket-Version", "13"),
]


@pytest.mark.parametrize(
    ("query", "headers", "status"),
    [
        ("", [], 401),
        ("", [("Authorization", "Bearer wrong")], 401),
        ("", [*BEARER, ("Origin", "http://evil.example")], 403),
        ("", [*BEARER, ("Origin", "null")], 403),
        ("?kinds=nothing", BEARER, 400),
        ("?sample=2", BEARER, 400),
    ],
)
async def test_a_handshake_without_the_token_or_from_elsewhere_is_refused(
    nursery: trio.Nursery,
    start_sim: Any,
    start_guard: Any,
    http: Any,
    query: str,
    headers: list[tuple[str, str]],
    status: int,
) -> None:
    _, _, plane = await start_plane(nursery, start_sim, start_guard)
    connection = await http.connect(plane.url)
    try:
        await connection.send_request("GET", f"/admin/events{query}", [*UPGRADE, *headers])
        head = await connection.response_head()
        assert head.status_code == status
        if status == 401:
            assert (b"www-authenticate", CHALLENGE) in head.headers
    finally:
        await connection.aclose()


async def test_a_handshake_from_the_planes_own_origin_or_with_basic_credentials_is_let_in(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any
) -> None:
    _, _, plane = await start_plane(nursery, start_sim, start_guard)
    encoded = base64.b64encode(f"x:{TOKEN}".encode())
    headers = [
        (b"authorization", b"Basic " + encoded),
        (b"origin", f"http://127.0.0.1:{plane.port}".encode()),
    ]
    async with open_websocket_url(ws_url(plane), extra_headers=headers) as ws:
        assert (await next_message(ws, "hello"))["policy"] == "pig"


async def test_the_stream_says_hello_then_decisions_and_admissions(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    # One slot and a short wait: a second request waits, then is refused.
    guard, server, plane = await start_plane(
        nursery, start_sim, start_guard, GLOBAL_LIMIT="1", PIG_QUEUE_WAIT_SECONDS="0.3"
    )
    async with viewer(plane) as ws:
        hello = json.loads(await ws.get_message())
        assert hello["type"] == "hello"
        assert hello["policy"] == "pig"
        assert hello["backends"] == ["metrics1"]
        assert hello["kinds"] == ["decision", "admission"]
        assert isinstance(hello["version"], str)
        await until(lambda: len(plane.hub.viewers) == 1)

        first = await next_message(ws, "decision")
        second = await next_message(ws, "decision")
        assert second["at"] > first["at"]
        assert second["cap"] == current_limit(server.engine.state.gate)[0] == 1
        assert [b["name"] for b in second["backends"]] == ["metrics1"]

        premium = [*BEARER, ("X-User-Tier", "premium"), ("X-Request-Id", "first-premium")]
        answer = await http.request(guard, "POST", CHAT, premium, BODY)
        assert answer.status == 200
        admitted = await next_message(ws, "admission")
        assert (admitted["outcome"], admitted["tier"], admitted["reason"]) == (
            "admitted",
            "premium",
            None,
        )
        # The stream names the request as its answer did: by its X-Request-Id.
        assert admitted["id"] == "first-premium" == answer.header("x-request-id").decode()
        assert 0 <= admitted["waited_s"] < 0.3

        # Hold the only slot with a long stream; the next request waits 0.3 s, then is refused.
        holder = await http.connect(guard)
        stream_body = json.loads(BODY)
        stream_body.update(stream=True, max_tokens=2000)
        await holder.send_request("POST", CHAT, BEARER, json.dumps(stream_body).encode())
        await holder.response_head()
        held = await next_message(ws, "admission")
        assert held["outcome"] == "admitted"
        assert held["id"] != admitted["id"]

        assert (await http.request(guard, "POST", CHAT, BEARER, BODY)).status == 429
        refused = await next_message(ws, "admission")
        assert (refused["outcome"], refused["tier"], refused["reason"]) == (
            "refused",
            "basic",
            "global_dynamic_limit",  # the published cap is GLOBAL_LIMIT's 1 here
        )
        assert refused["waited_s"] == pytest.approx(0.3, abs=0.15)

        later = await next_message(ws, "decision")
        assert later["admitted"] == {"basic": 1, "premium": 1}
        assert later["refused"] == {"basic": 1, "premium": 0}
        assert later["in_flight"] == 1
        await holder.aclose()


async def test_a_client_that_leaves_while_waiting_is_abandoned(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any
) -> None:
    guard, _, plane = await start_plane(
        nursery, start_sim, start_guard, GLOBAL_LIMIT="1", PIG_QUEUE_WAIT_SECONDS="0.5"
    )
    async with viewer(plane, "?kinds=admission") as ws:
        holder = await http.connect(guard)
        stream_body = json.loads(BODY)
        stream_body.update(stream=True, max_tokens=2000)
        await holder.send_request("POST", CHAT, BEARER, json.dumps(stream_body).encode())
        await holder.response_head()
        assert (await next_message(ws, "admission"))["outcome"] == "admitted"
        waiter = await http.connect(guard)
        await waiter.send_request("POST", CHAT, BEARER, BODY)
        await trio.sleep(0.1)
        await waiter.aclose()  # it leaves while it waits for the slot
        left = await next_message(ws, "admission")
        assert (left["outcome"], left["reason"]) == ("abandoned", None)
        assert left["waited_s"] < 0.5
        await holder.aclose()


async def test_kinds_and_sample_filter_the_stream(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    guard, _, plane = await start_plane(
        nursery, start_sim, start_guard, GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0"
    )
    async with (
        viewer(plane) as everything,
        viewer(plane, "?kinds=decision") as decisions,
        viewer(plane, "?kinds=admission&sample=0.5") as sampled,
    ):
        hellos = [json.loads(await ws.get_message()) for ws in (everything, decisions, sampled)]
        assert [h["kinds"] for h in hellos] == [
            ["decision", "admission"],
            ["decision"],
            ["admission"],
        ]
        await until(lambda: len(plane.hub.viewers) == 3)
        connection = await http.connect(guard)
        for _ in range(40):  # GLOBAL_LIMIT=0: each is refused at once
            assert (await connection.request("POST", CHAT, BEARER, BODY)).status == 429
        await connection.aclose()
        await trio.sleep(0.3)  # a few poll rounds, too
        seen_all = await messages_for(everything, 0.3)
        seen_decisions = await messages_for(decisions, 0.1)
        seen_sampled = await messages_for(sampled, 0.1)
    all_ids = [m["id"] for m in seen_all if m["type"] == "admission"]
    assert len(all_ids) == 40
    assert any(m["type"] == "decision" for m in seen_all)
    assert seen_decisions
    assert all(m["type"] == "decision" for m in seen_decisions)
    assert all(m["type"] == "admission" for m in seen_sampled)
    kept = [m["id"] for m in seen_sampled]
    assert kept == [i for i in all_ids if keeps_admission(i, 0.5)]
    assert 0 < len(kept) < 40
