"""The worked scenarios of PIG's learning pipeline (spec 5.6), with PIG's numbers.

Each scenario primes the learner with one poll, sets the remembered values the scenario names
(learned cap, counters), then evaluates the poll the scenario describes.
"""

from __future__ import annotations

from typing import Any

import attrs

from guard_core import LimitReason, LoadState, StateReason
from guard_core.evaluation import BackendPoll, LearnerState, Snapshot, evaluate
from guard_core.gate import GateState
from guard_core.observations import BackendSample, Flavour, Histogram
from guard_core.policy import PolicyConfig
from guard_core.throughput_learner import ThroughputState
from guard_core.ttft_learner import TtftSource, TtftState
from tests.core_steps import gate_holding


def scenario_config(**changes: Any) -> PolicyConfig:
    """The configuration PIG's own tests use for these scenarios."""
    settings: dict[str, Any] = {
        "global_limit": 100,
        "user_tps_yellow": 25.0,
        "user_tps_red": 20.0,
        "capacity_ratio": 1.0,
        "capacity_ratio_max": 1.0,
        "capacity_step_up": 0.10,
        "capacity_healthy_consecutive": 2,
        "capacity_healthy_multiplier": 1.2,
        "pressure_learn_min_running": 8,
    }
    settings.update(changes)
    return PolicyConfig(**settings)


def vllm(**fields: Any) -> BackendSample:
    values: dict[str, Any] = {
        "flavour": Flavour.VLLM,
        "running": 0.0,
        "waiting": 0.0,
        "kv_usage": 0.1,
        "preemptions": 0.0,
        "generation_tokens": 0.0,
    }
    values.update(fields)
    return BackendSample(**values)


def primed(
    config: PolicyConfig,
    sample: BackendSample,
    *,
    cap: int,
    throughput: ThroughputState,
    ttft: TtftState | None = None,
    yellow_count: int = 0,
    red_count: int = 0,
    dynamic_rejects: int = 0,
) -> LearnerState:
    """A learner that polled ``sample`` at t=0 and remembers the given learned values."""
    learner, _ = evaluate(
        LearnerState(config=config), gate_holding(), (BackendPoll(name="b", sample=sample),), at=0.0
    )
    last = learner.last
    assert last is not None
    last = attrs.evolve(
        last,
        decision=attrs.evolve(last.decision, cap=cap),
        throughput=throughput,
        ttft=ttft if ttft is not None else attrs.evolve(last.ttft, learned=cap, target=cap),
        signals=attrs.evolve(
            last.signals, user_tps_yellow_count=yellow_count, user_tps_red_count=red_count
        ),
        dynamic_rejects=dynamic_rejects,
    )
    return attrs.evolve(learner, last=last, dynamic_rejects=dynamic_rejects)


def last_of(learner: LearnerState) -> Snapshot:
    assert learner.last is not None
    return learner.last


def poll(
    learner: LearnerState, sample: BackendSample, gate: GateState | None = None, at: float = 1.0
) -> tuple[LearnerState, Any]:
    gate = gate or gate_holding(cap=last_of(learner).decision.cap if learner.last else 0)
    return evaluate(learner, gate, (BackendPoll(name="b", sample=sample),), at=at)


def test_slow_users_bring_the_cap_down_to_the_estimate() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=20.0, generation_tokens=500.0),
        cap=20,
        throughput=ThroughputState(learned=20, target=20, component=20),
        yellow_count=1,
    )
    learner, decision = poll(learner, vllm(running=20.0, generation_tokens=750.0))
    last = last_of(learner)
    assert last.signals.user_tps == 12.5
    assert (last.signals.raw_capacity, last.signals.safe_capacity) == (10, 10)
    assert last.throughput.phase == "pig_down"
    assert (decision.cap, decision.final_reason) == (10, LimitReason.THROUGHPUT)


def test_backend_waiting_closes_intake_and_keeps_what_was_learned() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=20.0, generation_tokens=500.0),
        cap=20,
        throughput=ThroughputState(learned=20, target=20, component=20),
        yellow_count=1,
    )
    learner, decision = poll(learner, vllm(running=20.0, waiting=1.0, generation_tokens=750.0))
    last = last_of(learner)
    assert (decision.cap, decision.final_reason) == (0, LimitReason.BACKEND_WAITING)
    assert last.throughput.learned == 20
    assert (last.throughput.phase, last.throughput.reason) == (
        "pressure_hold",
        "pressure_not_representative",
    )
    assert last.components.availability == 100
    # Users were at 12.5 tok/s, so the state is already red and the yellow
    # backend_waiting_queue reason is not added on top.
    assert decision.state is LoadState.RED
    assert StateReason.BACKEND_WAITING_QUEUE not in decision.yellow_reasons


def test_backend_waiting_on_a_healthy_backend_is_a_yellow_reason() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=4.0, generation_tokens=0.0),
        cap=20,
        throughput=ThroughputState(learned=20, target=20, component=20),
    )
    learner, decision = poll(learner, vllm(running=4.0, waiting=1.0, generation_tokens=400.0))
    assert (decision.cap, decision.final_reason) == (0, LimitReason.BACKEND_WAITING)
    assert decision.state is LoadState.YELLOW
    assert decision.yellow_reasons == (
        StateReason.WAITING,
        StateReason.SCHEDULER_PRESSURE_CAPACITY,
        StateReason.BACKEND_WAITING_QUEUE,
    )
    learner, decision = poll(learner, vllm(running=4.0, generation_tokens=800.0), at=2.0)
    assert decision.cap == 20


def test_a_preemption_learns_a_pressure_cap_that_then_holds() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=20.0, generation_tokens=500.0),
        cap=20,
        throughput=ThroughputState(learned=20, target=20, component=20),
    )
    learner, decision = poll(learner, vllm(running=20.0, preemptions=1.0, generation_tokens=1500.0))
    assert learner.pressure_cap == 15
    assert (decision.cap, decision.final_reason) == (15, LimitReason.PRESSURE)
    assert last_of(learner).pressure_reason == "severe_pressure"
    assert StateReason.PREEMPTIONS in decision.red_reasons
    assert decision.state is LoadState.RED
    # No new preemption, and no sign that users would stay fast at a higher cap (no new tokens):
    # the learned pressure cap holds.
    learner, decision = poll(
        learner, vllm(running=20.0, preemptions=1.0, generation_tokens=1500.0), at=2.0
    )
    assert (decision.cap, decision.final_reason) == (15, LimitReason.PRESSURE)
    assert last_of(learner).pressure_reason == "learned_cap"


def ttft_histogram(le_1: float, le_2: float) -> Histogram:
    total = le_1 + le_2
    return Histogram(
        ((0.5, 0.0), (1.0, le_1), (2.0, total), (5.0, total), (float("inf"), total)),
        total,
        le_1 * 0.8 + le_2 * 1.6,
    )


def test_late_first_tokens_cut_the_ttft_limit() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=20.0, generation_tokens=500.0, ttft=ttft_histogram(10, 0)),
        cap=20,
        throughput=ThroughputState(learned=20, target=20, component=20),
        ttft=TtftState(source=TtftSource.BACKEND, high_count=1, learned=20, target=20),
    )
    learner, decision = poll(
        learner, vllm(running=20.0, generation_tokens=2500.0, ttft=ttft_histogram(10, 2))
    )
    ttft = last_of(learner).ttft
    assert ttft.smoothed_p95 == 2.0
    assert (ttft.phase, ttft.learned) == ("ttft_down", 17)
    assert (decision.cap, decision.final_reason) == (17, LimitReason.TTFT)


def test_sparse_traffic_probes_the_target_but_holds_the_cap() -> None:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=1.0, generation_tokens=0.0),
        cap=3,
        throughput=ThroughputState(learned=3, target=3, component=3),
    )
    learner, decision = poll(learner, vllm(running=1.0, generation_tokens=100.0))
    throughput = last_of(learner).throughput
    assert (throughput.target, throughput.target_reason) == (4, "sparse_probe_floor")
    assert throughput.phase == "sparse_probe"
    assert decision.cap == 3


def test_rising_rejects_probe_up_to_the_demand_floor() -> None:
    config = scenario_config(capacity_ratio=0.42, capacity_ratio_max=0.85)
    learner = primed(
        config,
        vllm(running=1.0, generation_tokens=0.0),
        cap=4,
        throughput=ThroughputState(learned=4, target=4, component=4),
        dynamic_rejects=3,
    )
    learner = attrs.evolve(learner, dynamic_rejects=10)
    learner, decision = poll(learner, vllm(running=1.0, generation_tokens=100.0))
    throughput = last_of(learner).throughput
    assert throughput.phase == "demand_probe"
    assert throughput.target == 8
    assert decision.cap == 8


def test_sparse_recovery_under_demand() -> None:
    config = scenario_config(user_tps_yellow=55.0, capacity_ratio=0.42, capacity_ratio_max=0.85)
    learner = primed(
        config,
        vllm(running=10.0, generation_tokens=0.0),
        cap=3,
        throughput=ThroughputState(learned=3, target=3),
        dynamic_rejects=1,
    )
    learner = attrs.evolve(learner, dynamic_rejects=5)
    learner, decision = poll(learner, vllm(running=10.0, generation_tokens=1158.0))
    last = last_of(learner)
    assert (last.signals.raw_capacity, last.signals.safe_capacity) == (21, 8)
    assert last.throughput.phase == "sparse_recovery"
    assert decision.cap == 18


def saturated_basic(gate: GateState) -> tuple[LearnerState, Any]:
    config = scenario_config()
    learner = primed(
        config,
        vllm(running=49.0, generation_tokens=0.0),
        cap=50,
        throughput=ThroughputState(learned=50, target=50, component=50, healthy_count=1),
    )
    return poll(learner, vllm(running=49.0, generation_tokens=4900.0), gate)


def test_saturated_basic_tier_is_demand_that_probes_up() -> None:
    learner, decision = saturated_basic(gate_holding(basic_inflight=49, cap=50))
    assert last_of(learner).signals.tier_demand
    assert last_of(learner).throughput.phase == "probe_up"
    assert decision.cap > 50


def test_basic_held_back_by_a_waiting_premium_is_not_tier_demand() -> None:
    # The waiting premium request is in the gate's queue, and a queue is demand of its own
    # (PIG's rule), so the learner probes up; what it must not do is count the basic tier as
    # held back by the cap. (Before the evaluation read the gate itself, this test gave it a
    # copy with a premium waiter and an empty queue, a state no gate can be in.)
    learner, _ = saturated_basic(gate_holding(basic_inflight=49, premium_waiting=1, cap=50))
    signals = last_of(learner).signals
    assert not signals.tier_demand
    assert signals.queue == 1
    assert signals.capacity_demand


def test_cold_start_publishes_fifty() -> None:
    _, decision = evaluate(
        LearnerState(config=PolicyConfig()),
        gate_holding(),
        (BackendPoll(name="b", sample=vllm()),),
        at=0.0,
    )
    assert decision.cap == 50
    assert decision.final_reason is LimitReason.THROUGHPUT
