"""Backend choice: skipping, scoring and tie-breaking (spec 4.6)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from guard_core import InvalidObservation, PolicyConfigError
from guard_core.backend_choice import BackendView, backend_score, choose_backend, is_stale

NOW = 100.0
POLL = 1.0


def view(name: str = "b", **fields: Any) -> BackendView:
    return BackendView(name=name, **fields)


def choose(backends: list[BackendView], *, dynamic: bool = True, **kwargs: Any) -> int | None:
    return choose_backend(backends, now=NOW, poll_interval_s=POLL, dynamic=dynamic, **kwargs)


# -- scores -------------------------------------------------------------------------------------


def test_score_with_a_generation_rate() -> None:
    # capacity = max(1, floor(1000 * 0.42 / 25)) = floor(16.8) = 16
    b = view(generation_tps=1000.0, running=5, inflight=2, waiting=1, kv_usage=0.5)
    assert backend_score(b) == -(16 - 5 - 2) + 4 * 1 + 2 * 0.5 == -4.0


def test_score_without_a_generation_rate() -> None:
    b = view(running=5, inflight=2, waiting=1, kv_usage=0.5)
    assert backend_score(b) == 5 + 8 * 1 + 0.25 * 2 + 4 * 0.5 == 15.5


@pytest.mark.parametrize(
    ("tps", "capacity"),
    [(0.0, 1), (10.0, 1), (59.0, 1), (119.0, 1), (120.0, 2), (178.0, 2), (179.0, 3), (1e4, 168)],
)
def test_capacity_estimate_floors_at_one(tps: float, capacity: int) -> None:
    assert backend_score(view(generation_tps=tps)) == -capacity


def test_custom_ratio_and_target() -> None:
    # floor(100 * 1.0 / 20) = 5
    assert backend_score(view(generation_tps=100.0), capacity_ratio=1.0, target_user_tps=20) == -5
    backends = [view("a", generation_tps=100.0, running=3), view("b", generation_tps=40.0)]
    # Defaults: both capacities are 1, so a scores 2 and b scores -1.
    assert choose(backends) == 1
    # Ratio 1, target 20: a has capacity 5 and scores -2, b has capacity 2 and scores -2: tie.
    assert choose(backends, capacity_ratio=1.0, target_user_tps=20.0) == 0


# -- choice -------------------------------------------------------------------------------------


def test_no_backends_gives_none() -> None:
    assert choose([]) is None
    assert choose([], dynamic=False) is None


def test_single_backend_is_always_chosen() -> None:
    assert choose([view()]) == 0
    assert choose([view(failed=True)]) == 0
    assert choose([view(updated_at=0.0)]) == 0
    assert choose([view(failed=True)], dynamic=False) == 0


def test_lowest_score_wins() -> None:
    backends = [view("a", running=4), view("b", running=2), view("c", running=3)]
    assert choose(backends) == 1


def test_waiting_weighs_more_than_running_without_a_rate() -> None:
    # a: 0 + 8 = 8; b: 7 + 0 = 7.
    assert choose([view("a", waiting=1), view("b", running=7)]) == 1
    # a: 8; b: 8 -> tie, the earlier wins.
    assert choose([view("a", waiting=1), view("b", running=8)]) == 0


def test_ties_go_to_the_earlier_backend() -> None:
    backends = [view("a", running=2), view("b", running=1), view("c", running=1)]
    assert choose(backends) == 1
    assert choose([view("a"), view("b"), view("c")]) == 0


def test_rate_lets_a_busier_backend_win() -> None:
    # a: no rate, running 2 -> 2. b: capacity floor(2500 * 0.42 / 25) = 42, running 20 -> -22.
    backends = [view("a", running=2), view("b", generation_tps=2500.0, running=20)]
    assert choose(backends) == 1


def test_failed_backend_is_skipped_in_dynamic_mode_only() -> None:
    backends = [view("a", failed=True), view("b", running=50, waiting=3)]
    assert choose(backends) == 1
    assert choose(backends, dynamic=False) == 0


def test_staleness_edge() -> None:
    # 3 poll intervals old exactly is still fresh; a hair older is stale.
    fresh = view("a", updated_at=NOW - 3 * POLL)
    stale = view("a", updated_at=NOW - 3 * POLL - 0.01)
    assert not is_stale(fresh, now=NOW, poll_interval_s=POLL)
    assert is_stale(stale, now=NOW, poll_interval_s=POLL)
    assert not is_stale(view(updated_at=None), now=1e9, poll_interval_s=POLL)
    assert not is_stale(view(updated_at=NOW + 5), now=NOW, poll_interval_s=POLL)
    busy = view("b", running=30)
    assert choose([fresh, busy]) == 0
    assert choose([stale, busy]) == 1
    assert choose([stale, busy], dynamic=False) == 0


def test_never_updated_status_is_never_stale() -> None:
    backends = [view("a", updated_at=None), view("b", updated_at=NOW, running=1)]
    assert choose_backend(backends, now=1e9, poll_interval_s=POLL, dynamic=True) == 0


def test_all_skipped_falls_back_to_fewest_inflight() -> None:
    backends = [
        view("a", failed=True, inflight=3),
        view("b", updated_at=0.0, inflight=1, running=100),
        view("c", failed=True, inflight=1),
    ]
    assert choose(backends) == 1
    assert choose([view("a", failed=True, inflight=0), view("b", failed=True)]) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"poll_interval_s": 0.0},
        {"poll_interval_s": -1.0},
        {"poll_interval_s": math.nan},
        {"capacity_ratio": 0.0},
        {"capacity_ratio": 1.5},
        {"target_user_tps": 0.0},
    ],
)
def test_bad_settings_are_rejected(kwargs: dict[str, float]) -> None:
    settings: dict[str, Any] = {"now": NOW, "poll_interval_s": POLL, "dynamic": True, **kwargs}
    with pytest.raises(PolicyConfigError):
        choose_backend([view()], **settings)


@pytest.mark.parametrize(
    "fields",
    [
        {"running": -1},
        {"waiting": -1},
        {"inflight": -1},
        {"kv_usage": -0.1},
        {"kv_usage": math.nan},
        {"generation_tps": -1.0},
        {"generation_tps": math.inf},
    ],
)
def test_impossible_observations_are_rejected(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidObservation):
        view(**fields)


# -- properties ---------------------------------------------------------------------------------


@st.composite
def views(draw: st.DrawFn) -> BackendView:
    return BackendView(
        name=draw(st.sampled_from("abcdef")),
        failed=draw(st.booleans()),
        updated_at=draw(st.none() | st.floats(NOW - 10, NOW + 1)),
        generation_tps=draw(st.none() | st.floats(0.0, 5000.0)),
        running=draw(st.integers(0, 60)),
        waiting=draw(st.integers(0, 5)),
        kv_usage=draw(st.floats(0.0, 1.0)),
        inflight=draw(st.integers(0, 30)),
    )


backend_lists = st.lists(views(), max_size=6)


def usable(b: BackendView, dynamic: bool) -> bool:
    return not dynamic or not (b.failed or is_stale(b, now=NOW, poll_interval_s=POLL))


def more_load(b: BackendView, data: st.DataObject) -> BackendView:
    return attrs.evolve(
        b,
        running=b.running + data.draw(st.integers(0, 10)),
        waiting=b.waiting + data.draw(st.integers(0, 3)),
        inflight=b.inflight + data.draw(st.integers(0, 10)),
        kv_usage=b.kv_usage + data.draw(st.floats(0.0, 0.5)),
    )


@given(backend_lists, st.booleans())
def test_result_is_an_index_or_none_when_empty(backends: list[BackendView], dynamic: bool) -> None:
    index = choose(backends, dynamic=dynamic)
    if not backends:
        assert index is None
    else:
        assert index is not None
        assert 0 <= index < len(backends)


@given(backend_lists, st.booleans())
def test_choice_is_the_first_lowest_usable_score(
    backends: list[BackendView], dynamic: bool
) -> None:
    index = choose(backends, dynamic=dynamic)
    candidates = [i for i, b in enumerate(backends) if usable(b, dynamic)]
    if not candidates:
        if backends:
            assert index is not None
            fewest = min(b.inflight for b in backends)
            assert index == [b.inflight for b in backends].index(fewest)
        return
    assert index in candidates
    scores = {i: backend_score(backends[i]) for i in candidates}
    assert all(scores[index] <= s for s in scores.values())
    assert all(scores[index] < scores[i] for i in candidates if i < index)


@given(backend_lists)
def test_never_a_failed_or_stale_backend_while_a_healthy_one_exists(
    backends: list[BackendView],
) -> None:
    assume(any(usable(b, dynamic=True) for b in backends))
    index = choose(backends, dynamic=True)
    assert index is not None
    assert usable(backends[index], dynamic=True)


@given(views(), st.integers(1, 6), st.booleans())
def test_equal_backends_pick_the_first(template: BackendView, count: int, dynamic: bool) -> None:
    backends = [attrs.evolve(template, name=f"b{i}") for i in range(count)]
    assert choose(backends, dynamic=dynamic) == 0


@given(backend_lists, st.randoms(use_true_random=False), st.booleans())
def test_permutation_picks_the_earliest_of_the_best(
    backends: list[BackendView], rnd: Any, dynamic: bool
) -> None:
    assume(any(usable(b, dynamic) for b in backends))
    shuffled = list(backends)
    rnd.shuffle(shuffled)
    original = backends[choose(backends, dynamic=dynamic) or 0]
    index = choose(shuffled, dynamic=dynamic)
    assert index is not None
    # The same best score is found, and it is the earliest position holding that score.
    best = backend_score(original)
    assert backend_score(shuffled[index]) == best
    earlier = [b for b in shuffled[:index] if usable(b, dynamic)]
    assert all(backend_score(b) > best for b in earlier)


@given(views(), st.data())
def test_more_load_never_lowers_a_score(b: BackendView, data: st.DataObject) -> None:
    assert backend_score(more_load(b, data)) >= backend_score(b)


@given(backend_lists, st.booleans(), st.data())
def test_load_on_another_backend_never_steals_the_choice(
    backends: list[BackendView], dynamic: bool, data: st.DataObject
) -> None:
    assume(backends)
    chosen = choose(backends, dynamic=dynamic)
    assert chosen is not None
    other = data.draw(st.integers(0, len(backends) - 1))
    assume(other != chosen)
    changed = list(backends)
    changed[other] = more_load(changed[other], data)
    assert choose(changed, dynamic=dynamic) == chosen


@given(backend_lists, st.booleans(), st.data())
def test_more_load_never_makes_a_backend_chosen(
    backends: list[BackendView], dynamic: bool, data: st.DataObject
) -> None:
    """A backend chosen after load was added to it was already chosen before."""
    assume(backends)
    target = data.draw(st.integers(0, len(backends) - 1))
    loaded = list(backends)
    loaded[target] = more_load(loaded[target], data)
    if choose(loaded, dynamic=dynamic) == target:
        assert choose(backends, dynamic=dynamic) == target
