"""The guard engine: the one owner of the guard's state in the trio runtime.

Reads: admission requests, releases, first tokens, requests sent to and ended at each backend,
output-token intents and poll results from the proxy and the poller;
time from ``trio.current_time()`` only.
Guarantees:
- every state change goes through :func:`guard_core.apply_guard_event` (or, for the traffic
  counts the shell reports, :func:`guard_core.guard.apply_traffic_event`, its outcome-free
  part), in one task at a time (trio is single-threaded and none of these methods awaits while
  changing state);
- a waiting request wakes on every release and every poll (a broadcast), at its fallback
  re-check time, and at its deadline, and always ends with a slot or a refusal; a waiter whose
  task is cancelled (its client left) is removed from the queue and never admitted;
- a slot is released exactly once: :class:`Slot` ignores a second release, so ``finally`` blocks
  on every path may call it safely;
- every event is also handed to the recorder, when there is one, without waiting for it;
- each attempt carries what the predictive learner needs at no cost on the streaming path: the
  body size the proxy already knows (its ``Content-Length``) and, for the first token, the
  request's id; a refusal comes back with the learner's predicted ``Retry-After`` and the
  constraint that refused it (``None`` under PIG's learner).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from guard_adapters.explain import attempt_prediction, refusal_binding
from guard_core import (
    Admitted,
    BackendPoll,
    Binding,
    FirstTokenObserved,
    GuardConfig,
    GuardState,
    MetricsPolled,
    PrefillEnded,
    PrefillStarted,
    PublishedDecision,
    Queued,
    RejectCode,
    Rejected,
    SlotReleased,
    SlotRequested,
    Tier,
    WaitAbandoned,
    WaitRetried,
    apply_guard_event,
    next_check_at,
)
from guard_core.guard import GuardEvent, apply_traffic_event
from guard_core.traffic import (
    BackendFinished,
    BackendForwarded,
    OutputIntentObserved,
    RefusedAfterAdmission,
)

__all__ = ("AdmissionResult", "EngineObserver", "GuardEngine", "Slot")


class EngineObserver(Protocol):
    """What the engine tells the recorder and the metrics (all optional no-ops by default)."""

    def arrival(
        self, at: float, request_id: int, tier: Tier, path: str, body_bytes: int | None
    ) -> None: ...
    def retry(self, at: float, request_id: int) -> None: ...
    def gone(self, at: float, request_id: int) -> None: ...
    def outcome(
        self,
        at: float,
        request_id: int,
        admitted: bool,
        code: RejectCode | None,
        waited_s: float,
        *,
        retry_after_s: int | None = None,
        binding: Binding | None = None,
    ) -> None: ...
    def first_token(self, at: float, request_id: int, seconds: float) -> None: ...
    def completion(self, at: float, request_id: int, status: int) -> None: ...
    def decision(self, at: float, decision: PublishedDecision) -> None: ...


class _Silent:
    def arrival(
        self, at: float, request_id: int, tier: Tier, path: str, body_bytes: int | None
    ) -> None:
        pass

    def retry(self, at: float, request_id: int) -> None:
        pass

    def gone(self, at: float, request_id: int) -> None:
        pass

    def outcome(
        self,
        at: float,
        request_id: int,
        admitted: bool,
        code: RejectCode | None,
        waited_s: float,
        *,
        retry_after_s: int | None = None,
        binding: Binding | None = None,
    ) -> None:
        pass

    def first_token(self, at: float, request_id: int, seconds: float) -> None:
        pass

    def completion(self, at: float, request_id: int, status: int) -> None:
        pass

    def decision(self, at: float, decision: PublishedDecision) -> None:
        pass


@attrs.define(eq=False)
class Slot:
    """A held admission slot. Release it exactly once; later calls do nothing."""

    engine: GuardEngine
    request_id: int
    tier: Tier
    arrived_at: float
    released: bool = False
    first_token_seen: bool = False

    def first_token(self) -> None:
        """The stream delivered its first useful event (semantic TTFT, from arrival)."""
        if self.first_token_seen or self.released:
            return
        self.first_token_seen = True
        at = self.engine._at()
        seconds = at - self.arrived_at
        self.engine._apply(FirstTokenObserved(at, seconds, request_id=self.request_id))
        self.engine.observer.first_token(at, self.request_id, seconds)
        if self.engine.state.predictive is not None:
            # A prefill ended: the predictive learner may have room again for a waiter.
            self.engine._notify()

    def release(self, status: int = 0) -> None:
        if self.released:
            return
        self.released = True
        self.engine._release(self, status)


@attrs.frozen
class AdmissionResult:
    """Either a slot, or the refusal code (for metrics; the client only sees a 429)."""

    slot: Slot | None
    code: RejectCode | None
    waited_s: float
    #: The refusal's predicted ``Retry-After`` in whole seconds (the predictive learner only).
    retry_after_s: int | None = None
    #: The constraint that refused it (the predictive learner only).
    binding: Binding | None = None


class GuardEngine:
    """Owns the :class:`~guard_core.GuardState`; see the module rules."""

    def __init__(
        self,
        config: GuardConfig,
        *,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.now = clock
        self.observer: EngineObserver = observer or _Silent()
        self._origin = clock()
        self.state = GuardState.initial(config, at=0.0)
        self._wake = trio.Event()
        self._ids = itertools.count(1)

    # -- time: the core sees seconds since the engine started ------------------------------------

    def _at(self) -> float:
        return self.now() - self._origin

    def _apply(self, event: GuardEvent) -> object:
        step = apply_guard_event(self.state, event)
        self.state = step.state
        return step.outcome if step.decision is None else step.decision

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    # -- admission -----------------------------------------------------------------------------

    async def admit(
        self, tier: Tier, *, path: str = "", body_bytes: int | None = None
    ) -> AdmissionResult:
        """Ask for a slot; may wait briefly. Cancellation while waiting leaves the queue cleanly."""
        request_id = next(self._ids)
        arrived = self._at()
        self.observer.arrival(arrived, request_id, tier, path, body_bytes)
        outcome, binding = self._attempt(SlotRequested(arrived, tier, body_bytes))
        while isinstance(outcome, Queued):
            queued = outcome
            wake = self._wake
            check_at = next_check_at(queued, now=self._at(), config=self.state.config.gate)
            try:
                with trio.move_on_at(self._origin + check_at):
                    await wake.wait()
            except trio.Cancelled:
                at = self._at()
                self._apply(WaitAbandoned(at, queued))
                self.observer.gone(at, request_id)
                raise
            at = self._at()
            self.observer.retry(at, request_id)
            outcome, binding = self._attempt(WaitRetried(at, queued))
        at = self._at()
        waited = at - arrived
        if isinstance(outcome, Admitted):
            # Accepted: its prefill grace starts now (the same instant a replay will use).
            self._apply(PrefillStarted(at, request_id, body_bytes, tier=tier))
            self.observer.outcome(at, request_id, True, None, waited)
            slot = Slot(self, request_id, tier, arrived_at=arrived)
            return AdmissionResult(slot, None, waited)
        assert isinstance(outcome, Rejected)
        self.observer.outcome(
            at,
            request_id,
            False,
            outcome.code,
            waited,
            retry_after_s=outcome.retry_after_s,
            binding=binding,
        )
        return AdmissionResult(None, outcome.code, waited, outcome.retry_after_s, binding)

    def _attempt(self, event: SlotRequested | WaitRetried) -> tuple[object, Binding | None]:
        """Apply an attempt: its outcome and, for a refusal under the predictive learner, the
        constraint it came from."""
        before = self.state
        outcome = self._apply(event)
        if not isinstance(outcome, Rejected) or self.state.predictive is None:
            return outcome, None
        verdict = attempt_prediction(before, self.state)
        return outcome, refusal_binding(verdict, before.gate.decision, outcome.code)

    def _release(self, slot: Slot, status: int) -> None:
        at = self._at()
        self._apply(SlotReleased(at, slot.tier))
        self._apply(PrefillEnded(at, slot.request_id))
        self.observer.completion(at, slot.request_id, status)
        self._notify()

    # -- polls ---------------------------------------------------------------------------------

    def publish_poll(
        self, polls: tuple[BackendPoll, ...], *, at: float | None = None
    ) -> PublishedDecision | None:
        """Evaluate one poll round, publish its decision and wake every waiter."""
        at = self._at() if at is None else at
        decision = self._apply(MetricsPolled(at, polls))
        self._notify()
        if isinstance(decision, PublishedDecision):
            self.observer.decision(at, decision)
            return decision
        return None

    def seconds_since_start(self) -> float:
        return self._at()

    # -- traffic: counts the core keeps so the shell keeps none ---------------------------------

    def forwarded(self, backend: str) -> None:
        """A request was sent to ``backend``; pair with :meth:`finished` on every path."""
        self.state = apply_traffic_event(self.state, BackendForwarded(self._at(), backend))

    def finished(self, backend: str) -> None:
        self.state = apply_traffic_event(self.state, BackendFinished(self._at(), backend))

    def output_intent(self, tokens: int) -> None:
        """A classified body asked for ``tokens`` output tokens (adaptive output lanes)."""
        self.state = apply_traffic_event(self.state, OutputIntentObserved(self._at(), tokens))

    def refused_after_admission(self, tier: Tier) -> None:
        """An admitted request got a 429 before it was forwarded (the priority rewrite)."""
        self.state = apply_traffic_event(self.state, RefusedAfterAdmission(self._at(), tier))
