"""``guard_adapters.status_line``: the start-up line and ``pig_status`` (spec 10.3).

States are built by driving ``guard_core`` with real events (polls with backend samples,
first tokens, admissions), never by hand. Checks:

* the start-up line for default settings, word for word, and its Go durations;
* ``pig_status`` before the first poll, after healthy polls, with backend waiting, with yellow
  and red reasons, with TTFT fields, after a round where every backend failed, in static mode,
  with two backends (``backend_detail``) and with one (no detail);
* the tier part uses the published cap; ``reject=`` is the core's dynamic reject count;
* Hypothesis: for arbitrary backend samples, the line matches PIG's field layout and number
  formats exactly, and every Go duration parses back to the nanoseconds it came from.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.config import Settings, load_config
from guard_adapters.status_line import (
    BackendDetail,
    RuntimeCounts,
    current_snapshot,
    go_duration,
    startup_line,
    status_line,
)
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    BackendSample,
    Finished,
    FirstToken,
    Forwarded,
    GuardState,
    MetricsPolled,
    Queued,
    Rejected,
    Retried,
    Tier,
    apply_guard_event,
)
from tests.core_steps import attempt, with_first_tokens

METRICS_URL = "http://vllm:8000/metrics"
TWO_BACKENDS = "a=http://a:8000|http://a:8000/metrics,b=http://b:8000|http://b:8000/metrics"


def settings(**env: str) -> Settings:
    return load_config({"DYNAMIC_METRICS_URL": METRICS_URL, **env})


def initial(config: Settings) -> GuardState:
    return GuardState.initial(config.guard_config(), at=0.0)


def polled(state: GuardState, at: float, **samples: BackendSample | None) -> GuardState:
    """``state`` after one poll round; each keyword is a backend name and its sample."""
    polls = tuple(
        BackendPoll(name=name, sample=sample, error="" if sample is not None else "timed out")
        for name, sample in samples.items()
    )
    return apply_guard_event(state, MetricsPolled(at, polls)).state


def sample(
    running: int = 8,
    waiting: int = 0,
    kv: float = 0.1,
    tokens: float = 0.0,
    preemptions: float = 0.0,
) -> BackendSample:
    return BackendSample(
        running=running,
        waiting=waiting,
        kv_usage=kv,
        generation_tokens=tokens,
        preemptions=preemptions,
    )


def line(state: GuardState, names: tuple[str, ...] = ("backend1",), **kwargs: object) -> str:
    unavailable = kwargs.pop("backend_unavailable_total", 0)
    assert isinstance(unavailable, int)
    counts = kwargs.pop("counts", None)
    assert counts is None or isinstance(counts, RuntimeCounts)
    return status_line(
        state,
        version="v9",
        backend_names=names,
        backend_unavailable_total=unavailable,
        counts=counts,
    )


def fields(text: str) -> dict[str, str]:
    """Every ``key=value`` of the line (values stop at a space or a closing brace)."""
    return dict(re.findall(r"(\w+)=([^\s{}]*)", text))


def healthy_state(config: Settings | None = None) -> GuardState:
    """Two polls 1 s apart: 8 running, 400 tok/s, KV 0.12345, 2 earlier preemptions."""
    state = initial(config or settings())
    state = polled(state, 1.0, backend1=sample(tokens=1000, kv=0.12345, preemptions=2))
    return polled(state, 2.0, backend1=sample(tokens=1400, kv=0.12345, preemptions=2))


# -- start-up line -----------------------------------------------------------------------------


def test_startup_line_for_default_settings() -> None:
    assert startup_line(load_config({}), version="PIG-v0.8.12") == (
        "inference-guard PIG-v0.8.12 listen=:8000 upstream=http://backend:8000 backends=1"
        " dynamic=false/false metrics=0 queue=500ms poll=100ms status_log=5s"
        " target_tps=20.0/25.0 capacity_learning=cap learn=false ttft=false"
        " upstream_error_classification=true sse_keepalive=false sse_early_bridge=false"
        " global_cap=512"
    )


def test_startup_line_with_dynamic_mode_and_other_values() -> None:
    config = settings(
        UPSTREAM="http://user:secret@vllm:8000/",
        PIG_QUEUE_WAIT_SECONDS="1.5",
        PIG_QUEUE_POLL_MS="250",
        PIG_STATUS_LOG_INTERVAL_SECONDS="90",
        DYNAMIC_SINGLE_USER_TPS_YELLOW="30",
        DYNAMIC_SINGLE_USER_TPS_RED="12.25",
        DYNAMIC_PIG_ENFORCE="false",
        GLOBAL_LIMIT="64",
    )
    text = startup_line(config, version="1.2.3", program="phala-inference-guard")
    assert text.startswith("phala-inference-guard 1.2.3 listen=:8000 ")
    assert "secret" not in text
    got = fields(text)
    assert got["upstream"] == "http://user:<redacted>@vllm:8000"
    assert got["dynamic"] == "true/false"
    assert got["metrics"] == "1"
    assert (got["queue"], got["poll"], got["status_log"]) == ("1.5s", "250ms", "1m30s")
    assert got["target_tps"] == "12.2/30.0"  # %.1f rounds half to even, as Go does
    assert (got["learn"], got["ttft"], got["global_cap"]) == ("true", "true", "64")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.5, "500ms"),
        (0.1, "100ms"),
        (0.25, "250ms"),
        (5, "5s"),
        (1.5, "1.5s"),
        (60, "1m0s"),
        (90, "1m30s"),
        (3600, "1h0m0s"),
        (3725.25, "1h2m5.25s"),
        (0.0000015, "1.5µs"),
        (0.000000001, "1ns"),
        (-2, "-2s"),
    ],
)
def test_go_duration(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


_UNITS = {"h": 3600 * 10**9, "m": 60 * 10**9, "s": 10**9, "ms": 10**6, "µs": 10**3, "ns": 1}


def _parse_go_duration(text: str) -> int:
    """Nanoseconds of a Go duration string, by exact decimal arithmetic."""
    sign = -1 if text.startswith("-") else 1
    total = 0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|µs|ns|m|s)", text.lstrip("-")):
        whole, _, fraction = number.partition(".")
        scale = _UNITS[unit]
        total += int(whole) * scale + (
            int(fraction) * scale // 10 ** len(fraction) if fraction else 0
        )
    return sign * total


@given(st.integers(min_value=-(10**14), max_value=10**14))
def test_go_duration_parses_back(nanos: int) -> None:
    text = go_duration(nanos / 1e9)
    assert re.fullmatch(r"-?(\d+h)?(\d+m)?\d+(\.\d+)?(h|m|s|ms|µs|ns)", text)
    assert _parse_go_duration(text) == round(nanos / 1e9 * 1e9)


# -- pig_status --------------------------------------------------------------------------------


def test_status_before_the_first_poll() -> None:
    assert line(initial(settings())) == (
        "pig_status v=v9 backend={state=yellow:backend_unavailable backend=0/0 running=0"
        " waiting=0 prefill=0 decode=0 kv=0.000 gen_tps=na user_tps=na preempt=0}"
        " pig={limit=0 winner=backend_unavailable state_limit=0 throughput=0 estimate=/0"
        " projected=0 admit=0 cap=0 learned=0 target=0 target_reason=unknown ttft_limit=0"
        " ttft_learned=0 ttft_target=0 pressure=0/unknown/unknown"
        " prefill_limit=0/unknown/unknown avail=0 queue=0 reject=0 reject_delta=0 demand=0"
        " tier_demand=0 tier_reject_delta=0/0 backend_unavailable=0 tier_basic=0/0"
        " tier_premium=0/0 tier_waiting=0/0 learn=/unknown ttft_learn=/unknown/unknown}"
    )


def test_status_after_a_healthy_poll() -> None:
    text = line(healthy_state())
    assert text.startswith("pig_status v=v9 backend={state=green backend=1/1 running=8 ")
    got = fields(text)
    assert got["kv"] == "0.123"
    assert (got["gen_tps"], got["user_tps"]) == ("400.0", "50.0")
    assert (got["prefill"], got["decode"], got["preempt"]) == ("0", "8", "2")
    assert (got["limit"], got["admit"], got["winner"]) == ("50", "50", "throughput")
    assert (got["state_limit"], got["throughput"], got["cap"]) == ("512", "50", "50")
    assert got["estimate"] == "sparse/6"
    assert got["learn"] == "converged/at_or_above_target"
    assert got["tier_basic"] == "0/49"
    assert got["tier_premium"] == "0/1"
    assert "ttft_p95" not in got
    assert "prefill_transition" not in got
    assert "backend_detail" not in got


def test_under_the_predictive_learner_the_status_keeps_pigs_detail() -> None:
    """The gate holds PIG's decision with the predictive cap and reason: the line still shows
    the learner's figures, and the cap and winner it is actually held to."""
    state = healthy_state(settings(DYNAMIC_POLICY="predictive"))
    assert current_snapshot(state) is state.learner.last
    decision = state.gate.decision
    assert decision.final_reason == "predicted_speed"
    got = fields(line(state))
    assert (got["limit"], got["winner"]) == (str(decision.cap), "predicted_speed")
    assert (got["gen_tps"], got["decode"]) == ("400.0", "8")
    assert got["learn"] == "converged/at_or_above_target"


def test_rates_are_na_until_a_rate_exists() -> None:
    state = polled(initial(settings()), 1.0, backend1=sample(tokens=1000))
    assert "gen_tps=na user_tps=na " in line(state)


def test_status_with_backend_waiting_closes_intake() -> None:
    state = polled(healthy_state(), 3.0, backend1=sample(waiting=3, tokens=1800))
    got = fields(line(state))
    assert got["state"] == "red:waiting,scheduler_pressure_capacity"
    assert (got["waiting"], got["limit"], got["admit"]) == ("3", "0", "0")
    assert got["winner"] == "backend_waiting"
    assert got["pressure"].startswith("0/waiting_pressure/")
    assert got["tier_basic"] == "0/0"


def test_yellow_reasons_are_listed_when_there_is_no_red_reason() -> None:
    state = polled(healthy_state(), 3.0, backend1=sample(kv=0.75, tokens=1800))
    got = fields(line(state))
    assert got["state"] == "yellow:kv_cache,scheduler_pressure_capacity"
    assert got["kv"] == "0.750"
    assert got["pressure"] == f"{got['limit']}/healthy_kv_headroom/unknown"


def test_red_reasons_replace_yellow_ones() -> None:
    # KV at 0.75 is yellow, a new preemption is red: only the red reasons are printed.
    state = polled(healthy_state(), 3.0, backend1=sample(kv=0.75, tokens=1800, preemptions=3))
    got = fields(line(state))
    assert got["state"].startswith("red:")
    assert "preemptions" in got["state"]
    assert "kv_cache" not in got["state"]
    assert got["preempt"] == "3"


def test_ttft_fields_with_semantic_samples() -> None:
    state = healthy_state()
    for request_id in (1, 2, 3):  # three streams, each 0.3 s from arrival to first token
        for event in (
            Arrived(at=2.2, request_id=request_id, tier=Tier.BASIC),
            Forwarded(at=2.2, request_id=request_id),
            FirstToken(at=2.5, request_id=request_id, seconds=0.3),
            Finished(at=2.6, request_id=request_id, status=200),
        ):
            state = apply_guard_event(state, event).state
    assert not state.requests
    state = polled(state, 3.0, backend1=sample(tokens=1800))
    text = line(state)
    assert " ttft_p95=0.50 ttft_p99=0.50 ttft_src=semantic preempt=0}" in text
    assert fields(text)["ttft_learn"] == "ttft_healthy/healthy/unknown"


def test_ttft_source_is_not_printed_when_ttft_is_off() -> None:
    state = healthy_state(settings(DYNAMIC_TTFT_ENABLED="false"))
    text = line(state)
    assert "ttft_src" not in text
    assert "ttft_p95" not in text
    assert fields(text)["ttft_learn"] == "disabled/unknown/unknown"


def test_status_after_every_backend_failed() -> None:
    state = polled(healthy_state(), 3.0, backend1=None)
    text = line(state, backend_unavailable_total=4)
    got = fields(text)
    assert got["state"] == "yellow:backend_unavailable"
    assert (got["backend"], got["running"], got["limit"]) == ("0/1", "0", "0")
    assert got["winner"] == "backend_unavailable"
    assert got["backend_unavailable"] == "4"
    assert got["learn"] == "/unknown"


def test_status_in_static_mode() -> None:
    got = fields(line(initial(load_config({}))))
    assert got["state"] == "disabled"
    assert (got["limit"], got["winner"]) == ("512", "disabled")
    assert (got["tier_basic"], got["tier_premium"]) == ("0/511", "0/1")


def test_tier_part_uses_the_published_cap_and_live_counts() -> None:
    state = healthy_state()  # cap 50
    for tier in (Tier.PREMIUM, Tier.BASIC, Tier.BASIC):
        step = attempt(state, 2.5, tier)
        assert isinstance(step.outcome, Admitted)
        state = step.state
    got = fields(line(state))
    # premium 1 in flight: basic may hold 50 - 2, premium keeps 2.
    assert got["tier_basic"] == "2/48"
    assert got["tier_premium"] == "1/2"
    assert got["tier_waiting"] == "0/0"
    assert got["queue"] == "0"


def test_reject_counts_come_from_the_core() -> None:
    state = polled(healthy_state(), 3.0, backend1=sample(waiting=1, tokens=1800))
    step = attempt(state, 3.1, Tier.BASIC)
    queued = step.outcome
    assert isinstance(queued, Queued)  # intake is closed, so the request waits briefly
    assert fields(line(step.state))["tier_waiting"] == "1/0"
    (request_id,) = step.state.requests
    step = apply_guard_event(step.state, Retried(at=queued.deadline, request_id=request_id))
    assert isinstance(step.outcome, Rejected)
    got = fields(line(step.state, counts=RuntimeCounts(tier_reject_delta=(1, 0))))
    assert got["reject"] == "1"
    assert got["tier_reject_delta"] == "1/0"
    assert got["tier_waiting"] == "0/0"


def test_backend_detail_with_two_backends() -> None:
    config = load_config({"BACKENDS": TWO_BACKENDS})
    state = initial(config)
    state = polled(state, 1.0, a=sample(running=5, waiting=0, tokens=10), b=None)
    counts = RuntimeCounts(
        backends={
            "a": BackendDetail(inflight=4, ttft_valid=True, ttft_p95=0.5, ttft_p99=2.0),
            "b": BackendDetail(inflight=1),
        }
    )
    text = line(state, ("a", "b"), counts=counts)
    assert text.endswith(" backend_detail={a:5r/0w/4i/ttft0.50/ttft992.00;b:0r/0w/1i/err}")
    assert fields(text)["backend"] == "1/2"


def test_no_backend_detail_with_one_backend() -> None:
    assert "backend_detail" not in line(healthy_state(), ("backend1",))


_NUMBER = r"\d+"
_STATUS_LINE = re.compile(
    r"pig_status v=v9 backend=\{state=(green|yellow|red)(:[a-z0-9_]+(,[a-z0-9_]+)*)?"
    rf" backend={_NUMBER}/{_NUMBER} running={_NUMBER} waiting={_NUMBER}"
    rf" prefill={_NUMBER} decode={_NUMBER}( prefill_transition=1)?( prefill_settling=1)?"
    r" kv=\d+\.\d{3} (gen_tps=na user_tps=na|gen_tps=\d+\.\d user_tps=\d+\.\d)"
    r"( ttft_p95=\d+\.\d\d)?( ttft_p99=\d+\.\d\d)?( ttft_src=(semantic|backend))?"
    rf" preempt={_NUMBER}\}} pig=\{{limit={_NUMBER} winner=[a-z0-9_]+ state_limit={_NUMBER}"
    rf" throughput={_NUMBER} estimate=[a-z]*/{_NUMBER} projected={_NUMBER} admit={_NUMBER}"
    rf" cap={_NUMBER} learned={_NUMBER} target={_NUMBER} target_reason=[a-z0-9_]+"
    rf" ttft_limit={_NUMBER} ttft_learned={_NUMBER} ttft_target={_NUMBER}"
    rf" pressure={_NUMBER}/[a-z0-9_]+/[a-z0-9_]+ prefill_limit={_NUMBER}/[a-z0-9_]+/[a-z0-9_]+"
    rf" avail={_NUMBER} queue={_NUMBER} reject={_NUMBER} reject_delta={_NUMBER}"
    rf" demand=[01] tier_demand=[01] tier_reject_delta={_NUMBER}/{_NUMBER}"
    rf" backend_unavailable={_NUMBER} tier_basic={_NUMBER}/{_NUMBER}"
    rf" tier_premium={_NUMBER}/{_NUMBER} tier_waiting={_NUMBER}/{_NUMBER}"
    r" learn=[a-z0-9_]*/[a-z0-9_]+ ttft_learn=[a-z0-9_]*/[a-z0-9_]+/[a-z0-9_]+\}"
)

_samples = st.builds(
    sample,
    running=st.integers(0, 200),
    waiting=st.integers(0, 5),
    kv=st.floats(0, 1),
    tokens=st.floats(0, 1e6),
    preemptions=st.integers(0, 10).map(float),
)


@given(st.lists(st.one_of(st.none(), _samples), min_size=1, max_size=4), st.data())
def test_status_line_layout_for_any_samples(
    rounds: list[BackendSample | None], data: st.DataObject
) -> None:
    state = initial(settings())
    at = 0.0
    for poll_sample in rounds:
        at += data.draw(st.floats(0.1, 5))
        for _ in range(data.draw(st.integers(0, 3))):
            state = with_first_tokens(state, data.draw(st.floats(0, 40)))
        state = polled(state, at, backend1=poll_sample)
    text = line(state)
    assert "\n" not in text
    assert "  " not in text
    assert _STATUS_LINE.fullmatch(text), text
