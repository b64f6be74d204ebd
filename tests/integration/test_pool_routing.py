"""``PIG_ROUTING=guard`` through the proxy, over several sim-backends on loopback: requests that
share a prompt prefix (or a session) share a backend, a hot prefix is spread within the load
bound, and a throttled backend gets less work."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import trio

from guard_core.affinity import load_bound
from guard_core.guard import prompt_tokens_of
from guard_core.placements import cached_tokens

CHAT = "/v1/chat/completions"


def chat(system: str, question: str, **extra: Any) -> bytes:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        **extra,
    }
    return json.dumps(body).encode()


async def pool(start_sim: Any, count: int, **config: Any) -> dict[str, str]:
    named = {}
    for index in range(count):
        url, _ = await start_sim(**{"speed": 20.0, **config.get(f"b{index}", {})})
        named[f"b{index}"] = url
    return named


def env(named: dict[str, str], *, metrics: bool = False, **extra: str) -> dict[str, str]:
    entries = ",".join(
        f"{name}={url}|{url}/metrics" if metrics else f"{name}={url}" for name, url in named.items()
    )
    return {"BACKENDS": entries, "PIG_ROUTING": "guard", **extra}


def accepted(server: Any) -> Counter[str]:
    return Counter({name: int(b.accepted.value) for name, b in server.metrics.backends.items()})


async def test_a_conversation_or_a_session_keeps_its_backend(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    named = await pool(start_sim, 3)
    guard, server = await start_guard(
        env(named, DYNAMIC_PIG_ENABLED="false", PIG_AFFINITY_HEADER="X-Session")
    )
    homes: dict[int, set[str]] = {}
    conversations: dict[int, list[dict[str, str]]] = {
        n: [
            {"role": "system", "content": "Answer tersely."},
            {"role": "user", "content": f"Conversation {n}: what is a prefix cache?"},
        ]
        for n in range(8)
    }
    for turn in range(4):
        for n, messages in conversations.items():
            before = accepted(server)
            body = json.dumps({"model": "m", "messages": messages, "max_tokens": 4}).encode()
            reply = await http.request(guard, "POST", CHAT, [], body)
            assert reply.status == 200
            (went,) = (accepted(server) - before).keys()
            homes.setdefault(n, set()).add(went)
            messages += [
                {"role": "assistant", "content": f"answer {turn}"},
                {"role": "user", "content": f"and then {turn}?"},
            ]
    # One at a time nothing passes the bound: every turn of a conversation found its backend,
    # and the conversations spread over the pool.
    hits = sum(len(backends) == 1 for backends in homes.values())
    assert hits == len(homes), homes
    assert len({next(iter(b)) for b in homes.values()}) > 1

    # A trusted session header wins over the prompt: different prompts, one backend.
    sessions: set[str] = set()
    for turn in range(6):
        before = accepted(server)
        body = chat(f"prompt {turn}", "hello")
        reply = await http.request(guard, "POST", CHAT, [("X-Session", "user-77")], body)
        assert reply.status == 200
        sessions |= set((accepted(server) - before).keys())
    assert len(sessions) == 1

    # Every pick was the pool router's, and the metrics page says by which rule: the later
    # turns of each conversation and the session's requests found their backend by affinity.
    routed = {
        reason: sum(int(b.routed[reason].value) for b in server.metrics.backends.values())
        for reason in ("affinity", "ranked", "choice")
    }
    assert routed["choice"] == 0
    assert routed["affinity"] + routed["ranked"] == sum(accepted(server).values()) == 38
    assert routed["affinity"] >= 8 * 3 + 5, routed
    page = server.metrics.exposition().decode()
    affinity = sum(
        float(line.rpartition(" ")[2])
        for line in page.splitlines()
        if line.startswith("inference_guard_backend_routed_total{") and 'reason="affinity"' in line
    )
    assert affinity == routed["affinity"]


async def test_a_hot_prefix_is_spread_within_the_load_bound(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    named = await pool(start_sim, 3, **{f"b{i}": {"speed": 1.0} for i in range(3)})
    guard, server = await start_guard(
        env(named, DYNAMIC_PIG_ENABLED="false", PIG_AFFINITY_BOUND="1.25", GLOBAL_LIMIT="100")
    )
    hot = chat("One very popular system prompt.", "go", max_tokens=200, stream=True)
    peak: Counter[str] = Counter()
    total_peak = 0

    async def watch() -> None:
        nonlocal total_peak
        while True:
            now = {name: server.engine.state.traffic.inflight_of(name) for name in named}
            for name, count in now.items():
                peak[name] = max(peak[name], count)
            total_peak = max(total_peak, sum(now.values()))
            await trio.sleep(0.005)

    async with trio.open_nursery() as clients:
        clients.start_soon(watch)
        async with trio.open_nursery() as burst:
            for _ in range(24):
                burst.start_soon(http.request, guard, "POST", CHAT, [], hot)
                await trio.sleep(0.01)
        clients.cancel_scope.cancel()
    assert total_peak >= 12  # the burst overlapped
    # No backend ever held more than the bound allows at the pool's peak, and all three served.
    limit = load_bound(total_peak - 1, 3, 1.25)
    assert max(peak.values()) <= limit, (peak, limit)
    assert min(accepted(server).values()) > 0  # the hot prefix overflowed its own backend


async def test_a_throttled_backend_gets_less_work(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    named = await pool(start_sim, 2, b0={"speed": 1.0}, b1={"speed": 0.25})
    guard, server = await start_guard(
        env(named, metrics=True, DYNAMIC_POLL_INTERVAL_MS="100", DYNAMIC_PIG_ENFORCE="false")
    )
    await until(lambda: server.poller.rounds >= 2)

    async def one(index: int) -> None:
        body = chat(
            "Shared instructions.", f"q{index}", user=f"user-{index}", max_tokens=60, stream=True
        )
        await http.request(guard, "POST", CHAT, [], body)

    async with trio.open_nursery() as clients:
        for index in range(40):
            clients.start_soon(one, index)
            await trio.sleep(0.05)
    served = accepted(server)
    assert served["b0"] + served["b1"] == 40
    assert served["b1"] < served["b0"], served


async def test_the_live_router_remembers_where_each_prefix_went_in_the_core(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    """The proxy tells the core each placement (the request's prefix key and size with its
    backend), so the router's estimate of a warm cache is the simulator's, kept as core state:
    a request sharing a prefix is expected to find it cached where the last one went, and only
    there."""
    named = await pool(start_sim, 3)
    guard, server = await start_guard(env(named, DYNAMIC_PIG_ENABLED="false"))
    keying = server.app.relay.keying
    assert keying is not None
    names = tuple(named)
    for n in range(6):
        body = chat(f"System prompt number {n}, long enough to matter.", "hello")
        before = accepted(server)
        reply = await http.request(guard, "POST", CHAT, [], body)
        assert reply.status == 200
        (went,) = (accepted(server) - before).keys()
        key = keying.key([], [body])
        assert key is not None
        placements = server.engine.state.traffic.placements
        assert placements.keys[key].backend == went
        expected = prompt_tokens_of(server.engine.state, len(body))
        held = cached_tokens(placements, key, names, expected, capacity=None)
        assert held == tuple(expected if name == went else 0.0 for name in names)
    assert len(server.engine.state.traffic.placements.keys) == 6
    assert sum(server.engine.state.traffic.placements.sent.values()) > 0
