"""Several simulated engines behind one front, in one virtual time (a backend pool).

Reads: the engines (:class:`~guard_adapters.engine_model.Engine`, one per backend, each with its
own scheduler, KV cache and counters) and a speed factor per engine (a backend that is that
much slower: every step of it lasts that many times as long, for the whole run).

Guarantees:
- :meth:`EnginePool.advance` returns every engine's events up to ``until`` merged in time order
  (equal times in engine order), so the caller sees a finish on one engine before a later first
  token on another;
- a pool of one engine is exactly that engine: the same calls reach it and the same events come
  back, so a one-backend simulation gives the single-engine figures unchanged;
- :meth:`EnginePool.slow_down` applies a pool-wide slowdown on top of each engine's own factor.
Pure: no I/O, clock or randomness beyond what the engines own.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from guard_adapters.engine_model import Engine, EngineMetrics, EngineProfile, SimRequest, TokenEvent

__all__ = ("EnginePool",)


class EnginePool:
    """The engines of one simulated pool; see the module notes."""

    __slots__ = ("_engines", "_factors")

    def __init__(self, engines: Sequence[Engine], factors: Sequence[float] | None = None) -> None:
        if not engines:
            raise ValueError("a pool needs at least one engine")
        factors = tuple(factors) if factors is not None else (1.0,) * len(engines)
        if len(factors) != len(engines):
            raise ValueError("one speed factor per engine")
        if not all(math.isfinite(f) and f > 0 for f in factors):
            raise ValueError("speed factors must be finite and > 0")
        self._engines = tuple(engines)
        self._factors = factors
        for engine, factor in zip(self._engines, factors, strict=True):
            if factor != 1.0:
                engine.slow_down(factor, at=0.0)

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def profile(self) -> EngineProfile:
        """The first engine's profile (every engine of a simulated pool shares it)."""
        return self._engines[0].profile

    @property
    def engines(self) -> tuple[Engine, ...]:
        return self._engines

    def submit(self, request: SimRequest, *, at: float, backend: int = 0) -> None:
        self._engines[backend].submit(request, at=at)

    def advance(self, until: float) -> list[TokenEvent]:
        if len(self._engines) == 1:
            return self._engines[0].advance(until)
        batches = [engine.advance(until) for engine in self._engines]
        return list(heapq.merge(*batches, key=lambda event: event.at))

    def next_event_at(self) -> float | None:
        times = [t for t in (engine.next_event_at() for engine in self._engines) if t is not None]
        return min(times) if times else None

    def slow_down(self, factor: float, *, at: float) -> None:
        """A pool-wide speed factor from ``at`` on (1 restores each engine's own)."""
        for engine, own in zip(self._engines, self._factors, strict=True):
            engine.slow_down(factor * own, at=at)

    def metrics(self) -> tuple[EngineMetrics, ...]:
        """Each engine's metrics, in backend order."""
        return tuple(engine.metrics() for engine in self._engines)
