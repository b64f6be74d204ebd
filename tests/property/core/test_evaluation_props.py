"""Properties of the poll evaluation over random poll sequences (spec 5)."""

from __future__ import annotations

import math
from typing import Any

import attrs
from hypothesis import event, example, given
from hypothesis import strategies as st

from guard_core import LimitReason
from guard_core import normalise as norm
from guard_core.evaluation import (
    BackendPoll,
    LearnerState,
    Snapshot,
    evaluate,
    observe_first_token,
)
from guard_core.observations import BackendSample, Flavour, Histogram
from guard_core.policy import PolicyConfig
from tests.core_steps import gate_holding

TTFT_BOUNDS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)


@st.composite
def backend_series(draw: st.DrawFn, polls: int) -> list[BackendSample | None]:
    """One backend's samples over ``polls`` polls: counters mostly rise, sometimes reset."""
    generation = preemptions = 0.0
    ttft_counts = [0.0] * len(TTFT_BOUNDS)
    ttft_sum = 0.0
    series: list[BackendSample | None] = []
    for _ in range(polls):
        if draw(st.integers(0, 9)) == 0:
            series.append(None)  # this poll failed
            continue
        if draw(st.integers(0, 14)) == 0:
            generation = preemptions = 0.0  # engine restart: counters reset
        generation += draw(st.integers(0, 4000))
        preemptions += draw(st.sampled_from([0, 0, 0, 1, 3]))
        new_ttft = draw(st.lists(st.sampled_from(TTFT_BOUNDS[:-1]), max_size=12))
        for seconds in new_ttft:
            ttft_sum += seconds * 0.9
            for i, bound in enumerate(TTFT_BOUNDS):
                if seconds <= bound:
                    ttft_counts[i] += 1
        series.append(
            BackendSample(
                flavour=Flavour.VLLM,
                running=float(draw(st.integers(0, 80))),
                waiting=float(draw(st.sampled_from([0, 0, 0, 0, 1, 2, 5]))),
                kv_usage=draw(st.floats(0, 1)),
                preemptions=preemptions,
                generation_tokens=generation,
                ttft=Histogram(
                    tuple(zip(TTFT_BOUNDS, ttft_counts, strict=True)), ttft_counts[-1], ttft_sum
                ),
            )
        )
    return series


gate_views = st.builds(
    gate_holding,
    basic_waiting=st.sampled_from([0, 0, 0, 1, 4]),
    premium_inflight=st.integers(0, 10),
    basic_inflight=st.integers(0, 60),
    premium_waiting=st.sampled_from([0, 0, 1]),
    cap=st.integers(0, 80),
)


@st.composite
def runs(draw: st.DrawFn, max_polls: int = 8) -> dict[str, Any]:
    polls = draw(st.integers(1, max_polls))
    backends = draw(st.integers(1, 3))
    return {
        "config": PolicyConfig(global_limit=draw(st.sampled_from([1, 8, 64, 512]))),
        "series": [draw(backend_series(polls)) for _ in range(backends)],
        "gates": [draw(gate_views) for _ in range(polls)],
        "rejects": draw(st.lists(st.integers(0, 5), min_size=polls, max_size=polls)),
        "first_tokens": draw(st.lists(st.floats(0.01, 20), max_size=30)),
        "steps": [draw(st.floats(0.5, 2.0)) for _ in range(polls)],
    }


def play(run: dict[str, Any]) -> list[tuple[LearnerState, LearnerState, Any]]:
    """Evaluate every poll of ``run``; returns (before, after, decision) per poll."""
    learner = LearnerState(config=run["config"])
    at = 0.0
    history = []
    tokens = iter(run["first_tokens"])
    for index, gate in enumerate(run["gates"]):
        at += run["steps"][index]
        learner = attrs.evolve(
            learner, dynamic_rejects=learner.dynamic_rejects + run["rejects"][index]
        )
        for _ in range(index % 3):
            seconds = next(tokens, None)
            if seconds is not None:
                semantic = observe_first_token(learner.semantic_ttft, seconds)
                learner = attrs.evolve(learner, semantic_ttft=semantic)
        polls = tuple(
            BackendPoll(name=f"b{n}", sample=series[index])
            for n, series in enumerate(run["series"])
        )
        after, decision = evaluate(learner, gate, polls, at=at)
        history.append((learner, after, decision))
        learner = after
    return history


@given(runs())
def test_cap_never_exceeds_global_limit(run: dict[str, Any]) -> None:
    for _, _, decision in play(run):
        assert 0 <= decision.cap <= run["config"].global_limit


@given(runs())
def test_same_events_same_decisions(run: dict[str, Any]) -> None:
    assert [d for _, _, d in play(run)] == [d for _, _, d in play(run)]


@given(runs())
def test_backend_waiting_closes_intake_and_keeps_learned_values(run: dict[str, Any]) -> None:
    for before, after, decision in play(run):
        if decision.source != "metrics" or decision.waiting == 0:
            continue
        assert (decision.cap, decision.final_reason) == (0, LimitReason.BACKEND_WAITING)
        last = after.last
        assert last is not None
        if run["config"].global_limit > 0:
            assert last.throughput.learned > 0
            assert last.ttft.learned > 0
        if before.last is not None and before.pressure_cap > 0:
            assert after.pressure_cap > 0


@given(runs())
def test_all_backends_failed_closes_intake_and_forgets_nothing(run: dict[str, Any]) -> None:
    for before, after, decision in play(run):
        if decision.backend_failed < decision.backend_count:
            continue
        assert (decision.cap, decision.final_reason) == (0, LimitReason.BACKEND_UNAVAILABLE)
        assert decision.backend_unavailable
        assert after.last == before.last
        assert after.pressure_cap == before.pressure_cap


@given(runs())
def test_throughput_component_grows_by_at_most_one_step_per_poll(run: dict[str, Any]) -> None:
    for before, after, _ in play(run):
        if before.last is None or after.last is None or after.last is before.last:
            continue
        previous = before.last.throughput.component
        current = after.last.components.throughput
        if previous > 0 and current is not None:
            assert current <= previous + max(8, math.ceil(0.25 * previous))


def slow_ttft(sample: BackendSample | None, extra: int) -> BackendSample | None:
    """The same sample with ``extra`` more first tokens in the slowest finite bucket."""
    if sample is None or sample.ttft is None:
        return sample
    buckets = tuple(
        (bound, count + (extra if bound >= 10.0 else 0)) for bound, count in sample.ttft.buckets
    )
    ttft = Histogram(buckets, sample.ttft.count + extra, sample.ttft.sum + 10.0 * extra)
    return attrs.evolve(sample, ttft=ttft)


def _quiet_sample(*, running: float = 0.0, preemptions: float = 0.0, tokens: float = 0.0) -> Any:
    empty = Histogram(tuple((bound, 0.0) for bound in TTFT_BOUNDS), 0.0, 0.0)
    return BackendSample(
        flavour=Flavour.VLLM,
        running=running,
        preemptions=preemptions,
        generation_tokens=tokens,
        ttft=empty,
    )


#: Found by the deep profile (2026-12-03): the throughput stage recovers from a learned cap of 1
#: (PIG's sparse recovery, which also lowers its target to what it recovered: 12), but with one
#: slow first token TTFT is not healthy, so the stage holds near its target instead (13), and
#: the component, which follows the target under demand, comes out one higher. PIG's rules do
#: this; the guard keeps PIG's learner as it is.
_SPARSE_RECOVERY_RUN = {
    "config": PolicyConfig(global_limit=64),
    "series": [
        [
            _quiet_sample(),
            _quiet_sample(preemptions=1.0, tokens=912.0),
            None,
            _quiet_sample(),
            _quiet_sample(running=4.0, preemptions=1.0),
            None,
        ]
    ],
    "gates": [gate_holding(cap=0)] * 4 + [gate_holding(cap=0, basic_inflight=1), gate_holding()],
    "rejects": [0] * 6,
    "first_tokens": [],
    "steps": [1.0] * 6,
}


@given(runs(), st.integers(1, 20))
@example(_SPARSE_RECOVERY_RUN, 1)
def test_a_ttft_signal_never_raises_the_cap(run: dict[str, Any], extra: int) -> None:
    """From the same state, one poll with slow first tokens never gives a higher cap, but for
    one corner of PIG's learner: where the plain poll takes PIG's sparse recovery (learned below
    4, its target lowered to what it recovers), the slow one holds near the target it had, and
    the cap may follow that target. It never goes above the throughput stage's own target."""
    run = {**run, "first_tokens": []}  # keep the backend histogram as the TTFT source
    for before, _, decision in play(run):
        if before.last is None:
            continue
        polls = tuple(
            BackendPoll(name=name, sample=slow_ttft(status.sample, extra))
            for name, status in before.backends
        )
        plain = tuple(
            BackendPoll(name=name, sample=status.sample) for name, status in before.backends
        )
        at = decision.at + 1.0
        gate = gate_holding(cap=decision.cap)
        # Re-poll the same samples: the plain run sees no new first tokens at all.
        plain_state, with_plain = evaluate(before, gate, plain, at=at)
        slow_state, with_slow = evaluate(before, gate, polls, at=at)
        if with_slow.cap > with_plain.cap:
            assert plain_state.last is not None
            assert slow_state.last is not None
            assert plain_state.last.throughput.phase == "sparse_recovery"
            held = slow_state.last.throughput
            assert with_slow.cap <= max(held.target, held.learned)
            event("PIG's sparse recovery: the slow poll held a higher target")
            continue
        event("slow first tokens lowered the cap" if with_slow.cap < with_plain.cap else "same cap")


@given(runs(), st.integers(0, 3))
def test_a_counter_reset_on_one_backend_leaves_the_others_alone(
    run: dict[str, Any], which: int
) -> None:
    """Backend 0's rate is the same whether or not another backend's counters reset."""
    learner = LearnerState(config=run["config"])
    first = BackendSample(running=4.0, generation_tokens=1000.0, preemptions=5.0)
    second = BackendSample(running=4.0, generation_tokens=3000.0, preemptions=6.0)
    others_before = BackendSample(running=2.0, generation_tokens=900.0, preemptions=2.0)
    others_after = BackendSample(running=2.0, generation_tokens=500.0 + which, preemptions=0.0)
    polls_0 = (BackendPoll(name="a", sample=first), BackendPoll(name="b", sample=others_before))
    learner, _ = evaluate(learner, gate_holding(), polls_0, at=0.0)
    polls_1 = (BackendPoll(name="a", sample=second), BackendPoll(name="b", sample=others_after))
    after, _ = evaluate(learner, gate_holding(), polls_1, at=2.0)
    last: Snapshot | None = after.last
    assert last is not None
    # Backend a made 2000 tokens in 2 s; b's reset contributes nothing rather than a negative rate.
    assert last.signals.generation_tps == 1000.0
    assert last.signals.preemption_delta == 1.0
    status = dict(after.backends)["a"]
    alone = norm.normalise(norm.BackendStatus(at=0.0, failed=False, sample=first), second, at=2.0)
    assert status.sample == second
    assert alone.generation_tps == 1000.0
