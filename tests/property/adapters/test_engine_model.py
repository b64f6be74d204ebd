"""Properties of the simulated engine (guard_adapters.engine_model) under random call scripts."""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import event as note
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    ITL_BUCKETS,
    PROFILES,
    TTFT_BUCKETS,
    Engine,
    EngineDead,
    EngineProfile,
    RequestTooLong,
    SimRequest,
    TokenEvent,
    idle_prefill_s,
    profile_from_json,
)

MODEL_LEN = 512
TERMINAL = ("finished", "failed")


def small_profile(max_num_seqs: int, kv_extra: int, budget: int) -> EngineProfile:
    """A tiny engine so that scripts hit the batch limit, chunking and KV exhaustion often."""
    return EngineProfile(
        name="tiny",
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=MODEL_LEN + kv_extra,
        max_num_batched_tokens=budget,
        max_model_len=MODEL_LEN,
        step_base_s=0.01,
        decode_token_s=0.001,
        prefill_token_s=0.0001,
        kv_token_s=1e-6,
    )


profiles = st.builds(
    small_profile,
    max_num_seqs=st.integers(1, 6),
    kv_extra=st.integers(0, MODEL_LEN),
    budget=st.integers(8, 600),
)


@st.composite
def submit_ops(draw: st.DrawFn) -> tuple[Any, ...]:
    prompt = draw(st.integers(1, 400))
    output = draw(st.integers(1, MODEL_LEN - prompt))
    cached = draw(st.integers(0, prompt - 1))
    return ("submit", draw(st.floats(0, 0.2)), prompt, output, cached)


ops = st.lists(
    st.one_of(
        submit_ops(),
        submit_ops(),
        submit_ops(),
        st.tuples(st.just("advance"), st.floats(0, 1.0)),
        st.tuples(st.just("abort"), st.floats(0, 0.2), st.integers(0, 40)),
        st.tuples(st.just("slow"), st.floats(0, 0.2), st.sampled_from([0.5, 1.0, 2.0, 3.0])),
        st.tuples(st.just("abort_all"), st.floats(0, 0.2)),
        st.tuples(st.just("kill"), st.floats(0, 2.0)),
    ),
    max_size=40,
)


@attrs.define
class Tracked:
    request: SimRequest
    submitted_at: float
    tokens: int = 0
    started: bool = False
    ended: str | None = None
    ended_at: float = 0.0
    aborted_at: float | None = None


class Checker:
    """Drives an engine through a script and checks every event and metrics page on the way."""

    def __init__(self, engine: Engine, *, ignore_eos: bool) -> None:
        self.engine = engine
        self.ignore_eos = ignore_eos
        self.requests: dict[int, Tracked] = {}
        self.log: list[TokenEvent] = []
        self.clock = 0.0
        self.last_at = 0.0
        self.previous: Any = engine.metrics()

    def take(self, until: float) -> None:
        events = self.engine.advance(until)
        for event in events:
            assert event.at <= max(until, self.clock) + 1e-9
            assert event.at >= self.last_at - 1e-9, "events out of time order"
            self.last_at = event.at
            self.on_event(event)
        self.log.extend(events)
        self.check_metrics()

    def on_event(self, event: TokenEvent) -> None:
        tracked = self.requests[event.request_id]
        assert tracked.ended is None, f"event after the end: {event}"
        assert event.at >= tracked.submitted_at
        if tracked.aborted_at is not None:
            assert event.at <= tracked.aborted_at, "event after abort"
        limit = tracked.request.max_output_tokens
        if event.kind == "first_token":
            assert not tracked.started
            assert event.tokens == 1
            tracked.started = True
        elif event.kind == "tokens":
            assert tracked.started
            assert event.tokens >= 1
        elif event.kind == "finished":
            assert tracked.started
            tracked.ended, tracked.ended_at = "finished", event.at
        elif event.kind == "failed":
            assert event.tokens == 0
            tracked.ended, tracked.ended_at = "failed", event.at
        else:
            assert event.kind == "preempted"
            assert event.tokens == 0
        tracked.tokens += event.tokens
        assert tracked.tokens <= limit
        if event.kind == "finished" and self.ignore_eos:
            assert tracked.tokens == limit

    def check_metrics(self) -> None:
        engine = self.engine
        page = engine.metrics()
        assert 0 <= page.running <= engine.profile.max_num_seqs
        assert page.waiting >= 0
        assert 0.0 <= page.kv_usage <= 1.0
        assert 0 <= engine.kv_used_tokens <= engine.profile.kv_capacity_tokens
        old = self.previous
        for name in (
            "preemptions_total",
            "prompt_tokens_total",
            "generation_tokens_total",
            "requests_finished_total",
            "ttft_count",
            "itl_count",
        ):
            assert getattr(page, name) >= getattr(old, name), name
        assert page.ttft_sum >= old.ttft_sum - 1e-9
        counts = page.ttft_bucket_counts
        assert len(counts) == len(TTFT_BUCKETS) + 1
        assert list(counts) == sorted(counts)
        assert counts[-1] == page.ttft_count
        assert all(a >= b for a, b in zip(counts, old.ttft_bucket_counts, strict=True))
        itl = page.itl_bucket_counts
        assert len(itl) == len(engine.itl_buckets) + 1
        assert list(itl) == sorted(itl)
        assert itl[-1] == page.itl_count
        assert all(a >= b for a, b in zip(itl, old.itl_bucket_counts, strict=True))
        assert page.itl_sum >= old.itl_sum - 1e-9
        # every output token after a request's first is one inter-token observation
        assert page.itl_count == page.generation_tokens_total - page.ttft_count
        self.previous = page

    def run(self, script: Sequence[tuple[Any, ...]]) -> None:
        engine = self.engine
        next_id = 0
        for op in script:
            self.clock += op[1]
            if op[0] == "submit":
                request = SimRequest(
                    request_id=next_id,
                    prompt_tokens=op[2],
                    max_output_tokens=op[3],
                    cached_prompt_tokens=op[4],
                )
                next_id += 1
                if engine.dead:
                    with pytest.raises(EngineDead):
                        engine.submit(request, at=self.clock)
                    continue
                engine.submit(request, at=self.clock)
                self.requests[request.request_id] = Tracked(request, self.clock)
            elif op[0] == "advance":
                self.take(self.clock)
            elif op[0] == "abort":
                self.abort(op[2])
            elif op[0] == "abort_all":
                for rid in list(self.requests):
                    self.abort(rid)
                if not engine.dead:
                    page = engine.metrics()
                    assert engine.kv_used_tokens == 0
                    assert page.kv_usage == 0.0
                    assert page.running == page.waiting == 0
                    nxt = engine.next_event_at()
                    assert nxt is None or nxt <= self.clock
            elif op[0] == "slow":
                engine.slow_down(op[2], at=self.clock)
            else:
                engine.kill(at=self.clock)
                assert engine.dead
            self.check_metrics()
        self.drain()

    def abort(self, rid: int) -> None:
        tracked = self.requests.get(rid)
        self.engine.abort(rid, at=self.clock)  # unknown ids must be ignored too
        if tracked is not None and tracked.aborted_at is None and tracked.ended is None:
            tracked.aborted_at = self.clock

    def drain(self) -> None:
        for _ in range(100_000):
            nxt = self.engine.next_event_at()
            if nxt is None:
                break
            self.clock = max(self.clock, nxt)
            self.take(nxt)
        else:
            raise AssertionError("engine never went idle")
        self.take(self.clock)
        for tracked in self.requests.values():
            ends = [e for e in self.log if e.request_id == tracked.request.request_id]
            terminal = [e for e in ends if e.kind in TERMINAL]
            if tracked.aborted_at is None or terminal:
                assert len(terminal) == 1, f"{tracked} ended {len(terminal)} times"
        if not self.engine.dead:
            page = self.engine.metrics()
            assert page.running == page.waiting == 0
            assert self.engine.kv_used_tokens == 0


@given(profile=profiles, script=ops, seed=st.integers(0, 3), ignore_eos=st.booleans())
def test_random_scripts_keep_the_invariants(
    profile: EngineProfile, script: list[tuple[Any, ...]], seed: int, ignore_eos: bool
) -> None:
    engine = Engine(profile, seed=seed, ignore_eos=ignore_eos, mean_output_tokens=20)
    checker = Checker(engine, ignore_eos=ignore_eos)
    checker.run(script)
    kinds = {e.kind for e in checker.log}
    note(f"preempted: {'preempted' in kinds}")
    note(f"failed: {'failed' in kinds}")
    streaming = any(t.started and t.aborted_at for t in checker.requests.values())
    note(f"aborted while streaming: {streaming}")


@given(profile=profiles, script=ops, seed=st.integers(0, 3))
def test_same_seed_same_events(
    profile: EngineProfile, script: list[tuple[Any, ...]], seed: int
) -> None:
    runs = []
    for _ in range(2):
        engine = Engine(profile, seed=seed, ignore_eos=False, mean_output_tokens=30)
        checker = Checker(engine, ignore_eos=False)
        checker.run(script)
        runs.append((checker.log, engine.metrics()))
    assert runs[0] == runs[1]


@given(profile=profiles, script=ops.filter(lambda s: all(op[0] == "submit" for op in s)))
def test_token_counts_add_up_without_aborts(
    profile: EngineProfile, script: list[tuple[Any, ...]]
) -> None:
    """With neither abort nor kill, the counters equal what the events handed out."""
    engine = Engine(profile)
    checker = Checker(engine, ignore_eos=True)
    checker.run(script)
    page = engine.metrics()
    assert page.generation_tokens_total == sum(e.tokens for e in checker.log)
    assert page.requests_finished_total == len(checker.requests)
    assert page.prompt_tokens_total == sum(
        t.request.prompt_tokens for t in checker.requests.values()
    )
    assert page.ttft_count == len(checker.requests)
    # a request's gaps add up to the span from its first token to its last, preemptions included
    first = {e.request_id: e.at for e in checker.log if e.kind == "first_token"}
    spans = sum(e.at - first[e.request_id] for e in checker.log if e.kind == "finished")
    assert page.itl_sum == pytest.approx(spans, rel=1e-9, abs=1e-9)


@given(profile=profiles, script=ops, seed=st.integers(0, 3))
def test_without_token_events_the_ends_match(
    profile: EngineProfile, script: list[tuple[Any, ...]], seed: int
) -> None:
    """``token_events=False`` changes only the "tokens" events, never timing or totals."""
    logs = []
    for token_events in (True, False):
        engine = Engine(profile, seed=seed, token_events=token_events)
        checker = Checker(engine, ignore_eos=True)
        checker.run(script)
        logs.append(checker.log)
    full, lean = logs
    assert [e for e in full if e.kind not in ("tokens", "finished")] == [
        e for e in lean if e.kind != "finished"
    ]
    assert [(e.request_id, e.at) for e in full if e.kind == "finished"] == [
        (e.request_id, e.at) for e in lean if e.kind == "finished"
    ]


def replay(engine: Engine, requests: Sequence[SimRequest]) -> list[TokenEvent]:
    for request in requests:
        engine.submit(request, at=0.0)
    events: list[TokenEvent] = []
    while (nxt := engine.next_event_at()) is not None:
        events.extend(engine.advance(nxt))
    return events


def per_user_tpot(events: Sequence[TokenEvent]) -> float:
    first: dict[int, float] = {}
    gaps = []
    totals: dict[int, int] = {}
    for event in events:
        totals[event.request_id] = totals.get(event.request_id, 0) + event.tokens
        if event.kind == "first_token":
            first[event.request_id] = event.at
        elif event.kind == "finished":
            gaps.append((event.at - first[event.request_id]) / (totals[event.request_id] - 1))
    return statistics.fmean(gaps)


@given(factor=st.floats(0.25, 4.0), users=st.integers(1, 64))
def test_slow_down_from_the_start_scales_every_step(factor: float, users: int) -> None:
    requests = [
        SimRequest(request_id=i, prompt_tokens=300, max_output_tokens=200) for i in range(users)
    ]
    normal = per_user_tpot(replay(Engine(PROFILES[DEFAULT_PROFILE]), requests))
    slowed_engine = Engine(PROFILES[DEFAULT_PROFILE])
    slowed_engine.slow_down(factor, at=0.0)
    slowed = per_user_tpot(replay(slowed_engine, requests))
    assert slowed == pytest.approx(normal * factor, rel=1e-9)


def test_slow_down_mid_stream_halves_per_user_speed() -> None:
    engine = Engine(PROFILES[DEFAULT_PROFILE])
    for i in range(16):
        engine.submit(SimRequest(request_id=i, prompt_tokens=500, max_output_tokens=3000), at=0.0)
    stamps: list[float] = []
    slowed = False
    while (nxt := engine.next_event_at()) is not None:
        if not slowed and nxt > 10.0:
            engine.slow_down(2.0, at=10.0)
            slowed = True
            nxt = engine.next_event_at()
            assert nxt is not None
        stamps.extend(e.at for e in engine.advance(nxt) if e.request_id == 0 and e.tokens)
    before = [b - a for a, b in itertools.pairwise(stamps) if a > 5.0 and b < 10.0]
    after = [b - a for a, b in itertools.pairwise(stamps) if a > 10.1 and b < 15.0]
    ratio = statistics.fmean(after) / statistics.fmean(before)
    assert ratio == pytest.approx(2.0, rel=0.02)


@given(
    users=st.integers(1, 16),
    prompt=st.integers(1, 128),
    output=st.integers(2, 200),
    profile_name=st.sampled_from(sorted(PROFILES)),
)
def test_pure_decode_inter_token_latency_is_the_step_formula(
    users: int, prompt: int, output: int, profile_name: str
) -> None:
    """All prompts fit one step; then ``output - 1`` decode steps of the whole batch follow."""
    profile = PROFILES[profile_name]
    requests = [
        SimRequest(request_id=i, prompt_tokens=prompt, max_output_tokens=output)
        for i in range(users)
    ]
    engine = Engine(profile)
    events = replay(engine, requests)
    page = engine.metrics()
    assert page.itl_count == users * (output - 1)
    assert page.itl_count == page.generation_tokens_total - page.ttft_count
    # decode step j (1 .. output - 1) attends over each sequence's prompt and j more tokens
    steps = [profile.decode_step_s(users, users * (prompt + j)) for j in range(1, output)]
    mean = page.itl_sum / page.itl_count
    assert mean == pytest.approx(statistics.fmean(steps), rel=1e-9)
    assert mean == pytest.approx(per_user_tpot(events), rel=1e-9)
    # the bucket counts place every step where its duration falls
    expected = [0] * (len(ITL_BUCKETS) + 1)
    for step in steps:
        expected[bisect.bisect_left(ITL_BUCKETS, step)] += users
    assert page.itl_bucket_counts == tuple(itertools.accumulate(expected))


def test_inter_token_latency_buckets_are_vllms_and_may_be_replaced() -> None:
    # vllm-v1-histogram-buckets-by-version.tsv, vllm:inter_token_latency_seconds, v0.33.0
    assert ITL_BUCKETS == (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    )  # fmt: skip
    engine = Engine(PROFILES[DEFAULT_PROFILE], itl_buckets=(0.005, 0.012))
    assert engine.itl_buckets == (0.005, 0.012)
    replay(engine, [SimRequest(request_id=0, prompt_tokens=10, max_output_tokens=11)])
    page = engine.metrics()
    # one user steps in about 11.56 ms: every gap lands in (0.005, 0.012]
    assert page.itl_bucket_counts == (0, 10, 10)
    assert Engine(PROFILES[DEFAULT_PROFILE]).metrics().itl_bucket_counts == (0,) * 20
    for bad in ((0.1, 0.1), (0.2, 0.1), (0.1, math.inf), (math.nan,)):
        with pytest.raises(ValueError, match="itl_buckets"):
            Engine(PROFILES[DEFAULT_PROFILE], itl_buckets=bad)


def test_a_preempted_sequence_reports_its_whole_pause_as_one_gap() -> None:
    profile = attrs.evolve(small_profile(2, 40, 4096), max_num_batched_tokens=4096)
    engine = Engine(profile)
    requests = [
        SimRequest(request_id=i, prompt_tokens=260, max_output_tokens=200) for i in range(2)
    ]
    events = replay(engine, requests)
    page = engine.metrics()
    assert page.preemptions_total > 0
    assert page.itl_count == page.generation_tokens_total - page.ttft_count == 2 * 199
    stamps: dict[int, list[float]] = {0: [], 1: []}
    for event in events:
        stamps[event.request_id].extend([event.at] * event.tokens)
    gaps = [b - a for times in stamps.values() for a, b in itertools.pairwise(times)]
    assert page.itl_sum == pytest.approx(sum(gaps))
    longest = max(gaps)
    assert longest > 5 * profile.decode_step_s(2, 600)  # the wait in the queue and the recompute
    slot = bisect.bisect_left(ITL_BUCKETS, longest)
    assert page.itl_bucket_counts[slot] > page.itl_bucket_counts[slot - 1]


def test_idle_prefill_time_is_what_an_idle_engine_takes() -> None:
    profile = PROFILES[DEFAULT_PROFILE]
    for prompt, cached in ((1, 0), (100, 0), (2048, 0), (2049, 0), (9000, 0), (9000, 8192)):
        engine = Engine(profile)
        engine.submit(
            SimRequest(
                request_id=0, prompt_tokens=prompt, max_output_tokens=2, cached_prompt_tokens=cached
            ),
            at=3.0,
        )
        events = replay(engine, [])
        first = next(e.at for e in events if e.kind == "first_token")
        assert first - 3.0 == pytest.approx(idle_prefill_s(profile, prompt - cached), rel=1e-12)
    assert idle_prefill_s(profile, 2048) == pytest.approx(0.0115 + 2048 * 0.000075)
    assert idle_prefill_s(profile, 2049) == pytest.approx(2 * 0.0115 + 2049 * 0.000075)
    assert idle_prefill_s(profile, 0) == idle_prefill_s(profile, 1)


def test_abort_frees_kv_at_once() -> None:
    engine = Engine(PROFILES[DEFAULT_PROFILE])
    for i in range(3):
        engine.submit(SimRequest(request_id=i, prompt_tokens=1000, max_output_tokens=500), at=0.0)
    engine.advance(1.0)
    page = engine.metrics()
    assert page.running == 3
    assert engine.kv_used_tokens > 3000
    held = engine.kv_used_tokens
    engine.abort(1, at=1.0)
    after = engine.kv_used_tokens
    assert engine.metrics().running == 2
    assert held - after > 1000  # its prompt and what it had generated
    engine.abort(0, at=1.0)
    engine.abort(2, at=1.0)
    engine.abort(99, at=1.0)  # unknown: ignored
    assert engine.kv_used_tokens == 0
    assert engine.metrics().kv_usage == 0.0
    nxt = engine.next_event_at()
    assert nxt is None or nxt <= 1.1
    leftovers = engine.advance(5.0)
    assert all(e.at <= 1.0 + 1e-9 for e in leftovers)
    assert engine.next_event_at() is None


def test_kill_fails_everything_and_refuses_work() -> None:
    engine = Engine(attrs.evolve(PROFILES[DEFAULT_PROFILE], max_num_seqs=4))
    for i in range(10):
        engine.submit(SimRequest(request_id=i, prompt_tokens=800, max_output_tokens=900), at=0.0)
    engine.advance(2.0)
    engine.kill(at=2.5)
    events = engine.advance(3.0)
    failed = [e for e in events if e.kind == "failed"]
    assert sorted(e.request_id for e in failed) == list(range(10))
    assert all(e.at == 2.5 and e.tokens == 0 for e in failed)
    assert engine.dead
    assert engine.next_event_at() is None
    page = engine.metrics()
    assert (page.running, page.waiting, page.kv_usage) == (0, 0, 0.0)
    assert page.generation_tokens_total > 0
    with pytest.raises(EngineDead):
        engine.submit(SimRequest(request_id=50, prompt_tokens=10, max_output_tokens=10), at=3.0)
    engine.abort(3, at=3.0)
    engine.slow_down(2.0, at=3.0)
    engine.kill(at=4.0)
    assert engine.advance(10.0) == []


def test_requests_are_checked() -> None:
    engine = Engine(PROFILES[DEFAULT_PROFILE])
    with pytest.raises(RequestTooLong):
        engine.submit(
            SimRequest(request_id=1, prompt_tokens=16_000, max_output_tokens=1000), at=0.0
        )
    engine.submit(SimRequest(request_id=1, prompt_tokens=10, max_output_tokens=5), at=0.0)
    with pytest.raises(ValueError, match="already"):
        engine.submit(SimRequest(request_id=1, prompt_tokens=10, max_output_tokens=5), at=0.0)
    with pytest.raises(ValueError, match="cached"):
        SimRequest(request_id=2, prompt_tokens=10, max_output_tokens=5, cached_prompt_tokens=10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        SimRequest(request_id=2, prompt_tokens=0, max_output_tokens=5)
    with pytest.raises(ValueError, match="factor"):
        engine.slow_down(0.0, at=0.0)


def test_requests_at_one_instant_share_the_first_step() -> None:
    engine = Engine(PROFILES[DEFAULT_PROFILE])
    for i in range(4):
        engine.submit(SimRequest(request_id=i, prompt_tokens=100, max_output_tokens=3), at=2.0)
    events = engine.advance(2.5)
    firsts = {e.at for e in events if e.kind == "first_token"}
    assert len(firsts) == 1
    profile = engine.profile
    assert firsts.pop() == pytest.approx(2.0 + profile.step_base_s + 400 * profile.prefill_token_s)


def test_profiles_are_consistent() -> None:
    assert DEFAULT_PROFILE in PROFILES
    for name, profile in PROFILES.items():
        assert profile.name == name
        assert profile.kv_capacity_tokens >= profile.max_model_len
    with pytest.raises(TypeError):
        PROFILES["x"] = PROFILES[DEFAULT_PROFILE]  # type: ignore[index]
    assert TTFT_BUCKETS[0] == 0.001
    assert TTFT_BUCKETS[-1] == 2560.0
    assert len(TTFT_BUCKETS) == 22


@given(
    prompts=st.lists(st.integers(1, 200), min_size=2, max_size=12),
    output=st.integers(2, 300),
    kv_extra=st.integers(0, 1500),
)
def test_kv_exhaustion_preempts_and_everyone_still_finishes(
    prompts: list[int], output: int, kv_extra: int
) -> None:
    profile = attrs.evolve(small_profile(len(prompts), kv_extra, 4096), max_num_batched_tokens=4096)
    capacity = profile.kv_capacity_tokens
    script = [("submit", 0.0, p, output, 0) for p in prompts]
    engine = Engine(profile)
    checker = Checker(engine, ignore_eos=True)
    checker.run(script)
    page = engine.metrics()
    assert page.requests_finished_total == len(prompts)
    if sum(prompts) > capacity:  # admitted in turns: no lockstep to reason about
        return
    # All start together and decode in lockstep: the KV runs out before anyone ends, or never.
    if sum(prompts) + len(prompts) * (output - 1) > capacity:
        assert page.preemptions_total > 0
        assert any(e.kind == "preempted" for e in checker.log)
    else:
        assert page.preemptions_total == 0


# -- profiles from JSON -------------------------------------------------------------------------

PROFILE_FIELDS = (
    "name",
    "max_num_seqs",
    "kv_capacity_tokens",
    "max_num_batched_tokens",
    "max_model_len",
    "step_base_s",
    "decode_token_s",
    "prefill_token_s",
    "kv_token_s",
)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_built_in_profile_round_trips_through_json(name: str) -> None:
    profile = PROFILES[name]
    document = json.loads(json.dumps(attrs.asdict(profile)))
    assert profile_from_json(document) == profile
    del document["source"]
    assert profile_from_json(document) == attrs.evolve(profile, source="")


@given(
    seqs=st.integers(1, 1024),
    extra_budget=st.integers(1, 8192),
    model_len=st.integers(1, 65_536),
    extra_kv=st.integers(0, 10**6),
    times=st.tuples(
        st.floats(1e-6, 1.0), st.floats(0.0, 0.01), st.floats(0.0, 0.01), st.floats(0.0, 1e-6)
    ),
)
def test_any_valid_profile_document_gives_that_profile(
    seqs: int,
    extra_budget: int,
    model_len: int,
    extra_kv: int,
    times: tuple[float, float, float, float],
) -> None:
    document = {
        "name": "operator-gpu",
        "max_num_seqs": seqs,
        "kv_capacity_tokens": model_len + extra_kv,
        "max_num_batched_tokens": seqs + extra_budget,
        "max_model_len": model_len,
        "step_base_s": times[0],
        "decode_token_s": times[1],
        "prefill_token_s": times[2],
        "kv_token_s": times[3],
    }
    profile = profile_from_json(json.loads(json.dumps(document)))
    assert {field: getattr(profile, field) for field in PROFILE_FIELDS} == document


def test_optional_profile_fields_take_the_class_defaults() -> None:
    profile = profile_from_json(
        {
            "name": "x",
            "max_num_seqs": 8,
            "kv_capacity_tokens": 20_000,
            "step_base_s": 0.01,
            "decode_token_s": 0,
            "prefill_token_s": 0.0001,
        }
    )
    assert (profile.max_num_batched_tokens, profile.max_model_len) == (2048, 16384)
    assert profile.kv_token_s == 0.0
    assert isinstance(profile.decode_token_s, float)


GOOD_DOCUMENT: dict[str, object] = {
    "name": "x",
    "max_num_seqs": 8,
    "kv_capacity_tokens": 20_000,
    "step_base_s": 0.01,
    "decode_token_s": 0.0001,
    "prefill_token_s": 0.0001,
}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"gpu": "a100"}, "gpu"),
        ({"name": None}, "name"),
        ({"name": ""}, "name"),
        ({"max_num_seqs": 8.0}, "max_num_seqs"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_capacity_tokens": -5}, "kv_capacity_tokens"),
        ({"kv_capacity_tokens": 1000}, "kv_capacity_tokens"),  # below max_model_len
        ({"max_num_batched_tokens": 8}, "max_num_batched_tokens"),  # not above max_num_seqs
        ({"step_base_s": 0}, "step_base_s"),
        ({"step_base_s": "fast"}, "step_base_s"),
        ({"decode_token_s": -0.1}, "decode_token_s"),
        ({"prefill_token_s": float("nan")}, "prefill_token_s"),
        ({"kv_token_s": float("inf")}, "kv_token_s"),
        ({"source": 3}, "source"),
    ],
)
def test_bad_profile_documents_name_the_field(changes: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        profile_from_json(GOOD_DOCUMENT | changes)


def test_missing_profile_fields_are_all_named() -> None:
    with pytest.raises(ValueError, match="missing step_base_s, prefill_token_s"):
        profile_from_json(
            {k: v for k, v in GOOD_DOCUMENT.items() if k not in ("step_base_s", "prefill_token_s")}
        )
    with pytest.raises(ValueError, match="JSON object"):
        profile_from_json([1, 2])  # type: ignore[arg-type]
