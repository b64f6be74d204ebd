"""``serve`` with ``DYNAMIC_POLICY=predictive`` against PIG's learner, on the same overload.

Two simulated vLLM backends (the calibrated A100 Qwen2-7B profile) each get a guard, one with
PIG's learner and one with the predictive one, and the same crowd of streaming users at once:
120 users, each asking again and again for 100-200 output tokens on a prompt of about 250-1,900
tokens, a short think between requests and about 0.75 s after a 429, for 22 s. That is several
times what the engine carries at 25 tok/s per user, and the prompts make prefill, which stalls
every decoding stream while it runs, a large share of the engine's work: PIG's learner counts
requests, the predictive one weighs each by its body size.

Figures come from the users' side, over the requests started after an 8 s warm-up (the
learners' first polls): *admitted* is a 200, a stream's speed is ``(tokens - 1) / (last token -
first token)`` over streams of at least 16 content tokens. The test asserts that the predictive
guard admits more than PIG's learner while its users' p5 stays at or above 20 tok/s, that its
429s carry a predicted whole-second ``Retry-After``, and that its ``/pig/metrics`` page shows the
learner's explanation. A second, smaller run records the predictive guard live and replays the
recording to the same decisions.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import attrs
import h11
import trio
from prometheus_client.parser import text_string_to_metric_families

from guard_adapters.config import load_config
from guard_adapters.recording import (
    VERSION,
    Decision,
    Header,
    RecordingError,
    open_for_reading,
    read_records,
)
from guard_adapters.replay import replay, summarise
from guard_core import FirstToken, Refused
from guard_trio._recorder import Recorder
from guard_trio._server import GuardServer

TOKEN = "s3cret"
AUTH = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"
USERS = 120
LOAD_S = 28.0
WARM_UP_S = 12.0
RAMP_S = 2.0
MIN_SPEED_TOKENS = 16


@attrs.define
class Stream:
    """One request as its user saw it."""

    started: float
    status: int | None = None
    retry_after: bytes | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0

    @property
    def speed(self) -> float | None:
        if self.tokens < MIN_SPEED_TOKENS or self.first_at is None or self.last_at is None:
            return None
        if self.last_at <= self.first_at:
            return None
        return (self.tokens - 1) / (self.last_at - self.first_at)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request_body(rng: random.Random, output: tuple[int, int] = (100, 200)) -> bytes:
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(200, 1500)))
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(*output),
            "stream": True,
        }
    ).encode()


def content_tokens(event: bytes) -> int:
    if not event.startswith(b"data: {"):
        return 0
    choice = json.loads(event[6:])["choices"][0]
    return 1 if choice["delta"].get("content") else 0


async def read_stream(
    connection: Any, body: bytes, stream: Stream, headers: list[tuple[str, str]] | None = None
) -> None:
    sent = [*AUTH, ("Accept", "text/event-stream"), *(headers or [])]
    await connection.send_request("POST", CHAT, sent, body)
    head = await connection.response_head()
    stream.status = head.status_code
    stream.retry_after = dict(head.headers).get(b"retry-after")
    pending = b""
    while (chunk := await connection.next_chunk()) is not None:
        if stream.status != 200:
            continue
        now = trio.current_time()
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if content_tokens(event):
                stream.tokens += 1
                stream.first_at = stream.first_at or now
                stream.last_at = now


async def user(http: Any, index: int, guard: str, streams: list[Stream], start: float) -> None:
    """Request, read, think; after a 429 wait about 0.75 s; until the load ends."""
    rng = random.Random(index)  # the same requests in front of either guard
    await trio.sleep_until(start + RAMP_S * index / USERS)
    connection: Any = None
    try:
        while trio.current_time() < start + LOAD_S:
            stream = Stream(started=trio.current_time() - start)
            streams.append(stream)
            body = request_body(rng)
            if connection is None:
                connection = await http.connect(guard)
            await read_stream(connection, body, stream)
            if connection.h11.our_state is h11.DONE and connection.h11.their_state is h11.DONE:
                connection.h11.start_next_cycle()
            else:
                await connection.aclose()
                connection = None
            pause = rng.uniform(0.5, 1.0) if stream.status == 429 else rng.uniform(0.1, 0.4)
            await trio.sleep(pause)
    finally:
        if connection is not None:
            with trio.CancelScope(shield=True):
                await connection.aclose()


def figures(streams: list[Stream]) -> dict[str, Any]:
    measured = [s for s in streams if s.started >= WARM_UP_S and s.status is not None]
    speeds = [speed for speed in (s.speed for s in measured) if speed is not None]
    return {
        "admitted": sum(s.status == 200 for s in measured),
        "rejected": sum(s.status == 429 for s in measured),
        "p5": quantile(speeds, 0.05),
        "p50": quantile(speeds, 0.50),
        "streams": len(speeds),
    }


def page_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_predictive_admits_more_than_pig_and_keeps_users_fast(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    guards: dict[str, tuple[str, Any]] = {}
    for policy in ("pig", "predictive"):
        sim, _ = await start_sim(seed=7)
        guards[policy] = await start_guard(
            {
                "UPSTREAM": sim,
                "DYNAMIC_METRICS_URL": f"{sim}/metrics",
                "TOKEN": TOKEN,
                "DYNAMIC_POLL_INTERVAL_MS": "250",
                "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
                "DYNAMIC_POLICY": policy,
            }
        )
    streams: dict[str, list[Stream]] = {policy: [] for policy in guards}
    start = trio.current_time()
    with trio.fail_after(LOAD_S + 20):
        async with trio.open_nursery() as crowd:
            for policy, (guard, _) in guards.items():
                for index in range(USERS):
                    crowd.start_soon(user, http, index, guard, streams[policy], start)

    pig, predictive = figures(streams["pig"]), figures(streams["predictive"])
    waits = [s.retry_after or b"" for s in streams["predictive"] if s.status == 429]
    print(f"\npig: {pig}\npredictive: {predictive}")
    print(f"predictive Retry-After: { {w: waits.count(w) for w in sorted(set(waits))} }")
    assert pig["rejected"] > 0, "the load must be an overload for both"
    assert predictive["rejected"] > 0
    assert predictive["streams"] >= 50
    assert predictive["p5"] >= 20.0, predictive
    assert predictive["admitted"] > pig["admitted"], (pig, predictive)

    # Its refusals say when to come back, in whole seconds from the learner (1 to 30).
    assert set(waits) <= {str(n).encode() for n in range(1, 31)}
    assert set(waits) - {b"1"}, "at least one Retry-After is a prediction other than the fixed 1"

    # The explanation is on the metrics page; PIG's learner's page has none of it.
    guard, server = guards["predictive"]
    values = page_values((await http.request(guard, "GET", "/pig/metrics", AUTH)).body.decode())
    assert values[("inference_guard_predictive_fit_observations", ())] > 10
    assert values[("inference_guard_predictive_bytes_per_token_learned", ())] == 1
    assert 2.0 < values[("inference_guard_predictive_bytes_per_token", ())] < 8.0
    refusals = sum(
        value
        for (name, _), value in values.items()
        if name == "inference_guard_predictive_refusals_total"
    )
    assert refusals == sum(s.status == 429 for s in streams["predictive"])
    assert server.engine.state.predictive.last_cap is not None
    pig_page = (await http.request(guards["pig"][0], "GET", "/pig/metrics", AUTH)).body
    assert b"inference_guard_predictive_" not in pig_page


async def test_a_live_predictive_recording_replays_to_the_same_decisions(
    start_sim: Any, http: Any, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Everything the predictive learner read live (body sizes, first tokens by request, every
    poll) is in the recording, so a replay with the recorded settings reproduces each decision,
    its explanation, and each refusal's Retry-After and binding constraint."""
    sim, _ = await start_sim(max_num_seqs=16, seed=3)
    settings = load_config(
        {
            "LISTEN": "127.0.0.1:0",
            "UPSTREAM": sim,
            "DYNAMIC_METRICS_URL": f"{sim}/metrics",
            "TOKEN": TOKEN,
            "DYNAMIC_POLL_INTERVAL_MS": "100",
            "PIG_QUEUE_WAIT_SECONDS": "0.3",
            "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
            "DYNAMIC_POLICY": "predictive",
        }
    )
    path = tmp_path / "live.jsonl.gz"
    recorder = Recorder(path, config=settings.redacted(), producer="test")
    server = GuardServer(settings, on_event=recorder.event, on_poll=recorder.poll)
    host, port = await nursery.start(server.serve)
    guard = f"http://{host}:{port}"
    with trio.fail_after(10):
        while server.poller.rounds < 2:  # noqa: ASYNC110 - the poller has no event to wait on
            await trio.sleep(0.01)

    async def client(index: int) -> None:
        rng = random.Random(index)
        tier = [("X-User-Tier", "premium")] if index % 4 == 0 else []
        connection = await http.connect(guard)
        try:
            for _ in range(3):
                stream = Stream(started=0.0)
                await read_stream(connection, request_body(rng, (20, 80)), stream, tier)
                if connection.h11.their_state is not h11.DONE:
                    return
                connection.h11.start_next_cycle()
        finally:
            await connection.aclose()

    async with trio.open_nursery() as clients:
        for index in range(40):
            clients.start_soon(client, index)
            await trio.sleep(0.03)
    with trio.fail_after(10):
        while server.engine.state.gate.inflight:  # noqa: ASYNC110
            await trio.sleep(0.01)
        rounds = server.poller.rounds
        while server.poller.rounds < rounds + 2:  # noqa: ASYNC110
            await trio.sleep(0.01)
    await recorder.aclose()

    with open_for_reading(path) as stream:
        items = list(read_records(stream, strict=True))
    header = items[0]
    assert isinstance(header, Header)
    assert header.version == VERSION == 3
    records = [item for item in items[1:] if not isinstance(item, Header | RecordingError)]
    decisions = [r for r in records if isinstance(r, Decision)]
    assert decisions
    assert all(d.predicted is not None for d in decisions if d.source == "metrics")
    refused = [r for r in records if isinstance(r, Refused)]
    assert refused, "the load must bring refusals"
    assert all(r.binding is not None and r.retry_after_s is not None for r in refused)
    firsts = [r for r in records if isinstance(r, FirstToken)]
    assert firsts

    result = replay(records, load_config(header.config).guard_config())
    assert len(result.polls) == len(decisions)
    assert [poll for poll in result.polls if poll.differs] == []
    explained = [poll for poll in result.polls if poll.recorded and poll.recorded.predicted]
    assert explained
    assert all(poll.prediction is not None for poll in explained)
    assert result.differing_outcomes == 0
    assert (result.admitted, result.rejected) == (
        result.recorded_forwarded,
        result.recorded_rejected,
    )
    assert sum(result.refusals_by_binding.values()) == len(refused)
    summary = summarise(result)
    assert summary["predictive"]["differing_explanations"] == 0
    assert summary["predictive"]["final_fit"]["observations"] > 0


async def test_retry_after_is_predicted_fixed_or_absent_as_configured(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    """A request the predictive learner refuses (here: a body taken, at 0.001 bytes per token,
    for twenty million prompt tokens behind a running stream) gets the learner's Retry-After in
    ``predicted`` mode, ``PIG_RETRY_AFTER_SECONDS`` in ``fixed`` mode, and none when that is 0."""
    sim, _ = await start_sim()
    huge = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]})
    shown: dict[str, bytes | None] = {}
    for mode, seconds in (("predicted", "1"), ("fixed", "7"), ("predicted", "0")):
        guard, server = await start_guard(
            {
                "UPSTREAM": sim,
                "DYNAMIC_METRICS_URL": f"{sim}/metrics",
                "TOKEN": TOKEN,
                "DYNAMIC_POLL_INTERVAL_MS": "100",
                "DYNAMIC_POLICY": "predictive",
                "DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN": "0.001",
                "PIG_QUEUE_WAIT_SECONDS": "0",
                "PIG_RETRY_AFTER_MODE": mode,
                "PIG_RETRY_AFTER_SECONDS": seconds,
            }
        )
        running = await http.connect(guard)
        body = json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400,
                "stream": True,
            }
        )
        await running.send_request("POST", CHAT, AUTH, body.encode())
        assert (await running.response_head()).status_code == 200
        refused = await http.request(guard, "POST", CHAT, AUTH, huge.encode())
        assert refused.status == 429
        shown[f"{mode} {seconds}"] = refused.header("retry-after")
        await running.aclose()
        counted = server.metrics.predictive_refusals
        assert sum(counter.value for counter in counted.values()) == 1
    predicted = shown["predicted 1"]
    assert predicted is not None
    assert 1 <= int(predicted) <= 30
    assert shown["fixed 7"] == b"7"
    assert shown["predicted 0"] is None
