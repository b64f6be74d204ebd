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


async def two_models(start_sim: Any, start_guard: Any, **extra: str) -> tuple[str, Any]:
    alpha, _ = await start_sim(model="alpha", speed=20.0)
    beta, _ = await start_sim(model="beta", speed=20.0)
    return await start_guard(
        {
            "BACKENDS": f"b0={alpha},b1={beta}",
            "PIG_POOLS": "alpha=b0; beta=b1",
            "DYNAMIC_PIG_ENABLED": "false",
            **extra,
        }
    )


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
