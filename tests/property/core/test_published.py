"""The value the core publishes after each poll, the traffic counts, and backend choice over them.

Checks:
* the published value carries the gate's decision and the snapshot behind it (none after a
  round where every backend failed), and each backend's figures from its own normalised sample;
  a failed backend keeps its last good figures and is marked failed;
* the tier reject deltas count the core's own refusals since the previous good round;
* in-flight counts per backend follow forwarded/finished events and never go below zero;
* backend choice reads the published generation rate, so its capacity formula runs.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from guard_core import (
    BackendPoll,
    BackendSample,
    GuardConfig,
    GuardState,
    MetricsPolled,
    Tier,
    apply_guard_event,
)
from guard_core.backend_choice import backend_score, backend_views, choose_backend
from guard_core.events import Arrived
from guard_core.gate import GateConfig
from guard_core.guard import GuardEvent
from guard_core.lanes import AdaptiveOutputConfig, Thresholds
from guard_core.normalise import BackendStatus, normalise
from guard_core.traffic import (
    BackendFinished,
    BackendForwarded,
    OutputIntentObserved,
    RefusedAfterAdmission,
)

NAMES = ("a", "b", "c")


def fold(state: GuardState, *events: GuardEvent) -> GuardState:
    for event in events:
        state = apply_guard_event(state, event).state
    return state


def initial() -> GuardState:
    return GuardState.initial(GuardConfig(), at=0.0)


samples = st.none() | st.builds(
    BackendSample,
    running=st.integers(0, 50).map(float),
    waiting=st.integers(0, 5).map(float),
    kv_usage=st.floats(0.0, 1.0),
    generation_tokens=st.integers(0, 100_000).map(float),
)
rounds = st.lists(st.tuples(*(samples for _ in NAMES)), min_size=1, max_size=5)


@given(rounds)
def test_published_figures_are_the_normalised_samples(polled: list[tuple[object, ...]]) -> None:
    state = initial()
    last_good: dict[str, BackendSample] = {}
    previous: dict[str, tuple[float, BackendSample | None]] = {}
    for at, answers in enumerate(polled, start=1):
        polls = tuple(
            BackendPoll(name=name, sample=sample)  # type: ignore[arg-type]
            for name, sample in zip(NAMES, answers, strict=True)
        )
        state = fold(state, MetricsPolled(float(at), polls))
        published = state.published
        assert published.decision == state.gate.decision
        if all(answer is None for answer in answers):
            assert published.snapshot is None
            assert published.error
        else:
            assert published.snapshot is state.learner.last
            assert published.error == ""
        for poll in polls:
            figures = published.backend(poll.name)
            assert figures is not None
            assert figures.updated_at == at
            assert figures.failed is (poll.sample is None)
            if poll.sample is not None:
                before = previous.get(poll.name)
                status = (
                    None
                    if before is None
                    else BackendStatus(at=before[0], failed=before[1] is None, sample=before[1])
                )
                expected = normalise(status, poll.sample, at=float(at))
                assert figures.running == int(expected.running)
                assert figures.waiting == int(expected.waiting)
                assert figures.kv_usage == expected.kv_usage
                assert figures.generation_tps == expected.generation_tps
                last_good[poll.name] = poll.sample
            elif poll.name in last_good:
                assert figures.running == int(last_good[poll.name].running or 0)
            previous[poll.name] = (float(at), poll.sample)


def test_tier_reject_deltas_count_refusals_since_the_previous_good_round() -> None:
    good = (BackendPoll(name="a", sample=BackendSample(running=1.0)),)
    failed = (BackendPoll(name="a", sample=None, error="refused"),)
    state = fold(
        initial(),
        RefusedAfterAdmission(0.5, Tier.BASIC),
        RefusedAfterAdmission(0.6, Tier.PREMIUM),
        MetricsPolled(1.0, good),
    )
    # The whole count on the first good round, as PIG.
    assert state.published.tier_reject_delta == (1, 1)
    state = fold(state, RefusedAfterAdmission(1.5, Tier.BASIC), MetricsPolled(2.0, failed))
    assert state.published.tier_reject_delta == (0, 0)
    state = fold(state, RefusedAfterAdmission(2.5, Tier.BASIC), MetricsPolled(3.0, good))
    assert state.published.tier_reject_delta == (2, 0)
    assert state.traffic.tier_rejects == (3, 1)


def test_gate_refusals_count_as_tier_rejects() -> None:
    config = GuardConfig(gate=GateConfig(global_limit=1, queue_wait_s=0.0, dynamic=False))
    state = GuardState.initial(config, at=0.0)
    state = fold(
        state,
        Arrived(at=0.1, request_id=1, tier=Tier.BASIC),
        Arrived(at=0.2, request_id=2, tier=Tier.BASIC),
    )
    assert state.traffic.tier_rejects == (1, 0)
    # No backend able to take work is not a tier refusal (PIG counts it apart).
    state = fold(
        GuardState.initial(GuardConfig(), at=0.0), Arrived(at=0.1, request_id=1, tier=Tier.BASIC)
    )
    assert state.traffic.tier_rejects == (0, 0)


moves = st.lists(st.tuples(st.sampled_from(NAMES), st.booleans()), max_size=40)


@given(moves)
def test_inflight_follows_forwarded_and_finished(steps: list[tuple[str, bool]]) -> None:
    state = initial()
    expected = dict.fromkeys(NAMES, 0)
    for at, (name, forwarded) in enumerate(steps):
        event = BackendForwarded(at, name) if forwarded else BackendFinished(at, name)
        state = fold(state, event)
        expected[name] = max(0, expected[name] + (1 if forwarded else -1))
    for name in NAMES:
        assert state.traffic.inflight_of(name) == expected[name]


def test_output_intents_are_kept_only_with_adaptive_settings() -> None:
    state = fold(initial(), OutputIntentObserved(0.1, 500))
    assert state.traffic.adaptive.samples == ()
    config = GuardConfig(
        adaptive_output=AdaptiveOutputConfig(static=Thresholds((1024, 4096, 8192)))
    )
    state = fold(GuardState.initial(config, at=0.0), OutputIntentObserved(0.1, 500))
    assert state.traffic.adaptive.samples == (500,)


rates = st.integers(0, 4000)


@given(st.tuples(rates, rates, rates), st.tuples(*(st.integers(0, 8) for _ in NAMES)))
def test_backend_choice_uses_the_published_rate(
    tokens: tuple[int, int, int], inflight: tuple[int, ...]
) -> None:
    """Two polls one second apart give each backend a rate; the views carry it, the
    score is the capacity formula's, and in-flight counts come from the traffic state."""
    first = tuple(
        BackendPoll(name=n, sample=BackendSample(running=4.0, generation_tokens=0.0)) for n in NAMES
    )
    second = tuple(
        BackendPoll(name=n, sample=BackendSample(running=4.0, generation_tokens=float(t)))
        for n, t in zip(NAMES, tokens, strict=True)
    )
    events: list[GuardEvent] = [MetricsPolled(1.0, first), MetricsPolled(2.0, second)]
    for name, count in zip(NAMES, inflight, strict=True):
        events.extend(BackendForwarded(2.5, name) for _ in range(count))
    state = fold(initial(), *events)
    views = backend_views(NAMES, state.published, state.traffic)
    policy = state.config.policy
    for view, rate, count in zip(views, tokens, inflight, strict=True):
        assert view.generation_tps == rate
        assert view.inflight == count
        capacity = max(1, math.floor(rate * policy.capacity_ratio / policy.user_tps_yellow))
        assert backend_score(
            view, capacity_ratio=policy.capacity_ratio, target_user_tps=policy.user_tps_yellow
        ) == -(capacity - 4 - count)
    chosen = choose_backend(
        views,
        now=2.5,
        poll_interval_s=1.0,
        dynamic=True,
        capacity_ratio=policy.capacity_ratio,
        target_user_tps=policy.user_tps_yellow,
    )
    scores = [
        backend_score(
            v, capacity_ratio=policy.capacity_ratio, target_user_tps=policy.user_tps_yellow
        )
        for v in views
    ]
    assert chosen == scores.index(min(scores))


def test_a_failed_backend_has_no_rate_and_is_skipped() -> None:
    ok = BackendSample(running=1.0, generation_tokens=0.0)
    state = fold(
        initial(),
        MetricsPolled(1.0, (BackendPoll(name="a", sample=ok), BackendPoll(name="b", sample=ok))),
        MetricsPolled(
            2.0,
            (
                BackendPoll(name="a", sample=None, error="refused"),
                BackendPoll(name="b", sample=BackendSample(running=9.0, generation_tokens=10.0)),
            ),
        ),
    )
    a, b = backend_views(("a", "b"), state.published, state.traffic)
    assert a.failed
    assert a.generation_tps is None
    assert a.running == 0
    assert not b.failed
    assert b.generation_tps == 10.0
    assert choose_backend((a, b), now=2.5, poll_interval_s=1.0, dynamic=True) == 1
    never = backend_views(("z",), state.published, state.traffic)[0]
    assert not never.failed
    assert never.updated_at is None
