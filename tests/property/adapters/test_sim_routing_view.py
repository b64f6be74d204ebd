"""The simulated routers' view (guard_adapters.sim_routing.RoutingView) and the guard router's
memory of where each prefix key went."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from guard_adapters.sim_routing import (
    GuardRouting,
    LeastLoaded,
    RoundRobin,
    RoutedRequest,
    RoutingView,
)
from guard_adapters.simulation import simulate
from guard_adapters.traces import head, load_trace

MOONCAKE = Path(__file__).parents[2] / "fixtures/traces/mooncake-fast25-conversation-trace.jsonl"
NAMES = ("a", "b", "c")


def view(
    hash_ids: tuple[int, ...],
    *,
    prompt: int = 4000,
    pending: tuple[int, ...] = (0, 0, 0),
    loads: tuple[int, ...] = (0, 0, 0),
    cache_tokens: int | None = 50_000,
) -> RoutingView:
    return RoutingView(
        request=RoutedRequest(prompt_tokens=prompt, body_bytes=4 * prompt, hash_ids=hash_ids),
        names=NAMES,
        loads=loads,
        pending_tokens=pending,
        cache_tokens=cache_tokens,
    )


def test_a_key_follows_its_backend_while_the_cache_can_still_hold_it() -> None:
    router = GuardRouting()
    first = router.choose(view((1, 2, 3)))
    # The same conversation again, its backend with a little more queued than the others: the
    # expected cache gain (the earlier 4,000 tokens) beats the 3,000 tokens queued in front.
    queued = tuple(3000 if i == first else 0 for i in range(3))
    assert router.choose(view((1, 2, 3, 4), pending=queued)) == first
    # A queue longer than the gain: the request goes elsewhere.
    longer = tuple(9000 if i == first else 0 for i in range(3))
    assert router.choose(view((1, 2, 3, 4, 5), pending=longer)) != first


def test_a_key_whose_blocks_were_pushed_out_has_no_gain_left() -> None:
    router = GuardRouting()
    first = router.choose(view((7, 8), cache_tokens=10_000))
    # More than the cache holds goes to that backend under other keys (all other backends busy).
    busy = tuple(0 if i == first else 40 for i in range(3))
    for n in range(3):
        assert router.choose(view((100 + n, 1), cache_tokens=10_000, loads=busy)) == first
    queued = tuple(1000 if i == first else 0 for i in range(3))
    assert router.choose(view((7, 8, 9), cache_tokens=10_000, pending=queued)) != first


@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=40))
def test_the_memory_is_bounded(keys: list[int]) -> None:
    router = GuardRouting(memory=8)
    for key in keys:
        router.choose(view((key, key + 1)))
    assert router.remembered() == min(8, len(set(keys)))


class _Watching:
    """A router that places like least-loaded and keeps every view it was given."""

    name = "least-loaded"

    def __init__(self) -> None:
        self.inner = LeastLoaded()
        self.views: list[RoutingView] = []

    def choose(self, view: RoutingView) -> int:
        self.views.append(view)
        return self.inner.choose(view)

    def reasons(self) -> Mapping[str, int]:
        return {}


@settings(max_examples=5, deadline=None)
@given(st.sampled_from(["static:16", "predictive"]), st.sampled_from([1.0, 3.0]))
def test_the_simulation_gives_each_backends_pending_prefill(policy: str, slow: float) -> None:
    trace = list(head(load_trace(MOONCAKE), 60))
    watching = _Watching()
    simulate(trace, policy, backends=3, slow_backend=slow, routing=watching)
    assert watching.views
    longest = max(r.prompt_tokens for r in trace)
    for seen in watching.views:
        assert len(seen.pending_tokens) == len(seen.names) == 3
        for pending, load in zip(seen.pending_tokens, seen.loads, strict=True):
            assert 0 <= pending <= load * longest
    assert any(sum(seen.pending_tokens) > 0 for seen in watching.views)


def test_round_robin_and_least_loaded_read_only_the_view() -> None:
    robin = RoundRobin()
    assert [robin.choose(view(())) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoaded().choose(view((), loads=(3, 1, 1))) == 1
