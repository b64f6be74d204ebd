"""Backend choice under health (ejected, probing, full backends) and the failure mode's gate."""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

from guard_core import (
    Admitted,
    DecisionPublished,
    DecisionSource,
    GateConfig,
    GateState,
    LimitReason,
    LoadState,
    PublishedDecision,
    RejectCode,
    Rejected,
    SlotReleased,
    SlotRequested,
    Tier,
    apply_gate_event,
)
from guard_core.backend_choice import BackendView, choose_backend, is_probe
from guard_core.gate import failing_open
from guard_core.health import Availability, BackendHealth, availability

NOW = 100.0

#: A backend's health at NOW: available, half-open, probing, full, ejected (ending at a time).
healths = st.one_of(
    st.just(None),
    st.builds(lambda: BackendHealth(name="x", ejected_until=NOW - 1.0)),
    st.builds(lambda: BackendHealth(name="x", ejected_until=NOW - 1.0, probing=True)),
    st.builds(lambda: BackendHealth(name="x", full_until=NOW + 0.5)),
    st.floats(NOW + 0.1, NOW + 100.0).map(lambda t: BackendHealth(name="x", ejected_until=t)),
)
views = st.lists(
    st.builds(
        lambda i, running, failed, health: (i, running, failed, health),
        st.integers(0, 20),
        st.integers(0, 50),
        st.booleans(),
        healths,
    ),
    min_size=1,
    max_size=6,
)


def build(raw: list[tuple[int, int, bool, BackendHealth | None]]) -> list[BackendView]:
    return [
        BackendView(
            name=f"b{i}",
            inflight=inflight,
            running=running,
            failed=failed,
            updated_at=NOW,
            health=attrs.evolve(health, name=f"b{i}") if health is not None else None,
        )
        for i, (inflight, running, failed, health) in enumerate(raw)
    ]


def ready(view: BackendView) -> bool:
    return availability(view.health, now=NOW) in (Availability.AVAILABLE, Availability.PROBE)


@given(views, st.booleans())
def test_a_pool_always_gets_a_backend(raw: Any, dynamic: bool) -> None:
    backends = build(raw)
    chosen = choose_backend(backends, now=NOW, poll_interval_s=1.0, dynamic=dynamic)
    assert chosen is not None
    assert 0 <= chosen < len(backends)


@given(views, st.booleans())
def test_held_back_backends_only_when_every_backend_is(raw: Any, dynamic: bool) -> None:
    backends = build(raw)
    chosen = choose_backend(backends, now=NOW, poll_interval_s=1.0, dynamic=dynamic)
    assert chosen is not None
    if any(ready(view) for view in backends):
        assert ready(backends[chosen])
    else:
        # A full one is preferred to an ejected one (it may have room again now).
        kinds = {availability(view.health, now=NOW) for view in backends}
        if Availability.FULL in kinds:
            assert availability(backends[chosen].health, now=NOW) is Availability.FULL


@given(views)
def test_health_changes_nothing_among_backends_it_lets_take_work(raw: Any) -> None:
    """With every backend ready, the choice is the one without health at all."""
    backends = [attrs.evolve(v, health=None) for v in build(raw)]
    half_open = [
        attrs.evolve(v, health=BackendHealth(name=v.name, ejected_until=NOW - 5.0))
        for v in backends
    ]
    plain = choose_backend(backends, now=NOW, poll_interval_s=1.0, dynamic=True)
    assert choose_backend(half_open, now=NOW, poll_interval_s=1.0, dynamic=True) == plain
    assert plain is not None
    assert is_probe(half_open[plain], now=NOW)
    assert not is_probe(backends[plain], now=NOW)


# -- the failure mode --------------------------------------------------------------------------

attempts = st.lists(
    st.tuples(st.sampled_from(("premium", "basic", "release")), st.floats(0.0, 0.1)),
    max_size=80,
)
unusable = st.sampled_from(("startup", "all_failed"))


def closed_decision(kind: str) -> PublishedDecision:
    if kind == "startup":
        return PublishedDecision.startup(at=0.0)
    return PublishedDecision.all_polls_failed(at=0.0, backend_count=2)


def drive(gate: GateState, plan: list[tuple[str, float]]) -> list[tuple[GateState, object | None]]:
    at = 1.0
    seen: list[tuple[GateState, object | None]] = []
    held: list[Tier] = []
    for what, gap in plan:
        at += gap
        if what == "release":
            if not held:
                continue
            step = apply_gate_event(gate, SlotReleased(at, held.pop()))
        else:
            tier = Tier.PREMIUM if what == "premium" else Tier.BASIC
            step = apply_gate_event(gate, SlotRequested(at, tier))
            if isinstance(step.outcome, Admitted):
                held.append(tier)
        gate = step.state
        seen.append((gate, step.outcome))
    return seen


def gate_with(decision: PublishedDecision, **config: Any) -> GateState:
    gate = GateState.initial(GateConfig(**config), at=0.0)
    return apply_gate_event(gate, DecisionPublished(decision)).state


@given(attempts, unusable, st.integers(0, 12))
def test_close_is_todays_gate_exactly(plan: Any, kind: str, limit: int) -> None:
    decision = closed_decision(kind)
    closed = drive(gate_with(decision, global_limit=limit), plan)
    explicit = drive(gate_with(decision, global_limit=limit, fail_open=False), plan)
    assert closed == explicit
    for gate, outcome in closed:
        assert not failing_open(gate)
        if outcome is not None:  # a release has none
            assert outcome == Rejected(RejectCode.BACKEND_UNAVAILABLE)  # no intake at all


@given(attempts, unusable, st.integers(0, 12))
def test_open_never_exceeds_global_limit(plan: Any, kind: str, limit: int) -> None:
    gate = gate_with(closed_decision(kind), global_limit=limit, fail_open=True)
    assert failing_open(gate)
    admitted = 0
    for state, outcome in drive(gate, plan):
        assert state.inflight <= limit
        admitted += isinstance(outcome, Admitted)
        if isinstance(outcome, Rejected):
            assert outcome.code is not RejectCode.BACKEND_UNAVAILABLE
    if limit > 1 and any(what == "premium" for what, _ in plan[:1]):
        assert admitted > 0  # it forwards


@given(st.integers(1, 12), st.integers(1, 12))
def test_open_changes_nothing_while_metrics_decide(cap: int, limit: int) -> None:
    decision = PublishedDecision(
        at=0.0,
        source=DecisionSource.METRICS,
        cap=cap,
        state=LoadState.GREEN,
        final_reason=LimitReason.THROUGHPUT,
    )
    plan = [("premium", 0.01), ("basic", 0.01)] * 8 + [("release", 0.01)] * 3

    def seen(gate: GateState) -> list[tuple[int, int, object | None]]:
        return [(s.inflight, s.waiting, o) for s, o in drive(gate, plan)]

    opened = gate_with(decision, global_limit=limit, fail_open=True)
    assert seen(opened) == seen(gate_with(decision, global_limit=limit))
    assert not failing_open(gate_with(decision, global_limit=limit, fail_open=True))


# -- health as core state ----------------------------------------------------------------------


@given(st.lists(st.sampled_from(("fail", "ok", "full")), max_size=30))
def test_health_is_guard_state_that_backend_choice_reads(kinds: list[str]) -> None:
    """Health events change GuardState.health through the guard's one reducer, and the
    views backend choice reads carry exactly that state."""
    from guard_core import GuardConfig, GuardState, apply_guard_event
    from guard_core.backend_choice import backend_views
    from guard_core.health import (
        BackendFailed,
        BackendFull,
        BackendSucceeded,
        Failure,
        HealthState,
        apply_health,
    )

    config = GuardConfig()
    state = GuardState.initial(config, at=0.0)
    expected = HealthState()
    for step, kind in enumerate(kinds):
        at = float(step)
        events: dict[str, BackendFailed | BackendSucceeded | BackendFull] = {
            "fail": BackendFailed(at, "b0", Failure.RESET),
            "ok": BackendSucceeded(at, "b0"),
            "full": BackendFull(at, "b0"),
        }
        event = events[kind]
        state = apply_guard_event(state, event).state
        expected = apply_health(expected, event, config.health)
    assert state.health == expected
    view, other = backend_views(("b0", "b1"), state.published, state.traffic, state.health)
    assert view.health == expected.of("b0")
    assert other.health is None
