"""guard_core.placements: the router's memory of where each prefix key went."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import GuardConfig, GuardState
from guard_core.guard import apply_traffic_event, prompt_tokens_of
from guard_core.placements import Placements, cached_tokens, placed
from guard_core.traffic import BackendFinished, BackendForwarded

NAMES = ("a", "b", "c")

_PLACEMENT = st.tuples(
    st.none() | st.integers(0, 12), st.sampled_from(NAMES), st.integers(-5, 3000)
)


class _Reference:
    """The memory as the simulator kept it before the core did: an OrderedDict, oldest first."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.keys: OrderedDict[int, tuple[str, float, float]] = OrderedDict()
        self.sent = dict.fromkeys(NAMES, 0.0)

    def place(self, key: int | None, backend: str, tokens: int) -> None:
        self.sent[backend] += max(0, tokens)
        if key is None:
            return
        self.keys.pop(key, None)
        self.keys[key] = (backend, float(max(0, tokens)), self.sent[backend])
        while len(self.keys) > self.memory:
            self.keys.popitem(last=False)

    def cached(self, key: int | None, tokens: int, capacity: float | None) -> list[float]:
        out = [0.0] * len(NAMES)
        earlier = self.keys.get(key) if key is not None else None
        if earlier is None:
            return out
        backend, prompt, sent_after = earlier
        if capacity is None or self.sent[backend] - sent_after <= capacity:
            out[NAMES.index(backend)] = float(min(prompt, max(0, tokens)))
        return out


@given(
    memory=st.integers(1, 6),
    steps=st.lists(_PLACEMENT, max_size=60),
    probe=st.tuples(st.none() | st.integers(0, 12), st.integers(0, 3000)),
    capacity=st.none() | st.floats(0, 20_000),
)
def test_the_memory_matches_an_lru_of_the_latest_placements(
    memory: int,
    steps: list[tuple[int | None, str, int]],
    probe: tuple[int | None, int],
    capacity: float | None,
) -> None:
    reference = _Reference(memory)
    placements = Placements(memory=memory)
    for key, backend, tokens in steps:
        reference.place(key, backend, tokens)
        placements = placed(placements, key, backend, tokens)
        assert len(placements.keys) <= memory
        assert list(placements.keys) == list(reference.keys)
    key, tokens = probe
    expected = reference.cached(key, tokens, capacity)
    assert list(cached_tokens(placements, key, NAMES, tokens, capacity=capacity)) == expected


@given(steps=st.lists(_PLACEMENT, min_size=1, max_size=30))
def test_only_the_latest_backend_of_a_key_is_expected_to_hold_it(
    steps: list[tuple[int | None, str, int]],
) -> None:
    placements = Placements()
    for key, backend, tokens in steps:
        placements = placed(placements, key, backend, tokens)
    for key, backend, _ in reversed(steps):
        if key is None:
            continue
        held = cached_tokens(placements, key, NAMES, 10_000, capacity=None)
        assert [name for name, tokens in zip(NAMES, held, strict=True) if tokens] in ([], [backend])
        assert sum(1 for tokens in held if tokens) <= 1
        break


def test_a_key_is_forgotten_once_its_backend_was_sent_more_than_its_cache_holds() -> None:
    placements = placed(Placements(), 7, "a", 1000)
    assert cached_tokens(placements, 7, NAMES, 800, capacity=5000) == (800.0, 0.0, 0.0)
    placements = placed(placements, None, "a", 4000)  # still fits: 4,000 sent since
    assert cached_tokens(placements, 7, NAMES, 800, capacity=5000) == (800.0, 0.0, 0.0)
    placements = placed(placements, None, "b", 9000)  # another backend's traffic: no matter
    assert cached_tokens(placements, 7, NAMES, 800, capacity=5000) == (800.0, 0.0, 0.0)
    placements = placed(placements, 8, "a", 2000)  # 6,000 since: evicted from a's cache
    assert cached_tokens(placements, 7, NAMES, 800, capacity=5000) == (0.0, 0.0, 0.0)
    assert cached_tokens(placements, 7, NAMES, 800, capacity=None) == (800.0, 0.0, 0.0)


def test_a_memory_must_hold_a_key() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        Placements(memory=0)


def test_forwarded_requests_place_their_key_only_when_they_carry_their_size() -> None:
    """The core's traffic state keeps the memory; a forwarded event without a body size (PIG's
    routing, or affinity off) leaves it as it was, so nothing changes for PIG's users."""
    state = GuardState.initial(GuardConfig(), at=0.0)
    plain = apply_traffic_event(state, BackendForwarded(1.0, "a", 5))
    assert plain.traffic.placements == state.traffic.placements
    routed = apply_traffic_event(state, BackendForwarded(1.0, "b", 6, 42, 4000))
    tokens = prompt_tokens_of(state, 4000)
    assert tokens == 1000.0  # the learner's default of 4 bytes per token
    assert cached_tokens(routed.traffic.placements, 42, NAMES, tokens, capacity=None) == (
        0.0,
        1000.0,
        0.0,
    )
    assert routed.traffic.inflight_of("b") == 1
    ended = apply_traffic_event(routed, BackendFinished(2.0, "b"))
    assert ended.traffic.placements == routed.traffic.placements  # a finish forgets nothing
    assert ended.traffic.inflight_of("b") == 0
