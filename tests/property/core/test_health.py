"""Properties of passive outlier ejection and the full mark (guard_core.health)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import PolicyConfigError
from guard_core.health import (
    Availability,
    BackendFailed,
    BackendFull,
    BackendHealth,
    BackendSucceeded,
    Failure,
    HealthConfig,
    HealthEvent,
    HealthState,
    ProbeAbandoned,
    ProbeSent,
    apply_health,
    availability,
    backoff_s,
    polled,
)

NAME = "a"
CONFIG = HealthConfig(eject_after=3, backoff_s=2.0, backoff_max_s=16.0, full_hold_s=1.0)

# One step of a run: what happens, and how long after the previous step.
kinds = st.sampled_from(("fail", "ok", "full", "probe", "abandon", "poll"))
steps = st.lists(st.tuples(kinds, st.floats(0.0, 5.0)), max_size=60)
failures = st.sampled_from(tuple(Failure))


def event(kind: str, at: float, failure: Failure = Failure.CONNECT) -> HealthEvent | None:
    if kind == "fail":
        return BackendFailed(at, NAME, failure)
    if kind == "ok":
        return BackendSucceeded(at, NAME)
    if kind == "full":
        return BackendFull(at, NAME)
    if kind == "probe":
        return ProbeSent(at, NAME)
    if kind == "abandon":
        return ProbeAbandoned(at, NAME)
    return None  # "poll": a good poll of the backend


def run(
    plan: list[tuple[str, float]], config: HealthConfig = CONFIG
) -> list[tuple[str, float, BackendHealth, BackendHealth]]:
    """Each step with the backend's health before and after it."""
    state = HealthState()
    at = 0.0
    seen = []
    for kind, gap in plan:
        at += gap
        before = state.of(NAME) or BackendHealth(name=NAME)
        happened = event(kind, at)
        state = (
            polled(state, (NAME,)) if happened is None else apply_health(state, happened, config)
        )
        seen.append((kind, at, before, state.of(NAME) or BackendHealth(name=NAME)))
    return seen


@given(steps)
def test_ejection_only_after_n_failures_in_a_row(plan: list[tuple[str, float]]) -> None:
    in_a_row = 0
    for kind, at, before, after in run(plan):
        was_ejected = before.ejected_until is not None
        ejected_now = after.ejections > before.ejections
        if not was_ejected:
            in_a_row = in_a_row + 1 if kind == "fail" else (0 if kind == "ok" else in_a_row)
            assert ejected_now == (in_a_row == CONFIG.eject_after), (kind, at, in_a_row)
            if ejected_now:
                in_a_row = 0
        else:
            in_a_row = 0
            # An ejected backend is ejected again only by a failure after its backoff ended
            # (or of its probe), never by a failure while its backoff runs.
            if ejected_now:
                assert kind == "fail"
                assert before.probing or at >= (before.ejected_until or 0.0)


@given(steps)
def test_a_success_resets_the_count(plan: list[tuple[str, float]]) -> None:
    for kind, _at, _before, after in run(plan):
        if kind == "ok":
            assert after.failures == 0
            assert after.ejected_until is None


@given(steps)
def test_half_open_admits_at_most_one_probe_at_a_time(plan: list[tuple[str, float]]) -> None:
    """A shell that sends a probe whenever availability says PROBE never has two in flight."""
    outstanding = 0
    for kind, at, before, after in run(plan):
        if kind == "probe" and availability(before, now=at) is Availability.PROBE:
            assert after.probing
            assert after.probes == before.probes + 1
            assert availability(after, now=at) is Availability.PROBING
            outstanding += 1
        elif kind == "probe":
            assert after == before  # not half-open, or its probe is already out
        if kind in ("ok", "fail", "abandon", "full") and not after.probing:
            outstanding = 0
        assert outstanding <= 1
        assert outstanding == int(after.probing)


@given(steps)
def test_backoff_is_monotone_and_capped(plan: list[tuple[str, float]]) -> None:
    lengths = [backoff_s(CONFIG, streak) for streak in range(1, 80)]
    assert lengths[0] == CONFIG.backoff_s
    assert all(a <= b for a, b in itertools.pairwise(lengths))
    assert max(lengths) == CONFIG.backoff_max_s
    for _kind, at, before, after in run(plan):
        if after.ejections > before.ejections:
            assert after.ejected_until is not None
            length = after.ejected_until - at  # a difference of floats: within 1e-9
            assert CONFIG.backoff_s - 1e-9 <= length <= CONFIG.backoff_max_s + 1e-9
            if after.streak > 1:  # never shorter than the last
                assert length >= backoff_s(CONFIG, after.streak - 1) - 1e-9


@given(steps)
def test_full_is_never_a_failure_and_holds_briefly(plan: list[tuple[str, float]]) -> None:
    for kind, at, before, after in run(plan):
        if kind == "full":
            assert after.failures == before.failures
            assert after.ejections == before.ejections
            assert after.full_until == at + CONFIG.full_hold_s
            ejected = after.ejected_until is not None and after.ejected_until > at
            # An ejection outranks the mark; otherwise the backend is full until the hold ends.
            now = availability(after, now=at)
            assert now is (Availability.EJECTED if ejected else Availability.FULL), now
            assert availability(after, now=at + CONFIG.full_hold_s) is not Availability.FULL
        if kind == "poll":
            assert after.full_until is None


@given(steps, failures)
def test_deterministic(plan: list[tuple[str, float]], failure: Failure) -> None:
    assert run(plan) == run(plan)


@given(steps)
def test_counters_only_grow(plan: list[tuple[str, float]]) -> None:
    for _kind, _at, before, after in run(plan):
        assert after.ejections >= before.ejections
        assert after.probes >= before.probes
        assert after.full_marks >= before.full_marks


def test_a_restored_backend_starts_from_the_first_backoff_after_a_healthy_spell() -> None:
    state = HealthState()
    at = 0.0

    def step(event: HealthEvent) -> BackendHealth:
        nonlocal state
        state = apply_health(state, event, CONFIG)
        health = state.of(NAME)
        assert health is not None
        return health

    for _ in range(3):
        at += 0.1
        health = step(BackendFailed(at, NAME, Failure.CONNECT))
    assert health.ejected_until == pytest.approx(at + 2.0)
    assert health.ejected_until is not None
    at = health.ejected_until
    assert availability(health, now=at) is Availability.PROBE
    step(ProbeSent(at, NAME))
    health = step(BackendFailed(at, NAME, Failure.RESET))  # the probe failed: twice as long
    assert health.ejected_until == pytest.approx(at + 4.0)
    assert health.ejected_until is not None
    at = health.ejected_until
    step(ProbeSent(at, NAME))
    health = step(BackendSucceeded(at + 0.1, NAME))
    assert availability(health, now=at + 0.1) is Availability.AVAILABLE
    assert health.streak == 2
    health = step(BackendSucceeded(at + 0.1 + CONFIG.backoff_max_s, NAME))
    assert health.streak == 0  # served well for the longest backoff: the doubling restarts


def test_failures_while_the_backoff_runs_change_nothing() -> None:
    state = HealthState()
    for i in range(3):
        state = apply_health(state, BackendFailed(0.1 * i, NAME, Failure.CONNECT), CONFIG)
    before = state.of(NAME)
    state = apply_health(state, BackendFailed(1.0, NAME, Failure.SERVER_ERROR), CONFIG)
    assert state.of(NAME) == before


def test_zero_never_ejects() -> None:
    config = HealthConfig(eject_after=0)
    state = HealthState()
    for i in range(50):
        state = apply_health(state, BackendFailed(float(i), NAME, Failure.CONNECT), config)
    health = state.of(NAME)
    assert health is not None
    assert health.ejections == 0
    assert availability(health, now=100.0) is Availability.AVAILABLE


def test_settings_are_checked() -> None:
    with pytest.raises(PolicyConfigError, match="PIG_BACKEND_EJECT_SECONDS"):
        HealthConfig(backoff_s=10.0, backoff_max_s=5.0)
    with pytest.raises(PolicyConfigError, match="PIG_BACKEND_EJECT_FAILURES"):
        HealthConfig(eject_after=-1)
