"""A second metrics-page reader built on prometheus_client, kept outside the package.

It exists for two jobs: the benchmark (``bench_metrics_parse.py``) times it against
:func:`guard_adapters.metrics.parse_metrics`, and the property tests use it as an independent
cross-check on pages that prometheus_client accepts. It applies the same rules as the package
parser (same names, sum for ``vllm:`` and max for ``sglang:``, the same precedence, histogram
assembly and value skipping), but written over prometheus_client's sample objects instead of over
raw lines, and without sharing any table with the package module.

Differences that are prometheus_client's, not ours: it raises ``ValueError`` on many pages the
package parser reads (bad label syntax, an ``_`` in a value, ...); it tolerates more than two fields
after a name; and after ``# TYPE x counter`` it renames samples of ``x`` to ``x_total``. The real
pages meet none of these.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from guard_adapters._errors import MetricsParseError
from guard_adapters.metrics import MAX_PAGE_BYTES
from guard_core.observations import BackendSample, Flavour, Histogram

__all__ = ("parse_metrics_with_prometheus_client",)

_ADDED = {
    "vllm:num_requests_running": "running_v",
    "vllm:num_requests_waiting": "waiting_v",
    "vllm:num_preemptions_total": "preempt_v",
    "vllm:generation_tokens_total": "gen_v",
    "vllm:prompt_tokens_total": "prompt_v",
}
_HIGHEST = {
    "vllm:kv_cache_usage_perc": "kv_v",
    "vllm:gpu_cache_usage_perc": "kv_v_legacy",
    "sglang:num_running_reqs": "running_s",
    "sglang:num_queue_reqs": "waiting_s",
    "sglang:token_usage": "kv_s",
    "sglang:num_retracted_reqs": "retracted_s",
    "sglang:total_retracted_reqs": "retracted_s_legacy",
    "sglang:num_paused_reqs": "paused_s",
    "sglang:generation_tokens_total": "gen_s",
    "sglang:gen_throughput": "tps_s",
    "sglang:prompt_tokens_total": "prompt_s",
}
_TTFT = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
)
_ITL = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)


class _Hist:
    def __init__(self) -> None:
        self.per_bound: dict[float, float] = {}
        self.count: float | None = None
        self.total: float | None = None
        self.seen = False


def _number(raw: float | int) -> float | None:
    """The sample value as a float, or None when the package parser would skip it."""
    try:
        value = float(raw)
    except OverflowError:  # an integer too large for a float
        return None
    if math.isnan(value) or math.isinf(value) or value < 0:
        return None
    return value


def _either(first: float | None, second: float | None) -> float | None:
    return first if first is not None else second


def _take(
    name: str,
    labels: dict[str, str],
    raw: float | int,
    values: dict[str, float],
    hists: dict[str, _Hist],
) -> None:
    """Fold one prometheus_client sample into the running totals."""
    if name in _ADDED or name in _HIGHEST:
        value = _number(raw)
        if value is None:
            return
        if name in _ADDED:
            key = _ADDED[name]
            values[key] = values[key] + value if key in values else value
        else:
            key = _HIGHEST[name]
            values[key] = max(values[key], value) if key in values else value
        return
    base, _, part = name.rpartition("_")
    hist = hists.get(base)
    if hist is None or part not in ("bucket", "count", "sum"):
        return
    bound = 0.0
    if part == "bucket":
        le = labels.get("le")
        if le is None:
            raise MetricsParseError(f"{name} sample without an le label")
        try:
            bound = float(le) if "_" not in le else math.nan
        except ValueError:
            bound = math.nan
    value = _number(raw)
    if value is None:
        return
    if part == "bucket":
        if math.isnan(bound):
            return
        hist.per_bound[bound] = hist.per_bound.get(bound, 0.0) + value
    elif part == "count":
        hist.count = value if hist.count is None else hist.count + value
    else:
        hist.total = value if hist.total is None else hist.total + value
    hist.seen = True


def _pick(names: tuple[str, ...], hists: dict[str, _Hist]) -> Histogram | None:
    """The first of ``names`` with a count above zero, else the first seen at all."""
    chosen: Histogram | None = None
    for name in names:
        hist = hists[name]
        if not hist.seen:
            continue
        count = hist.count if hist.count is not None else hist.per_bound.get(math.inf, 0.0)
        candidate = Histogram(
            buckets=tuple(hist.per_bound.items()), count=count, sum=hist.total or 0.0
        )
        if count > 0:
            return candidate
        if chosen is None:
            chosen = candidate
    return chosen


def parse_metrics_with_prometheus_client(page: bytes | str) -> BackendSample:
    """Same contract as ``parse_metrics`` on pages prometheus_client can parse.

    Raises:
        MetricsParseError: the page is too large, or a histogram bucket has no ``le`` label.
        ValueError: prometheus_client refused the page.
    """
    if isinstance(page, str):
        size = len(page.encode("utf-8", "surrogatepass"))
        text = page
    else:
        size = len(page)
        text = page.decode("utf-8", "replace")
    if size > MAX_PAGE_BYTES:
        raise MetricsParseError(f"page is {size} bytes, over the {MAX_PAGE_BYTES} byte limit")

    values: dict[str, float] = {}
    hists = {name: _Hist() for name in (*_TTFT, *_ITL)}
    saw_vllm = saw_sglang = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            saw_vllm = saw_vllm or sample.name.startswith("vllm:")
            saw_sglang = saw_sglang or sample.name.startswith("sglang:")
            _take(sample.name, sample.labels, sample.value, values, hists)
    ttft = _pick(_TTFT, hists)

    preemptions: float | None = None
    retracted = _either(values.get("retracted_s"), values.get("retracted_s_legacy"))
    for part_value in (values.get("preempt_v"), retracted, values.get("paused_s")):
        if part_value is not None:
            preemptions = part_value if preemptions is None else preemptions + part_value

    if saw_vllm:
        flavour = Flavour.VLLM
    elif saw_sglang:
        flavour = Flavour.SGLANG
    else:
        flavour = Flavour.UNKNOWN
    return BackendSample(
        flavour=flavour,
        running=_either(values.get("running_v"), values.get("running_s")),
        waiting=_either(values.get("waiting_v"), values.get("waiting_s")),
        kv_usage=_either(
            _either(values.get("kv_v"), values.get("kv_v_legacy")), values.get("kv_s")
        ),
        preemptions=preemptions,
        generation_tokens=_either(values.get("gen_v"), values.get("gen_s")),
        generation_tps=values.get("tps_s") if "gen_v" not in values else None,
        ttft=ttft,
        prompt_tokens=_either(values.get("prompt_v"), values.get("prompt_s")),
        inter_token_latency=_pick(_ITL, hists),
    )
