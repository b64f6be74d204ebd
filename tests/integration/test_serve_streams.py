"""``serve`` with streams over real sockets: recorded transcripts relayed byte for byte with one
semantic TTFT sample each, the learned cap following a slowed-down backend down and back up,
routing over two backends (and around a dead one), and the premium reservation at the cap.

Every server runs on 127.0.0.1 inside the test's nursery; every test is bounded by
``trio.fail_after``. Timing assertions are loose: lower bounds and directions, never exact
figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from guard_adapters.sse import FirstUsefulEventScanner
from guard_core import LimitReason, StateReason
from guard_trio._proxy import TOO_MANY_REQUESTS_BODY
from guard_trio.tools.sim_backend import split_sse_events

TOKEN = "s3cret"
AUTH = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"
TRANSCRIPTS = Path(__file__).parents[1] / "fixtures" / "sse"
REPLAY_INTERVAL_S = 0.005


def chat_body(max_tokens: int = 4, *, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def events_before_first_useful(transcript: bytes) -> int | None:
    """How many replayed events come before the one that completes the first useful event.

    The sim sends event ``i`` (as :func:`split_sse_events` cuts it) ``i`` intervals after the
    response head, so this many intervals pass before the guard can see the useful one.
    """
    scanner = FirstUsefulEventScanner()
    for index, event in enumerate(split_sse_events(transcript)):
        if scanner.feed(event):
            return index
    return None


# -- 1. recorded transcripts ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(path.name for path in TRANSCRIPTS.glob("*.txt")))
async def test_a_recorded_transcript_passes_byte_for_byte_with_one_semantic_ttft_sample(
    name: str, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    path = TRANSCRIPTS / name
    transcript = path.read_bytes()
    before = events_before_first_useful(transcript)
    with trio.fail_after(15):
        sim, _ = await start_sim(replay_sse=path, replay_interval_s=REPLAY_INTERVAL_S)
        guard, server = await start_guard(
            {"UPSTREAM": sim, "TOKEN": TOKEN, "DYNAMIC_PIG_ENABLED": "false"}
        )
        connection = await http.connect(guard)
        try:
            await connection.send_request("POST", CHAT, AUTH, chat_body(16, stream=True))
            head = await connection.response_head()
            assert head.status_code == 200
            assert dict(head.headers)[b"content-type"].startswith(b"text/event-stream")
            received = b"".join([chunk async for chunk in connection.chunks()])
        finally:
            await connection.aclose()
        # The guard releases the slot just after it wrote the end of the response.
        await until(lambda: server.engine.state.gate.inflight == 0, 2.0)
    assert received == transcript
    semantic = server.engine.state.learner.semantic_ttft
    if before is None:
        assert semantic is None or semantic.count == 0
        return
    assert semantic is not None
    assert semantic.count == 1
    # The sim sleeps at least one interval between events; the sample starts at arrival.
    assert semantic.sum >= before * REPLAY_INTERVAL_S - 1e-3


# -- 2. the learned cap follows a slowed-down backend ---------------------------------------------


@attrs.frozen
class CapPoint:
    """One poll as the gate saw it: the published cap and what led to it."""

    at: float
    cap: int
    reason: LimitReason
    state: str
    state_reasons: tuple[StateReason, ...]
    running: int
    inflight: int
    user_tps: float | None
    phase: str

    def __str__(self) -> str:
        speed = "-" if self.user_tps is None else f"{self.user_tps:.1f}"
        return (
            f"{self.at:6.2f}s cap={self.cap:<3} {self.reason!s:<12} {self.state:<6} "
            f"running={self.running:<3} inflight={self.inflight:<3} user_tps={speed:<6} "
            f"{self.phase} {','.join(self.state_reasons)}"
        )


def record_caps(server: Any, timeline: list[CapPoint]) -> None:
    """Append the gate's decision to ``timeline`` after every poll round."""
    start = trio.current_time()

    def on_round(_report: Any) -> None:
        state = server.engine.state
        decision = state.gate.decision
        last = state.learner.last
        timeline.append(
            CapPoint(
                at=trio.current_time() - start,
                cap=decision.cap,
                reason=decision.final_reason,
                state=str(decision.state),
                state_reasons=decision.yellow_reasons + decision.red_reasons,
                running=decision.running,
                inflight=state.gate.inflight,
                user_tps=last.signals.user_tps if last is not None else None,
                phase=last.throughput.phase if last is not None else "",
            )
        )

    server.poller.on_round.append(on_round)


def show(timeline: list[CapPoint]) -> str:
    return "cap timeline:\n" + "\n".join(map(str, timeline))


async def test_the_learned_cap_follows_a_slowed_backend_down_and_back_up(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    # 16 streams of 2,000 tokens: about 80 tok/s each at full speed (the 7B profile at batch
    # 16), so none ends during the test; 13 tok/s each once the engine is 6 times slower.
    streams, slow_down = 16, 6.0
    timeline: list[CapPoint] = []
    outcomes = {"ok": 0, "refused": 0}
    with trio.fail_after(25):
        sim, backend = await start_sim(max_num_seqs=64)
        guard, server = await start_guard(
            {
                "UPSTREAM": sim,
                "DYNAMIC_METRICS_URL": f"{sim}/metrics",
                "TOKEN": TOKEN,
                "GLOBAL_LIMIT": "64",
                "DYNAMIC_POLL_INTERVAL_MS": "200",
                "DYNAMIC_SINGLE_USER_TPS_YELLOW_CONSECUTIVE": "1",
                "DYNAMIC_SINGLE_USER_TPS_RED_CONSECUTIVE": "1",
                "DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_CONSECUTIVE": "1",
                # A new stream counts as prefilling (per-user speed frozen) for 0.4 s, not 2 s.
                "DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MIN_SECONDS": "0.4",
            }
        )
        record_caps(server, timeline)

        async def client() -> None:
            """Stream, and ask again when the stream ends; back off a little after a 429."""
            while True:
                connection = await http.connect(guard)
                try:
                    await connection.send_request("POST", CHAT, AUTH, chat_body(2000, stream=True))
                    head = await connection.response_head()
                    async for _ in connection.chunks():
                        pass
                finally:
                    await connection.aclose()
                if head.status_code == 200:
                    outcomes["ok"] += 1
                else:
                    outcomes["refused"] += 1
                    await trio.sleep(0.2)

        def polls_after(count: int) -> list[CapPoint]:
            return timeline[count:]

        async with trio.open_nursery() as clients:
            for _ in range(streams):
                clients.start_soon(client)
            # Settled: every stream decodes, users are fast, and two polls agree on the cap.
            await until(
                lambda: (
                    len(timeline) >= 2
                    and all(
                        point.running == streams
                        and point.user_tps is not None
                        and point.user_tps > 37.5
                        for point in timeline[-2:]
                    )
                    and timeline[-1].cap == timeline[-2].cap
                ),
                6.0,
            )
            settled = timeline[-1]
            assert settled.cap >= streams, show(timeline)

            backend.control({"slow_down": slow_down})
            mark = len(timeline)
            await until(lambda: any(p.cap < settled.cap for p in polls_after(mark)), 8.0)
            fell = next(p for p in polls_after(mark) if p.cap < settled.cap)
            assert fell.reason in {LimitReason.THROUGHPUT, LimitReason.PRESSURE}, show(timeline)
            assert fell.user_tps is not None
            assert fell.user_tps < 25.0, show(timeline)
            assert StateReason.SINGLE_USER_TPS in fell.state_reasons, show(timeline)
            # Let it go on falling while the backend stays slow, until two polls agree.
            fall = len(timeline)
            await until(
                lambda: len(timeline) >= fall + 2 and timeline[-1].cap == timeline[-2].cap, 4.0
            )
            slowed = timeline[-1]
            assert slowed.cap < settled.cap, show(timeline)
            assert slowed.reason in {LimitReason.THROUGHPUT, LimitReason.PRESSURE}, show(timeline)
            # Nobody was evicted: the streams admitted before the fall still run.
            assert server.engine.state.gate.inflight == streams, show(timeline)

            backend.control({"reset_faults": True})
            mark = len(timeline)
            await until(lambda: any(p.cap > slowed.cap for p in polls_after(mark)), 6.0)
            clients.cancel_scope.cancel()
    rose = next(p for p in polls_after(mark) if p.cap > slowed.cap)
    assert rose.user_tps is None or rose.user_tps > 25.0, show(timeline)
    assert outcomes["refused"] == 0  # no stream ended, so nobody asked again


# -- 3. two backends ------------------------------------------------------------------------------


def finished(backend: Any) -> int:
    """Requests the sim served to the end (aborts and engine-dead errors are not counted)."""
    return sum(backend.finished_by_reason[reason] for reason in ("stop", "length"))


async def start_two_backends(start_sim: Any, start_guard: Any) -> tuple[str, Any, Any, Any]:
    sim_a, backend_a = await start_sim(seed=1)
    sim_b, backend_b = await start_sim(seed=2)
    guard, server = await start_guard(
        {
            "BACKENDS": f"a={sim_a}|{sim_a}/metrics,b={sim_b}|{sim_b}/metrics",
            "TOKEN": TOKEN,
            "DYNAMIC_POLL_INTERVAL_MS": "100",
        }
    )
    return guard, server, backend_a, backend_b


async def statuses_of(http: Any, guard: str, count: int, *, concurrent: bool) -> list[int]:
    """Send ``count`` streaming requests, all at once or one after the other."""
    statuses: list[int] = []
    # Concurrent streams must overlap (40 tokens: about 0.5 s); sequential ones can be short.
    tokens = 40 if concurrent else 8

    async def one() -> None:
        reply = await http.request(guard, "POST", CHAT, AUTH, chat_body(tokens, stream=True))
        statuses.append(reply.status)

    if concurrent:
        async with trio.open_nursery() as clients:
            for _ in range(count):
                clients.start_soon(one)
    else:
        for _ in range(count):
            await one()
    return statuses


async def test_requests_spread_over_two_backends_and_avoid_one_that_died(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    with trio.fail_after(20):
        guard, server, backend_a, backend_b = await start_two_backends(start_sim, start_guard)
        # Concurrent streams: each one's in-flight count makes its backend score worse, so the
        # next request goes to the other one.
        assert await statuses_of(http, guard, 8, concurrent=True) == [200] * 8
        assert finished(backend_a) + finished(backend_b) == 8
        assert finished(backend_a) >= 2
        assert finished(backend_b) >= 2
        # Backend a dies the way a vLLM server does on engine death: the engine fails and the
        # server goes away with it, so its /metrics stops answering too.
        backend_a.control({"kill": True, "metrics_fail": True})
        rounds = server.poller.rounds
        await until(lambda: server.poller.rounds >= rounds + 2)
        assert dict(server.engine.state.learner.backends)["a"].failed
        done_a, done_b = finished(backend_a), finished(backend_b)
        assert await statuses_of(http, guard, 6, concurrent=False) == [200] * 6
        assert await statuses_of(http, guard, 4, concurrent=True) == [200] * 4
        assert finished(backend_b) == done_b + 10
        assert finished(backend_a) == done_a


async def test_a_dead_engine_whose_metrics_still_answer_is_avoided(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    with trio.fail_after(20):
        guard, server, backend_a, backend_b = await start_two_backends(start_sim, start_guard)
        backend_a.control({"kill": True})  # /health turns 503; /metrics keeps answering
        rounds = server.poller.rounds
        await until(lambda: server.poller.rounds >= rounds + 2)
        done_b = finished(backend_b)
        assert await statuses_of(http, guard, 6, concurrent=False) == [200] * 6
        assert finished(backend_b) == done_b + 6


# -- 4. tiers -------------------------------------------------------------------------------------


async def test_premium_is_admitted_while_basic_is_refused_at_the_cap(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    with trio.fail_after(15):
        sim, backend = await start_sim()
        guard, server = await start_guard(
            {
                "UPSTREAM": sim,
                "TOKEN": TOKEN,
                "DYNAMIC_PIG_ENABLED": "false",
                "GLOBAL_LIMIT": "4",
                "PIG_QUEUE_WAIT_SECONDS": "0",
            }
        )
        holders = []
        try:
            # Cap 4: basic may hold 3 slots, one stays reserved for premium.
            for _ in range(3):
                holder = await http.connect(guard)
                holders.append(holder)
                await holder.send_request("POST", CHAT, AUTH, chat_body(2000, stream=True))
                assert (await holder.response_head()).status_code == 200
                assert await holder.next_chunk()
            gate = server.engine.state.gate
            assert (gate.basic_inflight, gate.premium_inflight) == (3, 0)
            refused = await http.request(guard, "POST", CHAT, AUTH, chat_body())
            assert refused.status == 429
            assert refused.body == TOO_MANY_REQUESTS_BODY
            premium = await http.request(
                guard, "POST", CHAT, [*AUTH, ("X-User-Tier", "premium")], chat_body(8, stream=True)
            )
            assert premium.status == 200
            assert premium.body.endswith(b"data: [DONE]\n\n")
            # Still 3 basic streams holding their slots: basic stays refused.
            assert (await http.request(guard, "POST", CHAT, AUTH, chat_body())).status == 429
            assert backend.engine_metrics().running == 3
            # One basic stream ends: its slot goes back to basic.
            await holders.pop().aclose()
            await until(lambda: server.engine.state.gate.basic_inflight == 2, 2.0)
            assert (await http.request(guard, "POST", CHAT, AUTH, chat_body())).status == 200
        finally:
            for holder in holders:
                await holder.aclose()
