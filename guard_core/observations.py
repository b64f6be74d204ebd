"""What one metrics scrape of one backend says, as plain values (spec 5.1).

Reads: nothing; adapters build these from Prometheus text, tests and replays build them directly.
Guarantees: a field is ``None`` when the page carried none of the metric names for it, so "absent"
and "zero" stay distinguishable; histogram buckets are cumulative and sorted by bound.
"""

from __future__ import annotations

import enum
import math

import attrs

__all__ = ("BackendSample", "Flavour", "Histogram")


class Flavour(enum.StrEnum):
    """Which engine's metric names a page used."""

    VLLM = "vllm"
    SGLANG = "sglang"
    UNKNOWN = "unknown"


def _sorted_buckets(
    buckets: tuple[tuple[float, float], ...],
) -> tuple[tuple[float, float], ...]:
    return tuple(sorted(buckets, key=lambda bucket: bucket[0]))


@attrs.frozen
class Histogram:
    """A cumulative histogram: ``(upper_bound, cumulative_count)`` pairs, ``+inf`` allowed."""

    buckets: tuple[tuple[float, float], ...] = attrs.field(converter=_sorted_buckets)
    count: float
    sum: float

    @property
    def finite_buckets(self) -> tuple[tuple[float, float], ...]:
        return tuple(bucket for bucket in self.buckets if not math.isinf(bucket[0]))


@attrs.frozen(kw_only=True)
class BackendSample:
    """The fields of one backend's metrics page that the capacity learner reads."""

    flavour: Flavour = Flavour.UNKNOWN
    #: Requests being generated (``vllm:num_requests_running`` / ``sglang:num_running_reqs``).
    running: float | None = None
    #: Requests queued in the engine (``vllm:num_requests_waiting`` / ``sglang:num_queue_reqs``).
    waiting: float | None = None
    #: KV-cache usage in [0, 1] (``vllm:kv_cache_usage_perc`` / ``sglang:token_usage``).
    kv_usage: float | None = None
    #: Cumulative preemptions (vLLM) or retracted plus paused requests (SGLang).
    preemptions: float | None = None
    #: Cumulative generated tokens (``*:generation_tokens_total``).
    generation_tokens: float | None = None
    #: SGLang's own generation rate in tok/s (``sglang:gen_throughput``); used only when the
    #: generation token counter is absent.
    generation_tps: float | None = None
    #: Time-to-first-token histogram of the engine.
    ttft: Histogram | None = None
    #: Cumulative prompt tokens the engine has taken in (``*:prompt_tokens_total``).
    prompt_tokens: float | None = None
    #: Histogram of the gaps between consecutive output tokens of a request: vLLM's and
    #: SGLang's ``inter_token_latency_seconds``, else the older ``time_per_output_token_seconds``.
    inter_token_latency: Histogram | None = None
