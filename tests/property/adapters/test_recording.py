"""The recording format: round trips of the core's request events and of the poll records,
older versions read as the same events, malformed lines, gzip, redaction, family filtering."""

from __future__ import annotations

import contextlib
import gzip
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.recording import (
    VERSION,
    Decision,
    Explanation,
    Header,
    Record,
    RecordingError,
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
from guard_core import (
    Abandoned,
    Arrived,
    Binding,
    Finished,
    FirstToken,
    Forwarded,
    Refused,
    RejectCode,
    RequestEvent,
    Retried,
    Tier,
)
from tests.load_tool import load_tool

ROOT = Path(__file__).parents[3]
EXAMPLE = ROOT / "tests/fixtures/recordings/example-vllm-overload.jsonl.gz"

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

request_events = st.one_of(
    st.builds(
        Arrived,
        at=times,
        request_id=ids,
        tier=st.sampled_from(Tier),
        body_bytes=st.none() | st.integers(0, 2**31),
        path=texts,
    ),
    st.builds(Retried, at=times, request_id=ids),
    st.builds(Abandoned, at=times, request_id=ids),
    st.builds(Forwarded, at=times, request_id=ids),
    st.builds(
        Refused,
        at=times,
        request_id=ids,
        code=st.none() | st.sampled_from(RejectCode),
        retry_after_s=st.none() | st.integers(1, 30),
        binding=st.none() | st.sampled_from(Binding),
    ),
    st.builds(
        FirstToken,
        at=times,
        request_id=ids,
        seconds=st.floats(0, 100, allow_nan=False),
    ),
    st.builds(Finished, at=times, request_id=ids, status=st.integers(0, 599)),
)


@given(records | request_events)
def test_every_record_round_trips(record: Record) -> None:
    line = encode(record)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode_line(line, line_no=7) == record


@given(st.lists(request_events, max_size=30))
def test_a_stream_of_request_events_round_trips_through_json_lines(
    events: list[RequestEvent],
) -> None:
    """events -> cattrs -> JSON lines -> events: the recording is the stream the core applied."""
    lines = [encode(Header()), *(encode(event) for event in events)]
    items = list(read_records(b"".join(lines).splitlines(keepends=True), strict=True))
    assert items == [Header(), *events]


def test_a_request_line_is_the_event_with_its_kind() -> None:
    line = encode(Arrived(at=1.5, request_id=7, tier=Tier.PREMIUM, body_bytes=12, path="/x"))
    assert line == (
        b'{"at":1.5,"request_id":7,"tier":"premium","body_bytes":12,"path":"/x","kind":"arrived"}\n'
    )
    assert encode(Finished(at=2.0, request_id=7, status=499)) == (
        b'{"at":2.0,"request_id":7,"status":499,"kind":"finished"}\n'
    )


def test_optional_fields_are_written_only_when_set() -> None:
    """A refusal under PIG's learner has no predicted Retry-After or binding, a decision no
    explanation; the predictive learner's appear only when there is one."""
    plain = Refused(at=1.0, request_id=3, code=RejectCode.GLOBAL_DYNAMIC_LIMIT)
    assert b"retry_after_s" not in encode(plain)
    assert b"binding" not in encode(plain)
    assert b"predicted" not in encode(Decision(at=1.0, poll=0, cap=4, state="green", reason="x"))
    refused = Refused(at=1.0, request_id=3, retry_after_s=4, binding=Binding.KV)
    assert b'"retry_after_s":4,"binding":"predicted_kv"' in encode(refused)
    named = Arrived(at=1.0, request_id=3, tier=Tier.BASIC, trace_id="req-9")
    assert encode(named).endswith(b'"path":"","trace_id":"req-9","kind":"arrived"}\n')


def version_1(*lines: bytes) -> list[object]:
    header = b'{"kind":"header","format":"inference-guard-recording","version":1}'
    return list(read_records([header, *lines], strict=True))


def test_version_1_lines_read_as_the_request_events() -> None:
    items = version_1(
        b'{"kind":"arrival","at":1.0,"id":9,"tier":"premium","path":"/v1/x","body_bytes":40}',
        b'{"kind":"retry","at":1.1,"id":9}',
        b'{"kind":"outcome","at":2.5,"id":9,"outcome":"rejected","code":"tier_priority",'
        b'"waited_s":0.5}',
        b'{"kind":"arrival","at":3.0,"id":10,"tier":"basic"}',
        b'{"kind":"gone","at":3.1,"id":10}',
        b'{"kind":"arrival","at":4.0,"id":11,"tier":"basic"}',
        b'{"kind":"outcome","at":4.0,"id":11,"outcome":"forwarded","waited_s":0.0}',
        b'{"kind":"first_token","at":4.5,"id":11,"seconds":0.5}',
        b'{"kind":"completion","at":5.0,"id":11,"status":200}',
        b'{"kind":"decision","at":1.0,"poll":0,"cap":4,"state":"green","reason":"none",'
        b'"yellow":[],"red":[],"source":"metrics"}',
    )
    header = items[0]
    assert isinstance(header, Header)
    assert header.version == 1
    assert items[1:-1] == [
        Arrived(at=1.0, request_id=9, tier=Tier.PREMIUM, body_bytes=40, path="/v1/x"),
        Retried(at=1.1, request_id=9),
        Refused(at=2.5, request_id=9, code=RejectCode.TIER_PRIORITY),
        Arrived(at=3.0, request_id=10, tier=Tier.BASIC),
        Abandoned(at=3.1, request_id=10),
        Arrived(at=4.0, request_id=11, tier=Tier.BASIC),
        Forwarded(at=4.0, request_id=11),
        FirstToken(at=4.5, request_id=11, seconds=0.5),
        Finished(at=5.0, request_id=11, status=200),
    ]
    decision = items[-1]
    assert isinstance(decision, Decision)
    assert decision.predicted is None
    assert Header().version == VERSION == 3


def test_version_2_refusals_keep_their_retry_after_and_binding() -> None:
    header = b'{"kind":"header","format":"inference-guard-recording","version":2}'
    line = (
        b'{"kind":"outcome","at":1.0,"id":3,"outcome":"rejected","code":"global_dynamic_limit",'
        b'"waited_s":0.0,"retry_after_s":4,"binding":"predicted_kv"}'
    )
    items = list(read_records([header, line], strict=True))
    assert items[1] == Refused(
        at=1.0,
        request_id=3,
        code=RejectCode.GLOBAL_DYNAMIC_LIMIT,
        retry_after_s=4,
        binding=Binding.KV,
    )


def test_the_example_tool_writes_the_events_the_version_1_example_reads_as(
    tmp_path: Path,
) -> None:
    """tools/make_example_recording.py, run today, writes the example in the current format:
    line for line the same events as the committed version-1 file reads as."""
    tool = load_tool("make_example_recording")
    out = tmp_path / "example.jsonl.gz"
    tool.OUT = out  # type: ignore[attr-defined]
    tool.ROOT = tmp_path  # type: ignore[attr-defined]
    tool.main()
    with open_for_reading(out) as fresh, open_for_reading(EXAMPLE) as committed:
        now, then = (
            list(read_records(fresh, strict=True)),
            list(read_records(committed, strict=True)),
        )
    assert isinstance(now[0], Header)
    assert isinstance(then[0], Header)
    assert (now[0].version, then[0].version) == (VERSION, 1)
    assert now[1:] == then[1:]


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
        (b'{"kind": "retried", "request_id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retried", "at": "soon", "request_id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retried", "at": NaN, "request_id": 3}', "missing or non-numeric 'at'"),
        (b'{"kind": "retried", "at": 1, "request_id": "x"}', "bad 'retried' record"),
        (b'{"kind": "retried", "at": 1, "request_id": 3, "extra": 1}', "bad 'retried' record"),
        (b'{"kind": "arrived", "at": 1, "request_id": 3, "tier": "gold"}', "bad 'arrived' record"),
        (b'{"kind": "scrape", "at": 1, "poll": 0}', "bad 'scrape' record"),
        # A version-1 kind in a current recording, and the other way round.
        (b'{"kind": "retry", "at": 1, "id": 3}', "unknown kind 'retry'"),
    ],
)
def test_malformed_lines_name_the_line_and_the_reason(line: bytes, reason: str) -> None:
    with pytest.raises(RecordingError) as caught:
        decode_line(line, line_no=42, source="run.jsonl")
    assert caught.value.line_no == 42
    assert reason in str(caught.value)
    assert str(caught.value).startswith("run.jsonl:42: ")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"kind": "retried", "at": 1, "request_id": 3}', "unknown kind 'retried'"),
        (b'{"kind": "retry", "at": 1, "id": "x"}', "bad 'retry' record"),
        (b'{"kind": "retry", "at": 1, "id": 3, "extra": 1}', "bad 'retry' record"),
        (b'{"kind": "outcome", "at": 1, "id": 3, "outcome": "rejected", "code": "?"}',
         "bad 'outcome' record"),
    ],
)  # fmt: skip
def test_malformed_version_1_lines_name_the_line_and_the_reason(line: bytes, reason: str) -> None:
    with pytest.raises(RecordingError) as caught:
        decode_line(line, line_no=42, source="run.jsonl", version=1)
    assert caught.value.line_no == 42
    assert reason in str(caught.value)


@given(st.binary(max_size=200), st.sampled_from([1, 2, VERSION]))
def test_arbitrary_bytes_never_raise_anything_else(line: bytes, version: int) -> None:
    with contextlib.suppress(RecordingError):
        decode_line(line, line_no=1, version=version)


def test_reading_skips_bad_lines_unless_strict() -> None:
    lines = [encode(Header()), b"garbage\n", b"\n", encode(Retried(at=1.0, request_id=1))]
    items = list(read_records(lines))
    assert isinstance(items[0], Header)
    assert isinstance(items[1], RecordingError)
    assert items[1].line_no == 2
    assert items[2] == Retried(at=1.0, request_id=1)
    with pytest.raises(RecordingError):
        list(read_records(lines, strict=True))


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_files_round_trip_plain_and_gzip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    written: list[Record | Header] = [
        Header(),
        Retried(at=0.5, request_id=1),
        Finished(at=1.5, request_id=1, status=200),
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
