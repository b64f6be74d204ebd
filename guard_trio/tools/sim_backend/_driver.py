"""The simulated engine's clock and faults: one driver task owns time, handlers only ask and tell.

Reads: a :class:`SimBackendConfig`; the trio clock (the engine's time is ``trio.current_time()``
minus the instant :meth:`EngineDriver.start` was called).

Guarantees:

- One task owns the engine's clock. :meth:`EngineDriver.drive` advances the engine whenever its
  next step ends, sleeping in between until that instant or until a handler changes the engine.
  Every other call into the engine is preceded by the same catch-up (``_sync``), so the engine is
  always at "now" when it is asked or told something, and every event it produces is handed to
  its request before that request is dropped.
- Handing tokens over is cheap: each request (:class:`Seq`) has a counter of tokens not yet
  written and a waiting task. The driver adds to the counter and wakes it; the request's own
  task writes everything that arrived since its last write as one send, and parks again. No
  task, channel or cancel scope is created per token or per step.
- Faults are scheduled from the configuration (a slow-down factor from a given time, engine
  death, failing ``/metrics``) or applied at once by :meth:`EngineDriver.control`, which checks
  a whole command before it applies any of it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

import trio

from guard_adapters.engine_model import Engine, EngineMetrics, SimRequest, TokenEvent
from guard_trio.tools.sim_backend._config import SimBackendConfig, histogram_bounds
from guard_trio.tools.sim_backend._metrics import Histogram

_GEN_RATE_WINDOW_S: Final = 5.0


class Seq:
    """One request in the engine, as its handler sees it.

    The handler sleeps in :meth:`wait_for_news` and the driver wakes it with :meth:`notify`:
    a bare reschedule of one known task, lighter than a parking lot or an event per wake.
    """

    __slots__ = ("end", "pending", "rid", "submitted_at", "waiter")

    def __init__(self, rid: int, submitted_at: float) -> None:
        self.rid = rid
        self.submitted_at = submitted_at
        self.pending = 0  # tokens produced and not yet taken by the handler
        self.end: str | None = None  # "finished" or "failed" once the engine is done with it
        self.waiter: trio.lowlevel.Task | None = None

    def notify(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait_for_news(self) -> None:
        """Sleep until the driver hands over tokens or an end (return at once if it has)."""
        if self.pending or self.end is not None:
            await trio.lowlevel.checkpoint()
            return
        self.waiter = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def wait_for_end(self) -> None:
        """Sleep until the engine is done with this request (a whole reply waits for this)."""
        while self.end is None:
            await self.wait_for_news()


class EngineDriver:
    """The engine, its clock, its requests and its faults. ``start`` once, then run ``drive``."""

    def __init__(self, config: SimBackendConfig) -> None:
        self.config = config
        ttft_bounds, itl_bounds = histogram_bounds(config)
        self._engine = Engine(
            config.engine_profile(),
            seed=config.seed,
            ignore_eos=config.mean_output_tokens is None,
            mean_output_tokens=config.mean_output_tokens or 256.0,
            itl_buckets=itl_bounds,
        )
        if config.speed != 1.0:
            self._engine.slow_down(1.0 / config.speed, at=0.0)
        self._seqs: dict[int, Seq] = {}
        self._next_rid = 0
        self._start: float | None = None
        self._driver_lot = trio.lowlevel.ParkingLot()
        self.created_wall = time.time()
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self.ttft_histogram = Histogram(ttft_bounds)
        self._gen_samples: deque[tuple[float, int]] = deque()
        # faults
        self._factor = 1.0
        self._scheduled: list[tuple[float, str, float]] = sorted(
            [(at_s, "slow_down", factor) for factor, at_s in config.slow_down]
            + ([(config.die_at_s, "kill", 0.0)] if config.die_at_s is not None else [])
        )
        self.metrics_delay_s = config.metrics_delay_s
        self._metrics_fail = False
        self._metrics_fail_after_s = config.metrics_fail_after_s
        #: ``/sim/control``: every generation request refused as full / its connection dropped.
        self.queue_forced_full = False
        self.dropping = False

    def start(self) -> None:
        """The engine's time 0 is now."""
        self._start = trio.current_time()

    # -- time and the engine -----------------------------------------------------------------------

    def _now(self) -> float:
        if self._start is None:
            return 0.0
        return trio.current_time() - self._start

    def _sync(self) -> float:
        """Bring the engine to now and hand out what it produced; returns now (virtual)."""
        now = self._now()
        events = self._engine.advance(now)
        if events:
            self._dispatch(events)
        return now

    def _dispatch(self, events: list[TokenEvent]) -> None:
        seqs = self._seqs
        for event in events:
            seq = seqs.get(event.request_id)
            if seq is None:
                continue
            kind = event.kind
            if kind == "tokens":
                seq.pending += event.tokens
            elif kind == "first_token":
                seq.pending += event.tokens
                self.ttft_histogram.observe(event.at - seq.submitted_at)
            elif kind == "finished":
                seq.pending += event.tokens
                seq.end = "finished"
                del seqs[event.request_id]
            elif kind == "failed":
                seq.end = "failed"
                del seqs[event.request_id]
            else:  # "preempted": the stream just pauses
                continue
            seq.notify()

    def _kick(self) -> None:
        """The engine changed outside the driver: let it recompute when to wake."""
        self._driver_lot.unpark_all()

    def engine_metrics(self) -> EngineMetrics:
        """The engine's figures at this instant."""
        self._sync()
        return self._engine.metrics()

    @property
    def dead(self) -> bool:
        return self._engine.dead

    @property
    def itl_buckets(self) -> tuple[float, ...]:
        """The inter-token latency bounds this flavour exposes."""
        return self._engine.itl_buckets

    def generation_rate(self, metrics: EngineMetrics) -> float:
        """Generated tokens per second over the last few seconds (SGLang's ``gen_throughput``)."""
        if not self._gen_samples:
            return 0.0
        now = self._now()
        then, total = self._gen_samples[0]
        if now - then <= 0:
            return 0.0
        return (metrics.generation_tokens_total - total) / (now - then)

    def _sample_generation(self, now: float) -> None:
        samples = self._gen_samples
        if samples and now - samples[-1][0] < 0.5:
            return
        samples.append((now, self._engine.metrics().generation_tokens_total))
        while len(samples) > 1 and now - samples[1][0] >= _GEN_RATE_WINDOW_S:
            samples.popleft()

    async def drive(self) -> None:
        engine = self._engine
        while True:
            now = self._sync()
            while self._scheduled and self._scheduled[0][0] <= now:
                at, action, value = self._scheduled.pop(0)
                events = engine.advance(at)
                if events:
                    self._dispatch(events)
                self._apply(action, value, at)
                now = self._sync()
            if self.config.flavour == "sglang":
                self._sample_generation(now)
            wake = engine.next_event_at()
            if self._scheduled:
                fault_at = self._scheduled[0][0]
                wake = fault_at if wake is None else min(wake, fault_at)
            if wake is not None and wake <= now:
                await trio.lowlevel.checkpoint()
                continue
            assert self._start is not None
            deadline = math.inf if wake is None else self._start + wake
            if self._gen_samples:
                deadline = min(deadline, trio.current_time() + 1.0)  # keep the rate window fresh
            with trio.move_on_at(deadline):
                await self._driver_lot.park()

    # -- faults ------------------------------------------------------------------------------------

    def _apply(self, action: str, value: float, at: float) -> None:
        if action == "slow_down":
            self._factor = value
            self._engine.slow_down(value / self.config.speed, at=at)
        elif action == "kill":
            self._engine.kill(at=at)
        self._kick()

    def control(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a ``/sim/control`` command now; returns the fault state afterwards.

        Keys: ``slow_down`` (factor > 0), ``kill`` (true), ``metrics_delay_s`` (>= 0),
        ``metrics_fail`` (bool), ``queue_full`` (bool: every generation request gets the
        engine's queue-full 503), ``drop_requests`` (bool: every generation request is read and
        its connection closed unanswered), ``reset_faults`` (true: factor 1, metrics healthy,
        scheduled faults dropped, no forced full or drop; a dead engine stays dead).

        Raises:
            ValueError: an unknown key or a value out of range (nothing is applied).
        """
        unknown = set(command) - {
            "slow_down",
            "kill",
            "metrics_delay_s",
            "metrics_fail",
            "queue_full",
            "drop_requests",
            "reset_faults",
        }
        if unknown:
            raise ValueError(f"unknown control keys: {', '.join(sorted(unknown))}")
        factor = command.get("slow_down")
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0
        ):
            raise ValueError("slow_down must be a number > 0")
        delay = command.get("metrics_delay_s")
        if delay is not None and (
            isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0
        ):
            raise ValueError("metrics_delay_s must be a number >= 0")
        now = self._sync()
        if command.get("reset_faults"):
            self._scheduled.clear()
            self.metrics_delay_s = 0.0
            self._metrics_fail = False
            self._metrics_fail_after_s = None
            self.queue_forced_full = self.dropping = False
            self._apply("slow_down", 1.0, now)
        if factor is not None:
            self._apply("slow_down", float(factor), now)
        if delay is not None:
            self.metrics_delay_s = float(delay)
        if "metrics_fail" in command:
            self._metrics_fail = bool(command["metrics_fail"])
        if "queue_full" in command:
            self.queue_forced_full = bool(command["queue_full"])
        if "drop_requests" in command:
            self.dropping = bool(command["drop_requests"])
        if command.get("kill"):
            self._apply("kill", 0.0, now)
            self._sync()
        return self.fault_state()

    def fault_state(self) -> dict[str, Any]:
        return {
            "slow_down": self._factor,
            "dead": self._engine.dead,
            "metrics_delay_s": self.metrics_delay_s,
            "metrics_fail": self.metrics_failing(),
            "queue_full": self.queue_forced_full,
            "drop_requests": self.dropping,
            "scheduled": [
                {"at_s": at, "action": action, "value": value}
                for at, action, value in self._scheduled
            ],
        }

    def queue_full(self) -> bool:
        """A new generation request is refused as full now (forced, or ``max_queued`` waiting)."""
        limit = self.config.max_queued
        if self.queue_forced_full:
            return True
        return limit is not None and self.engine_metrics().waiting >= limit

    def metrics_failing(self) -> bool:
        after = self._metrics_fail_after_s
        return self._metrics_fail or (after is not None and self._now() >= after)

    def kill(self) -> None:
        """The engine dies now (a request's fault that kills it, as a CUDA error does)."""
        self._apply("kill", 0.0, self._sync())
        self._sync()

    # -- requests ----------------------------------------------------------------------------------

    def submit(self, prompt_tokens: int, out_tokens: int) -> Seq:
        now = self._sync()
        self._next_rid += 1
        rid = self._next_rid
        self._engine.submit(
            SimRequest(request_id=rid, prompt_tokens=prompt_tokens, max_output_tokens=out_tokens),
            at=now,
        )
        seq = self._seqs[rid] = Seq(rid, now)
        self._kick()
        return seq

    def release(self, seq: Seq) -> None:
        """Abort ``seq`` in the engine unless it already ended (the client left early)."""
        if seq.end is not None:
            return
        now = self._sync()
        if seq.end is None:
            self._engine.abort(seq.rid, at=now)
            self._seqs.pop(seq.rid, None)
            seq.end = "aborted"
            self.finished_by_reason["abort"] += 1
            self._kick()

    def finish_reason(self, generated: int, out_tokens: int) -> str:
        reason = "length" if generated >= out_tokens else "stop"
        self.finished_by_reason[reason] += 1
        return reason
