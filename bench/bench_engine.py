"""Speed of the simulated engine (guard_adapters.engine_model), in wall time per virtual time.

Run: ``python bench/bench_engine.py``. Prints a table; nothing is asserted. Goals (PRODUCT.md and
the engine's brief): the HTTP sim-backend carries 512 concurrent streams at 50 tok/s on one core,
and one hour of a conversation trace (about 19k requests) simulates in under 60 s together with
the policy, so the engine alone must take a small part of both.

Scenarios:
* ``512 streams, per step``: 512 long requests on a profile whose steps last 20 ms whatever the
  batch (50 tok/s per stream), advanced one step at a time (``advance(next_event_at())``), as a
  backend that streams every step would; 60 virtual seconds.
* ``512 streams, 20 ms ticks``: the same, advanced on a 20 ms virtual clock tick.
* ``1 h at 5 req/s``: seeded Poisson arrivals, prompts of 200-4000 tokens, outputs of 20-1500,
  on the default profile, advanced at every arrival and every step (token events on), then the
  same with ``token_events=False`` and advancing only at arrivals (what an in-process simulation
  needs for TTFT and completions).
"""

from __future__ import annotations

import platform
import random
import sys
import time
from collections.abc import Callable

import attrs

from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    PROFILES,
    Engine,
    EngineProfile,
    SimRequest,
)

STREAMS = 512
STREAM_SECONDS = 60.0
HOUR = 3600.0
RATE = 5.0


def stream_profile() -> EngineProfile:
    return attrs.evolve(
        PROFILES[DEFAULT_PROFILE],
        name="bench-512x50",
        max_num_seqs=STREAMS,
        max_num_batched_tokens=4096,
        kv_capacity_tokens=STREAMS * 16_384,
        step_base_s=0.020,
        decode_token_s=0.0,
        prefill_token_s=0.0,
        kv_token_s=0.0,
    )


def run_streams(tick: float | None) -> tuple[float, int, int]:
    """Return (wall seconds, events, output tokens) for 60 virtual seconds of 512 streams."""
    engine = Engine(stream_profile(), seed=1)
    for rid in range(STREAMS):
        engine.submit(SimRequest(request_id=rid, prompt_tokens=500, max_output_tokens=8000), at=0.0)
    events = tokens = 0
    started = time.perf_counter()
    now = 0.0
    while now < STREAM_SECONDS:
        if tick is None:
            nxt = engine.next_event_at()
            if nxt is None:
                break
            now = nxt
        else:
            now += tick
        batch = engine.advance(now)
        events += len(batch)
        for event in batch:
            tokens += event.tokens
    return time.perf_counter() - started, events, tokens


def arrivals(seed: int) -> list[tuple[float, SimRequest]]:
    rng = random.Random(seed)
    out: list[tuple[float, SimRequest]] = []
    t = 0.0
    rid = 0
    while True:
        t += rng.expovariate(RATE)
        if t >= HOUR:
            return out
        prompt = min(4000, max(200, int(rng.lognormvariate(6.7, 0.7))))
        output = min(1500, max(20, int(rng.lognormvariate(5.3, 0.8))))
        out.append((t, SimRequest(request_id=rid, prompt_tokens=prompt, max_output_tokens=output)))
        rid += 1


def run_hour(*, token_events: bool, every_step: bool) -> tuple[float, int, int, float]:
    """Return (wall seconds, requests, events, mean TTFT) for one virtual hour."""
    trace = arrivals(7)
    engine = Engine(PROFILES[DEFAULT_PROFILE], seed=1, token_events=token_events)
    events = 0
    first: dict[int, float] = {}
    submitted: dict[int, float] = {}
    ttft_total = 0.0
    started = time.perf_counter()

    def take(until: float) -> None:
        nonlocal events, ttft_total
        batch = engine.advance(until)
        events += len(batch)
        for event in batch:
            if event.kind == "first_token":
                first[event.request_id] = event.at
                ttft_total += event.at - submitted[event.request_id]

    for at, request in trace:
        if every_step:
            while (nxt := engine.next_event_at()) is not None and nxt <= at:
                take(nxt)
        take(at)
        submitted[request.request_id] = at
        engine.submit(request, at=at)
    while (nxt := engine.next_event_at()) is not None:
        take(nxt if every_step else nxt + 3600.0)
    wall = time.perf_counter() - started
    return wall, len(trace), events, ttft_total / max(1, len(first))


def timed(label: str, fn: Callable[[], str]) -> None:
    print(f"{label:<34} {fn()}", flush=True)


def main() -> None:
    print(f"python {sys.version.split()[0]} on {platform.machine()} ({platform.system()})")
    print(f"{'scenario':<34} result")

    def streams(tick: float | None) -> Callable[[], str]:
        def go() -> str:
            wall, events, tokens = run_streams(tick)
            return (
                f"{wall / STREAM_SECONDS * 1000:7.1f} ms wall per virtual s, "
                f"{events / wall:9.0f} events/s, {tokens / STREAM_SECONDS / STREAMS:5.1f} "
                "tok/s per stream"
            )

        return go

    def hour(token_events: bool, every_step: bool) -> Callable[[], str]:
        def go() -> str:
            wall, requests, events, ttft = run_hour(
                token_events=token_events, every_step=every_step
            )
            return (
                f"{wall:7.2f} s wall for {requests} requests, {events} events "
                f"({events / wall:9.0f}/s), mean TTFT {ttft:.3f} s"
            )

        return go

    timed("512 streams, per step", streams(None))
    timed("512 streams, 20 ms ticks", streams(0.020))
    timed("1 h at 5 req/s, every step", hour(True, True))
    timed("1 h at 5 req/s, arrivals, no tokens", hour(False, False))


if __name__ == "__main__":
    main()
