"""Where each backend lives, and what is polled for it.

Reads: the validated :class:`~guard_adapters.config.Settings` (its backends and metrics URLs).
Guarantees:
- a backend's address (:class:`UpstreamTarget`) is read from its URL once: the host, the port
  (80 or 443 by default), the ``Host`` header value without any userinfo, and the path prefix
  without a trailing slash;
- with several backends each is polled under its own name, its engine's ``/health`` with it
  (an engine that died may keep serving ``/metrics``); otherwise the metrics URLs are polled
  as ``metrics1``, ``metrics2``... and summed as one signal, as PIG does;
- a timeout setting of 0 means none (:func:`budget`);
- :class:`RelayConfig` is every setting forwarding reads, converted once.
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

import attrs

from guard_adapters.affinity_key import AffinityKeying
from guard_adapters.config import Settings
from guard_core.affinity import build_ring
from guard_core.backend_pick import Routing

__all__ = (
    "MetricsSource",
    "RelayConfig",
    "UpstreamTarget",
    "budget",
    "health_url",
    "poll_sources",
)


@attrs.frozen
class UpstreamTarget:
    """Where one backend lives."""

    name: str
    scheme: str
    host: str
    port: int
    #: ``host:port`` as the Host header of upstream requests.
    authority: str
    #: Path prefix of the upstream URL ("" or "/something").
    base_path: str

    @classmethod
    def from_url(cls, name: str, url: str) -> UpstreamTarget:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        host = parts.hostname or ""
        authority = parts.netloc.rpartition("@")[2]
        return cls(name, parts.scheme, host, port, authority, parts.path.rstrip("/"))


@attrs.frozen
class MetricsSource:
    name: str
    url: str
    #: Also checked each round when set: a non-200 answer fails the backend for that round (a
    #: server whose engine died may keep serving /metrics).
    health_url: str | None = None


def health_url(upstream: str) -> str:
    """The engine's health route: ``/health`` at the root of the backend's host (vLLM, SGLang)."""
    parts = urlsplit(upstream)
    return f"{parts.scheme}://{parts.netloc}/health"


def poll_sources(settings: Settings) -> tuple[MetricsSource, ...]:
    """What the pollers fetch each round (see the module rules)."""
    if settings.backend_routing:
        return tuple(
            MetricsSource(name=b.name, url=b.metrics_url, health_url=health_url(b.upstream))
            for b in settings.backends
            if b.metrics_url
        )
    return tuple(
        MetricsSource(name=f"metrics{i}", url=url)
        for i, url in enumerate(settings.metrics_urls, start=1)
    )


def budget(seconds: float) -> float:
    """A timeout setting in seconds, 0 meaning none."""
    return float(seconds) if seconds > 0 else math.inf


@attrs.frozen
class RelayConfig:
    """What forwarding reads of the settings, typed once: the backends, the timeouts, the SSE
    features and, under ``PIG_ROUTING=guard``, the affinity ring and keying."""

    targets: tuple[UpstreamTarget, ...]
    proxy_timeout_s: float
    #: ``UPSTREAM_ERROR_CLASSIFICATION_ENABLED``, ``SSE_KEEPALIVE_ENABLED``,
    #: ``SSE_EARLY_BRIDGE_ENABLED``.
    classify_errors: bool
    sse_keepalive: bool
    sse_early_bridge: bool
    #: ``PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS`` and ``PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS`` (inf: none).
    head_timeout_s: float
    idle_timeout_s: float
    routing: Routing
    #: How requests are keyed for affinity (None: no affinity).
    keying: AffinityKeying | None

    @classmethod
    def of(cls, settings: Settings) -> RelayConfig:
        env = settings.env
        targets = tuple(UpstreamTarget.from_url(b.name, b.upstream) for b in settings.backends)
        guard = settings.guard_routing
        return cls(
            targets=targets,
            proxy_timeout_s=float(env.proxy_timeout_seconds),
            classify_errors=env.upstream_error_classification_enabled,
            sse_keepalive=env.sse_keepalive_enabled,
            sse_early_bridge=env.sse_early_bridge_enabled,
            head_timeout_s=budget(env.pig_upstream_head_timeout_seconds),
            idle_timeout_s=budget(env.pig_upstream_idle_timeout_seconds),
            routing=Routing(
                poll_interval_s=env.dynamic_poll_interval_ms / 1000,
                dynamic=settings.dynamic_enabled,
                ring=build_ring(tuple(t.name for t in targets)) if guard else None,
                bound=float(env.pig_affinity_bound),
            ),
            keying=AffinityKeying(
                env.pig_affinity_header.strip().lower().encode(),
                int(env.pig_affinity_prefix_bytes),
            )
            if guard
            else None,
        )
