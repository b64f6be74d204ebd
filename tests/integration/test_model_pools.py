"""``PIG_POOLS``: the body's ``model`` picks the backends that serve it, an unknown model gets
OpenAI's 404 from the guard before any slot is asked for, and ``/v1/models`` lists them all."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import trio

from guard_adapters.config import ConfigError, load_config

CHAT = "/v1/chat/completions"


def body(model: str | None) -> bytes:
    document: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if model is not None:
        document["model"] = model
    return json.dumps(document).encode()


def accepted(server: Any) -> Counter[str]:
    return Counter({name: int(b.accepted.value) for name, b in server.metrics.backends.items()})


async def two_models(
    start_sim: Any, start_guard: Any, *, max_model_len: int = 8192, **extra: str
) -> tuple[str, Any]:
    alpha, _ = await start_sim(model="alpha", speed=20.0, max_model_len=max_model_len)
    beta, _ = await start_sim(model="beta", speed=20.0, max_model_len=max_model_len)
    started: tuple[str, Any] = await start_guard(
        {
            "BACKENDS": f"b0={alpha},b1={beta}",
            "PIG_POOLS": "alpha=b0; beta=b1",
            "DYNAMIC_PIG_ENABLED": "false",
            **extra,
        }
    )
    return started


async def test_the_model_picks_its_backends_and_an_unknown_one_is_404(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    guard, server = await two_models(start_sim, start_guard)
    for model, home in (("alpha", "b0"), ("beta", "b1")) * 3:
        before = accepted(server)
        reply = await http.request(guard, "POST", CHAT, [], body(model))
        assert reply.status == 200
        assert accepted(server) - before == Counter({home: 1})

    before = accepted(server)
    taken = int(server.metrics.tier_accepted[next(iter(server.metrics.tier_accepted))].value)
    missing = await http.request(guard, "POST", CHAT, [("X-Request-Id", "m-404")], body("gamma"))
    assert missing.status == 404
    error = json.loads(missing.body)["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "model_not_found",
        "invalid_request_error",
        "model",
    )
    assert "gamma" in error["message"]
    assert missing.header("x-request-id") == b"m-404"
    assert accepted(server) == before  # no backend saw it
    assert int(server.metrics.tier_accepted[next(iter(server.metrics.tier_accepted))].value) == (
        taken
    )
    assert server.engine.state.gate.inflight == 0

    # A body that names no model is not routed by model: it still gets an answer.
    assert (await http.request(guard, "POST", CHAT, [], body(None))).status == 200

    models = await http.request(guard, "GET", "/v1/models", [])
    assert models.status == 200
    listed = json.loads(models.body)
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]


async def test_an_unknown_model_is_404_even_when_every_slot_is_refused(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    guard, server = await two_models(
        start_sim, start_guard, GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0"
    )
    connection = await http.connect(guard)
    for _ in range(3):  # on one kept-alive connection, as a flood would come
        assert (await connection.request("POST", CHAT, [], body("gamma"))).status == 404
        assert (await connection.request("POST", CHAT, [], body("alpha"))).status == 429
    await connection.aclose()
    assert server.metrics.rejected.value == 3


@pytest.mark.parametrize(
    ("pools", "words"),
    [
        ("alpha=b9", "not in BACKENDS: b9"),
        ("alpha", "is not model=backend"),
        ("alpha=b0;alpha=b1", "a second time"),
        ("alpha=", "no backend"),
    ],
)
def test_a_bad_pools_setting_is_refused_with_its_reason(pools: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(
            {
                "BACKENDS": "b0=http://127.0.0.1:1,b1=http://127.0.0.1:2",
                "PIG_POOLS": pools,
                "DYNAMIC_PIG_ENABLED": "false",
            }
        )
    assert "PIG_POOLS" in str(refused.value)
    assert words in str(refused.value)


async def test_each_pool_has_its_own_cap_and_learns_from_its_own_backends(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    alpha, _ = await start_sim(model="alpha", speed=1.0)
    beta, _ = await start_sim(model="beta", speed=1.0)
    guard, server = await start_guard(
        {
            "BACKENDS": f"b0={alpha}|{alpha}/metrics,b1={beta}|{beta}/metrics",
            "PIG_POOLS": "alpha=b0;beta=b1",
            "DYNAMIC_PIG_ENABLED": "true",
            "DYNAMIC_PIG_ENFORCE": "false",  # learn, but keep GLOBAL_LIMIT as each pool's cap
            "DYNAMIC_POLL_INTERVAL_MS": "100",
            "GLOBAL_LIMIT": "2",
            "PIG_QUEUE_WAIT_SECONDS": "0",
        }
    )
    first, second = server.pools.engines
    assert (first.name, second.name) == ("alpha", "beta")
    # Each pool's engine polls its own backends only.
    await until(lambda: all(e.state.published.backends for e in server.pools.engines))
    assert [b.name for b in first.state.published.backends] == ["b0"]
    assert [b.name for b in second.state.published.backends] == ["b1"]

    premium = [("X-User-Tier", "premium")]
    stream = {"stream": True, "max_tokens": 400}
    held = json.dumps({"model": "alpha", "messages": [{"role": "user", "content": "x"}], **stream})
    async with trio.open_nursery() as holders:
        for _ in range(2):  # alpha's two slots
            holders.start_soon(http.request, guard, "POST", CHAT, premium, held.encode())
        await until(lambda: first.state.gate.inflight == 2)
        # alpha is full; beta, another pool with its own cap, is not.
        assert (await http.request(guard, "POST", CHAT, premium, body("alpha"))).status == 429
        assert (await http.request(guard, "POST", CHAT, premium, body("beta"))).status == 200
        assert second.state.gate.inflight == 0
        page = server.metrics.exposition().decode()  # /pig/metrics' bytes (it wants a TOKEN)
        assert 'inference_guard_pool_inflight{pool="alpha"} 2.0' in page
        assert 'inference_guard_pool_inflight{pool="beta"} 0.0' in page
        assert 'inference_guard_pool_limit{pool="beta"} 2.0' in page
        holders.cancel_scope.cancel()
    await until(lambda: first.state.gate.inflight == 0)


async def _chunked(guard: str, payload: bytes) -> bytes:
    """A chunked POST (a body the guard streams rather than holds); the answer's bytes."""
    host, port = guard.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    half = len(payload) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:half], payload[half:]))
    head = b"POST %s HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n" % CHAT.encode()
    await stream.send_all(head + b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    answer = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            answer += chunk
    await stream.aclose()
    return answer


async def test_a_streamed_body_is_routed_by_the_model_in_its_first_bytes(
    start_sim: Any, start_guard: Any
) -> None:
    guard, server = await two_models(start_sim, start_guard)
    before = accepted(server)
    answer = await _chunked(guard, body("beta"))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert accepted(server) - before == Counter({"b1": 1})
    assert b'"model_not_found"' in await _chunked(guard, body("gamma"))
    assert accepted(server) - before == Counter({"b1": 1})


async def test_a_long_streamed_body_goes_out_whole_after_its_first_bytes(
    start_sim: Any, start_guard: Any
) -> None:
    guard, server = await two_models(start_sim, start_guard, max_model_len=200_000)
    words = "ab " * 50_000  # 150 KB of few tokens: longer than the lead read
    long = json.dumps(
        {"model": "beta", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
    ).encode()
    assert len(long) > 140_000
    before = accepted(server)
    answer = await _chunked(guard, long)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert accepted(server) - before == Counter({"b1": 1})


async def test_discover_builds_the_pools_from_what_each_backend_lists(
    start_sim: Any, http: Any, nursery: trio.Nursery
) -> None:
    from guard_trio._discovery import DiscoveryError, discover_pools
    from guard_trio._server import GuardServer

    alpha, _ = await start_sim(model="alpha", speed=20.0)
    beta, _ = await start_sim(model="beta", speed=20.0)
    again, _ = await start_sim(model="alpha", speed=20.0)
    env = {
        "LISTEN": "127.0.0.1:0",
        "BACKENDS": f"b0={alpha},b1={beta},b2={again}",
        "PIG_POOLS": "discover",
        "DYNAMIC_PIG_ENABLED": "false",
    }
    settings = load_config(env)
    assert settings.discover_pools
    assert settings.model_pools is None
    found = await discover_pools(settings, wait_s=5)
    assert found.model_pools is not None
    assert dict(found.model_pools.by_model) == {"alpha": ("b0", "b2"), "beta": ("b1",)}
    server = GuardServer(found)
    host, port = await nursery.start(server.serve)
    guard = f"http://{host}:{port}"
    before = accepted(server)
    for _ in range(4):
        assert (await http.request(guard, "POST", CHAT, [], body("alpha"))).status == 200
    assert set((accepted(server) - before).keys()) <= {"b0", "b2"}
    assert (await http.request(guard, "POST", CHAT, [], body("gamma"))).status == 404

    # Nothing to build pools from: start-up says so instead of guessing.
    nothing = load_config({**env, "BACKENDS": "b0=http://127.0.0.1:9"})
    with pytest.raises(DiscoveryError, match="no backend listed a model"):
        await discover_pools(nothing, wait_s=0.5)


async def test_a_pooled_refusal_still_takes_the_fast_path_and_keeps_the_connection(
    start_sim: Any, start_guard: Any, http: Any, monkeypatch: Any
) -> None:
    from guard_trio import _proxy

    answered = {"fast": 0}
    admit_simple = _proxy.ProxyApp.admit_simple

    def counting(self: Any, request: Any, body: bytes = b"") -> Any:
        attempt, answer = admit_simple(self, request, body)
        answered["fast"] += answer is not None
        return attempt, answer

    monkeypatch.setattr(_proxy.ProxyApp, "admit_simple", counting)
    guard, server = await two_models(
        start_sim, start_guard, GLOBAL_LIMIT="0", PIG_QUEUE_WAIT_SECONDS="0"
    )
    first, second = server.pools.engines
    connection = await http.connect(guard)
    for model in ("alpha", "beta") * 3:
        assert (await connection.request("POST", CHAT, [], body(model))).status == 429
    # The unknown model goes on through h11 for its 404; the connection stays open after it.
    assert (await connection.request("POST", CHAT, [], body("gamma"))).status == 404
    assert (await connection.request("POST", CHAT, [], body("beta"))).status == 429
    await connection.aclose()
    assert answered["fast"] == 7  # every refusal from the head, in its own pool
    assert server.metrics.rejected.value == 7
    assert first.state.gate.inflight == second.state.gate.inflight == 0
    assert first.state.traffic.tier_rejects[0] == 3  # alpha's basic refusals
    assert second.state.traffic.tier_rejects[0] == 4  # beta's


async def test_the_recording_listener_hears_the_first_pool_only(
    start_sim: Any, http: Any, nursery: trio.Nursery
) -> None:
    from guard_core import Arrived
    from guard_trio._server import GuardServer

    alpha, _ = await start_sim(model="alpha", speed=20.0)
    beta, _ = await start_sim(model="beta", speed=20.0)
    settings = load_config(
        {
            "LISTEN": "127.0.0.1:0",
            "BACKENDS": f"b0={alpha},b1={beta}",
            "PIG_POOLS": "alpha=b0;beta=b1",
            "DYNAMIC_PIG_ENABLED": "false",
        }
    )
    heard: list[Any] = []
    server = GuardServer(settings, on_event=heard.append)
    host, port = await nursery.start(server.serve)
    guard = f"http://{host}:{port}"
    ids = [("X-Request-Id", "to-alpha")], [("X-Request-Id", "to-beta")]
    assert (await http.request(guard, "POST", CHAT, ids[0], body("alpha"))).status == 200
    assert (await http.request(guard, "POST", CHAT, ids[1], body("beta"))).status == 200
    # Its polls are the first pool's: so are the events it records (a replay folds one pool).
    assert [e.trace_id for e in heard if isinstance(e, Arrived)] == ["to-alpha"]
