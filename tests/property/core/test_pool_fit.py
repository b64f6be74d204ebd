"""Per-backend fits for a pool and the pool's predictive admission (guard_core.pool_fit,
guard_core.pool_admission, the per-backend loads of guard_core.backend_prediction)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from guard_core.backend_prediction import backend_loads
from guard_core.engine_fit import EngineFit
from guard_core.pool_admission import even_spread, is_pool, pool_assess, pool_cap
from guard_core.pool_fit import (
    MAX_TRUSTED_ERROR,
    MIN_TRUSTED_OBSERVATIONS,
    STALE_AFTER_S,
    fit_for,
    reference_fit,
    trustworthy,
)
from guard_core.predictive import (
    PredictiveConfig,
    PredictiveState,
    first_token,
    forwarded,
    sent_to,
)

THETA = (0.0115, 0.0062, 0.016, 0.0075)  # about the default profile, in the fit's units
NAMES = ("b0", "b1", "b2", "b3")


def fitted(scale: float = 1.0, *, observations: int = 50, error: float = 0.05) -> EngineFit:
    return EngineFit(theta=THETA, scale=scale, observations=observations, relative_error=error)


def pool(
    fits: dict[str, EngineFit],
    *,
    fitted_at: dict[str, float] | None = None,
    limit: int = 256,
    names: tuple[str, ...] = NAMES,
) -> PredictiveState:
    initial = PredictiveState.initial(PredictiveConfig(global_limit=limit))
    return attrs.evolve(
        initial,
        fits=fits,
        fitted_at=fitted_at if fitted_at is not None else dict.fromkeys(fits, 100.0),
        healthy=len(names),
        backends=names,
        trusted_decoders=20.0,
    )


def test_a_young_noisy_or_stale_fit_is_replaced_by_the_pools_median() -> None:
    good = {name: fitted(scale) for name, scale in zip(NAMES[:3], (1.0, 1.2, 1.5), strict=True)}
    cases = {
        "young": (fitted(19.0, observations=MIN_TRUSTED_OBSERVATIONS - 1), 100.0),
        "noisy": (fitted(19.0, error=MAX_TRUSTED_ERROR + 0.2), 100.0),
        "stale": (fitted(19.0), 100.0 - STALE_AFTER_S - 1),
    }
    for name, (bad, learned_at) in cases.items():
        state = pool(
            {**good, "b3": bad}, fitted_at={**dict.fromkeys(good, 100.0), "b3": learned_at}
        )
        assert not trustworthy(state, "b3"), name
        assert fit_for(state, "b3") is good["b1"], name  # the median of 1.0, 1.2, 1.5
        assert reference_fit(state) is good["b1"]
        for trusted, own in good.items():
            assert fit_for(state, trusted) is own
    # A fit just as stale, but no fresher peer: it is its own.
    alone = pool({"b3": fitted(2.0)}, fitted_at={"b3": 0.0}, names=("b3", "b4"))
    assert fit_for(alone, "b3") is alone.fits["b3"]


def test_without_any_trustworthy_fit_the_cold_start_rule_holds() -> None:
    young = fitted(3.0, observations=2)
    state = pool({"b0": young})
    assert reference_fit(state) is None
    assert fit_for(state, "b0") is young
    assert fit_for(state, "b1") is state.fit()  # never seen: the learner's pessimistic fit


fit_strategy = st.builds(
    fitted,
    st.floats(min_value=0.2, max_value=20.0),
    observations=st.integers(min_value=0, max_value=100),
    error=st.floats(min_value=0.0, max_value=1.0),
)


@given(
    st.dictionaries(st.sampled_from(NAMES), fit_strategy, max_size=4),
    st.integers(min_value=0, max_value=600),
    st.floats(min_value=0.0, max_value=200_000.0),
)
def test_the_pool_cap_never_exceeds_the_global_limit(
    fits: dict[str, EngineFit], limit: int, admitted: float
) -> None:
    state = attrs.evolve(pool(fits, limit=limit), admitted_tokens=admitted, admitted_at=10.0)
    cap = pool_cap(state, at=10.0).cap
    assert 0 <= cap <= limit
    if limit >= len(NAMES):
        assert cap >= len(NAMES)  # every healthy backend contributes at least one


@given(fit_strategy, st.floats(min_value=0.0, max_value=50_000.0))
def test_a_backend_without_traffic_does_not_pin_the_pool_cap(
    bad: EngineFit, admitted: float
) -> None:
    good = {name: fitted(scale) for name, scale in zip(NAMES[:3], (1.0, 1.1, 1.3), strict=True)}
    stale_at = {**dict.fromkeys(good, 500.0), "b3": 500.0 - STALE_AFTER_S - 5}
    starved = attrs.evolve(
        pool({**good, "b3": bad}, fitted_at=stale_at), admitted_tokens=admitted, admitted_at=500.0
    )
    # The same pool with the starved backend holding the pool's reference fit.
    typical = attrs.evolve(starved, fits={**good, "b3": good["b1"]})
    assert pool_cap(starved, at=500.0).cap == pool_cap(typical, at=500.0).cap
    # ... and one slow backend never lowers the cap below what the other three give.
    three = attrs.evolve(starved, backends=NAMES[:3], healthy=3)
    assert pool_cap(starved, at=500.0).cap >= pool_cap(three, at=500.0).cap


def loaded(state: PredictiveState, placed: dict[str, int], *, body: int = 8000) -> PredictiveState:
    """``placed[name]`` requests of ``body`` bytes sent to each backend, all decoding."""
    rid = 0
    for name, count in placed.items():
        for _ in range(count):
            state = forwarded(state, rid, body, at=1.0)
            state = sent_to(state, rid, name)
            state = first_token(state, rid, at=1.5)
            rid += 1
    return state


def test_admission_asks_whether_some_backend_has_room() -> None:
    state = pool({name: fitted() for name in NAMES})
    busy = dict.fromkeys(NAMES, 400)
    crowded = loaded(state, busy, body=400)
    refused = pool_assess(crowded, busy, 8000, reserve=0, waited_s=0.0, at=2.0)
    assert not refused.admit
    # One backend with nothing in flight: it takes the request.
    room = {**busy, "b2": 0}
    spare = loaded(state, room, body=400)
    verdict = pool_assess(spare, room, 8000, reserve=0, waited_s=0.0, at=2.0)
    assert verdict.admit


@given(st.dictionaries(st.sampled_from(NAMES), st.integers(min_value=0, max_value=60)))
def test_an_idle_backend_always_admits_while_its_kv_has_room(placed: dict[str, int]) -> None:
    state = loaded(pool({name: fitted(3.0) for name in NAMES}), placed)
    verdict = pool_assess(state, placed, 40_000, reserve=1, waited_s=5.0, at=2.0)
    if any(placed.get(name, 0) == 0 for name in NAMES):
        assert verdict.admit


@given(st.dictionaries(st.sampled_from(NAMES), st.integers(min_value=0, max_value=20)))
def test_each_backend_sees_its_own_prefill_queue(placed: dict[str, int]) -> None:
    state = pool({name: fitted() for name in NAMES})
    rid = 0
    for name, count in placed.items():
        for _ in range(count):
            state = sent_to(forwarded(state, rid, 4000, at=1.0), rid, name)
            rid += 1
    loads = backend_loads(state, at=1.0)
    if rid == 0:
        assert loads is None
        return
    assert loads is not None
    assert sum(load.pending_tokens for load in loads.values()) == state.pending_tokens
    for name, count in placed.items():
        if count:
            assert loads[name].pending_count == count
    assert abs(sum(load.prompt_share for load in loads.values()) - 1.0) < 1e-9


def test_one_backend_is_not_a_pool() -> None:
    assert not is_pool(pool({"b0": fitted()}, names=("b0",)))
    assert is_pool(pool({"b0": fitted()}, names=("b0", "b1")))


@given(st.integers(min_value=0, max_value=40), st.integers(min_value=2, max_value=4))
def test_unknown_counts_are_spread_evenly(requests: int, backends: int) -> None:
    names = NAMES[:backends]
    state = pool({name: fitted() for name in names}, names=names)
    for rid in range(requests):
        state = forwarded(state, rid, 4000, at=1.0)
    spread = even_spread(state)
    assert set(spread) == set(names)
    assert sum(spread.values()) == requests
    assert max(spread.values()) - min(spread.values()) <= 1
    unknown = pool_assess(state, None, 4000, reserve=0, waited_s=0.0, at=2.0)
    assert unknown == pool_assess(state, spread, 4000, reserve=0, waited_s=0.0, at=2.0)
