"""A stateful Hypothesis model of the admission gate.

Random interleavings of requests, retries, deadlines, client departures, releases and new
published caps are driven through :func:`guard_core.gate.apply`, while a plain model keeps its own
count of slots held and requests waiting. After every step the invariants of the gate's module
header are checked; at the end every waiter is timed out and every slot released, and the gate
must be back to zero.
"""

from __future__ import annotations

import math

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from guard_core import (
    Admitted,
    DecisionPublished,
    DecisionSource,
    GateConfig,
    GateState,
    LimitReason,
    LoadState,
    PublishedDecision,
    Queued,
    Rejected,
    SlotReleased,
    SlotRequested,
    StateReason,
    Tier,
    WaitAbandoned,
    WaitRetried,
    apply_gate_event,
    basic_limit,
    current_limit,
)
from guard_core.gate import MAX_SHORT_WAIT_S

tiers = st.sampled_from(Tier)
reasons = st.lists(st.sampled_from(StateReason), max_size=3, unique=True).map(tuple)


@st.composite
def decisions(draw: st.DrawFn, *, at: float, global_limit: int) -> PublishedDecision:
    source = draw(st.sampled_from(DecisionSource))
    yellow = draw(reasons)
    red = draw(reasons)
    count = draw(st.integers(0, 3))
    return PublishedDecision(
        at=at,
        source=source,
        cap=draw(st.integers(0, global_limit + 4)),
        state=draw(st.sampled_from(LoadState)),
        final_reason=draw(st.sampled_from(LimitReason)),
        yellow_reasons=yellow,
        red_reasons=red,
        running=draw(st.integers(0, 40)),
        waiting=draw(st.integers(0, 4)),
        kv_usage=draw(st.floats(0, 1)),
        backend_count=count,
        backend_failed=draw(st.integers(0, count)),
    )


class GateMachine(RuleBasedStateMachine):
    """Drives the gate and a counting model side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.held: list[Tier] = []
        self.waiters: list[Queued] = []
        self.attempts = 0
        self.admitted = 0
        self.rejected = 0

    @initialize(
        global_limit=st.integers(0, 6),
        dynamic=st.booleans(),
        queue_wait_s=st.sampled_from([0.0, 0.05, 0.3, 0.5, 2.0]),
    )
    def start(self, global_limit: int, dynamic: bool, queue_wait_s: float) -> None:
        config = GateConfig(global_limit=global_limit, dynamic=dynamic, queue_wait_s=queue_wait_s)
        self.gate = GateState.initial(config, at=self.now)

    # -- helpers --------------------------------------------------------------------------------

    def _record(self, before: GateState, outcome: object, tier: Tier, *, retry: bool) -> None:
        """Check one attempt's outcome against the rules, then update the model."""
        code = getattr(outcome, "code", None)
        event(f"{'retry' if retry else 'request'}: {type(outcome).__name__} {code or ''}")
        if isinstance(outcome, Admitted):
            assert outcome.tier is tier
            limit, closed = current_limit(before)
            assert closed is None
            assert before.inflight + 1 <= before.config.global_limit
            if before.config.dynamic:
                assert before.inflight + 1 <= limit
            if tier is Tier.BASIC:
                # No basic admission while premium waits, and never a premium-owed slot.
                assert before.premium_waiting == 0
                assert before.basic_inflight + 1 <= basic_limit(limit, before.premium_inflight)
            self.held.append(tier)
            self.admitted += 1
        elif isinstance(outcome, Queued):
            assert outcome.tier is tier
            assert outcome.deadline > self.now
            assert outcome.deadline <= self.now + MAX_SHORT_WAIT_S or retry
            self.waiters.append(outcome)
        else:
            assert isinstance(outcome, Rejected)
            self.rejected += 1

    # -- rules ----------------------------------------------------------------------------------

    @rule(tier=tiers)
    def request(self, tier: Tier) -> None:
        self.attempts += 1
        step = apply_gate_event(self.gate, SlotRequested(self.now, tier))
        assert step.outcome is not None
        self._record(self.gate, step.outcome, tier, retry=False)
        self.gate = step.state

    @precondition(lambda self: self.waiters)
    @rule(index=st.integers(0, 1000), late=st.booleans())
    def retry(self, index: int, late: bool) -> None:
        queued = self.waiters.pop(index % len(self.waiters))
        at = max(self.now, queued.deadline) if late else self.now
        step = apply_gate_event(self.gate, WaitRetried(at, queued))
        assert step.outcome is not None
        if late:
            assert not isinstance(step.outcome, Queued), "a waiter at its deadline must get an end"
        else:
            assert not isinstance(step.outcome, Queued) or step.outcome.deadline == queued.deadline
        self._record(self.gate, step.outcome, queued.tier, retry=True)
        self.gate = step.state

    @precondition(lambda self: self.waiters)
    @rule(index=st.integers(0, 1000))
    def client_gone_while_waiting(self, index: int) -> None:
        queued = self.waiters.pop(index % len(self.waiters))
        step = apply_gate_event(self.gate, WaitAbandoned(self.now, queued))
        assert step.outcome is None
        self.rejected += 1  # the attempt ends without a response; counted as an end here
        self.gate = step.state

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000))
    def release(self, index: int) -> None:
        tier = self.held.pop(index % len(self.held))
        self.gate = apply_gate_event(self.gate, SlotReleased(self.now, tier)).state

    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        decision = data.draw(decisions(at=self.now, global_limit=self.gate.config.global_limit))
        self.gate = apply_gate_event(self.gate, DecisionPublished(decision)).state

    @rule(cap=st.integers(1, 8))
    def publish_healthy_cap(self, cap: int) -> None:
        """A plain green decision from metrics: the common case, so saturation is frequent."""
        decision = PublishedDecision(
            at=self.now,
            source=DecisionSource.METRICS,
            cap=cap,
            state=LoadState.GREEN,
            final_reason=LimitReason.THROUGHPUT,
        )
        self.gate = apply_gate_event(self.gate, DecisionPublished(decision)).state

    @rule(seconds=st.floats(0.001, 1.0))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def counts_match_the_model(self) -> None:
        gate = self.gate
        assert gate.premium_inflight == self.held.count(Tier.PREMIUM)
        assert gate.basic_inflight == self.held.count(Tier.BASIC)
        assert gate.premium_waiting == sum(q.tier is Tier.PREMIUM for q in self.waiters)
        assert gate.basic_waiting == sum(q.tier is Tier.BASIC for q in self.waiters)

    @invariant()
    def never_over_the_global_limit(self) -> None:
        assert 0 <= self.gate.inflight <= self.gate.config.global_limit

    @invariant()
    def every_attempt_ends_once(self) -> None:
        assert self.attempts == self.admitted + self.rejected + len(self.waiters)

    def teardown(self) -> None:
        if not hasattr(self, "gate"):
            return
        while self.waiters:
            queued = self.waiters.pop()
            step = apply_gate_event(self.gate, WaitRetried(math.inf, queued))
            assert not isinstance(step.outcome, Queued)
            self._record(self.gate, step.outcome, queued.tier, retry=True)
            self.gate = step.state
        while self.held:
            self.gate = apply_gate_event(self.gate, SlotReleased(self.now, self.held.pop())).state
        assert self.attempts == self.admitted + self.rejected
        assert (self.gate.inflight, self.gate.waiting) == (0, 0)


TestGateMachine = GateMachine.TestCase
