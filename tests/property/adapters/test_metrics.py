"""``guard_adapters.metrics.parse_metrics`` against real pages, made-up pages and junk.

* Real pages (``tests/fixtures/metrics``, see the README there): every field written out, with
  the line of the page it comes from.
* Hand-made fragments for the rules: legacy names, precedence, sums and maxima, histogram
  assembly, and what is skipped (NaN, infinities, negatives, junk values, bad bounds).
* Errors: each structural fault on a relevant line gives ``MetricsParseError`` with that line's
  number; the same fault on an unrelated family is ignored; pages over 4 MiB are refused.
* Hypothesis: random pages built from relevant series (random label sets, bounds, value formats,
  timestamps, indents, CRLF) mixed with unrelated series, comments and blank lines must give what a
  plain model of the rules computes from the series list, and the same as the prometheus_client
  reader of ``bench/metrics_parsers.py`` whenever prometheus_client accepts the page; a broken
  relevant line inserted anywhere is reported with its number; arbitrary text or bytes give either a
  sample or ``MetricsParseError``, never another exception.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from guard_adapters._errors import AdapterError, MetricsParseError
from guard_adapters.metrics import LEARNER_FAMILIES, MAX_PAGE_BYTES, parse_metrics
from guard_core._errors import GuardError
from guard_core.observations import BackendSample, Flavour, Histogram

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "metrics"
VLLM_010 = "vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom"
VLLM_08 = "vllm-0.8-early-v1-qwen2.5-coder-32b-productionstack318-fragment.prom"
VLLM_V0_TTFT = "vllm-v0-llama3-70b-ttft-histogram-issue8115-fragment.prom"
SGLANG_DOCS = "sglang-0.4-docs-llama3.1-8b-under-load.prom"
SGLANG_051 = "sglang-0.5.1-qwen32b-issue13485-fragment.prom"
ALL_PAGES = (VLLM_010, VLLM_08, VLLM_V0_TTFT, SGLANG_DOCS, SGLANG_051)
INF = math.inf

Parser = Callable[[bytes | str], BackendSample]


def page(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


@pytest.fixture(scope="module")
def client_parser() -> Parser:
    """``bench/metrics_parsers.py``'s prometheus_client reader, loaded from its path."""
    pytest.importorskip("prometheus_client")
    path = ROOT / "bench" / "metrics_parsers.py"
    spec = importlib.util.spec_from_file_location("bench_metrics_parsers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser: Parser = module.parse_metrics_with_prometheus_client
    return parser


# --------------------------------------------------------------------------------------------
# Real pages, every field written down
# --------------------------------------------------------------------------------------------

EXPECTED: dict[str, BackendSample] = {
    VLLM_010: BackendSample(
        flavour=Flavour.VLLM,
        running=0.0,  # line 39, vllm:num_requests_running{engine="0",...}
        waiting=0.0,  # line 42, vllm:num_requests_waiting
        # line 60, vllm:kv_cache_usage_perc (line 45 has the same figure under the old name)
        kv_usage=0.0011764705882353343,
        preemptions=0.0,  # line 75, vllm:num_preemptions_total
        generation_tokens=1739.0,  # line 87, vllm:generation_tokens_total
        generation_tps=None,  # vLLM has no gen_throughput gauge
        ttft=Histogram(
            # lines 217-239, vllm:time_to_first_token_seconds_bucket, one engine
            buckets=(
                (0.001, 0.0),
                (0.005, 0.0),
                (0.01, 0.0),
                (0.02, 0.0),
                (0.04, 4.0),
                (0.06, 6.0),
                (0.08, 6.0),
                (0.1, 6.0),
                (0.25, 6.0),
                (0.5, 6.0),
                (0.75, 6.0),
                (1.0, 6.0),
                (2.5, 6.0),
                (5.0, 6.0),
                (7.5, 6.0),
                (10.0, 6.0),
                (20.0, 6.0),
                (40.0, 6.0),
                (80.0, 6.0),
                (160.0, 6.0),
                (640.0, 6.0),
                (2560.0, 6.0),
                (INF, 6.0),
            ),
            count=6.0,  # line 240, _count
            sum=0.24629998207092285,  # line 241, _sum
        ),
        prompt_tokens=246.0,  # line 81, vllm:prompt_tokens_total
        inter_token_latency=Histogram(
            # lines 247-266: the page predates vllm:inter_token_latency_seconds, so its older
            # name vllm:time_per_output_token_seconds is read; 1731 of the 1733 gaps <= 25 ms
            buckets=(
                (0.01, 0.0),
                (0.025, 1731.0),
                (0.05, 1733.0),
                (0.075, 1733.0),
                (0.1, 1733.0),
                (0.15, 1733.0),
                (0.2, 1733.0),
                (0.3, 1733.0),
                (0.4, 1733.0),
                (0.5, 1733.0),
                (0.75, 1733.0),
                (1.0, 1733.0),
                (2.5, 1733.0),
                (5.0, 1733.0),
                (7.5, 1733.0),
                (10.0, 1733.0),
                (20.0, 1733.0),
                (40.0, 1733.0),
                (80.0, 1733.0),
                (INF, 1733.0),
            ),
            count=1733.0,  # line 267, _count: the 1739 generated tokens less 6 first tokens
            sum=41.111971570000605,  # line 268, _sum
        ),
    ),
    VLLM_08: BackendSample(
        flavour=Flavour.VLLM,
        running=0.0,  # line 3
        waiting=0.0,  # line 6
        kv_usage=0.0,  # line 9, only the old name vllm:gpu_cache_usage_perc
        # the fragment ends on the HELP/TYPE of the prefix-cache counter, no other series
    ),
    VLLM_V0_TTFT: BackendSample(
        flavour=Flavour.VLLM,
        ttft=Histogram(
            # lines 1-10: every bucket from 0.1 s to +Inf holds all 8060 requests
            buckets=(
                (0.1, 8060.0),
                (0.25, 8060.0),
                (0.5, 8060.0),
                (0.75, 8060.0),
                (1.0, 8060.0),
                (2.5, 8060.0),
                (5.0, 8060.0),
                (7.5, 8060.0),
                (10.0, 8060.0),
                (INF, 8060.0),
            ),
            count=8060.0,  # line 11
            sum=0.5871782302856445,  # line 12
        ),
    ),
    SGLANG_DOCS: BackendSample(
        flavour=Flavour.SGLANG,
        running=162.0,  # line 106, sglang:num_running_reqs
        waiting=2826.0,  # line 115, sglang:num_queue_reqs
        kv_usage=0.28,  # line 9, sglang:token_usage
        preemptions=None,  # no retracted / paused gauges in this (early 2025) sample
        generation_tokens=7557572.0,  # line 6, sglang:generation_tokens_total 7.557572e+06
        generation_tps=86.50814177726902,  # line 112, sglang:gen_throughput (about 86.5)
        ttft=Histogram(
            # lines 16-36, sglang:time_to_first_token_seconds_bucket
            buckets=(
                (0.001, 0.0),
                (0.005, 0.0),
                (0.01, 0.0),
                (0.02, 0.0),
                (0.04, 1.0),
                (0.06, 3.0),
                (0.08, 6.0),
                (0.1, 6.0),
                (0.25, 6.0),
                (0.5, 6.0),
                (0.75, 6.0),
                (1.0, 27.0),
                (2.5, 140.0),
                (5.0, 314.0),
                (7.5, 941.0),
                (10.0, 1330.0),
                (15.0, 1970.0),
                (20.0, 2326.0),
                (25.0, 2417.0),
                (30.0, 2513.0),
                (INF, 11008.0),
            ),
            count=11008.0,  # line 37
            sum=2351897.9474117756,  # line 15, 2.3518979474117756e+06
        ),
        prompt_tokens=8128902.0,  # line 3, sglang:prompt_tokens_total 8.128902e+06
        inter_token_latency=Histogram(
            # lines 61-79, sglang:time_per_output_token_seconds_bucket (the pre-0.4.6 name)
            buckets=(
                (0.005, 1.0),
                (0.01, 73.0),
                (0.015, 382.0),
                (0.02, 593.0),
                (0.025, 855.0),
                (0.03, 1035.0),
                (0.04, 1815.0),
                (0.05, 11685.0),
                (0.075, 433413.0),
                (0.1, 4950195.0),
                (0.15, 7039435.0),
                (0.2, 7171662.0),
                (0.3, 7266055.0),
                (0.4, 7296752.0),
                (0.5, 7312226.0),
                (0.75, 7339675.0),
                (1.0, 7357747.0),
                (2.5, 7389414.0),
                (INF, 7400757.0),
            ),
            count=7400757.0,  # line 80, _count 7.400757e+06
            sum=866964.5791549598,  # line 60, _sum
        ),
    ),
    SGLANG_051: BackendSample(
        flavour=Flavour.SGLANG,
        running=1.0,  # line 3, one rank (tp_rank="0", pp_rank="0")
        kv_usage=0.0,  # line 9, sglang:token_usage
        generation_tps=0.8371284457403783,  # line 12, sglang:gen_throughput
        # no num_queue_reqs, generation counter or histogram in this fragment
    ),
}


@pytest.mark.parametrize("name", ALL_PAGES)
def test_real_page_fields(name: str) -> None:
    assert parse_metrics(page(name)) == EXPECTED[name]


@pytest.mark.parametrize("name", ALL_PAGES)
def test_real_page_as_text_and_with_crlf_and_indent(name: str) -> None:
    raw = page(name)
    text = raw.decode("utf-8")
    assert parse_metrics(text) == EXPECTED[name]
    assert parse_metrics(text.replace("\n", "\r\n")) == EXPECTED[name]
    indented = "\n".join(f"  \t{line}" if line else line for line in text.split("\n"))
    assert parse_metrics(indented) == EXPECTED[name]


@pytest.mark.parametrize("name", ALL_PAGES)
def test_real_page_agrees_with_prometheus_client(name: str, client_parser: Parser) -> None:
    assert client_parser(page(name)) == EXPECTED[name]


def test_real_vllm_page_is_the_fixture_copied_byte_for_byte() -> None:
    raw = page(VLLM_010)
    assert len(raw) == 46656
    assert not raw.endswith(b"\n")  # the capture's last line has no newline


UNRELATED_LINES = (
    "# HELP something unrelated",
    "",
    'python_gc_objects_collected_total{generation="0"} 1.0',
    'http_request_size_bytes_bucket{le="+Inf",handler="/v1/chat"} 12.0',
    "process_open_fds 9.0",
    "broken_exporter_line{oops 1 2 3",
    "#",
)


@given(
    name=st.sampled_from(ALL_PAGES),
    insertions=st.lists(
        st.tuples(st.integers(min_value=0), st.sampled_from(UNRELATED_LINES)), max_size=12
    ),
)
def test_unrelated_lines_change_nothing(name: str, insertions: list[tuple[int, str]]) -> None:
    lines = page(name).decode().split("\n")
    for position, line in insertions:
        lines.insert(position % (len(lines) + 1), line)
    assert parse_metrics("\n".join(lines)) == EXPECTED[name]


# --------------------------------------------------------------------------------------------
# Rules, on small fragments
# --------------------------------------------------------------------------------------------


def parse_lines(*lines: str) -> BackendSample:
    return parse_metrics("\n".join(lines))


def test_vllm_label_sets_are_added_and_kv_takes_the_max() -> None:
    sample = parse_lines(
        'vllm:num_requests_running{engine="0"} 3',
        'vllm:num_requests_running{engine="1"} 4',
        'vllm:num_requests_waiting{engine="0"} 1',
        'vllm:num_requests_waiting{engine="1"} 2',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1"} 0.75',
        'vllm:num_preemptions_total{engine="0"} 5',
        'vllm:num_preemptions_total{engine="1"} 6',
        'vllm:generation_tokens_total{engine="0"} 100',
        'vllm:generation_tokens_total{engine="1"} 50',
    )
    assert sample == BackendSample(
        flavour=Flavour.VLLM,
        running=7.0,
        waiting=3.0,
        kv_usage=0.75,
        preemptions=11.0,
        generation_tokens=150.0,
    )


def test_sglang_label_sets_take_the_max() -> None:
    sample = parse_lines(
        'sglang:num_running_reqs{tp_rank="0"} 8',
        'sglang:num_running_reqs{tp_rank="1"} 8',
        'sglang:num_queue_reqs{tp_rank="0"} 2',
        'sglang:num_queue_reqs{tp_rank="1"} 3',
        'sglang:token_usage{tp_rank="0"} 0.4',
        'sglang:token_usage{tp_rank="1"} 0.5',
        'sglang:num_retracted_reqs{tp_rank="0"} 1',
        'sglang:num_retracted_reqs{tp_rank="1"} 4',
        'sglang:num_paused_reqs{tp_rank="0"} 2',
        'sglang:generation_tokens_total{tp_rank="0"} 900',
        'sglang:generation_tokens_total{tp_rank="1"} 1000',
        'sglang:gen_throughput{tp_rank="0"} 10.5',
        'sglang:gen_throughput{tp_rank="1"} 12.5',
    )
    assert sample == BackendSample(
        flavour=Flavour.SGLANG,
        running=8.0,
        waiting=3.0,
        kv_usage=0.5,
        preemptions=6.0,  # max retracted 4 + max paused 2
        generation_tokens=1000.0,
        generation_tps=12.5,
    )


def test_vllm_names_win_over_sglang_names_but_preemptions_add_all_three() -> None:
    sample = parse_lines(
        "sglang:num_running_reqs 90",
        "vllm:num_requests_running 1",
        "sglang:num_queue_reqs 90",
        "vllm:num_requests_waiting 2",
        "sglang:token_usage 0.9",
        "vllm:kv_cache_usage_perc 0.1",
        "sglang:generation_tokens_total 9000",
        "vllm:generation_tokens_total 10",
        "sglang:gen_throughput 77",
        "vllm:num_preemptions_total 1",
        "sglang:num_retracted_reqs 10",
        "sglang:num_paused_reqs 100",
    )
    assert sample == BackendSample(
        flavour=Flavour.VLLM,
        running=1.0,
        waiting=2.0,
        kv_usage=0.1,
        preemptions=111.0,
        generation_tokens=10.0,
        generation_tps=None,  # the vLLM generation counter is present
    )


def test_sglang_values_are_used_when_vllm_names_are_absent() -> None:
    sample = parse_lines(
        "vllm:some_other_metric 1",
        "sglang:num_running_reqs 4",
        "sglang:generation_tokens_total 10",
        "sglang:gen_throughput 7",
    )
    # any vllm: line makes the page vLLM-flavoured; the fields still come from SGLang
    assert sample == BackendSample(
        flavour=Flavour.VLLM, running=4.0, generation_tokens=10.0, generation_tps=7.0
    )


def test_legacy_kv_name_is_used_only_without_the_current_one() -> None:
    assert parse_lines("vllm:gpu_cache_usage_perc 0.3").kv_usage == 0.3
    both = parse_lines("vllm:gpu_cache_usage_perc 0.3", "vllm:kv_cache_usage_perc 0.2")
    assert both.kv_usage == 0.2
    legacy_then_sglang = parse_lines("sglang:token_usage 0.9", "vllm:gpu_cache_usage_perc 0.3")
    assert legacy_then_sglang.kv_usage == 0.3
    two_engines = parse_lines(
        'vllm:gpu_cache_usage_perc{engine="0"} 0.3', 'vllm:gpu_cache_usage_perc{engine="1"} 0.6'
    )
    assert two_engines.kv_usage == 0.6


def test_legacy_sglang_retracted_name() -> None:
    assert parse_lines("sglang:total_retracted_reqs 3").preemptions == 3.0
    both = parse_lines("sglang:total_retracted_reqs 3", "sglang:num_retracted_reqs 1")
    assert both.preemptions == 1.0
    assert parse_lines("sglang:total_retracted_reqs 3", "sglang:num_paused_reqs 2").preemptions == 5


def test_names_that_are_not_read() -> None:
    sample = parse_lines(
        "vllm:num_preemptions 9",  # no release exposes the bare counter name
        'vllm:num_preemptions_created{engine="0"} 1.7e9',
        "vllm:generation_tokens_created 1.7e9",
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 5',
        "vllm:time_to_first_token_seconds_created 1.7e9",
        'vllm:time_to_first_token_seconds_bucket_x{le="1"} 5',
        "sglang:num_running_reqs_offline_batch 3",
        "sglang:num_retracted_requests_total 4",
        "vllm:kv_cache_usage_perc_x 0.5",
        "xvllm:num_requests_running 5",
        "vllm:num_requests_running} 5",
        "# vllm:num_requests_running 5",
    )
    assert sample == BackendSample(flavour=Flavour.VLLM)


def test_flavour() -> None:
    assert parse_lines("sglang:num_running_reqs 1").flavour is Flavour.SGLANG
    assert parse_lines("sglang:anything 1", "  vllm:anything 1").flavour is Flavour.VLLM
    assert parse_lines("\tsglang:anything 1").flavour is Flavour.SGLANG
    assert parse_lines("# TYPE vllm:x gauge", "python_info 1").flavour is Flavour.UNKNOWN
    assert parse_metrics(b"") == BackendSample()


def test_value_forms_and_timestamps() -> None:
    sample = parse_lines(
        "vllm:num_requests_running 1e1",
        "vllm:num_requests_running\t+2",
        "vllm:num_requests_running   .5   1700000000000",
        'vllm:num_requests_running {engine="3"} 0.25 -5',
        'vllm:num_requests_running{a="}"} 0.25',
        "vllm:num_requests_running{}7   ",
    )
    assert sample.running == 10 + 2 + 0.5 + 0.25 + 0.25 + 7


@pytest.mark.parametrize(
    "value",
    [
        "NaN",
        "nan",
        "+Inf",
        "Inf",
        "-Inf",
        "-1",
        "-0.5",
        "1_000",
        "0x10",
        "abc",
        "1.2.3",
        "--1",
        '"1"',
    ],
)
def test_skipped_values_count_as_absent(value: str) -> None:
    sample = parse_lines(
        f"vllm:num_requests_running {value}",
        "sglang:num_running_reqs 4",
        f'vllm:time_to_first_token_seconds_bucket{{le="1"}} {value}',
        f"vllm:time_to_first_token_seconds_count {value}",
        f"vllm:time_to_first_token_seconds_sum {value}",
        f"sglang:gen_throughput {value}",
    )
    assert sample == BackendSample(flavour=Flavour.VLLM, running=4.0)


def test_skipped_values_do_not_disturb_the_others() -> None:
    sample = parse_lines(
        "vllm:num_requests_running 2",
        "vllm:num_requests_running NaN",
        "vllm:num_requests_running -3",
        "vllm:num_requests_running +Inf",
        "vllm:num_requests_running 5",
    )
    assert sample.running == 7.0


HIST = "vllm:time_to_first_token_seconds"


def test_histogram_label_sets_are_added_per_bound_and_sorted() -> None:
    sample = parse_lines(
        f'{HIST}_bucket{{engine="1",le="+Inf"}} 5',
        f'{HIST}_bucket{{engine="1",le="0.5"}} 2',
        f'{HIST}_bucket{{engine="0",le="0.5"}} 1',
        f'{HIST}_bucket{{engine="0",le="+Inf"}} 3',
        f'{HIST}_bucket{{engine="0",le="0.1"}} 0',
        f'{HIST}_count{{engine="0"}} 3',
        f'{HIST}_count{{engine="1"}} 5',
        f'{HIST}_sum{{engine="0"}} 1.5',
        f'{HIST}_sum{{engine="1"}} 2.5',
    )
    assert sample.ttft == Histogram(
        buckets=((0.1, 0.0), (0.5, 3.0), (INF, 8.0)), count=8.0, sum=4.0
    )


def test_histogram_bound_spellings() -> None:
    sample = parse_lines(
        f'{HIST}_bucket{{le="1"}} 1',
        f'{HIST}_bucket{{le="1.0"}} 1',
        f'{HIST}_bucket{{le="1e0"}} 1',
        f'{HIST}_bucket{{le="Inf"}} 4',
        f'{HIST}_bucket{{le="+inf"}} 1',
        f'{HIST}_bucket{{le="-2"}} 0',
        f'{HIST}_bucket{{le="NaN"}} 9',
        f'{HIST}_bucket{{le="abc"}} 9',
        f'{HIST}_bucket{{le="1_0"}} 9',
        f'{HIST}_bucket{{le=""}} 9',
    )
    assert sample.ttft == Histogram(buckets=((-2.0, 0.0), (1.0, 3.0), (INF, 5.0)), count=5, sum=0)


def test_histogram_count_falls_back_to_the_inf_bucket() -> None:
    sample = parse_lines(f'{HIST}_bucket{{le="1"}} 2', f'{HIST}_bucket{{le="+Inf"}} 3')
    assert sample.ttft == Histogram(buckets=((1.0, 2.0), (INF, 3.0)), count=3.0, sum=0.0)
    only_sum = parse_lines(f"{HIST}_sum 2.5")
    assert only_sum.ttft == Histogram(buckets=(), count=0.0, sum=2.5)
    no_inf = parse_lines(f'{HIST}_bucket{{le="1"}} 2')
    assert no_inf.ttft == Histogram(buckets=((1.0, 2.0),), count=0.0, sum=0.0)


def test_ttft_is_the_first_histogram_with_observations() -> None:
    old = "vllm:request_time_to_first_token_seconds"
    sgl = "sglang:time_to_first_token_seconds"
    empty_new = (f'{HIST}_bucket{{le="+Inf"}} 0', f"{HIST}_count 0", f"{HIST}_sum 0")
    used_old = (f'{old}_bucket{{le="+Inf"}} 4', f"{old}_count 4", f"{old}_sum 2")
    used_sgl = (f'{sgl}_bucket{{le="+Inf"}} 9', f"{sgl}_count 9", f"{sgl}_sum 3")
    old_hist = Histogram(buckets=((INF, 4.0),), count=4.0, sum=2.0)
    sgl_hist = Histogram(buckets=((INF, 9.0),), count=9.0, sum=3.0)
    assert parse_lines(*used_sgl, *used_old, *empty_new).ttft == old_hist
    assert parse_lines(*used_sgl, *empty_new).ttft == sgl_hist
    assert parse_lines(*used_sgl).ttft == sgl_hist
    assert parse_lines(*used_old).ttft == old_hist
    # nothing observed anywhere: the first histogram present, with its zero count
    empty_sgl = (f'{sgl}_bucket{{le="+Inf"}} 0', f"{sgl}_count 0")
    zero = Histogram(buckets=((INF, 0.0),), count=0.0, sum=0.0)
    assert parse_lines(*empty_sgl, *empty_new).ttft == zero
    assert parse_lines(*empty_sgl).ttft == zero


def test_prompt_tokens_add_for_vllm_take_the_max_for_sglang_and_prefer_vllm() -> None:
    vllm = parse_lines(
        'vllm:prompt_tokens_total{engine="0"} 100',
        'vllm:prompt_tokens_total{engine="1"} 23',
        'vllm:prompt_tokens_created{engine="0"} 1.7e9',  # not the counter
        "vllm:request_prompt_tokens_sum 999",  # the per-request histogram is not read
    )
    assert vllm.prompt_tokens == 123.0
    sglang = parse_lines(
        'sglang:prompt_tokens_total{tp_rank="0"} 400', 'sglang:prompt_tokens_total{tp_rank="1"} 90'
    )
    assert sglang.prompt_tokens == 400.0
    both = parse_lines("sglang:prompt_tokens_total 400", "vllm:prompt_tokens_total 7")
    assert both.prompt_tokens == 7.0
    skipped = parse_lines("vllm:prompt_tokens_total NaN", "sglang:prompt_tokens_total 5")
    assert skipped.prompt_tokens == 5.0
    assert parse_lines("vllm:prompt_tokens_total -1").prompt_tokens is None
    assert parse_lines("vllm:generation_tokens_total 3").prompt_tokens is None


ITL = "vllm:inter_token_latency_seconds"
TPOT = "vllm:time_per_output_token_seconds"
SGL_ITL = "sglang:inter_token_latency_seconds"
SGL_TPOT = "sglang:time_per_output_token_seconds"


def used(base: str, count: int, total: float) -> tuple[str, ...]:
    return (
        f'{base}_bucket{{le="0.05"}} {count - 1}',
        f'{base}_bucket{{le="+Inf"}} {count}',
        f"{base}_count {count}",
        f"{base}_sum {total}",
    )


def test_inter_token_latency_prefers_the_current_names_with_observations() -> None:
    itl = Histogram(buckets=((0.05, 4.0), (INF, 5.0)), count=5.0, sum=0.2)
    tpot = Histogram(buckets=((0.05, 6.0), (INF, 7.0)), count=7.0, sum=0.3)
    sgl = Histogram(buckets=((0.05, 8.0), (INF, 9.0)), count=9.0, sum=0.4)
    sgl_old = Histogram(buckets=((0.05, 1.0), (INF, 2.0)), count=2.0, sum=0.1)
    # vLLM 0.10.2 to 0.14 exports both names; the current one is read
    assert parse_lines(*used(TPOT, 7, 0.3), *used(ITL, 5, 0.2)).inter_token_latency == itl
    assert parse_lines(*used(TPOT, 7, 0.3)).inter_token_latency == tpot
    assert parse_lines(*used(SGL_TPOT, 2, 0.1), *used(SGL_ITL, 9, 0.4)).inter_token_latency == sgl
    assert parse_lines(*used(SGL_TPOT, 2, 0.1)).inter_token_latency == sgl_old
    assert parse_lines(*used(SGL_ITL, 9, 0.4), *used(TPOT, 7, 0.3)).inter_token_latency == tpot
    # an empty current histogram gives way to one with observations, as for TTFT
    empty = (f'{ITL}_bucket{{le="+Inf"}} 0', f"{ITL}_count 0")
    assert parse_lines(*empty, *used(SGL_ITL, 9, 0.4)).inter_token_latency == sgl
    zero = Histogram(buckets=((INF, 0.0),), count=0.0, sum=0.0)
    assert parse_lines(*empty).inter_token_latency == zero
    # the two families never feed each other
    only_itl = parse_lines(*used(ITL, 5, 0.2))
    assert only_itl.ttft is None
    assert only_itl.inter_token_latency == itl
    only_ttft = parse_lines(*used(HIST, 5, 0.2))
    assert only_ttft.inter_token_latency is None
    assert only_ttft.ttft == itl


def test_inter_token_latency_label_sets_add_per_bound() -> None:
    sample = parse_lines(
        f'{ITL}_bucket{{engine="0",le="0.025"}} 10',
        f'{ITL}_bucket{{engine="1",le="0.025"}} 5',
        f'{ITL}_bucket{{engine="0",le="+Inf"}} 12',
        f'{ITL}_bucket{{engine="1",le="+Inf"}} 6',
        f'{ITL}_sum{{engine="0"}} 0.3',
        f'{ITL}_sum{{engine="1"}} 0.2',
    )
    assert sample.inter_token_latency == Histogram(
        buckets=((0.025, 15.0), (INF, 18.0)), count=18.0, sum=0.5
    )


def test_per_request_time_per_output_token_is_not_read() -> None:
    sample = parse_lines(
        *used("vllm:request_time_per_output_token_seconds", 4, 1.0),
        *used("sglang:request_time_per_output_token_seconds", 4, 1.0),
        f"{ITL}_created 1.7e9",
    )
    assert sample == BackendSample(flavour=Flavour.VLLM)


def test_broken_inter_token_latency_lines_are_errors() -> None:
    with pytest.raises(MetricsParseError, match="le label") as caught:
        parse_lines("vllm:num_requests_running 1", f'{TPOT}_bucket{{engine="0"}} 5')
    assert caught.value.line_no == 2
    with pytest.raises(MetricsParseError, match="no value"):
        parse_lines("sglang:prompt_tokens_total")


@pytest.mark.parametrize(
    "labels",
    [
        'le="2"',
        'le="2",engine="0"',
        'engine="0",le="2"',
        'engine="0", le="2"',
        'engine = "0" , le = "2" ,',
        'a="x,le=\\"9\\"",le="2"',  # an le inside another label's value is not the bound
        'a="x\\\\",le="2"',  # an escaped backslash ends that value
        'handle="9",le="2"',  # a label whose name ends in "le"
        'lex="9",le="2"',
        'a="{}",le="2",b="}"',
        'le="2",le="3"',  # the first le wins
    ],
)
def test_bucket_label_sets(labels: str) -> None:
    sample = parse_lines(f"{HIST}_bucket{{{labels}}} 1")
    assert sample.ttft is not None
    assert sample.ttft.buckets == ((2.0, 1.0),)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

BROKEN_RELEVANT = (
    ('vllm:num_requests_running{engine="0" 1', "never closed"),
    ("vllm:num_requests_running{", "never closed"),
    ("sglang:num_running_reqs {1", "never closed"),
    ("vllm:num_requests_running", "no value"),
    ("vllm:num_requests_running   \r", "no value"),
    ('vllm:num_requests_running{engine="0"}', "no value"),
    ('sglang:token_usage{tp_rank="0"}  ', "no value"),
    ("vllm:kv_cache_usage_perc 1 2 3", "more than"),
    ('vllm:generation_tokens_total{a="b"} 1 2 x', "more than"),
    (f'{HIST}_bucket{{engine="0"}} 1', "le label"),
    (f"{HIST}_bucket 1", "le label"),
    (f"{HIST}_bucket{{}} 1", "le label"),
    (f'{HIST}_bucket{{a="x,le=\\"1\\""}} 1', "le label"),
    (f'{HIST}_bucket{{model="x}} 1', "le label"),  # an unclosed value swallows the rest
    (f"{HIST}_bucket{{le=1}} 1", "le label"),  # an unquoted bound
    ('sglang:time_to_first_token_seconds_bucket{le="1" 1', "never closed"),
    (f"{HIST}_bucket{{le=NaN}} NaN", "le label"),  # structure is checked before values
)


@pytest.mark.parametrize(("line", "reason"), BROKEN_RELEVANT)
@pytest.mark.parametrize("indent", ["", "  "])
def test_broken_relevant_line_is_an_error_naming_it(line: str, reason: str, indent: str) -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Requests running.",
            "vllm:num_requests_waiting 3",
            "",
            f"{indent}{line}",
            "vllm:num_requests_running 1",
        ]
    )
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics(text)
    error = caught.value
    assert error.line_no == 4
    assert reason in error.reason
    assert "line 4" in str(error)
    assert isinstance(error, AdapterError)
    assert isinstance(error, GuardError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.line_no, copy.reason, str(copy)) == (4, error.reason, str(error))


@pytest.mark.parametrize(("line", "reason"), BROKEN_RELEVANT)
def test_same_breakage_in_an_unrelated_family_is_ignored(line: str, reason: str) -> None:
    del reason
    for unrelated in (line.replace(":", ":x_", 1), "python_" + line, line.replace(":", "_", 1)):
        assert parse_lines(unrelated, "vllm:num_requests_running 1").running == 1.0


def test_first_of_two_identical_broken_lines_is_reported() -> None:
    text = "a 1\nvllm:num_requests_running\nb 2\nvllm:num_requests_running\n"
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics(text)
    assert caught.value.line_no == 2


def test_line_numbers_count_crlf_lines_and_the_first_line() -> None:
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics("vllm:num_requests_running {\r\nx 1")
    assert caught.value.line_no == 1
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics(b"x 1\r\n\r\n# c\r\nsglang:num_queue_reqs\r\n")
    assert caught.value.line_no == 4


def test_page_size_limit() -> None:
    line = b"vllm:num_requests_running 1\n"
    filler = b"#" * (MAX_PAGE_BYTES - len(line) - 1) + b"\n"
    at_limit = line + filler
    assert len(at_limit) == MAX_PAGE_BYTES
    assert parse_metrics(at_limit).running == 1.0
    assert parse_metrics(at_limit.decode()).running == 1.0
    for too_big in (at_limit + b"\n", at_limit.decode() + "\n"):
        with pytest.raises(MetricsParseError) as caught:
            parse_metrics(too_big)
        assert caught.value.line_no is None
        assert str(MAX_PAGE_BYTES) in str(caught.value)
    # characters are not bytes: 1.5 Mi three-byte characters are 4.5 MiB of UTF-8
    wide = "\u20ac" * (MAX_PAGE_BYTES // 2)
    with pytest.raises(MetricsParseError):
        parse_metrics(wide)


def test_undecodable_bytes_are_replaced_not_refused() -> None:
    sample = parse_metrics(b'\xff\xfe junk\nvllm:num_requests_running{m="\xc3("} 2\n')
    assert sample.running == 2.0


# --------------------------------------------------------------------------------------------
# Generated pages against a plain model of the rules
# --------------------------------------------------------------------------------------------

#: name -> (field, engine, combine); an independent statement of the rules, not the module's.
PLAIN_RULES: dict[str, tuple[str, str, str]] = {
    "vllm:num_requests_running": ("running", "v", "sum"),
    "vllm:num_requests_waiting": ("waiting", "v", "sum"),
    "vllm:kv_cache_usage_perc": ("kv", "v", "max"),
    "vllm:gpu_cache_usage_perc": ("kv_old", "v", "max"),
    "vllm:num_preemptions_total": ("preempt", "v", "sum"),
    "vllm:generation_tokens_total": ("gen", "v", "sum"),
    "sglang:num_running_reqs": ("running", "s", "max"),
    "sglang:num_queue_reqs": ("waiting", "s", "max"),
    "sglang:token_usage": ("kv", "s", "max"),
    "sglang:num_retracted_reqs": ("retracted", "s", "max"),
    "sglang:total_retracted_reqs": ("retracted_old", "s", "max"),
    "sglang:num_paused_reqs": ("paused", "s", "max"),
    "sglang:generation_tokens_total": ("gen", "s", "max"),
    "sglang:gen_throughput": ("tps", "s", "max"),
    "vllm:prompt_tokens_total": ("prompt", "v", "sum"),
    "sglang:prompt_tokens_total": ("prompt", "s", "max"),
}
TTFT_BASES = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
)
ITL_BASES = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)
HIST_BASES = (*TTFT_BASES, *ITL_BASES)
HIST_NAMES = tuple(f"{base}_{part}" for base in HIST_BASES for part in ("bucket", "count", "sum"))
RELEVANT_NAMES = (*PLAIN_RULES, *HIST_NAMES)
LABEL_KEYS = ("engine", "model_name", "tp_rank", "handle", "lex", "is_streaming")


def test_learner_families_name_exactly_what_is_read() -> None:
    assert len(LEARNER_FAMILIES) == len(set(LEARNER_FAMILIES))
    assert set(LEARNER_FAMILIES) == {*PLAIN_RULES, *HIST_BASES}


class Series(NamedTuple):
    name: str
    labels: tuple[tuple[str, str], ...]
    le: str | None
    le_at: int
    value: str
    timestamp: str | None
    gap: str  # between the name or label set and the value
    indent: str
    spaced_labels: bool  # ", " between labels and a trailing comma


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(series: Series) -> str:
    pairs = [f'{key}="{escape(value)}"' for key, value in series.labels]
    if series.le is not None:
        pairs.insert(series.le_at % (len(pairs) + 1), f'le="{series.le}"')
    labels = ""
    if pairs:
        labels = (
            ("{" + ", ".join(pairs) + ",}") if series.spaced_labels else "{" + ",".join(pairs) + "}"
        )
    stamp = f" {series.timestamp}" if series.timestamp is not None else ""
    return f"{series.indent}{series.name}{labels}{series.gap}{series.value}{stamp}"


def number_texts(allow_junk: bool) -> st.SearchStrategy[str]:
    finite = st.floats(min_value=0.0, max_value=1e12, allow_nan=False)
    options = [
        finite.map(repr),
        finite.map(lambda x: f"{x:.6g}"),
        finite.map(lambda x: f"{x:e}"),
        st.integers(min_value=0, max_value=10**6).map(str),
        st.integers(min_value=0, max_value=10**6).map(lambda n: f"+{n}"),
        st.sampled_from(["NaN", "nan", "+Inf", "-Inf", "Inf", "-1", "-0.5", "1e400", "0"]),
        st.floats(min_value=1e-3, max_value=1e6).map(lambda x: repr(-x)),
    ]
    if allow_junk:
        options.append(st.sampled_from(["abc", "1_000", "0x10", "1.2.3", "--1", "one", "Infinity"]))
    return st.one_of(options)


def reference_value(text: str) -> float | None:
    if "_" in text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


BOUND_TEXTS = ("0.1", "0.5", "1", "1.0", "2.5", "10", "+Inf", "Inf", "-1", "NaN", "abc", "1_0")


@st.composite
def series_strategy(draw: st.DrawFn, allow_junk: bool) -> Series:
    name = draw(st.sampled_from(RELEVANT_NAMES))
    keys = draw(st.lists(st.sampled_from(LABEL_KEYS), unique=True, max_size=3))
    label_values = st.text(alphabet='ab0 _-/.,{}="\\:le\n', max_size=10)
    labels = tuple((key, draw(label_values)) for key in keys)
    is_bucket = name.endswith("_bucket")
    return Series(
        name=name,
        labels=labels,
        le=draw(st.sampled_from(BOUND_TEXTS)) if is_bucket else None,
        le_at=draw(st.integers(min_value=0, max_value=3)),
        value=draw(number_texts(allow_junk)),
        timestamp=draw(st.none() | st.integers(0, 2**41).map(str)),
        gap=draw(st.sampled_from([" ", "\t", "   "])),
        indent=draw(st.sampled_from(["", "", "", " ", "\t"])),
        spaced_labels=draw(st.booleans()),
    )


#: Lines that are not read, each accepted by prometheus_client (TYPE counter only for *_total:
#: prometheus_client renames other counters' samples).
UNRELATED = (
    "",
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    "# TYPE vllm:time_to_first_token_seconds histogram",
    "# TYPE vllm:num_preemptions_total counter",
    "# HELP sglang:token_usage The token usage.",
    "# a comment that mentions vllm:num_requests_running 5",
    'python_gc_objects_collected_total{generation="0"} 1234.0',
    "process_virtual_memory_bytes 1.2e+10",
    'http_requests_total{handler="/metrics",method="GET",status="2xx"} 14.0',
    'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0',
    'vllm:time_to_first_token_seconds_created{engine="0"} 1.77e+09',
    'vllm:num_preemptions_created{engine="0"} 1.77e+09',
    'vllm:num_preemptions{engine="0"} 99.0',
    "sglang:num_running_reqs_offline_batch 4.0",
    'sglang:num_retracted_requests_total{x="y"} 3.0',
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="850"} 1.0',
    'vllm:request_time_per_output_token_seconds_bucket{le="0.1"} 7.0',
    'sglang:request_time_per_output_token_seconds_count{is_streaming="true"} 7.0',
)
#: Unrelated lines that prometheus_client refuses (the scanner never looks at them).
UNRELATED_BROKEN = (
    "python_info{broken 1",
    'vllm:request_time_per_output_token_seconds_bucket{engine="0" 5',
    "http_x",
    "vllm:num_requests_running_x{",
    "sglang:foo 1 2 3 4",
    "vllm:num_requests_runningx",
)


def page_strategy(allow_junk: bool) -> st.SearchStrategy[list[Series | str]]:
    unrelated = UNRELATED + UNRELATED_BROKEN if allow_junk else UNRELATED
    return st.lists(st.one_of(series_strategy(allow_junk), st.sampled_from(unrelated)), max_size=40)


def assemble_page(items: list[Series | str], crlf: bool, final_newline: bool) -> str:
    newline = "\r\n" if crlf else "\n"
    lines = [render(item) if isinstance(item, Series) else item for item in items]
    return newline.join(lines) + (newline if final_newline else "")


def reference_sample(items: list[Series | str]) -> BackendSample:
    """The rules applied straight to the generated series, without any text parsing."""
    found: dict[tuple[str, str], float] = {}  # (field, engine) -> combined value
    per_bound = {base: dict[float, float]() for base in HIST_BASES}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    present: set[str] = set()
    names = []
    for item in items:
        line = render(item) if isinstance(item, Series) else item
        stripped = line.lstrip(" \t")
        if stripped and not stripped.startswith("#"):
            names.append(stripped)
        if not isinstance(item, Series):
            continue
        value = reference_value(item.value)
        if item.name in PLAIN_RULES:
            if value is None:
                continue
            field, engine, combine = PLAIN_RULES[item.name]
            key = (field, engine)
            if key not in found:
                found[key] = value
            elif combine == "sum":
                found[key] += value
            else:
                found[key] = max(found[key], value)
            continue
        base, _, part = item.name.rpartition("_")
        if value is None:
            continue
        if part == "bucket":
            assert item.le is not None
            if "_" in item.le:
                continue
            try:
                bound = float(item.le)
            except ValueError:
                continue
            if math.isnan(bound):
                continue
            per_bound[base][bound] = per_bound[base].get(bound, 0.0) + value
        elif part == "count":
            counts[base] = counts.get(base, 0.0) + value
        else:
            sums[base] = sums.get(base, 0.0) + value
        present.add(base)

    def pick(*keys: tuple[str, str]) -> float | None:
        for key in keys:
            if key in found:
                return found[key]
        return None

    retracted = pick(("retracted", "s"), ("retracted_old", "s"))
    parts = [p for p in (pick(("preempt", "v")), retracted, pick(("paused", "s"))) if p is not None]
    preemptions = None
    if parts:
        preemptions = parts[0]
        for extra in parts[1:]:
            preemptions += extra

    def first_histogram(bases: tuple[str, ...]) -> Histogram | None:
        chosen = None
        for base in bases:
            if base not in present:
                continue
            count = counts.get(base, per_bound[base].get(INF, 0.0))
            histogram = Histogram(
                buckets=tuple(per_bound[base].items()), count=count, sum=sums.get(base, 0.0)
            )
            if count > 0:
                return histogram
            if chosen is None:
                chosen = histogram
        return chosen

    if any(name.startswith("vllm:") for name in names):
        flavour = Flavour.VLLM
    elif any(name.startswith("sglang:") for name in names):
        flavour = Flavour.SGLANG
    else:
        flavour = Flavour.UNKNOWN
    return BackendSample(
        flavour=flavour,
        running=pick(("running", "v"), ("running", "s")),
        waiting=pick(("waiting", "v"), ("waiting", "s")),
        kv_usage=pick(("kv", "v"), ("kv_old", "v"), ("kv", "s")),
        preemptions=preemptions,
        generation_tokens=pick(("gen", "v"), ("gen", "s")),
        generation_tps=pick(("tps", "s")) if ("gen", "v") not in found else None,
        ttft=first_histogram(TTFT_BASES),
        prompt_tokens=pick(("prompt", "v"), ("prompt", "s")),
        inter_token_latency=first_histogram(ITL_BASES),
    )


@given(
    items=page_strategy(allow_junk=True),
    crlf=st.booleans(),
    final_newline=st.booleans(),
    as_bytes=st.booleans(),
)
def test_generated_pages_match_the_model(
    items: list[Series | str], crlf: bool, final_newline: bool, as_bytes: bool
) -> None:
    text = assemble_page(items, crlf, final_newline)
    parsed = parse_metrics(text.encode() if as_bytes else text)
    assert parsed == reference_sample(items)


@given(items=page_strategy(allow_junk=False), crlf=st.booleans(), final_newline=st.booleans())
def test_generated_pages_match_prometheus_client(
    client_parser: Parser, items: list[Series | str], crlf: bool, final_newline: bool
) -> None:
    text = assemble_page(items, crlf, final_newline)
    ours = parse_metrics(text)
    try:
        theirs = client_parser(text)
    except ValueError:
        event("prometheus_client refused the page")
        return
    event("prometheus_client accepted the page")
    assert ours == theirs
    assert ours == reference_sample(items)


BROKEN_STRATEGY = st.sampled_from([line for line, _ in BROKEN_RELEVANT])


@given(
    items=page_strategy(allow_junk=True),
    position=st.integers(min_value=0),
    broken=BROKEN_STRATEGY,
    crlf=st.booleans(),
)
def test_broken_line_anywhere_is_reported_with_its_number(
    items: list[Series | str], position: int, broken: str, crlf: bool
) -> None:
    lines = [render(item) if isinstance(item, Series) else item for item in items]
    index = position % (len(lines) + 1)
    lines.insert(index, broken)
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics(("\r\n" if crlf else "\n").join(lines))
    assert caught.value.line_no == index + 1


# --------------------------------------------------------------------------------------------
# Anything at all: a sample or MetricsParseError, and a reported line really is the culprit
# --------------------------------------------------------------------------------------------

TOKENS = (
    *RELEVANT_NAMES,
    "vllm:",
    "sglang:",
    "{",
    "}",
    '"',
    "=",
    ",",
    "le",
    'le="',
    "+Inf",
    "NaN",
    "-Inf",
    "1",
    "0.5",
    "-2",
    "1e308",
    "_",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\\",
    "#",
    "x",
    "\u20ac",
)


def check_outcome(text: str | bytes) -> None:
    try:
        sample = parse_metrics(text)
    except MetricsParseError as error:
        check_error(text, error)
        return
    for field in (
        "running",
        "waiting",
        "kv_usage",
        "preemptions",
        "generation_tokens",
        "prompt_tokens",
    ):
        value = getattr(sample, field)
        assert value is None or value >= 0, (field, value)
    assert sample.generation_tps is None or sample.generation_tps >= 0
    for histogram in (sample.ttft, sample.inter_token_latency):
        if histogram is not None:
            assert histogram.count >= 0
            assert histogram.sum >= 0
            assert all(not math.isnan(bound) and count >= 0 for bound, count in histogram.buckets)


def check_error(text: str | bytes, error: MetricsParseError) -> None:
    assert error.line_no is not None  # small pages are never refused for their size
    decoded = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    lines = decoded.split("\n")
    assert 1 <= error.line_no <= len(lines)
    culprit = lines[error.line_no - 1]
    # the culprit starts with a name that is read, ends there or goes on with "{" or a blank
    head = culprit.lstrip(" \t")
    assert any(
        head.startswith(name)
        and (head[len(name) : len(name) + 1] in ("", "{") or head[len(name)].isspace())
        for name in RELEVANT_NAMES
    ), culprit
    # everything before it reads fine, and the line alone fails as line 1
    parse_metrics("\n".join(lines[: error.line_no - 1]))
    with pytest.raises(MetricsParseError) as alone:
        parse_metrics(culprit)
    assert alone.value.line_no == 1


@given(st.lists(st.sampled_from(TOKENS), max_size=60).map("".join))
def test_token_soup_gives_a_sample_or_a_located_error(text: str) -> None:
    check_outcome(text)


@given(st.text(max_size=300))
def test_arbitrary_text_gives_a_sample_or_an_error(text: str) -> None:
    check_outcome(text)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_sample_or_an_error(data: bytes) -> None:
    check_outcome(data)


@given(
    name=st.sampled_from(ALL_PAGES),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.sampled_from((*TOKENS, "", ""))), max_size=8
    ),
)
def test_damaged_real_pages_give_a_sample_or_a_located_error(
    name: str, edits: list[tuple[int, str]]
) -> None:
    text = page(name).decode()
    for position, token in edits:
        at = position % (len(text) + 1)
        text = text[:at] + token + text[at + 1 :]
    assume(text)
    check_outcome(text)
