"""The closed-loop simulation: accounting, the policies' limits, determinism, and what overload
does to an unguarded engine compared with the guard."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.config import load_config
from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    ITL_BUCKETS,
    PROFILES,
    TTFT_BUCKETS,
    Engine,
    SimRequest,
    idle_prefill_s,
)
from guard_adapters.simulation import (
    TIERS,
    Guard,
    NoPolicy,
    RequestOutcome,
    SimulationResult,
    Static,
    _backend_sample,
    parse_policy,
    simulate,
    summarise,
    validate_slowdowns,
)
from guard_adapters.traces import TraceRequest, head, load_trace, scale_rate
from guard_core import GuardConfig, Tier
from guard_core.gate import MAX_SHORT_WAIT_S

AZURE = Path(__file__).parents[2] / "fixtures/traces/azure-llm-2023-conv.csv"
MOONCAKE = Path(__file__).parents[2] / "fixtures/traces/mooncake-fast25-conversation-trace.jsonl"
JSON_KEYS = {
    "requests",
    "admitted",
    "rejected",
    "user_tps_p5",
    "user_tps_p50",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "goodput_per_s",
    "goodput_prompt_aware_per_s",
}


@functools.cache
def guard_config(global_limit: int | None = None) -> GuardConfig:
    environ = {"DYNAMIC_METRICS_URL": "http://sim/metrics"}
    if global_limit is not None:
        environ["GLOBAL_LIMIT"] = str(global_limit)
    return load_config(environ).guard_config()


@functools.cache
def overload_trace() -> tuple[TraceRequest, ...]:
    """The first five minutes of the Azure trace, arriving four times as fast."""
    return scale_rate(head(load_trace(AZURE), 300.0), 4.0)


@functools.cache
def overloaded(policy: str, seed: int = 0) -> SimulationResult:
    return simulate(
        overload_trace(), parse_policy(policy, guard_config()), seed=seed, premium_share=0.2
    )


traces = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=0.3),  # gap to the previous arrival
        st.integers(min_value=1, max_value=6_000),
        st.integers(min_value=1, max_value=300),
    ),
    max_size=60,
).map(
    lambda rows: tuple(
        TraceRequest(arrival_s=at, prompt_tokens=prompt, output_tokens=output)
        for at, (_, prompt, output) in zip(
            _running_sum(gap for gap, _, _ in rows), rows, strict=True
        )
    )
)


def _running_sum(gaps: Iterable[float]) -> list[float]:
    total, out = 0.0, []
    for gap in gaps:
        total += gap
        out.append(total)
    return out


policies = st.one_of(
    st.just(NoPolicy()),
    st.integers(min_value=0, max_value=8).map(Static),
    st.integers(min_value=1, max_value=8).map(lambda n: Guard(guard_config(n))),
)


def check_accounting(trace: tuple[TraceRequest, ...], result: SimulationResult) -> None:
    outcomes = result.requests
    assert [o.request_id for o in outcomes] == list(range(len(trace)))
    for outcome, request in zip(outcomes, trace, strict=True):
        assert outcome.arrival_s == request.arrival_s
        if outcome.admitted:
            assert outcome.reject_code is None
            assert outcome.admitted_at is not None
            assert outcome.arrival_s <= outcome.admitted_at
            assert outcome.finished != outcome.failed  # drained: every admitted one ended
            if outcome.finished:
                assert outcome.tokens == request.output_tokens
                assert outcome.first_token_at is not None
                assert outcome.first_token_at > outcome.admitted_at
        else:
            assert outcome.reject_code is not None
            assert outcome.first_token_at is None
            assert outcome.tokens == 0
        # the prompt-aware bound only ever widens the strict one
        assert outcome.good_prompt_aware or not outcome.good
        assert outcome.cached_prompt_tokens == 0  # these traces name no blocks
    rows = result.summary
    assert set(rows) == set(TIERS)
    for row in rows.values():
        assert row.admitted + row.rejected == row.requests
        assert row.goodput_prompt_aware_per_s >= row.goodput_per_s
    assert rows["all"].requests == len(trace)
    assert rows["all"].admitted == sum(o.admitted for o in outcomes)
    for field in ("requests", "admitted", "rejected"):
        assert getattr(rows["all"], field) == getattr(rows["premium"], field) + getattr(
            rows["basic"], field
        )


@given(traces, policies, st.floats(min_value=0.0, max_value=1.0), st.sampled_from(list(PROFILES)))
def test_every_request_is_counted_once_and_every_admitted_one_runs_to_its_end(
    trace: tuple[TraceRequest, ...], policy: Guard | NoPolicy | Static, share: float, profile: str
) -> None:
    result = simulate(trace, policy, profile=profile, seed=3, premium_share=share)
    check_accounting(trace, result)
    assert result.policy == policy.name


@given(traces)
def test_the_none_policy_rejects_nothing_and_never_delays(trace: tuple[TraceRequest, ...]) -> None:
    result = simulate(trace, NoPolicy(), premium_share=0.5)
    assert all(o.admitted and o.admitted_at == o.arrival_s for o in result.requests)
    assert all(o.cap_at_admission is None for o in result.requests)
    assert all(p.cap is None for p in result.series)


@given(traces, st.integers(min_value=0, max_value=6))
def test_static_never_has_more_than_its_limit_in_flight(
    trace: tuple[TraceRequest, ...], limit: int
) -> None:
    result = simulate(trace, Static(limit))
    for outcome in result.requests:
        if outcome.admitted:
            assert outcome.admitted_at == outcome.arrival_s  # no waiting, ever
            assert outcome.inflight_at_admission is not None
            assert outcome.inflight_at_admission <= limit
            assert outcome.cap_at_admission == limit
        else:
            assert outcome.reject_code == "static_limit"
    assert all(p.inflight <= limit and p.cap == limit for p in result.series)
    if limit == 0:
        assert not any(o.admitted for o in result.requests)


@given(traces, st.integers(min_value=1, max_value=6), st.floats(min_value=0.0, max_value=1.0))
def test_the_guard_never_admits_beyond_its_published_cap(
    trace: tuple[TraceRequest, ...], limit: int, share: float
) -> None:
    result = simulate(trace, Guard(guard_config(limit)), premium_share=share)
    for outcome in result.requests:
        if outcome.admitted:
            assert outcome.inflight_at_admission is not None
            assert outcome.cap_at_admission is not None
            assert 1 <= outcome.inflight_at_admission <= outcome.cap_at_admission <= limit
            assert outcome.admitted_at is not None
            assert outcome.admitted_at - outcome.arrival_s <= MAX_SHORT_WAIT_S + 1e-9


def test_the_guard_on_real_overload_never_admits_beyond_its_cap() -> None:
    result = overloaded("guard")
    check_accounting(overload_trace(), result)
    admitted = [o for o in result.requests if o.admitted]
    assert admitted
    assert all(
        o.inflight_at_admission is not None
        and o.cap_at_admission is not None
        and o.inflight_at_admission <= o.cap_at_admission
        for o in admitted
    )
    assert result.polls >= 75  # one a second over the 75 s of arrivals, and through the drain
    assert sum(result.limit_reasons.values()) == result.polls


@given(traces, st.integers(min_value=0, max_value=3))
def test_a_seed_gives_the_same_result_every_time(
    trace: tuple[TraceRequest, ...], seed: int
) -> None:
    policy = Guard(guard_config(4))
    first = simulate(trace, policy, seed=seed, premium_share=0.3)
    assert simulate(trace, policy, seed=seed, premium_share=0.3) == first


def test_the_real_trace_gives_the_same_result_for_the_same_seed() -> None:
    again = simulate(overload_trace(), Guard(guard_config()), seed=0, premium_share=0.2)
    assert again == overloaded("guard")
    other = simulate(overload_trace(), Guard(guard_config()), seed=1, premium_share=0.2)
    assert [o.tier for o in other.requests] != [o.tier for o in again.requests]


def test_under_overload_the_guard_serves_users_better_than_no_policy() -> None:
    none, guard = overloaded("none").summary["all"], overloaded("guard").summary["all"]
    assert none.rejected == 0
    assert guard.rejected > 0
    assert none.user_tps_p5 is not None
    assert guard.user_tps_p5 is not None
    assert none.ttft_p95_s is not None
    assert guard.ttft_p95_s is not None
    assert guard.user_tps_p5 > none.user_tps_p5 or guard.ttft_p95_s < none.ttft_p95_s


def test_under_overload_the_guard_refuses_premium_less_often_than_basic() -> None:
    rows = overloaded("guard").summary
    premium, basic = rows["premium"], rows["basic"]
    assert premium.requests > 0
    assert basic.requests > 0
    assert premium.rejected / premium.requests < basic.rejected / basic.requests


def test_the_json_shape_has_every_tier_and_field() -> None:
    document = overloaded("static:32").as_json()
    assert set(document) == set(TIERS)
    for row in document.values():
        assert set(row) == JSON_KEYS
        assert all(value is None or isinstance(value, int | float) for value in row.values())


def test_the_series_has_one_point_a_second_until_the_drain() -> None:
    result = overloaded("guard")
    ats = [p.at for p in result.series]
    assert ats == pytest.approx([float(i) for i in range(1, len(ats) + 1)])
    assert ats[-1] >= result.end_s - 1.0
    speeds = [o.user_tps for o in result.requests if o.user_tps is not None]
    for point in result.series:
        assert point.running >= 0
        assert point.waiting >= 0
        assert point.guard_waiting >= 0
        if point.user_tps is not None:
            assert min(speeds) - 1e-9 <= point.user_tps <= max(speeds) + 1e-9


def outcome(**changes: object) -> RequestOutcome:
    fields: dict[str, object] = {
        "request_id": 0,
        "tier": Tier.BASIC,
        "arrival_s": 10.0,
        "prompt_tokens": 100,
        "output_tokens": 41,
        "admitted": True,
        "admitted_at": 10.0,
        "first_token_at": 10.5,
        "last_token_at": 12.5,
        "tokens": 41,
        "finished": True,
    }
    fields.update(changes)
    return RequestOutcome(**fields)  # type: ignore[arg-type]


def refused_outcome(**changes: object) -> RequestOutcome:
    return outcome(
        admitted=False,
        admitted_at=None,
        first_token_at=None,
        last_token_at=None,
        tokens=0,
        finished=False,
        reject_code="static_limit",
        **changes,
    )


def test_per_request_measures() -> None:
    good = outcome()
    assert good.ttft_s == pytest.approx(0.5)
    assert good.user_tps == pytest.approx(20.0)  # 40 tokens after the first, in 2 s
    assert good.good
    assert not outcome(first_token_at=11.5, last_token_at=13.5).good  # TTFT 1.5 s
    assert not outcome(last_token_at=14.5).good  # 10 tok/s
    assert not outcome(finished=False, failed=True).good
    single = outcome(output_tokens=1, tokens=1, last_token_at=10.5)
    assert single.user_tps is None
    assert single.good  # no decode phase to be slow in
    refused = refused_outcome()
    assert refused.ttft_s is None
    assert refused.user_tps is None
    assert not refused.good
    assert not refused.good_prompt_aware
    # prompt-aware: the TTFT bound grows by the prompt's idle prefill time, nothing else does
    late = outcome(first_token_at=11.5, last_token_at=13.5)  # TTFT 1.5 s
    assert not late.good_prompt_aware  # no idle prefill time recorded: the strict bound
    assert attrs.evolve(late, idle_prefill_s=0.5).good_prompt_aware
    assert not attrs.evolve(late, idle_prefill_s=0.49).good_prompt_aware
    slow = outcome(first_token_at=11.5, last_token_at=14.5, idle_prefill_s=2.0)  # 13.3 tok/s
    assert not slow.good_prompt_aware
    unfinished = outcome(finished=False, failed=True, idle_prefill_s=5.0)
    assert not unfinished.good_prompt_aware


def test_summary_quantiles_and_goodput() -> None:
    tiers = [Tier.PREMIUM, Tier.BASIC, Tier.BASIC, Tier.BASIC, Tier.BASIC]
    outcomes = [
        outcome(request_id=i, first_token_at=10.1 + 0.1 * i, last_token_at=12.1 + 0.1 * i, tier=t)
        for i, t in enumerate(tiers)
    ] + [refused_outcome(request_id=9)]
    rows = summarise(outcomes, duration_s=2.0)
    every = rows["all"]
    assert (every.requests, every.admitted, every.rejected) == (6, 5, 1)
    assert every.ttft_p50_s == pytest.approx(0.3)
    assert every.ttft_p99_s == pytest.approx(0.496)
    assert every.goodput_per_s == pytest.approx(5 / 2.0)
    assert every.goodput_prompt_aware_per_s == pytest.approx(5 / 2.0)
    late = [outcome(request_id=i, first_token_at=11.2, last_token_at=13.2) for i in range(4)]
    late[0] = attrs.evolve(late[0], idle_prefill_s=0.3)
    late[1] = attrs.evolve(late[1], idle_prefill_s=0.1)
    late_rows = summarise(late, duration_s=4.0)["all"]
    assert late_rows.goodput_per_s == 0.0
    assert late_rows.goodput_prompt_aware_per_s == pytest.approx(1 / 4.0)
    assert rows["premium"].requests == 1
    assert rows["basic"].rejected == 1
    empty = summarise([], duration_s=0.0)["premium"]
    assert empty.requests == 0
    assert empty.ttft_p50_s is None
    assert empty.goodput_per_s == 0.0
    assert empty.goodput_prompt_aware_per_s == 0.0


def test_policy_names_parse_and_bad_ones_are_refused() -> None:
    assert parse_policy("none") == NoPolicy()
    assert parse_policy(" Static:32 ") == Static(32)
    assert parse_policy("guard", guard_config(7)) == Guard(guard_config(7))
    assert [parse_policy(t).name for t in ("none", "static:5", "guard")] == [
        "none",
        "static:5",
        "guard",
    ]
    for bad in ("static", "static:-1", "static:x", "cap:3", ""):
        with pytest.raises(ValueError, match="policy"):
            parse_policy(bad)


def test_bad_arguments_are_refused() -> None:
    trace = (TraceRequest(1.0, 10, 10), TraceRequest(0.0, 10, 10))
    with pytest.raises(ValueError, match="sorted"):
        simulate(trace, NoPolicy())
    with pytest.raises(ValueError, match="profile"):
        simulate(trace[:1], NoPolicy(), profile="no-such-gpu")
    with pytest.raises(ValueError, match="interval"):
        simulate(trace[:1], NoPolicy(), poll_interval_s=0.0)


def test_policies_may_be_given_as_text_with_guard_settings() -> None:
    trace = head(load_trace(AZURE), 20.0)
    by_text = simulate(trace, "guard", guard_config=guard_config(3))
    assert by_text == simulate(trace, Guard(guard_config(3)))
    assert all(
        o.cap_at_admission is not None and o.cap_at_admission <= 3
        for o in by_text.requests
        if o.admitted
    )


def test_an_empty_trace_simulates_to_nothing() -> None:
    result = simulate((), Guard(guard_config()))
    assert result.requests == ()
    assert result.summary["all"].requests == 0
    assert math.isclose(result.duration_s, 0.0)


# -- prompt-aware goodput ---------------------------------------------------------------------


def test_each_outcome_carries_its_idle_prefill_time() -> None:
    trace = scale_rate(head(load_trace(AZURE), 60.0), 2.0)
    for profile in ("a100-qwen2-7b", "2xa100-tp2-qwen2.5-32b"):
        result = simulate(trace, Static(16), profile=profile)
        for outcome in result.requests:
            uncached = max(1, outcome.prompt_tokens) - outcome.cached_prompt_tokens
            assert outcome.idle_prefill_s == idle_prefill_s(PROFILES[profile], uncached)


def test_for_short_prompts_both_goodputs_nearly_agree() -> None:
    """Prompts of at most 256 tokens prefill in under 31 ms: the bounds are 1 s and < 1.031 s."""
    trace = tuple(
        attrs.evolve(r, prompt_tokens=min(r.prompt_tokens, 256))
        for r in scale_rate(head(load_trace(AZURE), 300.0), 3.0)
    )
    for policy in ("none", "static:32", "guard"):
        every = simulate(trace, parse_policy(policy, guard_config()), premium_share=0.2)
        row = every.summary["all"]
        assert row.goodput_per_s > 0
        assert row.goodput_per_s <= row.goodput_prompt_aware_per_s <= row.goodput_per_s * 1.02


def test_long_prompts_are_good_only_by_the_prompt_aware_measure() -> None:
    # 12,000-token prompts, one every 10 s: an idle engine needs 6 chunks, about 0.97 s
    # (A100 7B) or 3.6 s (32B on two A100s) to prefill each, so on the slower engine none can
    # start within 1 s
    trace = tuple(TraceRequest(10.0 * i, 12_000, 50) for i in range(10))
    result = simulate(trace, NoPolicy(), profile="2xa100-tp2-qwen2.5-32b")
    row = result.summary["all"]
    assert row.goodput_per_s == 0.0
    assert row.goodput_prompt_aware_per_s == pytest.approx(10 / 90.0)
    for outcome in result.requests:
        assert outcome.ttft_s == pytest.approx(outcome.idle_prefill_s)  # alone on the engine


# -- the prefix cache in the run ----------------------------------------------------------------


def test_a_repeated_prompt_with_hash_ids_skips_its_cached_prefill() -> None:
    blocks = tuple(range(20))  # 20 blocks of 512 cover a 10,000-token prompt
    trace = (
        TraceRequest(0.0, 10_000, 20, hash_ids=blocks),
        TraceRequest(30.0, 10_000, 20, hash_ids=blocks),
        TraceRequest(60.0, 10_000, 20, hash_ids=(*blocks[:5], *range(100, 115))),
        TraceRequest(90.0, 10_000, 20),  # no blocks named: nothing looked up
    )
    result = simulate(trace, NoPolicy())
    cached = [o.cached_prompt_tokens for o in result.requests]
    assert cached == [0, 9_999, 5 * 512, 0]
    profile = PROFILES[DEFAULT_PROFILE]
    for outcome in result.requests:  # each alone on the engine
        uncached = outcome.prompt_tokens - outcome.cached_prompt_tokens
        assert outcome.ttft_s == pytest.approx(idle_prefill_s(profile, uncached))
    first, second = result.requests[:2]
    assert first.ttft_s is not None
    assert second.ttft_s is not None
    assert second.ttft_s < first.ttft_s / 50


@functools.cache
def mooncake_minute() -> tuple[TraceRequest, ...]:
    return head(load_trace(MOONCAKE), 60.0)


def test_mooncake_prefixes_are_reused_within_the_caches_bounds() -> None:
    trace = mooncake_minute()
    result = simulate(trace, Static(12))
    admitted = [o for o in result.requests if o.admitted]
    hits = [o for o in admitted if o.cached_prompt_tokens > 0]
    assert hits
    for outcome in result.requests:
        assert 0 <= outcome.cached_prompt_tokens <= max(0, outcome.prompt_tokens - 1)
        if not outcome.admitted:
            assert outcome.cached_prompt_tokens == 0  # never reached the engine
        else:
            assert outcome.cached_prompt_tokens % 512 == 0 or (
                outcome.cached_prompt_tokens == outcome.prompt_tokens - 1
            )
    # the same requests with their block lists dropped: no reuse, and slower first tokens
    plain = simulate(tuple(attrs.evolve(r, hash_ids=()) for r in trace), Static(12))
    assert all(o.cached_prompt_tokens == 0 for o in plain.requests)
    with_cache = sum(o.ttft_s or 0.0 for o in admitted)
    without = sum(o.ttft_s or 0.0 for o in plain.requests if o.admitted)
    assert with_cache < without


def test_the_cache_is_as_large_as_the_profiles_kv() -> None:
    """93,872 KV tokens hold 183 blocks: after 21 + 170 blocks, 8 of the first prompt's go."""
    first = TraceRequest(0.0, 21 * 512 - 12, 4, hash_ids=tuple(range(21)))
    other = TraceRequest(20.0, 170 * 512 - 100, 4, hash_ids=tuple(range(1000, 1170)))
    trace = (first, other, attrs.evolve(first, arrival_s=40.0))
    # a model length that lets the long prompt in on both engines
    wide = attrs.evolve(PROFILES["a100-qwen2-7b"], max_model_len=93_872)  # 907 blocks
    small = attrs.evolve(PROFILES["a100-qwen2-7b-kv5g"], max_model_len=93_872)  # 183 blocks
    on_wide = [o.cached_prompt_tokens for o in simulate(trace, NoPolicy(), profile=wide).requests]
    assert on_wide == [0, 0, 21 * 512 - 13]  # all of it but the last token
    on_small = [o.cached_prompt_tokens for o in simulate(trace, NoPolicy(), profile=small).requests]
    assert on_small == [0, 0, 13 * 512]  # its tail went first, its head is still there


# -- slowdowns ------------------------------------------------------------------------------------


def decode_only(output: int) -> tuple[TraceRequest, ...]:
    return (TraceRequest(0.0, 16, output),)


@given(
    at_s=st.floats(1.0, 5.0),
    duration_s=st.floats(0.1, 3.0),
    factor=st.floats(0.25, 8.0),
)
def test_a_slowdown_delays_a_lone_stream_by_the_work_it_did_not_do(
    at_s: float, duration_s: float, factor: float
) -> None:
    """Inside the window the engine does ``1 / factor`` of its work; the end moves by the rest."""
    trace = decode_only(2000)  # about 24 s of decoding at 11.6 to 11.7 ms a token
    normal = simulate(trace, NoPolicy()).requests[0]
    slowed = simulate(trace, NoPolicy(), slowdowns=((at_s, duration_s, factor),)).requests[0]
    assert normal.last_token_at is not None
    assert slowed.last_token_at is not None
    # the window lies inside the stream, also when it is a speed-up
    assert slowed.last_token_at > at_s + duration_s
    delay = slowed.last_token_at - normal.last_token_at
    assert delay == pytest.approx(duration_s * (1 - 1 / factor), rel=1e-6, abs=1e-9)
    assert slowed.first_token_at == normal.first_token_at


def test_slowdowns_after_the_end_or_in_any_order_are_the_same_run() -> None:
    trace = scale_rate(head(load_trace(AZURE), 30.0), 2.0)
    plain = simulate(trace, Guard(guard_config()), premium_share=0.2)
    late = simulate(trace, Guard(guard_config()), premium_share=0.2, slowdowns=((1e6, 5, 3),))
    assert late == plain
    windows = ((20.0, 5.0, 2.0), (5.0, 10.0, 4.0), (15.0, 5.0, 0.5))
    shuffled = simulate(trace, Guard(guard_config()), premium_share=0.2, slowdowns=windows)
    ordered = simulate(
        trace, Guard(guard_config()), premium_share=0.2, slowdowns=tuple(sorted(windows))
    )
    assert shuffled == ordered
    assert shuffled != plain


def test_an_eightfold_slowdown_costs_goodput_and_speed() -> None:
    trace = overload_trace()
    plain = overloaded("static:32").summary["all"]
    slowed = simulate(trace, Static(32), premium_share=0.2, slowdowns=((20.0, 30.0, 8.0),))
    row = slowed.summary["all"]
    assert row.goodput_per_s < plain.goodput_per_s
    assert plain.user_tps_p5 is not None
    assert row.user_tps_p5 is not None
    assert row.user_tps_p5 < plain.user_tps_p5


@pytest.mark.parametrize(
    ("slowdowns", "message"),
    [
        (((-1.0, 5.0, 2.0),), "start"),
        (((math.nan, 5.0, 2.0),), "start"),
        (((0.0, 0.0, 2.0),), "duration"),
        (((0.0, math.inf, 2.0),), "duration"),
        (((0.0, 5.0, 0.0),), "factor"),
        (((0.0, 5.0, -2.0),), "factor"),
        (((0.0, 5.0, math.inf),), "factor"),
        (((0.0, 5.0),), "at_s, duration_s, factor"),
        ((("x", 5.0, 2.0),), "at_s, duration_s, factor"),
        (((0.0, 10.0, 2.0), (9.0, 5.0, 3.0)), "overlap"),
    ],
)
def test_bad_slowdowns_are_refused(slowdowns: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_slowdowns(slowdowns)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        simulate(decode_only(5), NoPolicy(), slowdowns=slowdowns)  # type: ignore[arg-type]


def test_slowdown_windows_may_touch() -> None:
    assert validate_slowdowns([(10, 5, 2), (0, 10, 3)]) == ((0.0, 10.0, 3.0), (10.0, 5.0, 2.0))
    assert validate_slowdowns(()) == ()


# -- what the guard is polled with --------------------------------------------------------------


def test_the_polled_sample_carries_prompt_tokens_and_inter_token_latency() -> None:
    engine = Engine(PROFILES[DEFAULT_PROFILE])
    for i in range(3):
        engine.submit(SimRequest(request_id=i, prompt_tokens=300, max_output_tokens=40), at=0.0)
    engine.advance(0.3)
    m = engine.metrics()
    sample = _backend_sample(m)
    assert sample.prompt_tokens == 900.0 == m.prompt_tokens_total
    assert sample.generation_tokens == float(m.generation_tokens_total)
    itl = sample.inter_token_latency
    assert itl is not None
    assert itl.count == m.itl_count == m.generation_tokens_total - 3 > 0
    assert itl.sum == m.itl_sum
    assert [bound for bound, _ in itl.finite_buckets] == list(ITL_BUCKETS)
    assert itl.buckets[-1] == (math.inf, float(m.itl_count))
    assert sample.ttft is not None
    assert [bound for bound, _ in sample.ttft.finite_buckets] == list(TTFT_BUCKETS)
    assert sample.ttft.count == 3
