"""The backend for one request (guard_core.backend_pick): PIG's choice alone without a ring,
the pool router with one, never a backend already tried."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from guard_core import GuardConfig, GuardState
from guard_core.affinity import build_ring
from guard_core.backend_choice import backend_views, choose_backend
from guard_core.backend_pick import CHOICE, REASONS, Routing, pick_backend
from guard_core.guard import apply_health_event, apply_traffic_event
from guard_core.health import BackendFailed, Failure
from guard_core.traffic import BackendForwarded

NAMES = ("b0", "b1", "b2", "b3")

loads = st.lists(st.integers(min_value=0, max_value=6), min_size=4, max_size=4)
failures = st.lists(st.integers(min_value=0, max_value=4), min_size=4, max_size=4)
tried_sets = st.frozensets(st.integers(min_value=0, max_value=3), max_size=4)
keys = st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1))


def pool_state(inflight: list[int], failed: list[int]) -> GuardState:
    state = GuardState.initial(GuardConfig(), at=0.0)
    for name, count, fails in zip(NAMES, inflight, failed, strict=True):
        for _ in range(count):
            state = apply_traffic_event(state, BackendForwarded(1.0, name))
        for _ in range(fails):
            state = apply_health_event(state, BackendFailed(1.0, name, Failure.CONNECT))
    return state


@given(loads, failures, tried_sets, st.booleans())
def test_without_a_ring_the_pick_is_pig_choice(
    inflight: list[int], failed: list[int], tried: frozenset[int], dynamic: bool
) -> None:
    state = pool_state(inflight, failed)
    routing = Routing(poll_interval_s=1.0, dynamic=dynamic)
    picked = pick_backend(state, NAMES, routing, now=2.0, tried=tried)
    views = backend_views(NAMES, state.published, state.traffic, state.health)
    expected = choose_backend(
        views,
        now=2.0,
        poll_interval_s=1.0,
        dynamic=dynamic,
        capacity_ratio=state.config.policy.capacity_ratio,
        target_user_tps=state.config.policy.user_tps_yellow,
        tried=tried,
    )
    assert (None if picked is None else picked.index) == expected
    assert picked is None or picked.reason == CHOICE


@given(loads, failures, tried_sets, keys)
def test_with_a_ring_the_pick_names_the_router_rule_that_chose(
    inflight: list[int], failed: list[int], tried: frozenset[int], key: int | None
) -> None:
    state = pool_state(inflight, failed)
    ring = build_ring(NAMES)
    routing = Routing(poll_interval_s=1.0, dynamic=True, ring=ring)
    picked = pick_backend(state, NAMES, routing, now=2.0, key=key, tried=tried)
    if picked is None:
        return
    assert picked.reason in REASONS
    if picked.reason == CHOICE:
        # Only when the router found no candidate: PIG's choice then picked the same backend
        # it picks without a ring.
        plain = pick_backend(state, NAMES, attrs.evolve(routing, ring=None), now=2.0, tried=tried)
        assert plain is not None
        assert plain.index == picked.index
    if picked.reason == "affinity":
        assert key is not None  # affinity needs a prefix key


@given(loads, failures, tried_sets, keys, st.booleans())
def test_a_pick_never_repeats_a_backend_tried(
    inflight: list[int], failed: list[int], tried: frozenset[int], key: int | None, ring: bool
) -> None:
    state = pool_state(inflight, failed)
    routing = Routing(poll_interval_s=1.0, dynamic=True, ring=build_ring(NAMES) if ring else None)
    picked = pick_backend(state, NAMES, routing, now=2.0, key=key, tried=tried)
    if picked is not None:
        assert picked.index not in tried
    if len(tried) == len(NAMES):
        assert picked is None


@given(keys)
def test_with_a_ring_a_key_keeps_its_backend_while_loads_are_even(key: int | None) -> None:
    state = pool_state([1, 1, 1, 1], [0, 0, 0, 0])
    routing = Routing(poll_interval_s=1.0, dynamic=False, ring=build_ring(NAMES))
    first = pick_backend(state, NAMES, routing, now=2.0, key=key)
    again = pick_backend(state, NAMES, routing, now=2.0, key=key)
    assert first is not None
    assert first == again
