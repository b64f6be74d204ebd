"""The recording format: round trips, malformed lines, gzip, redaction, family filtering."""

from __future__ import annotations

import contextlib
import gzip
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.recording import (
    Arrival,
    Completion,
    Decision,
    Explanation,
    FirstToken,
    Gone,
    Header,
    Outcome,
    Record,
    RecordingError,
    Retry,
    Scrape,
    ScrapeFailed,
    decode_line,
    encode,
    learner_text,
    open_for_reading,
    open_for_writing,
    read_records,
    redact,
)

times = st.floats(0, 1e6, allow_nan=False)
ids = st.integers(0, 2**40)
texts = st.text(max_size=40)

numbers = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
explanations = st.builds(
    Explanation,
    cap=st.integers(0, 10**4),
    user_tps=numbers,
    ttft_s=numbers,
    kv_usage=st.floats(0, 1),
    binding=st.sampled_from(["none", "predicted_speed", "predicted_ttft", "predicted_kv"]),
    fit_step_base_s=numbers,
    fit_per_decoder_s=numbers,
    fit_per_kv_s=numbers,
    fit_per_prompt_token_s=numbers,
    fit_relative_error=numbers,
    fit_observations=st.integers(0, 10**9),
)

records = st.one_of(
    st.builds(
        Scrape, at=times, poll=st.integers(0, 10**6), backend=texts, flavour=texts, text=texts
    ),
    st.builds(ScrapeFailed, at=times, poll=st.integers(0, 10**6), backend=texts, error=texts),
    st.builds(
        Arrival,
        at=times,
        id=ids,
        tier=st.sampled_from(["basic", "premium"]),
        path=texts,
        body_bytes=st.none() | st.integers(0, 2**31),
    ),
    st.builds(Retry, at=times, id=ids),
    st.builds(Gone, at=times, id=ids),
    st.builds(
        Outcome,
        at=times,
        id=ids,
        outcome=st.sampled_from(["forwarded", "rejected"]),
        code=st.none() | texts,
        waited_s=st.floats(0, 1, allow_nan=False),
        retry_after_s=st.none() | st.integers(1, 30),
        binding=st.none() | st.sampled_from(["none", "predicted_speed", "predicted_ttft"]),
    ),
    st.builds(FirstToken, at=times, id=ids, seconds=st.floats(0, 100, allow_nan=False)),
    st.builds(Completion, at=times, id=ids, status=st.integers(0, 599)),
    st.builds(
        Decision,
        at=times,
        poll=st.integers(0, 10**6),
        cap=st.integers(0, 10**4),
        state=texts,
        reason=texts,
        yellow=st.lists(texts, max_size=3),
        red=st.lists(texts, max_size=3),
        predicted=st.none() | explanations,
    ),
)


@given(records)
def test_every_record_round_trips(record: Record) -> None:
    line = encode(record)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode_line(line, line_no=7) == record


def test_version_2_fields_are_written_only_when_set() -> None:
    """A recording made with PIG's learner keeps its version-1 lines; the predictive
    learner's explanation and predicted Retry-After appear only when there is one."""
    plain = Outcome(at=1.0, id=3, outcome="rejected", code="global_dynamic_limit")
    assert b"retry_after_s" not in encode(plain)
    assert b"binding" not in encode(plain)
    assert b"predicted" not in encode(Decision(at=1.0, poll=0, cap=4, state="green", reason="x"))
    refused = Outcome(at=1.0, id=3, outcome="rejected", retry_after_s=4, binding="predicted_kv")
    assert b'"retry_after_s":4,"binding":"predicted_kv"' in encode(refused)


def test_version_1_lines_read_with_the_new_fields_empty() -> None:
    outcome = decode_line(
        b'{"kind":"outcome","at":2.5,"id":9,"outcome":"rejected","code":"tier_priority",'
        b'"waited_s":0.5}',
        line_no=4,
    )
    assert outcome == Outcome(at=2.5, id=9, outcome="rejected", code="tier_priority", waited_s=0.5)
    assert isinstance(outcome, Outcome)
    assert (outcome.retry_after_s, outcome.binding) == (None, None)
    decision = decode_line(
        b'{"kind":"decision","at":1.0,"poll":0,"cap":4,"state":"green","reason":"none",'
        b'"yellow":[],"red":[],"source":"metrics"}',
        line_no=5,
    )
    assert isinstance(decision, Decision)
    assert decision.predicted is None
    header = decode_line(
        b'{"kind":"header","format":"inference-guard-recording","version":1}', line_no=1
    )
    assert isinstance(header, Header)
    assert header.version == 1
    assert Header().version == 2


def test_header_round_trips_and_comes_first() -> None:
    header = Header(
        started_at="2026-11-29T00:00:00Z", producer="test", config={"GLOBAL_LIMIT": "8"}
    )
    assert decode_line(encode(header), line_no=1) == header
    assert encode(header).startswith(b'{"kind":"header"')


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"kind": "nope", "at": 1}', "unknown kind 'nope'"),
        (b'{"kind": "retry", "id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retry", "at": "soon", "id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retry", "at": NaN, "id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retry", "at": 1, "id": "x"}', "bad 'retry' record"),
        (b'{"kind": "retry", "at": 1, "id": 3, "extra": 1}', "bad 'retry' record"),
        (b'{"kind": "scrape", "at": 1, "poll": 0}', "bad 'scrape' record"),
    ],
)
def test_malformed_lines_name_the_line_and_the_reason(line: bytes, reason: str) -> None:
    with pytest.raises(RecordingError) as caught:
        decode_line(line, line_no=42, source="run.jsonl")
    assert caught.value.line_no == 42
    assert reason in str(caught.value)
    assert str(caught.value).startswith("run.jsonl:42: ")


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_else(line: bytes) -> None:
    with contextlib.suppress(RecordingError):
        decode_line(line, line_no=1)


def test_reading_skips_bad_lines_unless_strict() -> None:
    lines = [encode(Header()), b"garbage\n", b"\n", encode(Retry(at=1.0, id=1))]
    items = list(read_records(lines))
    assert isinstance(items[0], Header)
    assert isinstance(items[1], RecordingError)
    assert items[1].line_no == 2
    assert items[2] == Retry(at=1.0, id=1)
    with pytest.raises(RecordingError):
        list(read_records(lines, strict=True))


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_files_round_trip_plain_and_gzip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    written: list[Record | Header] = [
        Header(),
        Retry(at=0.5, id=1),
        Completion(at=1.5, id=1, status=200),
    ]
    with open_for_writing(path) as out:
        for record in written:
            out.write(encode(record))
    raw = path.read_bytes()
    assert raw.startswith(b"\x1f\x8b") == name.endswith(".gz")
    if name.endswith(".gz"):
        assert gzip.decompress(raw).startswith(b'{"kind":"header"')
    with open_for_reading(path) as stream:
        assert list(read_records(stream)) == written


def test_redaction_drops_secrets() -> None:
    env = {
        "TOKEN": "s3cret",
        "GLOBAL_LIMIT": "8",
        "ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION": "Bearer x",
    }
    assert redact(env) == {"GLOBAL_LIMIT": "8"}


def test_learner_text_keeps_only_the_families_read() -> None:
    page = (
        "# HELP vllm:num_requests_running Number of requests.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 3.0\n'
        "# TYPE python_gc_objects_collected_total counter\n"
        "python_gc_objects_collected_total 12.0\n"
        'vllm:time_to_first_token_seconds_bucket{le="1.0"} 2.0\n'
        "vllm:time_to_first_token_seconds_count 2.0\n"
        "vllm:time_to_first_token_seconds_sum 0.5\n"
        "vllm:time_to_first_token_seconds_created 1.7e9\n"
        'vllm:num_requests_running_by_reason{r="x"} 9\n'
    )
    kept = learner_text(page, ("vllm:num_requests_running", "vllm:time_to_first_token_seconds"))
    assert kept.splitlines() == [
        "# HELP vllm:num_requests_running Number of requests.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0"} 3.0',
        'vllm:time_to_first_token_seconds_bucket{le="1.0"} 2.0',
        "vllm:time_to_first_token_seconds_count 2.0",
        "vllm:time_to_first_token_seconds_sum 0.5",
    ]
    assert learner_text("python_gc 1\n", ("vllm:x",)) == ""
