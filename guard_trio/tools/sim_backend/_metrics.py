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
from typing import TYPE_CHECKING

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


def _itl_family(
    name: str,
    documentation: str,
    *,
    labels: tuple[list[str], list[str]],
    metrics: EngineMetrics,
    bounds: Sequence[float],
) -> HistogramMetricFamily:
    """The engine's inter-token latency histogram under ``name``; ``labels``: names, values."""
    family = HistogramMetricFamily(name, documentation, labels=labels[0])
    family.add_metric(labels[1], _bucket_pairs(bounds, metrics.itl_bucket_counts), metrics.itl_sum)
    return family


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
        names = ["model_name"] if legacy else ["model_name", "engine"]
        values = [model] if legacy else [model, "0"]
        created = driver.created_wall
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                m.running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting),
            (
                ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
                if legacy
                else ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
            )
            + (m.kv_usage,),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=names)
            gauge.add_metric(values, float(value))
            yield gauge
        counters = (
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                m.preemptions_total,
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                m.generation_tokens_total,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=names)
            counter.add_metric(values, float(value), created=created)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in driver.finished_by_reason.items():
            success.add_metric([*values, reason], float(count), created=created)
        yield success
        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=names,
        )
        histogram = driver.ttft_histogram
        ttft.add_metric(values, histogram.buckets(), histogram.sum)
        yield ttft
        itl_name, itl_help = (
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.")
            if legacy
            else (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
            )
        )
        yield _itl_family(
            itl_name, itl_help, labels=(names, values), metrics=m, bounds=driver.itl_buckets
        )

    def _sglang(self, m: EngineMetrics, model: str) -> Iterator[Metric]:
        driver = self._driver
        scheduler = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        scheduler_values = [model, "unified", "0", "0"]
        tokenizer = ["model_name", "engine_type"]
        tokenizer_values = [model, "unified"]
        gauges = (
            ("sglang:num_running_reqs", "The number of running requests.", m.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", m.waiting),
            ("sglang:token_usage", "The token usage.", m.kv_usage),
            (
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                driver.generation_rate(m),
            ),
            # Cumulative here: what a guard reads from this gauge is the count of retractions.
            ("sglang:num_retracted_reqs", "The number of retracted requests.", m.preemptions_total),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=scheduler)
            gauge.add_metric(scheduler_values, float(value))
            yield gauge
        counters = (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                m.generation_tokens_total,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=tokenizer)
            counter.add_metric(tokenizer_values, float(value), created=driver.created_wall)
            yield counter
        ttft = HistogramMetricFamily(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=tokenizer,
        )
        histogram = driver.ttft_histogram
        ttft.add_metric(tokenizer_values, histogram.buckets(), histogram.sum)
        yield ttft
        yield _itl_family(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=(tokenizer, tokenizer_values),
            metrics=m,
            bounds=driver.itl_buckets,
        )


def metrics_registry(driver: EngineDriver, config: SimBackendConfig) -> CollectorRegistry:
    """A registry of its own whose one collector reads ``driver`` at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(driver, config))
    return registry
