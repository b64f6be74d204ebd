"""Slot accounting of the whole guard reducer under random interleavings (F4, item 2).

``test_gate_machine.py`` drives :func:`guard_core.gate.apply` and counts slots per tier. This
machine goes one level up, through :func:`guard_core.apply_guard_event`, the reducer the trio
engine uses, and sends each request's events as the engine sends them: arrival (``Arrived``),
a short wait (``Retried`` on a wake-up, a broadcast after every release, or the deadline), a
client that leaves while waiting (``Abandoned``), an admitted request that is forwarded
(``Forwarded``) and later ends by completing, by an upstream failure or by its client leaving
(one ``Finished``, which gives the slot back and ends the prefill grace), first tokens of
streams, and cap changes (``DecisionPublished`` and failed polls).

The model keeps the set of requests whose upstream exchange is live. After every step:
- the core's in-use slots equal the live upstream requests, per tier, and are never negative;
- the waiting counts equal the model's waiters;
- every admission happened under the cap in force at that moment (``GLOBAL_LIMIT``, and the
  published cap in dynamic mode); a lower cap published later evicts nobody;
- the prefill ledger holds exactly the live requests, and the learner's dynamic-refusal count
  grows only on final 429s with a dynamic code (never while waiting, never on a departure);
- the core's request table holds exactly the live requests and the waiters;
- an end of a request that holds no slot (unknown, waiting, or already ended) changes nothing.
At teardown every waiter reaches its deadline and every live request ends: all back to zero.
"""

from __future__ import annotations

import math

import attrs
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
    Abandoned,
    Admitted,
    Arrived,
    BackendPoll,
    DecisionPublished,
    DecisionSource,
    Finished,
    FirstToken,
    Forwarded,
    GateConfig,
    GuardConfig,
    GuardEvent,
    GuardState,
    LimitReason,
    LoadState,
    MetricsPolled,
    PublishedDecision,
    Queued,
    RejectCode,
    Rejected,
    RequestEvent,
    Retried,
    StateReason,
    Tier,
    apply_guard_event,
    basic_limit,
    current_limit,
)

_DYNAMIC_CODES = frozenset(
    {RejectCode.GLOBAL_DYNAMIC_LIMIT, RejectCode.TIER_PRIORITY, RejectCode.TIER_BASIC_LIMIT}
)
#: How an admitted request's upstream exchange ends, with the status the engine would record.
_ENDINGS = {"completed": 200, "upstream_failed": 502, "client_gone": 499}


@attrs.define
class LiveRequest:
    """An admitted request whose upstream exchange is running."""

    request_id: int
    tier: Tier
    streaming: bool
    arrived_at: float
    first_token: bool = False


@attrs.define
class Waiter:
    request_id: int
    arrived_at: float
    queued: Queued


class GuardInterleavings(RuleBasedStateMachine):
    """The guard reducer and a model of the upstream's live requests, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.ids = 0
        self.live: list[LiveRequest] = []
        self.waiters: list[Waiter] = []
        self.arrivals = 0
        self.ended = 0  # admitted and finished, refused, or left while waiting
        self.dynamic_refusals = 0

    @initialize(
        global_limit=st.integers(0, 6),
        dynamic=st.booleans(),
        queue_wait_s=st.sampled_from([0.0, 0.05, 0.3, 0.5]),
        first_cap=st.integers(0, 8),
    )
    def start(self, global_limit: int, dynamic: bool, queue_wait_s: float, first_cap: int) -> None:
        config = GuardConfig(
            gate=GateConfig(global_limit=global_limit, dynamic=dynamic, queue_wait_s=queue_wait_s),
            learning=dynamic,
        )
        self.state = GuardState.initial(config, at=self.now)
        if dynamic:
            self._publish(first_cap, LoadState.GREEN)

    # -- helpers --------------------------------------------------------------------------------

    def _apply(self, guard_event: GuardEvent) -> object:
        step = apply_guard_event(self.state, guard_event)
        self.state = step.state
        return step.outcome

    def _publish(self, cap: int, state: LoadState, *, unavailable: bool = False) -> None:
        decision = PublishedDecision(
            at=self.now,
            source=DecisionSource.METRICS,
            cap=cap,
            state=state,
            final_reason=LimitReason.BACKEND_UNAVAILABLE if unavailable else LimitReason.THROUGHPUT,
            red_reasons=(StateReason.WAITING,) if state is LoadState.RED else (),
            backend_count=1,
            backend_failed=1 if unavailable else 0,
        )
        self._apply(DecisionPublished(decision))

    def _attempt_ended(
        self, before: GuardState, outcome: object, request_id: int, tier: Tier, arrived_at: float
    ) -> None:
        """Check one attempt's outcome against the state it was decided on; update the model."""
        gate = before.gate
        if isinstance(outcome, Admitted):
            limit, closed = current_limit(gate)
            assert closed is None, "admitted while the cap was closed"
            assert gate.inflight + 1 <= gate.config.global_limit
            if gate.config.dynamic:
                assert gate.inflight + 1 <= limit, (gate.inflight, limit)
            if tier is Tier.BASIC:
                assert gate.premium_waiting == 0
                assert gate.basic_inflight + 1 <= basic_limit(limit, gate.premium_inflight)
            # The engine forwards it at once: its prefill grace starts now.
            self._apply(Forwarded(at=self.now, request_id=request_id))
            self.live.append(LiveRequest(request_id, tier, request_id % 2 == 0, arrived_at))
            event(f"admitted {tier}")
        elif isinstance(outcome, Queued):
            assert outcome.deadline > self.now
            self.waiters.append(Waiter(request_id, arrived_at, outcome))
            event("queued")
        else:
            assert isinstance(outcome, Rejected)
            self.ended += 1
            if outcome.code in _DYNAMIC_CODES:
                self.dynamic_refusals += 1
            event(f"429 {outcome.code}")

    def _retry(self, waiter: Waiter, at: float) -> None:
        before = self.state
        outcome = self._apply(Retried(at=at, request_id=waiter.request_id))
        if at >= waiter.queued.deadline:
            assert not isinstance(outcome, Queued), "a waiter at its deadline must get an end"
        self._attempt_ended(
            before, outcome, waiter.request_id, waiter.queued.tier, waiter.arrived_at
        )

    def _end(self, live: LiveRequest, how: str) -> None:
        """``Slot.release``: one event ends the slot and the prefill grace together."""
        before = self.state
        self._apply(Finished(at=self.now, request_id=live.request_id, status=_ENDINGS[how]))
        assert self.state.gate.inflight_of(live.tier) == before.gate.inflight_of(live.tier) - 1
        assert live.request_id not in self.state.learner.prefill
        self.ended += 1
        event(f"ended: {how} ({_ENDINGS[how]})")

    # -- rules ----------------------------------------------------------------------------------

    @rule(tier=st.sampled_from(Tier))
    def arrive(self, tier: Tier) -> None:
        self.ids += 1
        self.arrivals += 1
        before = self.state
        outcome = self._apply(Arrived(at=self.now, request_id=self.ids, tier=tier))
        self._attempt_ended(before, outcome, self.ids, tier, self.now)

    @precondition(lambda self: self.waiters)
    @rule(index=st.integers(0, 100), late=st.booleans())
    def retry_one(self, index: int, late: bool) -> None:
        waiter = self.waiters.pop(index % len(self.waiters))
        self._retry(waiter, max(self.now, waiter.queued.deadline) if late else self.now)

    @precondition(lambda self: self.waiters)
    @rule()
    def wake_everyone(self) -> None:
        """The engine's broadcast: every waiter retries, in queue order, at the same instant."""
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            self._retry(waiter, self.now)

    @precondition(lambda self: self.waiters)
    @rule(index=st.integers(0, 100))
    def client_gone_while_waiting(self, index: int) -> None:
        waiter = self.waiters.pop(index % len(self.waiters))
        outcome = self._apply(Abandoned(at=self.now, request_id=waiter.request_id))
        assert outcome is None
        self.ended += 1

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), how=st.sampled_from(sorted(_ENDINGS)), wake=st.booleans())
    def upstream_exchange_ends(self, index: int, how: str, wake: bool) -> None:
        self._end(self.live.pop(index % len(self.live)), how)
        if wake and self.waiters:
            self.wake_everyone()

    @precondition(lambda self: any(r.streaming and not r.first_token for r in self.live))
    @rule(index=st.integers(0, 100))
    def first_token(self, index: int) -> None:
        streams = [r for r in self.live if r.streaming and not r.first_token]
        live = streams[index % len(streams)]
        live.first_token = True
        seconds = self.now - live.arrived_at
        self._apply(FirstToken(at=self.now, request_id=live.request_id, seconds=seconds))

    @precondition(lambda self: self.state.config.gate.dynamic)
    @rule(cap=st.integers(0, 8), state=st.sampled_from(LoadState), unavailable=st.booleans())
    def cap_changes(self, cap: int, state: LoadState, unavailable: bool) -> None:
        held = self.state.gate.inflight
        self._publish(cap if not unavailable else 0, state, unavailable=unavailable)
        # A lower cap evicts nobody: the live requests keep their slots.
        assert self.state.gate.inflight == held

    @precondition(lambda self: self.state.config.learning)
    @rule()
    def poll_fails(self) -> None:
        held = self.state.gate.inflight
        self._apply(
            MetricsPolled(self.now, (BackendPoll(name="backend", sample=None, error="refused"),))
        )
        assert self.state.gate.inflight == held

    @rule(pick=st.integers(0, 100), status=st.sampled_from(sorted(_ENDINGS.values())))
    def stray_end_changes_nothing(self, pick: int, status: int) -> None:
        """An end of a request that holds no slot: one never seen, a waiter, or one ended."""
        live = {r.request_id for r in self.live}
        strays = [0, self.ids + 1, *(w.request_id for w in self.waiters)]
        strays += [rid for rid in range(1, self.ids + 1) if rid not in live]
        request_id = strays[pick % len(strays)]
        before = self.state
        stray: RequestEvent = Finished(at=self.now, request_id=request_id, status=status)
        assert apply_guard_event(before, stray).state == before
        assert self.state is before

    @rule(seconds=st.floats(0.001, 0.6))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def slots_in_use_equal_live_upstream_requests(self) -> None:
        gate = self.state.gate
        assert gate.premium_inflight == sum(r.tier is Tier.PREMIUM for r in self.live)
        assert gate.basic_inflight == sum(r.tier is Tier.BASIC for r in self.live)
        assert 0 <= gate.inflight <= gate.config.global_limit

    @invariant()
    def waiting_counts_match(self) -> None:
        gate = self.state.gate
        assert gate.premium_waiting == sum(w.queued.tier is Tier.PREMIUM for w in self.waiters)
        assert gate.basic_waiting == sum(w.queued.tier is Tier.BASIC for w in self.waiters)
        assert gate.premium_waiting >= 0
        assert gate.basic_waiting >= 0

    @invariant()
    def prefill_ledger_holds_the_live_requests(self) -> None:
        held = sorted(self.state.learner.prefill)
        assert held == sorted(r.request_id for r in self.live)

    @invariant()
    def request_table_holds_the_live_requests_and_the_waiters(self) -> None:
        requests = self.state.requests
        assert sorted(requests) == sorted(
            [r.request_id for r in self.live] + [w.request_id for w in self.waiters]
        )
        for waiter in self.waiters:
            assert requests[waiter.request_id].queued is not None

    @invariant()
    def dynamic_refusals_counted_on_final_429s_only(self) -> None:
        assert self.state.learner.dynamic_rejects == self.dynamic_refusals

    @invariant()
    def every_arrival_is_somewhere(self) -> None:
        assert self.arrivals == self.ended + len(self.live) + len(self.waiters)

    def teardown(self) -> None:
        if not hasattr(self, "state"):
            return
        while self.waiters:
            self._retry(self.waiters.pop(), math.inf)
        while self.live:
            self._end(self.live.pop(), "completed")
        gate = self.state.gate
        assert (gate.inflight, gate.waiting) == (0, 0)
        assert dict(self.state.learner.prefill) == {}
        assert dict(self.state.requests) == {}
        assert self.arrivals == self.ended


TestGuardInterleavings = GuardInterleavings.TestCase
