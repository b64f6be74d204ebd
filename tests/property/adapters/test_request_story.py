"""``replay --explain``: the rule behind a refusal in the example recording, recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard_adapters.config import load_config
from guard_adapters.recording import Header, open_for_reading, read_records
from guard_adapters.request_story import explain_request, render_story
from guard_core import Forwarded, Refused, RejectCode

EXAMPLE = Path(__file__).parents[2] / "fixtures/recordings/example-vllm-overload.jsonl.gz"


@pytest.fixture(scope="module")
def example() -> tuple[Header, list[object]]:
    with open_for_reading(EXAMPLE) as stream:
        items = list(read_records(stream, strict=True))
    header = items[0]
    assert isinstance(header, Header)
    return header, list(items[1:])


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (RejectCode.GLOBAL_DYNAMIC_LIMIT, "had reached the learned cap of"),
        (RejectCode.TIER_BASIC_LIMIT, "slots not reserved for premium"),
        (RejectCode.TIER_PRIORITY, "premium request(s) waited"),
    ],
)
def test_each_kind_of_recorded_refusal_is_explained_by_its_rule(
    example: tuple[Header, list[object]], code: RejectCode, words: str
) -> None:
    header, records = example
    config = load_config(header.config).guard_config()
    refused = next(r for r in records if isinstance(r, Refused) and r.code is code)
    story = explain_request(records, config, str(refused.request_id))  # type: ignore[arg-type]
    assert story is not None
    assert story.request_id == refused.request_id
    assert story.verdict == f"refused: {code}"
    final = [step for step in story.steps if step.outcome == "refused"]
    assert len(final) == 1
    assert words in final[0].rule
    if code is RejectCode.GLOBAL_DYNAMIC_LIMIT:
        # The figures are the gate's own at that instant: in flight had reached the cap.
        step = final[0]
        assert step.premium_inflight + step.basic_inflight >= step.cap > 0
        assert f"of {step.cap} " in step.rule
    text = render_story(story)
    assert f"verdict: refused: {code}" in text
    assert "rule: " in text


def test_an_admitted_request_is_told_as_admitted_and_an_unknown_id_is_none(
    example: tuple[Header, list[object]],
) -> None:
    header, records = example
    config = load_config(header.config).guard_config()
    forwarded = next(r for r in records if isinstance(r, Forwarded))
    story = explain_request(records, config, str(forwarded.request_id))  # type: ignore[arg-type]
    assert story is not None
    assert story.verdict == "admitted"
    assert [s.event for s in story.steps][:2] == ["arrived", "forwarded"]
    assert explain_request(records, config, "no-such-request") is None  # type: ignore[arg-type]
