"""The trio guard engine: waits, wake-ups, deadlines, cancellation, exactly-once release.

Virtual time (trio's autojump clock), so every assertion on time is exact.
"""

from __future__ import annotations

import random

import attrs
import pytest
import trio

from guard_adapters.backends import MetricsSource
from guard_core import (
    BackendPoll,
    BackendSample,
    Binding,
    DecisionSource,
    Forwarded,
    GateConfig,
    GuardConfig,
    LimitReason,
    LoadState,
    PredictiveConfig,
    PublishedDecision,
    Refused,
    RejectCode,
    RequestEvent,
    Retried,
    Tier,
    apply_guard_event,
)
from guard_core.gate import DecisionPublished
from guard_trio._engine import AdmissionResult, GuardEngine
from guard_trio._poller import Poller

P, B = Tier.PREMIUM, Tier.BASIC


def engine_with_cap(cap: int, **gate: object) -> GuardEngine:
    config = GuardConfig(gate=GateConfig(**gate), learning=False)  # type: ignore[arg-type]
    engine = GuardEngine(config)
    decision = PublishedDecision(
        at=0.0,
        source=DecisionSource.METRICS,
        cap=cap,
        state=LoadState.GREEN,
        final_reason=LimitReason.THROUGHPUT,
    )
    engine.state = apply_guard_event(engine.state, DecisionPublished(decision)).state
    return engine


async def test_admits_and_releases_exactly_once(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(2)
    result = await engine.admit(P)
    assert result.slot is not None
    assert engine.state.gate.inflight == 1
    result.slot.release(200)
    result.slot.release(200)  # a second release is ignored
    assert engine.state.gate.inflight == 0


async def test_a_release_wakes_a_waiter_at_once(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(1)
    first = await engine.admit(P)
    assert first.slot is not None
    results: list[AdmissionResult] = []

    async def wait_for_slot() -> None:
        results.append(await engine.admit(P))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_slot)
        await trio.sleep(0.2)
        assert engine.state.gate.premium_waiting == 1
        first.slot.release()
    assert results[0].slot is not None
    assert results[0].waited_s == pytest.approx(0.2)


async def test_a_waiter_is_refused_at_its_deadline(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(1)
    held = await engine.admit(P)
    assert held.slot is not None
    start = trio.current_time()
    refused = await engine.admit(P)
    assert refused.slot is None
    assert refused.code is RejectCode.GLOBAL_DYNAMIC_LIMIT
    assert trio.current_time() - start == pytest.approx(0.5)
    assert engine.state.gate.waiting == 0


async def test_a_poll_wakes_waiters(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(1)
    held = await engine.admit(B)
    assert held.slot is not None
    results: list[AdmissionResult] = []

    async def wait_for_slot() -> None:
        results.append(await engine.admit(P))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_slot)
        await trio.sleep(0.1)
        bigger = attrs.evolve(engine.state.gate.decision, cap=3)
        engine.state = apply_guard_event(engine.state, DecisionPublished(bigger)).state
        engine.retry_waiters()
    assert results[0].slot is not None
    assert results[0].waited_s == pytest.approx(0.1)


class _Scheduled(trio.abc.Instrument):
    """Records every task trio is asked to run next."""

    def __init__(self) -> None:
        self.tasks: list[trio.lowlevel.Task] = []

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self.tasks.append(task)


class _Fixed(random.Random):
    """A random source that always draws ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("newest_first", [False, True])
async def test_a_release_retries_every_waiter_and_wakes_only_the_admitted(
    autojump_clock: trio.abc.Clock, newest_first: bool
) -> None:
    events: list[RequestEvent] = []
    engine = engine_with_cap(1)
    engine._order = _Fixed(0.0 if newest_first else 0.99)
    engine.on_event = events.append
    held = await engine.admit(P)
    assert held.slot is not None
    tasks: dict[int, trio.lowlevel.Task] = {}
    results: dict[int, AdmissionResult] = {}

    async def wait_for_slot(index: int) -> None:
        tasks[index] = trio.lowlevel.current_task()
        results[index] = await engine.admit(P)

    async with trio.open_nursery() as nursery:
        for index in range(30):
            nursery.start_soon(wait_for_slot, index)
            await trio.sleep(0.001)
        assert engine.state.gate.premium_waiting == 30
        waiting_ids = sorted(engine._waiters)
        del events[:]
        scheduled = _Scheduled()
        trio.lowlevel.add_instrument(scheduled)
        held.slot.release()  # synchronous: every retry and every wake-up happens in here
        trio.lowlevel.remove_instrument(scheduled)
        # Every waiter was retried once, in arrival order or its reverse (the broadcast's
        # order is drawn each time); only the first retried got the slot, and only its task
        # was woken: the others sleep on until their own timers.
        retried = [event.request_id for event in events if isinstance(event, Retried)]
        assert retried == (waiting_ids[::-1] if newest_first else waiting_ids)
        first = 29 if newest_first else 0
        assert scheduled.tasks == [tasks[first]]
        assert engine.state.gate.premium_waiting == 29
        nursery.cancel_scope.cancel()
    assert results.keys() == {first}
    slot = results[first].slot
    assert slot is not None
    slot.release()
    assert engine.state.gate.inflight == 0
    assert engine.state.gate.waiting == 0


async def test_a_polls_retries_follow_its_report(autojump_clock: trio.abc.Clock) -> None:
    # The recorder hears of a round from the poller's report and of retries from the engine: a
    # recording must hold the round before the retries it allowed, or replay folds them first.
    seen: list[object] = []
    engine = engine_with_cap(1)
    engine.on_event = seen.append
    held = await engine.admit(P)
    assert held.slot is not None
    closed = trio.socket.socket()
    await closed.bind(("127.0.0.1", 0))  # bound, never listening: every fetch is refused
    host, port = closed.getsockname()
    source = MetricsSource(name="metrics1", url=f"http://{host}:{port}/metrics")
    poller = Poller(engine, (source,), interval_s=1.0, on_round=seen.append)
    results: list[AdmissionResult] = []

    async def wait_for_slot() -> None:
        results.append(await engine.admit(P))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_slot)
        await trio.sleep(0.01)
        report = await poller.poll_once()
    closed.close()
    assert results[0].slot is None  # the one slot stayed held: refused at its deadline
    position = seen.index(report)
    retried = [(i, item) for i, item in enumerate(seen) if isinstance(item, Retried)]
    assert retried, "the poll retried nobody"
    # The first retry is the poll's own (at the round's instant), and it comes after the round.
    first, event = retried[0]
    assert event.at == report.at
    assert first > position
    held.slot.release()


async def test_a_cancelled_waiter_leaves_the_queue(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(1)
    held = await engine.admit(P)
    assert held.slot is not None
    with trio.move_on_after(0.2):
        await engine.admit(B)
    assert engine.state.gate.waiting == 0
    held.slot.release()
    assert engine.state.gate.inflight == 0


async def test_premium_waiter_blocks_basic_until_served(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(2)
    first = await engine.admit(P)
    second = await engine.admit(P)
    assert first.slot is not None
    assert second.slot is not None
    outcomes: dict[str, AdmissionResult] = {}

    async def ask(tier: Tier, name: str) -> None:
        outcomes[name] = await engine.admit(tier)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, B, "basic")  # queued before the premium request
        await trio.sleep(0.01)
        nursery.start_soon(ask, P, "premium")
        await trio.sleep(0.01)
        first.slot.release()
    # The freed slot goes to premium although basic waited longer.
    assert outcomes["premium"].slot is not None
    assert outcomes["basic"].slot is None


async def test_start_up_refuses_at_once_in_dynamic_mode(autojump_clock: trio.abc.Clock) -> None:
    engine = GuardEngine(GuardConfig())
    start = trio.current_time()
    result = await engine.admit(P)
    assert result.code is RejectCode.BACKEND_UNAVAILABLE
    assert trio.current_time() == start


async def test_first_token_is_measured_from_arrival(autojump_clock: trio.abc.Clock) -> None:
    engine = engine_with_cap(4)
    result = await engine.admit(P)
    assert result.slot is not None
    await trio.sleep(0.75)
    result.slot.first_token()
    result.slot.first_token()  # only the first counts
    semantic = engine.state.learner.semantic_ttft
    assert semantic is not None
    assert semantic.count == 1
    assert semantic.sum == pytest.approx(0.75)
    assert len(engine.state.learner.prefill) == 1
    result.slot.release()
    assert not engine.state.learner.prefill


# -- the predictive learner --------------------------------------------------------------------


class Outcomes:
    """A listener that keeps how the engine says each attempt ended."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, RejectCode | None, int | None, Binding | None]] = []

    def __call__(self, event: RequestEvent) -> None:
        if isinstance(event, Forwarded):
            self.seen.append((True, None, None, None))
        elif isinstance(event, Refused):
            self.seen.append((False, event.code, event.retry_after_s, event.binding))


def predictive_engine(observer: Outcomes | None = None) -> GuardEngine:
    """A predictive guard after one good poll (4 running, little KV in use)."""
    config = GuardConfig(predictive=PredictiveConfig())
    engine = GuardEngine(config, on_event=observer)
    sample = BackendSample(running=4.0, waiting=0.0, kv_usage=0.05, generation_tokens=10.0)
    engine.publish_poll((BackendPoll(name="metrics1", sample=sample),), at=0.0)
    return engine


async def test_the_predictive_learner_gets_each_body_size_and_first_token(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = predictive_engine()
    result = await engine.admit(B, body_bytes=8000)
    assert result.slot is not None
    model = engine.state.predictive
    assert model is not None
    assert model.requests[result.slot.request_id].body_bytes == 8000
    assert (model.pending_count, model.pending_tokens) == (1, 2000.0)
    await trio.sleep(0.3)
    result.slot.first_token()
    model = engine.state.predictive
    assert model is not None
    assert (model.pending_count, model.decoders) == (0, 1)
    assert model.requests[result.slot.request_id].first_at == pytest.approx(0.3, abs=0.01)
    result.slot.release(200)
    assert not engine.state.predictive.requests  # type: ignore[union-attr]


async def test_a_predictive_refusal_carries_its_retry_after_and_binding(
    autojump_clock: trio.abc.Clock,
) -> None:
    observer = Outcomes()
    engine = predictive_engine(observer)
    running = await engine.admit(B, body_bytes=4000)
    assert running.slot is not None
    # Prefilling a prompt of ten million tokens would stall the running stream (and keep this
    # one from its first token) far beyond the targets: the learner refuses it.
    refused = await engine.admit(B, body_bytes=40_000_000)
    assert refused.slot is None
    assert refused.code is RejectCode.GLOBAL_DYNAMIC_LIMIT
    assert refused.binding in (Binding.SPEED, Binding.TTFT)
    assert refused.retry_after_s is not None
    assert 1 <= refused.retry_after_s <= 30
    assert observer.seen[-1] == (False, refused.code, refused.retry_after_s, refused.binding)
    assert observer.seen[0] == (True, None, None, None)


async def test_pigs_learner_gives_no_retry_after_or_binding(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = engine_with_cap(1)
    held = await engine.admit(P, body_bytes=100)
    assert held.slot is not None
    refused = await engine.admit(P, body_bytes=100)
    assert (refused.code, refused.retry_after_s, refused.binding) == (
        RejectCode.GLOBAL_DYNAMIC_LIMIT,
        None,
        None,
    )
