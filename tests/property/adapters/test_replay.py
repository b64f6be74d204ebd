"""Replay of the example recording: exact reproduction, and a visible what-if."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard_adapters.recording import (
    Decision,
    Header,
    Record,
    RecordingError,
    Scrape,
    ScrapeFailed,
    open_for_reading,
    read_records,
)
from guard_adapters.replay import replay, summarise
from guard_core import GuardConfig, LimitReason, PolicyConfig

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
