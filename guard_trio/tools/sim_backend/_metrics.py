"""The simulated backend's ``/metrics`` page: the engine's figures under each server's names.

Reads: the engine's figures at the instant of a scrape (through the driver, which first brings
the engine to now), the finish-reason counts and the TTFT histogram the driver keeps.

Guarantees: the page is produced by prometheus-client from a private registry with this one
collector, so its text format is the library's; vLLM's current names (0.33, with the ``engine``
label), its 0.7-era names (no ``engine`` label, the old KV gauge, ``time_per_output_token``) or
SGLang's, with each flavour's histogram bounds (:func:`~._config.histogram_bounds`);
:func:`guard_adapters.metrics.parse_metrics` reads the same numbers back.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from guard_adapters.engine_model import EngineMetrics
from guard_trio.tools.sim_backend._config import SimBackendConfig

if TYPE_CHECKING:  # the driver keeps a histogram of this module
    from guard_trio.tools.sim_backend._driver import EngineDriver


class Histogram:
    """A cumulative-on-read histogram with the ``le`` semantics of prometheus-client."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        return _bucket_pairs(self.bounds, itertools.accumulate(self.counts))


def _bucket_pairs(bounds: Sequence[float], cumulative: Iterable[int]) -> list[tuple[str, float]]:
    """``(le, cumulative count)`` pairs as HistogramMetricFamily takes them, ``+Inf`` last."""
    return [
        ("+Inf" if bound == math.inf else repr(float(bound)), float(total))
        for bound, total in zip((*bounds, math.inf), cumulative, strict=True)
    ]


#: A metric's labels: their names and, in the same order, their values.
Labels = tuple[list[str], list[str]]
_TTFT_HELP: Final = "Histogram of time to first token in seconds."
_ITL_HELP: Final = "Histogram of inter-token latency in seconds."


def _gauges(rows: Iterable[tuple[str, str, float]], labels: Labels) -> Iterator[Metric]:
    """One gauge per ``(name, help, value)`` row."""
    for name, documentation, value in rows:
        gauge = GaugeMetricFamily(name, documentation, labels=labels[0])
        gauge.add_metric(labels[1], float(value))
        yield gauge


def _counters(
    rows: Iterable[tuple[str, str, float]], labels: Labels, created: float
) -> Iterator[Metric]:
    """One counter per ``(name, help, value)`` row, each with the server's start as ``created``."""
    for name, documentation, value in rows:
        counter = CounterMetricFamily(name, documentation, labels=labels[0])
        counter.add_metric(labels[1], float(value), created=created)
        yield counter


def _histograms(
    driver: EngineDriver, metrics: EngineMetrics, labels: Labels, ttft: str, itl: tuple[str, str]
) -> Iterator[Metric]:
    """The TTFT histogram the driver keeps and the engine's inter-token latency histogram."""
    histogram = driver.ttft_histogram
    first = HistogramMetricFamily(ttft, _TTFT_HELP, labels=labels[0])
    first.add_metric(labels[1], histogram.buckets(), histogram.sum)
    yield first
    pairs = _bucket_pairs(driver.itl_buckets, metrics.itl_bucket_counts)
    between = HistogramMetricFamily(itl[0], itl[1], labels=labels[0])
    between.add_metric(labels[1], pairs, metrics.itl_sum)
    yield between


class _Collector:
    """The engine's figures as vLLM (current or 0.7-era names) or SGLang expose them."""

    def __init__(self, driver: EngineDriver, config: SimBackendConfig) -> None:
        self._driver = driver
        self._config = config

    def collect(self) -> Iterator[Metric]:
        metrics = self._driver.engine_metrics()
        config = self._config
        if config.flavour == "sglang":
            yield from self._sglang(metrics, config.model)
        else:
            yield from self._vllm(metrics, config.model, legacy=config.metrics_names == "legacy")

    def _vllm(self, m: EngineMetrics, model: str, *, legacy: bool) -> Iterator[Metric]:
        driver = self._driver
        labels = (["model_name"], [model]) if legacy else (["model_name", "engine"], [model, "0"])
        kv = (
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
            if legacy
            else ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        )
        yield from _gauges(
            (
                (
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    m.running,
                ),
                (
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    m.waiting,
                ),
                (*kv, m.kv_usage),
            ),
            labels,
        )
        yield from _counters(
            (
                (
                    "vllm:num_preemptions",
                    "Cumulative number of preemption from the engine.",
                    m.preemptions_total,
                ),
                (
                    "vllm:prompt_tokens",
                    "Number of prefill tokens processed.",
                    m.prompt_tokens_total,
                ),
                (
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    m.generation_tokens_total,
                ),
            ),
            labels,
            driver.created_wall,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels[0], "finished_reason"],
        )
        for reason, count in driver.finished_by_reason.items():
            success.add_metric([*labels[1], reason], float(count), created=driver.created_wall)
        yield success
        itl = (
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.")
            if legacy
            else ("vllm:inter_token_latency_seconds", _ITL_HELP)
        )
        yield from _histograms(driver, m, labels, "vllm:time_to_first_token_seconds", itl)

    def _sglang(self, m: EngineMetrics, model: str) -> Iterator[Metric]:
        driver = self._driver
        scheduler = (
            ["model_name", "engine_type", "tp_rank", "pp_rank"],
            [model, "unified", "0", "0"],
        )
        tokenizer = (["model_name", "engine_type"], [model, "unified"])
        rate = driver.generation_rate(m)
        yield from _gauges(
            (
                ("sglang:num_running_reqs", "The number of running requests.", m.running),
                (
                    "sglang:num_queue_reqs",
                    "The number of requests in the waiting queue.",
                    m.waiting,
                ),
                ("sglang:token_usage", "The token usage.", m.kv_usage),
                ("sglang:gen_throughput", "The generation throughput (token/s).", rate),
                # Cumulative here: what a guard reads from this gauge is the count of retractions.
                (
                    "sglang:num_retracted_reqs",
                    "The number of retracted requests.",
                    m.preemptions_total,
                ),
            ),
            scheduler,
        )
        yield from _counters(
            (
                (
                    "sglang:prompt_tokens",
                    "Number of prefill tokens processed.",
                    m.prompt_tokens_total,
                ),
                (
                    "sglang:generation_tokens",
                    "Number of generation tokens processed.",
                    m.generation_tokens_total,
                ),
            ),
            tokenizer,
            driver.created_wall,
        )
        yield from _histograms(
            driver,
            m,
            tokenizer,
            "sglang:time_to_first_token_seconds",
            ("sglang:inter_token_latency_seconds", _ITL_HELP),
        )


def metrics_registry(driver: EngineDriver, config: SimBackendConfig) -> CollectorRegistry:
    """A registry of its own whose one collector reads ``driver`` at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(driver, config))
    return registry
