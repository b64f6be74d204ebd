"""``guard_adapters.admin_stream``: the admin stream's messages (schema v1), from core values.

States are built by driving ``guard_core`` with real events (poll rounds with backend samples,
admissions, refusals, releases), never by hand. Checks:

* Hypothesis: after any mix of polls and requests, a decision message says exactly what the
  state holds (the cap in force, in flight and waiting per tier, each backend's figures in
  the published order, the per-user speed and TTFT window the learner saw), every number in
  it is finite, and it encodes to one line of strict JSON that reads back equal;
* the state document holds every field of the decision message with the same value, and
  under the predictive learner its predictions and fit;
* admission messages: the wait from the arrival, the reason only for a refusal;
* sampling is by request id alone, monotone in the share and keeps about that share;
* the query string: what is accepted, and that anything else is a SubscriptionError.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.admin_stream import (
    KINDS,
    SCHEMA_VERSION,
    Subscription,
    SubscriptionError,
    TierCounts,
    admission_message,
    decision_message,
    encode,
    hello_message,
    keeps_admission,
    parse_subscription,
    state_document,
)
from guard_adapters.config import load_config
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    BackendSample,
    Finished,
    Forwarded,
    GuardState,
    MetricsPolled,
    RejectCode,
    Tier,
    apply_guard_event,
)
from guard_core.gate import current_limit
from tests.core_steps import attempt

METRICS = "http://engine:8000/metrics"
TWO = "a=http://a:8000|http://a:8000/metrics,b=http://b:8000|http://b:8000/metrics"


def initial(**env: str) -> GuardState:
    settings = load_config({"DYNAMIC_METRICS_URL": METRICS, **env})
    return GuardState.initial(settings.guard_config(), at=0.0)


samples = st.builds(
    BackendSample,
    running=st.integers(0, 300),
    waiting=st.integers(0, 50),
    kv_usage=st.floats(0.0, 1.0),
    generation_tokens=st.floats(0.0, 1e7),
    preemptions=st.just(0.0),
)

#: One step of a run: a poll (a sample per backend, None for a failed one), or a request of a
#: tier that is admitted and held, or finished at once.
steps = st.one_of(
    st.tuples(st.just("poll"), st.lists(st.one_of(st.none(), samples), min_size=2, max_size=2)),
    st.tuples(st.just("hold"), st.sampled_from(Tier)),
    st.tuples(st.just("release"), st.sampled_from(Tier)),
)


def run(state: GuardState, plan: list[Any]) -> GuardState:
    """Apply ``plan`` one second per step; tokens grow so that rates are meaningful."""
    tokens = 0.0
    for number, (kind, value) in enumerate(plan, start=1):
        at = float(number)
        if kind == "poll":
            polls = []
            for name, drawn in zip(("a", "b"), value, strict=True):
                sample = None
                if drawn is not None:
                    tokens += drawn.generation_tokens or 0.0
                    sample = BackendSample(
                        running=drawn.running,
                        waiting=drawn.waiting,
                        kv_usage=drawn.kv_usage,
                        generation_tokens=tokens,
                        preemptions=0.0,
                    )
                error = "" if sample is not None else "timed out"
                polls.append(BackendPoll(name=name, sample=sample, error=error))
            state = apply_guard_event(state, MetricsPolled(at, tuple(polls))).state
            continue
        step = attempt(state, at, value)
        state = step.state
        request_id = max(state.requests, default=0)
        if isinstance(step.outcome, Admitted):
            state = apply_guard_event(state, Forwarded(at=at, request_id=request_id)).state
            if kind == "release":
                state = apply_guard_event(state, Finished(at=at, request_id=request_id)).state
    return state


def numbers(value: object) -> list[float]:
    """Every number in a JSON value."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


counts = st.builds(TierCounts, st.integers(0, 10**9), st.integers(0, 10**9))


@given(st.lists(steps, max_size=12), counts, counts, st.floats(0, 1e6))
def test_a_decision_message_says_what_the_state_holds(
    plan: list[Any], admitted: TierCounts, refused: TierCounts, at: float
) -> None:
    state = run(initial(BACKENDS=TWO), plan)
    message = decision_message(state, at=at, admitted=admitted, refused=refused)
    gate, published = state.gate, state.published
    assert (message["v"], message["type"], message["at"]) == (SCHEMA_VERSION, "decision", at)
    assert message["cap"] == current_limit(gate)[0]
    assert message["state"] == str(published.decision.state)
    assert message["in_flight"] == gate.premium_inflight + gate.basic_inflight
    assert message["waiting"] == {"basic": gate.basic_waiting, "premium": gate.premium_waiting}
    assert message["admitted"] == {"basic": admitted.basic, "premium": admitted.premium}
    assert message["refused"] == {"basic": refused.basic, "premium": refused.premium}
    reasons = [*published.decision.red_reasons, *published.decision.yellow_reasons]
    assert message["reasons"] == [str(r) for r in reasons]
    assert [b["name"] for b in message["backends"]] == [f.name for f in published.backends]
    for shown, figures in zip(message["backends"], published.backends, strict=True):
        assert (shown["failed"], shown["running"], shown["waiting"]) == (
            figures.failed,
            figures.running,
            figures.waiting,
        )
        assert shown["kv_usage"] == figures.kv_usage
    snapshot = published.snapshot
    observed = None
    if snapshot is not None:
        signals = snapshot.signals
        observed = signals.user_tps
        if observed is None and signals.generation_tps is not None and signals.running > 0:
            observed = signals.generation_tps / signals.running
    assert message["tps"] == {"observed": observed, "predicted": None}  # PIG's learner
    assert message["ttft_s"]["predicted"] is None
    assert all(math.isfinite(n) for n in numbers(message))
    text = encode(message)
    assert "\n" not in text
    assert json.loads(text) == message


def test_a_decision_after_healthy_polls_carries_the_backends_and_speeds() -> None:
    plan: list[Any] = [
        *(("poll", [BackendSample(running=4, waiting=0, kv_usage=0.25, generation_tokens=400.0,
                                  preemptions=0.0)] * 2),) * 3,
        ("hold", Tier.PREMIUM),
    ]  # fmt: skip
    state = run(initial(BACKENDS=TWO), plan)
    message = decision_message(state, at=3.5, admitted=TierCounts(0, 1), refused=TierCounts())
    assert message["source"] == "metrics"
    assert message["in_flight"] == 1
    assert message["running"] == 8  # the two backends' running summed at the poll
    assert [b["running"] for b in message["backends"]] == [4, 4]
    assert [b["kv_usage"] for b in message["backends"]] == [0.25, 0.25]
    assert all(b["generation_tps"] is not None for b in message["backends"])
    assert message["tps"]["observed"] is not None


def test_the_state_document_holds_the_decision_and_more() -> None:
    state = run(initial(GLOBAL_LIMIT="4", DYNAMIC_PIG_ENABLED="false"), [("hold", Tier.BASIC)])
    assert state.gate.inflight == 1
    admitted, refused = TierCounts(3, 1), TierCounts(5, 0)
    decision = decision_message(state, at=7.0, admitted=admitted, refused=refused)
    document = state_document(
        state, at=7.0, version="9.9", policy="pig", admitted=admitted, refused=refused, viewers=2
    )
    assert document["type"] == "state"
    for key, value in decision.items():
        if key != "type":
            assert document[key] == value, key
    assert (document["version"], document["policy"], document["viewers"]) == ("9.9", "pig", 2)
    assert document["predictive"] is None
    assert document["decision_at"] == state.published.decision.at
    assert json.loads(encode(document)) == document


def test_under_the_predictive_learner_the_predictions_are_shown() -> None:
    state = initial(DYNAMIC_POLICY="predictive")
    tokens = 0.0
    for second in range(1, 6):
        tokens += 500.0
        sample = BackendSample(
            running=6, waiting=0, kv_usage=0.2, generation_tokens=tokens, preemptions=0.0
        )
        polls = (BackendPoll(name="metrics1", sample=sample),)
        state = apply_guard_event(state, MetricsPolled(float(second), polls)).state
    assert state.predictive is not None
    predicted = state.predictive.last_cap
    message = decision_message(state, at=5.0, admitted=TierCounts(), refused=TierCounts())
    document = state_document(
        state,
        at=5.0,
        version="v",
        policy="predictive",
        admitted=TierCounts(),
        refused=TierCounts(),
        viewers=0,
    )
    assert predicted is not None  # five good polls: the learner has set a cap
    assert message["tps"]["predicted"] == predicted.user_tps
    assert message["ttft_s"]["predicted"] == predicted.ttft_s
    assert document["predictive"]["cap"]["cap"] == predicted.cap
    assert document["predictive"]["cap"]["binding"] == str(predicted.binding)
    assert document["predictive"]["cap"]["fit"]["observations"] == predicted.fit.observations
    assert all(math.isfinite(n) for n in numbers(document))


def test_the_hello_names_the_guard_and_the_kinds() -> None:
    hello = hello_message(version="1.2", policy="pig", backends=("a", "b"), kinds=("decision",))
    assert hello == {
        "v": 1,
        "type": "hello",
        "version": "1.2",
        "policy": "pig",
        "backends": ["a", "b"],
        "kinds": ["decision"],
    }


# -- admissions --------------------------------------------------------------------------------


@given(
    st.integers(1, 2**40),
    st.sampled_from(Tier),
    st.floats(0, 1e6),
    st.floats(0, 100),
    st.sampled_from(("admitted", "refused", "abandoned")),
    st.one_of(st.none(), st.sampled_from(RejectCode)),
)
def test_an_admission_message_reports_the_outcome_and_the_wait(
    request_id: int,
    tier: Tier,
    arrived_at: float,
    waited: float,
    outcome: str,
    code: RejectCode | None,
) -> None:
    arrived = Arrived(at=arrived_at, request_id=request_id, tier=tier)
    message = admission_message(arrived, at=arrived_at + waited, outcome=outcome, code=code)
    assert (message["v"], message["type"], message["outcome"]) == (1, "admission", outcome)
    assert message["id"] == str(request_id)
    assert message["tier"] == str(tier)
    assert message["waited_s"] == pytest.approx(waited, abs=1e-6 * max(1.0, arrived_at))
    assert message["waited_s"] >= 0
    expected_reason = str(code) if outcome == "refused" and code is not None else None
    assert message["reason"] == expected_reason
    assert message["predicted_tps"] is None
    assert json.loads(encode(message)) == message


def test_an_unknown_outcome_is_a_caller_bug() -> None:
    arrived = Arrived(at=0.0, request_id=1, tier=Tier.BASIC)
    with pytest.raises(ValueError, match="unknown outcome"):
        admission_message(arrived, at=1.0, outcome="maybe")


@given(st.lists(st.text(max_size=12), max_size=30), st.floats(0, 1), st.floats(0, 1))
def test_sampling_is_by_id_alone_and_monotone_in_the_share(
    ids: list[str], low: float, high: float
) -> None:
    low, high = min(low, high), max(low, high)
    for request_id in ids:
        assert keeps_admission(request_id, low) == keeps_admission(request_id, low)
        if keeps_admission(request_id, low):
            assert keeps_admission(request_id, high)
        assert keeps_admission(request_id, 1.0)
        assert not keeps_admission(request_id, 0.0)


@pytest.mark.parametrize("share", [0.05, 0.1, 0.5, 0.9])
def test_sampling_keeps_about_the_share(share: float) -> None:
    kept = sum(keeps_admission(str(n), share) for n in range(1, 20_001))
    assert abs(kept / 20_000 - share) < 0.02


# -- the query string --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "kinds", "sample"),
    [
        ("", KINDS, 1.0),
        ("kinds=decision", ("decision",), 1.0),
        ("kinds=admission", ("admission",), 1.0),
        ("kinds=admission,decision", KINDS, 1.0),
        ("kinds=decision,admission&sample=0.1", KINDS, 0.1),
        ("sample=0", KINDS, 0.0),
        ("sample=1", KINDS, 1.0),
        ("sample=.25&kinds=admission", ("admission",), 0.25),
    ],
)
def test_subscriptions_that_are_accepted(query: str, kinds: tuple[str, ...], sample: float) -> None:
    assert parse_subscription(query) == Subscription(kinds, sample)


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("kinds=everything", "unknown kind"),
        ("kinds=", "names no kind"),
        ("kinds=,", "names no kind"),
        ("sample=1.5", "between 0 and 1"),
        ("sample=-0.1", "between 0 and 1"),
        ("sample=nan", "between 0 and 1"),
        ("sample=1e-1", "between 0 and 1"),
        ("sample=0.1&sample=0.2", "given twice"),
        ("token=abc", "unknown parameter"),
        ("kinds", "malformed"),
    ],
)
def test_subscriptions_that_are_refused(query: str, problem: str) -> None:
    with pytest.raises(SubscriptionError, match=problem):
        parse_subscription(query)


@given(st.sets(st.sampled_from(KINDS), min_size=1), st.floats(0, 1))
def test_any_subset_and_share_reads_back(kinds: set[str], share: float) -> None:
    query = f"kinds={','.join(sorted(kinds))}&sample={share:.6f}"
    subscription = parse_subscription(query)
    assert set(subscription.kinds) == kinds
    assert subscription.sample == pytest.approx(share, abs=1e-6)


@given(st.text(max_size=60))
def test_any_query_is_a_subscription_or_a_subscription_error(query: str) -> None:
    try:
        subscription = parse_subscription(query)
    except SubscriptionError:
        return
    assert set(subscription.kinds) <= set(KINDS)
    assert subscription.kinds
    assert 0.0 <= subscription.sample <= 1.0
