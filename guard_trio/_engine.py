"""The guard engine: the one owner of the guard's state in the trio runtime.

Reads: admission requests, releases, first tokens, requests sent to and ended at each backend,
each backend's health events (failures, successes, full answers, probes), output-token intents
and poll results from the proxy and the poller;
time from ``trio.current_time()`` only.
Guarantees:
- every state change goes through :func:`guard_core.apply_guard_event`, in one task at a time
  (trio is single-threaded and none of these methods awaits while changing state); the
  proxy's side of a request is said in the request events of :mod:`guard_core.events`, and
  what it saw of backends in the traffic and health events (:meth:`GuardEngine.tell`);
- a waiting request is retried on every release and every poll, at its fallback re-check
  time, and at its deadline, and always ends with a slot or a refusal; a waiter whose task is
  cancelled (its client left) is removed from the queue and never admitted. The engine retries
  the waiters itself, in the releasing (or polling) task, and wakes only the ones whose wait
  ended: PIG's broadcast, every waiter retrying, without a task switch per waiter. A broadcast
  has no FIFO order; the retries go in arrival order or its reverse, at random on each
  wake-up, which is how trio's scheduler ran the tasks one event woke (it reverses each batch
  of runnable tasks half the time);
- a slot is released exactly once: :class:`Slot` ignores a second release, so ``finally`` blocks
  on every path may call it safely;
- every request event it applied is handed, in order, to the listener (the recorder), when
  there is one, without waiting for it; a refusal is applied as :class:`~guard_core.Refused`,
  so the listener sees how every attempt ended;
- each attempt carries what the predictive learner needs at no cost on the streaming path: the
  body size the proxy already knows (its ``Content-Length``) and, for the first token, the
  request's id; a refusal comes back with the learner's predicted ``Retry-After`` and the
  constraint that refused it (``None`` under PIG's learner).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping

import attrs
import trio

from guard_adapters.explain import attempt_prediction, refusal_binding
from guard_core import (
    Abandoned,
    Admitted,
    Arrived,
    BackendPoll,
    Binding,
    Finished,
    FirstToken,
    Forwarded,
    GuardConfig,
    GuardState,
    GuardStep,
    MetricsPolled,
    PublishedDecision,
    Queued,
    Refused,
    RejectCode,
    Rejected,
    RequestEvent,
    Retried,
    Tier,
    apply_guard_event,
    next_check_at,
)
from guard_core.flow import RETRY_PASSES, retry_has_room, waiters_in_order
from guard_core.guard import refuses_at_once
from guard_core.health import HealthEvent
from guard_core.traffic import TrafficEvent

__all__ = ("AdmissionResult", "Attempt", "GuardEngine", "PoolEngines", "RequestListener", "Slot")

#: Told every request event the engine applied, in order (the recorder's ``event``).
RequestListener = Callable[[RequestEvent], None]


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
        self.engine._apply(FirstToken(at=at, request_id=self.request_id, seconds=seconds))
        if self.engine.state.predictive is not None:
            # A prefill ended: the predictive learner may have room again for a waiter.
            self.engine.retry_waiters()

    def release(self, status: int = 0, output_tokens: int | None = None) -> None:
        """Give the slot back; ``output_tokens``: what the response delivered, when counted
        (tenant fairness counts it in attained service)."""
        if self.released:
            return
        self.released = True
        engine = self.engine
        # One event: the core gives the slot back and ends the prefill grace in one step.
        ended = Finished(
            at=engine._at(), request_id=self.request_id, status=status, output_tokens=output_tokens
        )
        engine._apply(ended)
        engine.retry_waiters()


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


@attrs.define(eq=False)
class Attempt:
    """One request's admission in progress: its outcome so far and, once settled, its result."""

    request_id: int
    tier: Tier
    arrived: float
    body_bytes: int | None
    outcome: object
    binding: Binding | None
    result: AdmissionResult | None = None
    #: The request's ``X-Request-Id`` (its :class:`~guard_core.Arrived` says it too).
    trace_id: str = ""
    #: The engine that began it (its pool's), which settles or abandons it.
    engine: GuardEngine | None = None


@attrs.define(eq=False)
class _Waiter:
    """A waiting attempt's task, as the engine retries it: the event that wakes it when its
    wait ended and the timer of its own next retry (its fallback re-check or its deadline)."""

    attempt: Attempt
    woken: trio.Event = attrs.field(factory=trio.Event)
    timer: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class GuardEngine:
    """Owns the :class:`~guard_core.GuardState`; see the module rules."""

    def __init__(
        self,
        config: GuardConfig,
        *,
        on_event: RequestListener | None = None,
        clock: Callable[[], float] = trio.current_time,
        ids: Iterator[int] | None = None,
        name: str = "",
    ) -> None:
        self.now = clock
        self.on_event = on_event
        self._origin = clock()
        self.state = GuardState.initial(config, at=0.0)
        #: Request ids; the engines of several pools share one count, so ids stay unique.
        self._ids = ids if ids is not None else itertools.count(1)
        #: The pool it admits for ("" for PIG's single pool).
        self.name = name
        #: The waiting attempts, in arrival order: the engine retries them itself on each
        #: wake-up (in arrival order, or in fair order under flow control).
        self._waiters: dict[int, _Waiter] = {}
        #: Picks each broadcast's order (arrival or its reverse).
        self._order = random.Random()

    # -- time: the core sees seconds since the engine started ------------------------------------

    def seconds_since_start(self) -> float:
        return self.now() - self._origin

    _at = seconds_since_start

    def started_at(self, attempt: Attempt) -> float:
        """When ``attempt`` arrived, on the runtime's clock (``trio.current_time()``)."""
        return self._origin + attempt.arrived

    def _apply(self, event: RequestEvent) -> object:
        """Apply one request event and tell the listener; the attempt's outcome, if any."""
        step = apply_guard_event(self.state, event)
        self.state = step.state
        if self.on_event is not None:
            self.on_event(event)
        return step.outcome

    def retry_waiters(self) -> None:
        """Retry the waiters now and wake the ones whose wait ended. Without flow control this
        is PIG's broadcast: every waiter once, in arrival order or its reverse (at random), and
        each one left waiting starts its fallback re-check again from now, as a waiter woken by
        a broadcast would. Under flow control the order is the core's fair order (higher bands
        first, then the tenant furthest below its share), once more when a wait ended, and a
        pass stops once no retry can be admitted (``retry_has_room``): at most
        ``RETRY_PASSES`` retries per waiter on one wake-up."""
        ranked = self.state.flow is not None
        for _ in range(RETRY_PASSES if ranked else 1):
            ended, now = False, self._at()  # one instant: nothing awaits in here
            for waiter in self._in_retry_order():
                if ranked and not retry_has_room(self.state.gate):
                    break
                if self._retry_waiter(waiter, now):
                    ended = True
                elif not ranked:
                    waiter.timer.deadline = self._next_check(waiter.attempt, now)
            if not (ranked and ended and self._waiters):
                return

    def _in_retry_order(self) -> list[_Waiter]:
        state, waiters = self.state, self._waiters
        if state.flow is not None:
            fair = waiters_in_order(state.flow, state.requests, state.gate)
            return [waiters[request_id] for request_id in fair if request_id in waiters]
        listed = list(waiters.values())
        return listed[::-1] if self._order.random() < 0.5 else listed

    def _retry_waiter(self, waiter: _Waiter, at: float) -> bool:
        """Attempt a queued request again at ``at`` (now); whether its wait ended (a slot or a
        refusal). One that ended leaves the waiters, and its task is woken."""
        attempt = waiter.attempt
        retried = Retried(at=at, request_id=attempt.request_id)
        attempt.outcome, attempt.binding = self._attempt(retried)
        if isinstance(attempt.outcome, Queued):
            return False
        self._conclude(attempt, at)
        del self._waiters[attempt.request_id]
        waiter.woken.set()
        return True

    # -- admission -----------------------------------------------------------------------------

    def begin(
        self,
        tier: Tier,
        *,
        path: str = "",
        body_bytes: int | None = None,
        trace_id: str = "",
        band: str = "",
        tenant: str = "",
    ) -> Attempt:
        """Ask for a slot now, without waiting: the attempt is applied once, and comes back
        settled (a slot or a refusal) unless it was queued; :meth:`settle` finishes it.
        ``band`` and ``tenant`` are the request's flow-control labels ("" without them)."""
        request_id = next(self._ids)
        arrived = self._at()
        outcome, binding = self._attempt(
            Arrived(
                at=arrived,
                request_id=request_id,
                tier=tier,
                body_bytes=body_bytes,
                path=path,
                trace_id=trace_id,
                band=band,
                tenant=tenant,
            )
        )
        attempt = Attempt(
            request_id, tier, arrived, body_bytes, outcome, binding, None, trace_id, self
        )
        if not isinstance(outcome, Queued):
            self._conclude(attempt, arrived)  # at once: the same instant
        return attempt

    def refuses_at_once(
        self, tier: Tier, length: int | None, band: str = "", tenant: str = ""
    ) -> bool:
        """The gate would refuse a slot request now, with no wait: a pure peek at the state
        (nothing is applied, nothing recorded)."""
        # Id 0 is never one of the engine's, and the step is dropped: nothing is applied.
        attempt = Arrived(
            at=self._at(), request_id=0, tier=tier, body_bytes=length, band=band, tenant=tenant
        )
        return refuses_at_once(self.state, attempt)

    async def admit(
        self, tier: Tier, *, path: str = "", body_bytes: int | None = None
    ) -> AdmissionResult:
        """Ask for a slot; may wait briefly. Cancellation while waiting leaves the queue cleanly."""
        return await self.settle(self.begin(tier, path=path, body_bytes=body_bytes))

    async def settle(self, attempt: Attempt) -> AdmissionResult:
        """Wait out a queued attempt (at once for a settled one). A wake-up retries the
        waiters (:meth:`retry_waiters`) and wakes this one only when its wait ended; its own timer
        (its fallback re-check, its deadline) retries it alone. Under flow control a wait it
        ends that way lets the others try again."""
        if attempt.result is not None:
            return attempt.result
        waiter = _Waiter(attempt)
        self._waiters[attempt.request_id] = waiter
        try:
            while attempt.result is None:
                waiter.timer = trio.CancelScope(deadline=self._next_check(attempt, self._at()))
                with waiter.timer:
                    await waiter.woken.wait()
                ended = attempt.result is None and self._retry_waiter(waiter, self._at())
                if ended and self.state.flow is not None:
                    self.retry_waiters()  # a claim on a free slot may have ended with it
        except trio.Cancelled:
            self._waiters.pop(attempt.request_id, None)
            self.abandon(attempt)
            raise
        return attempt.result

    def _next_check(self, attempt: Attempt, now: float) -> float:
        """When a waiting attempt retries on its own, on the runtime's clock: its fallback
        re-check from ``now``, or its deadline when sooner."""
        queued = attempt.outcome
        assert isinstance(queued, Queued)
        return self._origin + next_check_at(queued, now=now, config=self.state.config.gate)

    def abandon(self, attempt: Attempt) -> None:
        """An attempt nobody will settle or serve (its client left): leave the queue, or give
        the slot back. Safe to call more than once."""
        if attempt.result is None:
            at = self._at()
            self._apply(Abandoned(at=at, request_id=attempt.request_id))
            attempt.result = AdmissionResult(None, None, at - attempt.arrived)
        elif attempt.result.slot is not None:
            attempt.result.slot.release(0)

    def _conclude(self, attempt: Attempt, at: float) -> None:
        waited, outcome, request_id = at - attempt.arrived, attempt.outcome, attempt.request_id
        if isinstance(outcome, Admitted):
            # Accepted: its prefill grace starts now (the same instant a replay will use).
            self._apply(Forwarded(at=at, request_id=request_id))
            slot = Slot(self, request_id, attempt.tier, arrived_at=attempt.arrived)
            attempt.result = AdmissionResult(slot, None, waited)
            return
        assert isinstance(outcome, Rejected)
        retry_after_s = outcome.retry_after_s
        filed, listener = request_id in self.state.requests, self.on_event
        if filed or listener is not None:
            refused = Refused(
                at=at,
                request_id=request_id,
                code=outcome.code,
                retry_after_s=retry_after_s,
                binding=attempt.binding,
            )
            if filed:
                self._apply(refused)
            elif listener is not None:
                # Refused at once: the core never filed it, so applying the event changes
                # nothing (guard_core.requests ignores an unknown id); the recording says it.
                listener(refused)
        attempt.result = AdmissionResult(None, outcome.code, waited, retry_after_s, attempt.binding)

    def _attempt(self, event: Arrived | Retried) -> tuple[object, Binding | None]:
        """Apply an attempt: its outcome and, for a refusal under the predictive learner, the
        constraint it came from."""
        before = self.state
        outcome = self._apply(event)
        if not isinstance(outcome, Rejected) or self.state.predictive is None:
            return outcome, None
        verdict = attempt_prediction(before, self.state)
        return outcome, refusal_binding(verdict, before.gate.decision, outcome.code)

    # -- polls ---------------------------------------------------------------------------------

    def publish_poll(
        self, polls: tuple[BackendPoll, ...], *, at: float | None = None
    ) -> PublishedDecision | None:
        """Evaluate one poll round and publish its decision. The caller then calls
        :meth:`retry_waiters`, once it has recorded the round: a recording must hold the poll
        before the retries it allowed."""
        at = self._at() if at is None else at
        step: GuardStep = apply_guard_event(self.state, MetricsPolled(at, polls))
        self.state = step.state
        return step.decision

    # -- traffic and health: what the shell saw happen, told as the core's events -------------

    def tell(self, kind: Callable[..., TrafficEvent | HealthEvent], *fields: object) -> None:
        """Apply the traffic or health event ``kind(now, *fields)``: a request sent to or ended
        at a backend (:class:`~guard_core.traffic.BackendForwarded` and
        :class:`~guard_core.traffic.BackendFinished`, paired on every path), an output-token
        intent, a refusal after admission, or what a backend did with a request
        (:mod:`guard_core.health`)."""
        self.state = apply_guard_event(self.state, kind(self._at(), *fields)).state


class PoolEngines:
    """The engine of each pool (``PIG_POOLS``): which one admits a model's requests and which
    one a backend's traffic and health are told to. Without pools there is one engine for
    every backend and every request, PIG's single pool."""

    def __init__(
        self,
        default: GuardEngine,
        *,
        by_backend: Mapping[str, GuardEngine] | None = None,
        by_model: Mapping[str, GuardEngine] | None = None,
    ) -> None:
        self.default = default
        self._by_backend = dict(by_backend or {})
        self._by_model = dict(by_model or {})
        seen = [default, *self._by_backend.values()]
        #: Every engine once, the default (first pool's) first.
        self.engines: tuple[GuardEngine, ...] = tuple(dict.fromkeys(seen))

    def of_backend(self, name: str) -> GuardEngine:
        return self._by_backend.get(name, self.default)

    def of_model(self, model: str | None) -> GuardEngine:
        return self.default if model is None else self._by_model.get(model, self.default)
