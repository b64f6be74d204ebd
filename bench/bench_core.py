"""Micro-benchmarks of the pure core: one admission decision and one poll evaluation.

Run: ``python bench/bench_core.py`` (also part of ``nox -s bench``). Prints medians of several
repeats; nothing is asserted. Goals (PRODUCT.md): admission <= 10 us, poll evaluation <= 200 us
(the predictive learner's rows are four events per request and PIG's pipeline plus the fit per
poll, so their goals are four and two times those; the short-wait and pool rows have none:
they show that a held request costs about the same with 2,000 others waiting as with 10,
reading each backend's load the same with 2,000 requests in flight as with 20, and a placement
in the router's full memory of 4,096 prefix keys a few microseconds),
one parse of the real vLLM metrics page <= 200 us (bench_metrics_parse.py compares parsers).
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import timeit
from pathlib import Path

from guard_adapters.metrics import parse_metrics
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    BackendSample,
    DecisionPublished,
    Finished,
    FirstToken,
    Flavour,
    Forwarded,
    GateConfig,
    GateState,
    GuardConfig,
    GuardState,
    Histogram,
    LearnerState,
    MetricsPolled,
    PolicyConfig,
    PredictiveConfig,
    PublishedDecision,
    Retried,
    SlotReleased,
    SlotRequested,
    Tier,
    apply_gate_event,
    apply_guard_event,
    evaluate,
)
from guard_core.backend_prediction import backend_loads
from guard_core.decision import DecisionSource, LimitReason, LoadState, Queued
from guard_core.placements import DEFAULT_MEMORY, Placements, placed
from guard_core.traffic import BackendForwarded

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests/fixtures/metrics/vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom"


def median_us(statement: object, number: int, repeat: int = 7) -> float:
    times = timeit.repeat(statement, number=number, repeat=repeat)  # type: ignore[arg-type]
    return statistics.median(times) / number * 1e6


def admission_pair() -> float:
    """One admitted request: try-acquire and release, at 100 in flight under cap 256."""
    gate = GateState.initial(GateConfig(), at=0.0)
    decision = PublishedDecision(
        at=0.0, source=DecisionSource.METRICS, cap=256, state=LoadState.GREEN,
        final_reason=LimitReason.THROUGHPUT,
    )  # fmt: skip
    gate = apply_gate_event(gate, DecisionPublished(decision)).state
    for _ in range(100):
        gate = apply_gate_event(gate, SlotRequested(0.0, Tier.BASIC)).state
    request, release = SlotRequested(1.0, Tier.PREMIUM), SlotReleased(1.0, Tier.PREMIUM)

    def once() -> None:
        state = apply_gate_event(gate, request).state
        apply_gate_event(state, release)

    return median_us(once, 20_000) / 2


def poll_evaluation() -> float:
    """One steady-state poll: the real vLLM page, counters moving, a learner with history."""
    sample = parse_metrics(PAGE.read_bytes())
    learner = LearnerState(config=PolicyConfig())
    gate = GateState(
        config=GateConfig(),
        decision=PublishedDecision.static(at=0.0, global_limit=50),
        basic_inflight=20,
    )
    at = 0.0
    for step in range(5):
        at += 1.0
        moved = sample.__class__(
            flavour=sample.flavour, running=20.0, waiting=0.0, kv_usage=0.3,
            preemptions=0.0, generation_tokens=1000.0 * step, ttft=sample.ttft,
        )  # fmt: skip
        learner, _ = evaluate(learner, gate, (BackendPoll(name="b", sample=moved),), at=at)
    polls = (BackendPoll(name="b", sample=moved),)

    def once() -> None:
        evaluate(learner, gate, polls, at=at + 1.0)

    return median_us(once, 2_000)


def _learned(state: GuardState, names: tuple[str, ...]) -> tuple[GuardState, float]:
    """``state`` after seven polls of the backends ``names`` (the same steady samples each)."""
    at = 0.0
    for poll in range(1, 8):
        at = float(poll)
        tokens = 1200.0 * poll
        sample = BackendSample(
            flavour=Flavour.VLLM, running=40.0, waiting=0.0, kv_usage=0.2,
            generation_tokens=tokens, prompt_tokens=3000.0 * poll,
            inter_token_latency=Histogram(((math.inf, tokens),), tokens, tokens * 0.02),
        )  # fmt: skip
        polls = tuple(BackendPoll(name=name, sample=sample) for name in names)
        state = apply_guard_event(state, MetricsPolled(at, polls)).state
    return state, at


def _predictive_guard() -> tuple[GuardState, float]:
    """A predictive guard that has learned from a few polls, with 20 requests in flight."""
    initial = GuardState.initial(GuardConfig(predictive=PredictiveConfig()), at=0.0)
    state, at = _learned(initial, ("b",))
    for rid in range(20):
        arrived = Arrived(at=at, request_id=rid, tier=Tier.BASIC, body_bytes=2000)
        step = apply_guard_event(state, arrived)
        if not isinstance(step.outcome, Admitted):
            break
        state = apply_guard_event(step.state, Forwarded(at=at, request_id=rid)).state
        state = apply_guard_event(state, FirstToken(at=at, request_id=rid, seconds=0.2)).state
    return state, at


def predictive_admission() -> float:
    """One predictive admission and its end: attempt, forward, first token, release."""
    state, at = _predictive_guard()
    events = (
        Arrived(at=at, request_id=10_000, tier=Tier.PREMIUM, body_bytes=2000),
        Forwarded(at=at, request_id=10_000),
        FirstToken(at=at, request_id=10_000, seconds=0.2),
        Finished(at=at, request_id=10_000),
    )

    assert isinstance(apply_guard_event(state, events[0]).outcome, Admitted)

    def once() -> None:
        current = state
        for event in events:
            current = apply_guard_event(current, event).state

    return median_us(once, 2_000)


def _predictive_pool(held: int) -> tuple[GuardState, float]:
    """A predictive guard over four backends that has learned from a few polls, with ``held``
    requests in flight spread over them (each placed: the pool rules read each one's load)."""
    names = tuple(f"b{index}" for index in range(4))
    # Filled under the static cap: the learner would refuse most of them.
    config = GuardConfig(
        gate=GateConfig(global_limit=100_000, dynamic=False),
        policy=PolicyConfig(global_limit=100_000),
        predictive=PredictiveConfig(),
    )
    state, at = _learned(GuardState.initial(config, at=0.0), names)
    for rid in range(held):
        arrived = Arrived(at=at, request_id=rid, tier=Tier.BASIC, body_bytes=2000)
        state = apply_guard_event(state, arrived).state
        state = apply_guard_event(state, Forwarded(at=at, request_id=rid)).state
        placed = BackendForwarded(at=at, backend=names[rid % 4], request_id=rid)
        state = apply_guard_event(state, placed).state
    assert len(state.requests) == held
    return state, at


def pool_loads(held: int) -> float:
    """The pool rules' reading of each backend's own load (``backend_loads``), done once to
    admit and once to route every request, with ``held`` requests in flight over four backends."""
    state, at = _predictive_pool(held)
    predictive = state.predictive
    assert predictive is not None
    assert backend_loads(predictive, at=at) is not None
    return median_us(lambda: backend_loads(predictive, at=at), 200)


def short_wait(waiting: int) -> float:
    """A request held in the short wait and refused at its deadline (its arrival and its retry),
    with the one slot taken and ``waiting`` others waiting: the refusal path of an overload
    that holds requests first."""
    config = GuardConfig(
        gate=GateConfig(global_limit=1, dynamic=False), policy=PolicyConfig(global_limit=1)
    )
    state = GuardState.initial(config, at=0.0)
    for rid in range(waiting + 1):  # the first takes the slot, the others wait
        arrived = Arrived(at=0.0, request_id=rid, tier=Tier.BASIC, body_bytes=2000)
        state = apply_guard_event(state, arrived).state
    assert len(state.requests) == waiting + 1
    arrived = Arrived(at=0.1, request_id=1_000_000, tier=Tier.BASIC, body_bytes=2000)
    queued = apply_guard_event(state, arrived)
    assert isinstance(queued.outcome, Queued)
    retried = Retried(at=queued.outcome.deadline, request_id=1_000_000)

    def once() -> None:
        apply_guard_event(apply_guard_event(state, arrived).state, retried)

    return median_us(once, 500)


def placement() -> float:
    """The pool router's memory after one more placement, with its 4,096 prefix keys full (the
    proxy and the simulator make one per routed request with a key)."""
    placements = Placements()
    for key in range(DEFAULT_MEMORY):
        placements = placed(placements, key, "b0", 512.0)
    keys = iter(range(10**9))  # each call a new key: a touch and an eviction

    def once() -> None:
        placed(placements, next(keys) % (2 * DEFAULT_MEMORY), "b1", 512.0)

    return median_us(once, 2_000)


def predictive_poll() -> float:
    """One poll with the predictive learner: PIG's pipeline plus the fit and the cap."""
    state, at = _predictive_guard()
    tokens = 1200.0 * 8
    sample = BackendSample(
        flavour=Flavour.VLLM, running=40.0, waiting=0.0, kv_usage=0.2,
        generation_tokens=tokens, prompt_tokens=24000.0,
        inter_token_latency=Histogram(((math.inf, tokens),), tokens, tokens * 0.02),
    )  # fmt: skip
    polled = MetricsPolled(at + 1.0, (BackendPoll(name="b", sample=sample),))
    return median_us(lambda: apply_guard_event(state, polled), 500)


def metrics_parse() -> float:
    """One parse of the real 46 KB vLLM 0.10 page by the poller's scanner, as bytes."""
    page = PAGE.read_bytes()
    return median_us(lambda: parse_metrics(page), 500)


def main() -> None:
    build = f"{platform.python_implementation()} {sys.version.split()[0]} ({platform.machine()})"
    rows = [
        ("admission decision (gate, per attempt)", admission_pair(), 10.0),
        ("poll evaluation (learning pipeline)", poll_evaluation(), 200.0),
        ("predictive: attempt+forward+first+end", predictive_admission(), 40.0),
        ("predictive: one poll (PIG's + the fit)", predictive_poll(), 400.0),
        ("a short wait refused at its end, 10 waiting", short_wait(10), None),
        ("  the same with 2,000 waiting", short_wait(2_000), None),
        ("a placement in a full prefix memory", placement(), None),
        ("pool of 4: each backend's load, 20 held", pool_loads(20), None),
        ("  the same with 2,000 held", pool_loads(2_000), None),
        ("metrics page parse (vLLM 0.10, 46 KB)", metrics_parse(), 200.0),
    ]
    print(f"guard_core micro-benchmarks on {build}, median of 7 repeats")
    print(f"{'what':42} {'us':>9} {'goal us':>8}")
    for name, value, goal in rows:
        print(f"{name:42} {value:9.2f} {'-' if goal is None else f'{goal:.0f}':>8}")


if __name__ == "__main__":
    main()
