"""Replay of the example recording: exact reproduction, and a visible what-if; the predictive
learner's inputs, explanations and refusals through replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from guard_adapters.config import load_config
from guard_adapters.explain import explanation
from guard_adapters.recording import (
    Decision,
    Header,
    Record,
    RecordingError,
    Scrape,
    ScrapeFailed,
    decode_line,
    encode,
    open_for_reading,
    read_records,
)
from guard_adapters.replay import replay, summarise
from guard_core import (
    Arrived,
    Binding,
    DecisionSource,
    Finished,
    FirstToken,
    Forwarded,
    GuardConfig,
    LimitReason,
    PolicyConfig,
    Refused,
    Tier,
)

EXAMPLE = Path(__file__).parents[2] / "fixtures/recordings/example-vllm-overload.jsonl.gz"


def load() -> list[Record]:
    with open_for_reading(EXAMPLE) as stream:
        items = list(read_records(stream, strict=True))
    assert isinstance(items[0], Header)
    return [item for item in items if not isinstance(item, Header | RecordingError)]


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return load()


def test_replay_with_recorded_settings_reproduces_every_decision(records: list[Record]) -> None:
    result = replay(records, GuardConfig())
    recorded = [r for r in records if isinstance(r, Decision)]
    assert len(result.polls) == len(recorded) == 150
    assert all(poll.recorded is not None for poll in result.polls)
    assert [poll.differs for poll in result.polls].count(True) == 0
    assert (result.admitted, result.rejected) == (
        result.recorded_forwarded,
        result.recorded_rejected,
    )
    summary = summarise(result)
    assert summary["differing_polls"] == 0
    assert sum(summary["time_in_state_s"].values()) == pytest.approx(150.0)


def test_the_example_exercises_the_interesting_paths(records: list[Record]) -> None:
    reasons = {poll.decision.final_reason for poll in replay(records, GuardConfig()).polls}
    assert {
        LimitReason.THROUGHPUT,
        LimitReason.TTFT,
        LimitReason.PRESSURE,
        LimitReason.BACKEND_WAITING,
    } <= reasons


def test_a_lower_ttft_target_changes_the_decisions(records: list[Record]) -> None:
    strict = GuardConfig(policy=PolicyConfig(ttft_target_s=0.5))
    result = replay(records, strict)
    differing = [poll for poll in result.polls if poll.differs]
    assert differing
    baseline = summarise(replay(records, GuardConfig()))
    assert summarise(result)["final_reasons"]["ttft"] > baseline["final_reasons"]["ttft"]


def test_replay_is_deterministic(records: list[Record]) -> None:
    first = replay(records, GuardConfig())
    second = replay(records, GuardConfig())
    assert first == second


def test_a_scrape_that_no_longer_parses_counts_as_failed(records: list[Record]) -> None:
    broken = [
        Scrape(
            at=r.at,
            poll=r.poll,
            backend=r.backend,
            flavour=r.flavour,
            text="vllm:num_requests_running{ 1\n",
        )
        if isinstance(r, Scrape) and r.poll == 3
        else r
        for r in records
    ]
    result = replay(broken, GuardConfig())
    assert result.unparsable_scrapes == 1
    poll = result.polls[3]
    assert (poll.decision.cap, poll.decision.final_reason) == (0, LimitReason.BACKEND_UNAVAILABLE)
    assert poll.differs


def test_scrapes_only_still_give_one_decision_per_poll(records: list[Record]) -> None:
    scrapes = [r for r in records if isinstance(r, Scrape | ScrapeFailed)]
    result = replay(scrapes, GuardConfig())
    assert len(result.polls) == 150
    assert result.admitted == result.rejected == 0
    assert all(poll.recorded is None for poll in result.polls)


# -- the predictive learner --------------------------------------------------------------------


PREDICTIVE = load_config(
    {"DYNAMIC_METRICS_URL": "http://engine:8000/metrics", "DYNAMIC_POLICY": "predictive"}
).guard_config()


def page(*, running: int, generated: float, prompt: float) -> str:
    return (
        f'vllm:num_requests_running{{engine="0"}} {running}\n'
        'vllm:num_requests_waiting{engine="0"} 0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        f'vllm:generation_tokens_total{{engine="0"}} {generated}\n'
        f'vllm:prompt_tokens_total{{engine="0"}} {prompt}\n'
    )


def scrape(at: float, poll: int, **figures: Any) -> Scrape:
    return Scrape(at=at, poll=poll, backend="metrics1", flavour="vllm", text=page(**figures))


def test_replay_gives_the_learner_each_body_size_and_first_token_by_request() -> None:
    records: list[Record] = [
        scrape(1.0, 0, running=0, generated=0, prompt=0),
        Arrived(
            at=1.5, request_id=7, tier=Tier.BASIC, path="/v1/chat/completions", body_bytes=4000
        ),
        Forwarded(at=1.5, request_id=7),
    ]
    model = replay(records, PREDICTIVE).state.predictive  # type: ignore[union-attr]
    assert model is not None
    assert model.requests[7].body_bytes == 4000
    assert (model.pending_count, model.pending_tokens) == (1, 1000.0)  # 4 bytes per token
    records.append(FirstToken(at=2.0, request_id=7, seconds=0.5))
    model = replay(records, PREDICTIVE).state.predictive  # type: ignore[union-attr]
    assert model is not None
    assert (model.pending_count, model.decoders) == (0, 1)
    assert model.requests[7].first_at == 2.0
    # A first token for a request the replay never forwarded changes nothing.
    records.append(FirstToken(at=2.1, request_id=8, seconds=0.5))
    assert replay(records, PREDICTIVE).state.predictive == model  # type: ignore[union-attr]
    records.append(Finished(at=3.0, request_id=7, status=200))
    model = replay(records, PREDICTIVE).state.predictive  # type: ignore[union-attr]
    assert model is not None
    assert (model.decoders, dict(model.requests)) == (0, {})


def test_under_pigs_learner_there_is_no_explanation(records: list[Record]) -> None:
    result = replay(records, GuardConfig())
    assert all(poll.prediction is None for poll in result.polls)
    assert all("predicted" not in poll.as_json() for poll in result.polls)
    assert result.refusals_by_binding == {}
    assert "predictive" not in summarise(result)


def test_a_version_1_recording_replays_under_the_predictive_learner(
    records: list[Record],
) -> None:
    """The example (version 1, made with PIG's learner) has no explanations to compare with:
    each poll gets the replay's own, and none counts as differing for lack of one."""
    result = replay(records, PREDICTIVE)
    assert len(result.polls) == 150
    metrics = [p for p in result.polls if p.decision.source is DecisionSource.METRICS]
    assert metrics
    assert all(poll.prediction is not None for poll in metrics)
    assert not any(poll.explanation_differs for poll in result.polls)
    shown = result.polls[-1].as_json()["predicted"]
    assert set(shown) == {"cap", "user_tps", "ttft_s", "kv_usage", "binding", "fit"}
    summary = summarise(result)["predictive"]
    assert summary["polls"] == sum(p.prediction is not None for p in result.polls)
    assert sum(summary["cap_binding"].values()) == summary["polls"]
    assert sum(summary["refusals_by_binding"].values()) == result.rejected
    assert summary["final_fit"]["observations"] > 0
    assert replay(records, PREDICTIVE) == result


def as_recorded(records: list[Record], config: GuardConfig) -> list[Record]:
    """``records`` with each decision replaced by what a replay under ``config`` decided and
    explained, sent through the file format and back (as a live recording would hold it)."""
    polls = {poll.poll: poll for poll in replay(records, config).polls}
    rewritten: list[Record] = []
    for original in records:
        record = original
        if isinstance(original, Decision):
            poll = polls[original.poll]
            decision = poll.decision
            assert poll.prediction is not None
            record = Decision(
                at=original.at,
                poll=original.poll,
                cap=decision.cap,
                state=str(decision.state),
                reason=str(decision.final_reason),
                yellow=[str(r) for r in decision.yellow_reasons],
                red=[str(r) for r in decision.red_reasons],
                source=str(decision.source),
                predicted=explanation(poll.prediction),
            )
        decoded = decode_line(encode(record), line_no=1)
        assert not isinstance(decoded, Header)
        rewritten.append(decoded)
    return rewritten


def test_recorded_explanations_are_compared_exactly(records: list[Record]) -> None:
    recorded = as_recorded(records, PREDICTIVE)
    result = replay(recorded, PREDICTIVE)
    assert [poll for poll in result.polls if poll.differs] == []
    assert summarise(result)["predictive"]["differing_explanations"] == 0
    # One number of one explanation off by a hair: that poll, and only it, differs.
    target = next(r for r in recorded if isinstance(r, Decision) and r.poll == 40)
    assert target.predicted is not None
    nudged = attrs.evolve(
        target,
        predicted=attrs.evolve(
            target.predicted, fit_relative_error=target.predicted.fit_relative_error + 1e-12
        ),
    )
    changed = replay([nudged if r is target else r for r in recorded], PREDICTIVE)
    assert [poll.poll for poll in changed.polls if poll.differs] == [40]
    assert changed.polls[40].explanation_differs


def test_a_recorded_retry_after_the_replay_does_not_predict_is_an_outcome_difference(
    records: list[Record],
) -> None:
    baseline = replay(records, PREDICTIVE).differing_outcomes
    odd = [
        attrs.evolve(r, retry_after_s=999, binding=Binding.KV) if isinstance(r, Refused) else r
        for r in records
    ]
    result = replay(odd, PREDICTIVE)
    assert result.rejected > 0
    assert result.differing_outcomes > baseline
    # PIG's learner predicts no Retry-After at all: each refusal it shares with the recording
    # differs from it.
    assert replay(odd, GuardConfig()).differing_outcomes > 0
