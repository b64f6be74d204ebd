"""The refusal path's pieces in-process, and what trio's building blocks cost per request.

Run: ``python bench/bench_hot_path.py [--scale F]`` (also part of ``nox -s bench``; ``--scale``
multiplies the calls per repeat, 0.01 for a smoke run). No network: a guard
refusing everything (static, ``GLOBAL_LIMIT=0``, no wait) is built as ``serve`` builds it, and
each piece of a refusal is timed on the same small POST ``bench_proxy.py`` sends. The trio rows
time, inside ``trio.run``, a checkpoint, one timeout (a cancel scope with a deadline), a task
per request (a nursery and one task: how the guard watched for a client's disconnect before)
and what an admitted request pays for that watch now (its scope, the connection's watcher
woken and stopped, over a socket pair). Prints the best of seven repeats in microseconds per
call, CPU time; it asserts only that its guard refuses the POST.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Awaitable, Callable

import trio
import trio.testing

from guard_adapters.config import load_config
from guard_adapters.http_head import read_simple_request
from guard_adapters.outcome import Admission, ExchangeNotes, ExchangeOutcome
from guard_core import (
    DecisionSource,
    GateConfig,
    GuardConfig,
    LimitReason,
    LoadState,
    PublishedDecision,
    RejectCode,
    Tier,
)
from guard_core.events import Arrived
from guard_core.gate import DecisionPublished
from guard_core.guard import apply as apply_guard_event
from guard_core.lanes import Lane
from guard_trio._downstream import Downstream
from guard_trio._engine import AdmissionResult, GuardEngine
from guard_trio._server import GuardServer

_BODY = (
    b'{"model":"bench","messages":[{"role":"system","content":"You are terse."},'
    b'{"role":"user","content":"Name one river, one stone and one sea, nothing else."}],'
    b'"max_tokens":16,"temperature":0}'
)
_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_BODY)
) + _BODY
_REFUSING = {
    "DYNAMIC_PIG_ENABLED": "false",
    "GLOBAL_LIMIT": "0",
    "PIG_QUEUE_WAIT_SECONDS": "0",
    "UPSTREAM": "http://127.0.0.1:9",
    "LISTEN": "127.0.0.1:0",
}


CHAT_PATH = "/v1/chat/completions"

#: Calls per repeat are multiplied by this (``--scale``).
SCALE = [1.0]


def best_us(call: Callable[[], object], number: int = 20_000, repeat: int = 7) -> float:
    """The best of ``repeat`` runs of ``number`` calls, in CPU microseconds per call."""
    best = float("inf")
    number = max(1, round(number * SCALE[0]))
    for _ in range(repeat):
        started = time.process_time()
        for _ in range(number):
            call()
        best = min(best, (time.process_time() - started) / number)
    return best * 1e6


async def best_us_async(
    call: Callable[[], Awaitable[object]], number: int = 5_000, repeat: int = 7
) -> float:
    best = float("inf")
    number = max(1, round(number * SCALE[0]))
    for _ in range(repeat):
        started = time.process_time()
        for _ in range(number):
            await call()
        best = min(best, (time.process_time() - started) / number)
    return best * 1e6


async def _watched() -> None:
    """A watcher task per request (how the guard watched for disconnects before): a nursery,
    one task, cancelled at the end."""
    with trio.CancelScope():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()


async def _watch_row() -> float:
    """What an admitted request pays for its disconnect watch now: its cancel scope, and the
    connection's one watcher task woken to read and stopped again (over a socket pair, the
    request read to its end)."""
    ours, theirs = trio.socket.socketpair()
    async with trio.open_nursery() as nursery:
        down = Downstream(trio.SocketStream(ours), "127.0.0.1")
        down.tasks = nursery
        down.ready_event()  # nothing read yet: NEED_DATA
        down._request_read.set()  # the request's body has been read

        async def watched() -> None:
            with trio.CancelScope() as scope:
                down.watch(scope)
                await trio.lowlevel.checkpoint()
                down.unwatch()

        row = await best_us_async(watched)
        nursery.cancel_scope.cancel()
    theirs.close()
    ours.close()
    return row


async def _timed() -> None:
    with trio.move_on_after(60):
        await trio.lowlevel.checkpoint()


async def _admitted_rows() -> list[tuple[str, float]]:
    """An admitted request's admission and release in the engine (its slot, its prefill grace,
    the table), with none, 500 and 5,000 other slots held: what the core's copies cost as the
    guard fills (a copy of its tables is bounded by their square root, :mod:`guard_core.table`)."""
    server = GuardServer(load_config({**_REFUSING, "GLOBAL_LIMIT": "100000"}))
    engine = server.engine

    def admit_and_release() -> None:
        result = engine.begin(Tier.BASIC, path=CHAT_PATH, body_bytes=len(_BODY)).result
        assert result is not None
        assert result.slot is not None
        result.slot.release(200)

    rows = [("an admission and its release: begin + release", best_us(admit_and_release))]
    held: list[AdmissionResult | None] = []
    for count in (500, 5_000):
        held += [
            engine.begin(Tier.BASIC, body_bytes=len(_BODY)).result for _ in range(count - len(held))
        ]
        rows.append(
            (f"  the same with {count:,} slots held", best_us(admit_and_release, number=5_000))
        )
    for result in held:
        assert result is not None
        assert result.slot is not None
        result.slot.release(200)
    await server.aclose()
    return rows


def _release_row(waiting: int) -> tuple[str, float]:
    """A release with ``waiting`` requests held in the short wait (a cap of 20 full, PIG's
    0.5 s wait): the release, every waiter's retry, the admitted one's wake-up and a new
    request queued in its place. On trio's mock clock, so no deadline passes while it runs;
    the mean of 200 releases (scaled), not a best of seven."""

    async def run() -> float:
        engine = GuardEngine(GuardConfig(gate=GateConfig(queue_wait_s=0.5), learning=False))
        decision = PublishedDecision(
            at=0.0,
            source=DecisionSource.METRICS,
            cap=20,
            state=LoadState.GREEN,
            final_reason=LimitReason.THROUGHPUT,
        )
        engine.state = apply_guard_event(engine.state, DecisionPublished(decision)).state
        releases = max(2, round(200 * SCALE[0]))
        held = [engine.begin(Tier.PREMIUM).result for _ in range(20)]

        async def wait_for_slot() -> None:
            while True:  # admitted, it holds its slot and a new request queues in its place
                held.append(await engine.admit(Tier.PREMIUM))

        async with trio.open_nursery() as nursery:
            for _ in range(waiting):
                nursery.start_soon(wait_for_slot)
            await trio.testing.wait_all_tasks_blocked()
            started = time.process_time()
            for _ in range(releases):
                result = held.pop(0)
                assert result is not None
                assert result.slot is not None
                result.slot.release(200)
                await trio.testing.wait_all_tasks_blocked()
            spent = time.process_time() - started
            nursery.cancel_scope.cancel()
        return spent / releases * 1e6

    micros = trio.run(run, clock=trio.testing.MockClock())
    return f"a release with {waiting:,} waiting (mean): retries, wake-up, re-queue", micros


async def measure() -> list[tuple[str, float]]:
    server = GuardServer(load_config(_REFUSING))
    app, engine = server.app, server.engine
    request = read_simple_request(_REQUEST)
    assert request is not None
    _attempt, answer = app.admit_simple(request)
    assert answer is not None
    assert answer.startswith(b"HTTP/1.1 429"), answer[:40]

    def notes() -> ExchangeOutcome:
        return ExchangeNotes(
            trace_id="bench",
            request_id=1,
            admitted_path=True,
            tier=Tier.BASIC,
            lane=Lane.DEFAULT,
            body_bytes=len(_BODY),
            admission=Admission.REFUSED,
            code=RejectCode.TIER_BASIC_LIMIT,
            decision_s=1e-5,
            status=429,
        ).outcome()

    outcome = notes()

    arrival = Arrived(
        at=1.0,
        request_id=10**9,
        tier=Tier.BASIC,
        body_bytes=len(_BODY),
        path=CHAT_PATH,
    )
    state = engine.state

    def core_step() -> object:
        return apply_guard_event(state, arrival)

    def whole() -> object:
        parsed = read_simple_request(_REQUEST)
        assert parsed is not None
        return app.admit_simple(parsed)

    rows = [
        ("the fast reader: read_simple_request", best_us(lambda: read_simple_request(_REQUEST))),
        ("the core's step: guard_core apply(Arrived) (refused)", best_us(core_step)),
        (
            "the engine's attempt: GuardEngine.begin (refused)",
            best_us(lambda: engine.begin(Tier.BASIC, path=CHAT_PATH, body_bytes=200)),
        ),
        ("the exchange's outcome: ExchangeNotes(...).outcome()", best_us(notes)),
        ("its listeners: hand_outcome (the metrics)", best_us(lambda: app.hand_outcome(outcome))),
        ("the cached 429: RefusalAnswers.whole", best_us(lambda: app.refusals.whole(None, "x"))),
        ("a whole refusal: read + admit_simple", best_us(whole)),
        *await _admitted_rows(),
        ("trio: checkpoint", await best_us_async(trio.lowlevel.checkpoint)),
        ("trio: a cancel scope with a deadline + checkpoint", await best_us_async(_timed)),
        ("trio: a task per request (nursery + task) + checkpoint", await best_us_async(_watched)),
        ("the disconnect watch: scope + watch + checkpoint + unwatch", await _watch_row()),
    ]
    await server.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="calls per repeat, scaled")
    SCALE[0] = parser.parse_args().scale
    rows = trio.run(measure)
    rows += [_release_row(waiting) for waiting in (10, 1_000)]
    print(f"bench_hot_path: {platform.python_implementation()} {platform.python_version()}")
    print("CPU microseconds per call, best of 7 repeats")
    width = max(len(name) for name, _ in rows)
    for name, micros in rows:
        print(f"{name.ljust(width)}  {micros:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
