"""Consistent hashing with bounded loads (guard_core.affinity)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import PolicyConfigError
from guard_core.affinity import DEFAULT_BOUND, build_ring, choose, load_bound

NAMES = st.lists(
    st.text(alphabet="abcdefgh0123456789-", min_size=1, max_size=8),
    min_size=1,
    max_size=6,
    unique=True,
)
KEYS = st.integers(min_value=0, max_value=(1 << 64) - 1)
BOUNDS = st.floats(min_value=1.01, max_value=3.0)


@st.composite
def pools(draw: st.DrawFn) -> tuple[list[str], dict[str, int]]:
    names = draw(NAMES)
    loads = {name: draw(st.integers(min_value=0, max_value=40)) for name in names}
    return names, loads


def test_the_bound_is_the_ceiling_of_the_factor_times_the_mean_after_one_more() -> None:
    assert load_bound(0, 4, 1.25) == 1
    assert load_bound(7, 4, 1.25) == math.ceil(1.25 * 8 / 4)
    assert load_bound(99, 4, 1.25) == 32
    for bad in (1.0, 0.5, math.inf, math.nan):
        with pytest.raises(PolicyConfigError):
            load_bound(1, 2, bad)
    with pytest.raises(PolicyConfigError):
        build_ring(["a", "a"])


@given(pools(), KEYS, BOUNDS)
def test_the_choice_is_eligible_and_within_the_bound(
    pool: tuple[list[str], dict[str, int]], key: int, bound: float
) -> None:
    names, loads = pool
    ring = build_ring(names)
    chosen = choose(ring, key, loads, bound)
    assert chosen in names
    limit = load_bound(sum(loads.values()), len(names), bound)
    assert loads[chosen] + 1 <= limit
    # Deterministic: a ring built again from the same names gives the same answer.
    assert choose(build_ring(list(names)), key, dict(loads), bound) == chosen


@given(pools(), KEYS, BOUNDS)
def test_the_first_backend_on_the_walk_within_the_bound_is_chosen(
    pool: tuple[list[str], dict[str, int]], key: int, bound: float
) -> None:
    names, loads = pool
    ring = build_ring(names)
    chosen = choose(ring, key, loads, bound)
    walk = ring.walk(key)
    assert sorted(walk) == sorted(names)
    limit = load_bound(sum(loads.values()), len(names), bound)
    # Every backend the walk met before the chosen one was full.
    for name in walk[: walk.index(chosen)]:
        assert loads[name] + 1 > limit


@given(pools(), KEYS)
def test_a_key_keeps_its_backend_while_that_backend_has_room(
    pool: tuple[list[str], dict[str, int]], key: int
) -> None:
    names, loads = pool
    ring = build_ring(names)
    home = choose(ring, key, {}, DEFAULT_BOUND)
    assert home == ring.walk(key)[0]
    limit = load_bound(sum(loads.values()), len(names), DEFAULT_BOUND)
    if loads[home] + 1 <= limit:
        assert choose(ring, key, loads, DEFAULT_BOUND) == home


@given(pools(), KEYS, st.data())
def test_ineligible_backends_are_skipped_and_none_only_when_none_is_eligible(
    pool: tuple[list[str], dict[str, int]], key: int, data: st.DataObject
) -> None:
    names, loads = pool
    ring = build_ring(names)
    allowed = data.draw(st.sets(st.sampled_from(names)))
    chosen = choose(ring, key, loads, eligible=allowed)
    if not allowed:
        assert chosen is None
        return
    assert chosen in allowed
    by_predicate = choose(ring, key, loads, eligible=lambda name: name in allowed)
    assert by_predicate == chosen
    limit = load_bound(sum(loads[name] for name in allowed), len(allowed), DEFAULT_BOUND)
    assert loads[chosen] + 1 <= limit


@given(
    st.lists(st.sampled_from("abcdefghij"), min_size=2, max_size=8, unique=True),
    st.lists(KEYS, min_size=1, max_size=200),
    st.data(),
)
def test_removing_a_backend_moves_only_its_own_keys(
    names: list[str], keys: list[int], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(names))
    before = build_ring(names)
    after = build_ring([name for name in names if name != gone])
    for key in keys:
        was = choose(before, key, {})
        now = choose(after, key, {})
        if was != gone:
            assert now == was
        else:
            assert now != gone


def test_a_hot_key_fills_backends_in_ring_order_without_passing_the_bound() -> None:
    names = [f"sim-{i}" for i in range(4)]
    ring = build_ring(names)
    loads = dict.fromkeys(names, 0)
    for _ in range(200):
        chosen = choose(ring, 12345, loads, 1.25)
        assert chosen is not None
        loads[chosen] += 1
        assert max(loads.values()) <= load_bound(sum(loads.values()) - 1, 4, 1.25)
    # The hot key's home backend carries the most, but only about a quarter above the mean.
    home = ring.walk(12345)[0]
    assert loads[home] == max(loads.values())
    assert loads[home] <= math.ceil(1.25 * 200 / 4)
    # The overflow went down the walk: each backend on it carries at least what the next does.
    walk = ring.walk(12345)
    assert all(loads[a] >= loads[b] for a, b in itertools.pairwise(walk))
    assert all(loads[name] > 0 for name in walk)


def test_spread_over_many_keys_is_close_to_even() -> None:
    names = [f"sim-{i}" for i in range(4)]
    ring = build_ring(names)
    counts = dict.fromkeys(names, 0)
    for index in range(4000):
        chosen = choose(ring, (index * 0x9E3779B97F4A7C15) & ((1 << 64) - 1), {})
        assert chosen is not None
        counts[chosen] += 1
    assert min(counts.values()) > 4000 / 4 * 0.8
