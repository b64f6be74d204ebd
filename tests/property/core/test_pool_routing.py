"""Ranking by predicted outcome and the composed pool router (guard_core.ranking,
guard_core.backend_prediction, guard_core.pool_routing)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from guard_core.affinity import build_ring, load_bound
from guard_core.backend_choice import BackendView
from guard_core.backend_prediction import BackendOutlook, outlook
from guard_core.engine_fit import EngineFit
from guard_core.pool_routing import RouteReason, route
from guard_core.predictive import PredictiveConfig, PredictiveState
from guard_core.ranking import Candidate, best, pig_room, ranked

NAMES = [f"b{i}" for i in range(5)]
THETA = (0.0115, 0.0062, 0.016, 0.0075)  # about the default profile, in the fit's units


def fitted(scale: float = 1.0) -> EngineFit:
    return EngineFit(theta=THETA, scale=scale, observations=10)


def state(scales: dict[str, float]) -> PredictiveState:
    initial = PredictiveState.initial(PredictiveConfig())
    return attrs.evolve(initial, fits={name: fitted(s) for name, s in scales.items()}, healthy=2)


def seen(name: str, speed: float, ttft: float, *, ttft_within: bool = True) -> BackendOutlook:
    return BackendOutlook(
        name=name,
        user_tps=speed,
        ttft_s=ttft,
        ttft_excess_s=ttft / 2,
        ttft_within=ttft_within,
        within_target=ttft_within and speed >= 20,
    )


candidates_strategy = st.lists(
    st.builds(
        Candidate,
        name=st.sampled_from(NAMES),
        eligible=st.booleans(),
        room=st.booleans(),
        load=st.integers(min_value=0, max_value=30),
        score=st.one_of(st.none(), st.floats(min_value=-50, max_value=50)),
        pending_tokens=st.one_of(st.none(), st.floats(min_value=0, max_value=100_000)),
        cached_tokens=st.floats(min_value=0, max_value=100_000),
    ),
    min_size=1,
    max_size=5,
    unique_by=lambda candidate: candidate.name,
)


@given(candidates_strategy, st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)))
def test_the_route_is_eligible_whenever_one_is(
    candidates: list[Candidate], key: int | None
) -> None:
    ring = build_ring([c.name for c in candidates])
    chosen = route(candidates, ring=ring, key=key)
    if not any(c.eligible for c in candidates):
        assert chosen is None
        assert best(candidates) is None
        return
    assert chosen is not None
    picked = candidates[chosen.index]
    assert picked.eligible
    assert picked.name == chosen.name
    eligible = [c for c in candidates if c.eligible]
    limit = load_bound(sum(c.load for c in eligible), len(eligible))
    if chosen.reason is RouteReason.AFFINITY:
        assert key is not None
        assert picked.room
        assert picked.load + 1 <= limit
    elif any(c.room and c.load + 1 <= limit for c in eligible):
        # Ranked: one with room and within the load bound whenever there is one.
        assert picked.room
        assert picked.load + 1 <= limit


@given(candidates_strategy)
def test_ranking_prefers_room_then_the_lower_score(candidates: list[Candidate]) -> None:
    order = ranked(candidates)
    assert sorted(order) == [i for i, c in enumerate(candidates) if c.eligible]
    rooms = [candidates[i].room for i in order]
    assert rooms == sorted(rooms, reverse=True)


def test_with_outlooks_the_fastest_within_the_ttft_target_wins() -> None:
    candidates = [
        Candidate(name="slow", outlook=seen("slow", 30, 0.5)),
        Candidate(name="fast", outlook=seen("fast", 60, 0.9)),
        Candidate(name="late", outlook=seen("late", 90, 4.0, ttft_within=False)),
    ]
    assert [candidates[i].name for i in ranked(candidates)] == ["fast", "slow", "late"]
    # Nobody within the TTFT target: the soonest first token wins.
    late = [
        Candidate(name="a", outlook=seen("a", 90, 5.0, ttft_within=False)),
        Candidate(name="b", outlook=seen("b", 10, 3.0, ttft_within=False)),
    ]
    assert late[best(late)].name == "b"  # type: ignore[index]


@given(
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=0, max_value=40),
    st.floats(min_value=1.05, max_value=5.0),
    st.integers(min_value=100, max_value=60000),
)
def test_a_slower_fit_never_predicts_a_faster_speed_and_more_load_never_helps(
    load: int, more: int, factor: float, body: int
) -> None:
    learner = state({"quick": 1.0, "slow": factor})
    pool = 2 * (load + more) + 1
    quick = outlook(learner, "quick", inflight=load, pool_inflight=pool, body_bytes=body, at=5.0)
    slow = outlook(learner, "slow", inflight=load, pool_inflight=pool, body_bytes=body, at=5.0)
    assert slow.user_tps < quick.user_tps
    assert slow.ttft_s >= quick.ttft_s
    busier = outlook(
        learner, "quick", inflight=load + more, pool_inflight=pool, body_bytes=body, at=5.0
    )
    assert busier.user_tps <= quick.user_tps


def test_a_backend_predicted_slower_gets_less_work() -> None:
    learner = state({"b0": 1.0, "b1": 1.0, "b2": 3.0})
    names = ["b0", "b1", "b2"]
    ring = build_ring(names)
    loads = dict.fromkeys(names, 0)
    for index in range(120):
        pool = sum(loads.values())
        candidates = []
        for name in names:
            view = outlook(
                learner, name, inflight=loads[name], pool_inflight=pool, body_bytes=4000, at=1.0
            )
            candidates.append(
                Candidate(name=name, load=loads[name], room=view.within_target, outlook=view)
            )
        chosen = route(candidates, ring=ring, key=index * 7919)
        assert chosen is not None
        loads[chosen.name] += 1
    assert loads["b2"] < loads["b0"]
    assert loads["b2"] < loads["b1"]


def test_an_unlearned_backend_is_judged_like_the_pools_worst_fit_before_any_is_trusted() -> None:
    learner = state({"known": 2.0})
    fresh = outlook(learner, "new", inflight=1, pool_inflight=2, body_bytes=2000, at=0.0)
    known = outlook(learner, "known", inflight=1, pool_inflight=2, body_bytes=2000, at=0.0)
    assert fresh.user_tps == known.user_tps
    assert fresh.ttft_s == known.ttft_s


def test_pig_room_needs_nothing_waiting_and_the_speed_target() -> None:
    assert pig_room(BackendView(name="a"), target_user_tps=25)
    assert not pig_room(BackendView(name="a", waiting=1), target_user_tps=25)
    fast = BackendView(name="a", running=4, generation_tps=200.0)
    slow = BackendView(name="a", running=4, generation_tps=60.0)
    assert pig_room(fast, target_user_tps=25)
    assert not pig_room(slow, target_user_tps=25)


@given(
    st.floats(min_value=0, max_value=50_000),
    st.floats(min_value=0, max_value=50_000),
    st.floats(min_value=0, max_value=50_000),
    st.integers(min_value=0, max_value=2**64 - 1),
)
def test_affinity_wins_only_when_the_cache_gain_beats_the_queue_in_front(
    cached: float, pending: float, other_pending: float, key: int
) -> None:
    names = ["a", "b"]
    ring = build_ring(names)
    affine = ring.walk(key)[0]
    other = "b" if affine == "a" else "a"
    candidates = [
        Candidate(
            name=name,
            load=1,
            pending_tokens=pending if name == affine else other_pending,
            cached_tokens=cached if name == affine else 0.0,
        )
        for name in names
    ]
    chosen = route(candidates, ring=ring, key=key)
    assert chosen is not None
    if cached >= pending - other_pending:
        assert (chosen.name, chosen.reason) == (affine, RouteReason.AFFINITY)
    else:
        # The affine backend's queue costs more than its cache saves: the least pending wins.
        assert chosen.reason is RouteReason.RANKED
        assert chosen.name == other


@given(
    st.lists(st.integers(min_value=0, max_value=30), min_size=2, max_size=5),
    st.lists(st.floats(min_value=0, max_value=60_000), min_size=5, max_size=5),
    st.integers(min_value=0, max_value=2**64 - 1),
    st.floats(min_value=1.05, max_value=3.0),
)
def test_the_router_never_passes_the_load_bound(
    loads: list[int], pending: list[float], key: int, bound: float
) -> None:
    names = NAMES[: len(loads)]
    candidates = [
        Candidate(name=n, load=load, pending_tokens=p, cached_tokens=p / 2)
        for n, load, p in zip(names, loads, pending, strict=False)
    ]
    chosen = route(candidates, ring=build_ring(names), key=key, bound=bound)
    assert chosen is not None
    assert loads[chosen.index] + 1 <= load_bound(sum(loads), len(loads), bound)
