"""Trace loading: both real formats, malformed rows with file:line, rate scaling, tiers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.traces import (
    TraceError,
    TraceFormat,
    TraceRequest,
    head,
    load_trace,
    parse_trace,
    premium_flags,
    read_trace,
    scale_rate,
)

TRACES = Path(__file__).parents[2] / "fixtures/traces"
AZURE = TRACES / "azure-llm-2023-conv.csv"
MOONCAKE = TRACES / "mooncake-fast25-conversation-trace.jsonl"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def test_the_whole_azure_conversation_trace_loads() -> None:
    trace = read_trace(AZURE, strict=True)
    assert trace.format is TraceFormat.AZURE_CSV
    assert trace.skipped == ()
    requests = trace.requests
    assert len(requests) == 19_366
    assert requests[0] == TraceRequest(arrival_s=0.0, prompt_tokens=374, output_tokens=44)
    # 18:15:50.9951690 - 18:15:46.6805900, at microsecond precision.
    assert requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert requests[1].prompt_tokens == 396
    assert requests[1].output_tokens == 109
    assert 3_400 < requests[-1].arrival_s < 3_600  # about 58 minutes
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert all(r.output_tokens >= 1 and r.prompt_tokens >= 0 for r in requests)


def test_the_mooncake_prefix_loads() -> None:
    requests = load_trace(MOONCAKE, strict=True)
    assert len(requests) == 7_980
    assert requests[0] == TraceRequest(
        arrival_s=0.0, prompt_tokens=6758, output_tokens=500, hash_ids=tuple(range(14))
    )
    assert requests[1].hash_ids == (0, *range(14, 28))  # shares its first block with the first
    assert requests[-1].arrival_s == pytest.approx(2432.999)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    # one id per started 512-token block, on every row: the block size the READMEs state
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // 512) for r in requests)


def test_hash_ids_are_read_and_malformed_ones_skip_the_row(tmp_path: Path) -> None:
    base = {"timestamp": 0, "input_length": 1000, "output_length": 5}
    lines = [
        json.dumps(base | {"hash_ids": [7, 8]}),
        json.dumps(base | {"timestamp": 1}),  # no hash_ids: none known
        json.dumps(base | {"timestamp": 2, "hash_ids": []}),
        json.dumps(base | {"timestamp": 3, "hash_ids": [1, -2]}),
        json.dumps(base | {"timestamp": 4, "hash_ids": [1, 2.5]}),
        json.dumps(base | {"timestamp": 5, "hash_ids": [True]}),
        json.dumps(base | {"timestamp": 6, "hash_ids": "0,1"}),
        json.dumps(base | {"timestamp": 7, "hash_ids": None}),
        json.dumps(base | {"timestamp": 8, "hash_ids": [[1]]}),
        json.dumps(base | {"timestamp": 9, "hash_ids": [3, 3, 2**40]}),
    ]
    path = tmp_path / "hashes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)
    assert [r.hash_ids for r in trace.requests] == [(7, 8), (), (), (3, 3, 2**40)]
    assert [e.line_no for e in trace.skipped] == [4, 5, 6, 7, 8, 9]
    reasons = [e.reason for e in trace.skipped]
    assert reasons[0] == "hash_ids[1] must be a non-negative whole number, got -2"
    assert reasons[1] == "hash_ids[1] must be a non-negative whole number, got 2.5"
    assert reasons[2] == "hash_ids[0] must be a non-negative whole number, got True"
    assert reasons[3] == "hash_ids must be a list of block ids, got str"
    assert reasons[4] == "hash_ids must be a list of block ids, got NoneType"
    assert reasons[5] == "hash_ids[0] must be a non-negative whole number, got [1]"
    with pytest.raises(TraceError, match=r"hashes\.jsonl:4: hash_ids\[1\]"):
        read_trace(path, strict=True)
    azure = parse_trace([AZURE_HEADER, "2023-11-16 18:15:46.5,10,2"]).requests
    assert azure[0].hash_ids == ()


def test_the_format_is_recognised_from_content_not_from_the_name(tmp_path: Path) -> None:
    disguised = tmp_path / "trace.txt"
    disguised.write_bytes(MOONCAKE.read_bytes()[:2_000].rsplit(b"\n", 1)[0] + b"\n")
    assert read_trace(disguised).format is TraceFormat.MOONCAKE_JSONL


def test_malformed_azure_rows_are_skipped_and_reported_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "\n".join(
            [
                AZURE_HEADER,
                "2023-11-16 18:15:46.6805900,374,44",  # line 2
                "yesterday,10,10",  # line 3: bad time
                "2023-11-16 18:15:47.0000000,-1,10",  # line 4: negative prompt
                "2023-11-16 18:15:48.0000000,10",  # line 5: a field short
                "2023-11-16 18:15:49.0000000,10,0",  # line 6: no output token
                "2023-11-16 18:15:50.0000000,12,x",  # line 7: not a number
                "",
                "2023-11-16 18:15:51.5000000,20,30",  # line 9
            ]
        )
        + "\n"
    )
    trace = read_trace(path)
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 4.81941])
    assert [e.line_no for e in trace.skipped] == [3, 4, 5, 6, 7]
    assert all(str(e).startswith(f"{path}:{e.line_no}: ") for e in trace.skipped)
    assert "TIMESTAMP" in trace.skipped[0].reason
    assert "ContextTokens" in trace.skipped[1].reason
    assert "GeneratedTokens" in trace.skipped[3].reason
    with pytest.raises(TraceError) as raised:
        read_trace(path, strict=True)
    assert raised.value.line_no == 3
    assert str(raised.value).startswith(f"{path}:3: ")


def test_malformed_mooncake_rows_are_skipped_and_reported(tmp_path: Path) -> None:
    good = {"timestamp": 1500, "input_length": 100, "output_length": 20, "hash_ids": [0]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"timestamp": 10, "input_length": 5}),
        json.dumps({"timestamp": True, "input_length": 5, "output_length": 5}),
        json.dumps([1, 2, 3]),
        json.dumps({"timestamp": 3000.0, "input_length": 7.0, "output_length": 2.5}),
        json.dumps({"timestamp": 2500, "input_length": 7.0, "output_length": 3}),
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)
    assert trace.format is TraceFormat.MOONCAKE_JSONL
    assert trace.requests == (
        TraceRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=20, hash_ids=(0,)),
        TraceRequest(arrival_s=1.0, prompt_tokens=7, output_tokens=3),
    )
    assert [e.line_no for e in trace.skipped] == [2, 3, 4, 5, 6]
    assert "output_length" in trace.skipped[1].reason
    assert all(str(e).startswith(f"{path}:") for e in trace.skipped)
    with pytest.raises(TraceError, match=r"mooncake\.jsonl:2: "):
        read_trace(path, strict=True)


def test_unknown_and_empty_files_are_refused_even_when_lenient(tmp_path: Path) -> None:
    unknown = tmp_path / "other.csv"
    unknown.write_text("when,prompt,output\n1,2,3\n")
    with pytest.raises(TraceError, match=r"other\.csv:1: unknown trace format"):
        read_trace(unknown)
    empty = tmp_path / "empty.csv"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="empty"):
        read_trace(empty)
    wrong_header = tmp_path / "azure.csv"
    wrong_header.write_text("TIMESTAMP,Context\n2023-11-16 18:15:46,1\n")
    with pytest.raises(TraceError, match="header"):
        read_trace(wrong_header)


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted() -> None:
    data = f"\ufeff{AZURE_HEADER}\r\n2023-11-16 18:15:46.5,1,2\r\n2023-11-16 18:15:47,3,4\r\n"
    trace = parse_trace(data.encode().splitlines(keepends=True))
    assert trace.requests == (TraceRequest(0.0, 1, 2), TraceRequest(0.5, 3, 4))


def test_trace_errors_survive_pickling() -> None:
    error = TraceError(7, "bad row", source="t.csv")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.line_no, copy.reason, copy.source, str(copy)) == (
        7,
        "bad row",
        "t.csv",
        str(error),
    )


rows = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=10_000_000),  # ms
        st.integers(min_value=0, max_value=200_000),
        st.integers(min_value=1, max_value=10_000),
    ),
    min_size=1,
    max_size=40,
)


def mooncake_lines(items: list[tuple[int, int, int]]) -> list[str]:
    return [
        json.dumps({"timestamp": at, "input_length": p, "output_length": o}) for at, p, o in items
    ]


@given(rows)
def test_any_order_of_rows_comes_back_sorted_from_zero_with_counts_kept(
    items: list[tuple[int, int, int]],
) -> None:
    trace = parse_trace(mooncake_lines(items), strict=True)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0.0
    start = min(at for at, _, _ in items)
    expected = sorted(items)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [
        (p, o) for _, p, o in sorted(items, key=lambda item: item[0])
    ]
    assert arrivals == pytest.approx([(at - start) / 1000 for at, _, _ in expected])


@given(rows, st.floats(min_value=0.01, max_value=100.0))
def test_scaling_divides_arrival_times_and_keeps_everything_else(
    items: list[tuple[int, int, int]], factor: float
) -> None:
    trace = parse_trace(mooncake_lines(items)).requests
    scaled = scale_rate(trace, factor)
    assert len(scaled) == len(trace)
    for before, after in zip(trace, scaled, strict=True):
        assert after.arrival_s == pytest.approx(before.arrival_s / factor)
        assert (after.prompt_tokens, after.output_tokens) == (
            before.prompt_tokens,
            before.output_tokens,
        )
    arrivals = [r.arrival_s for r in scaled]
    assert arrivals == sorted(arrivals)


@given(
    st.lists(st.lists(st.integers(0, 2**63), max_size=5), min_size=1, max_size=10),
    st.floats(min_value=0.01, max_value=100.0),
)
def test_scaling_and_cutting_keep_the_hash_ids(ids: list[list[int]], factor: float) -> None:
    lines = [
        json.dumps({"timestamp": i, "input_length": 1, "output_length": 1, "hash_ids": block})
        for i, block in enumerate(ids)
    ]
    trace = parse_trace(lines, strict=True).requests
    assert [r.hash_ids for r in trace] == [tuple(block) for block in ids]
    assert [r.hash_ids for r in scale_rate(trace, factor)] == [tuple(block) for block in ids]
    assert [r.hash_ids for r in head(trace, 1e9)] == [tuple(block) for block in ids]


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_scaling_refuses_a_factor_that_is_not_a_positive_number(factor: float) -> None:
    with pytest.raises(ValueError, match="rate factor"):
        scale_rate([TraceRequest(0.0, 1, 1)], factor)


def test_scaling_the_real_trace_by_four_quarters_its_span() -> None:
    trace = load_trace(AZURE)
    scaled = scale_rate(trace, 4.0)
    assert scaled[-1].arrival_s == pytest.approx(trace[-1].arrival_s / 4)
    assert len(head(scaled, 300.0)) == len(head(trace, 1200.0))


@given(rows, st.floats(min_value=0.0, max_value=20_000.0))
def test_head_keeps_exactly_the_requests_before_the_cut(
    items: list[tuple[int, int, int]], seconds: float
) -> None:
    trace = parse_trace(mooncake_lines(items)).requests
    kept = head(trace, seconds)
    assert kept == trace[: len(kept)]
    assert all(r.arrival_s < seconds for r in kept)
    assert all(r.arrival_s >= seconds for r in trace[len(kept) :])


@given(
    st.integers(min_value=0, max_value=500),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=0, max_value=2**32),
)
def test_premium_flags_are_seeded_and_stable_under_prefixes(
    count: int, share: float, seed: int
) -> None:
    flags = premium_flags(count, share, seed=seed)
    assert len(flags) == count
    assert flags == premium_flags(count, share, seed=seed)
    assert premium_flags(count // 2, share, seed=seed) == flags[: count // 2]
    if share == 0.0:
        assert not any(flags)
    if share == 1.0:
        assert all(flags)


def test_premium_share_is_about_the_share_asked_for() -> None:
    flags = premium_flags(20_000, 0.2, seed=7)
    assert 0.18 < sum(flags) / len(flags) < 0.22
    assert premium_flags(20_000, 0.2, seed=8) != flags


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_premium_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="premium share"):
        premium_flags(3, share, seed=0)
