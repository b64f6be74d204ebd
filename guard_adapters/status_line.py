"""The two log lines PIG operators grep for: the start-up line and ``pig_status`` (spec 10.3).

Reads: the loaded :class:`~guard_adapters.config.Settings` (start-up line) and, for
``pig_status``, the guard's state: the value the latest poll published
(:class:`~guard_core.published.Published`), the gate's counts and the traffic counts
(:func:`runtime_counts` gathers the per-backend and tier figures; a caller may pass its own).
Guarantees:
- pure: no clock, no logging; each function returns one line without the trailing newline and
  without the ``YYYY/MM/DD HH:MM:SS`` prefix, which belongs to the logger;
- every ``pig_status`` field appears in PIG's order with PIG's number formats (``%.3f`` KV,
  ``%.1f`` rates, ``%.2f`` latencies, ``na`` for a rate that is not valid), the optional fields
  only when they carry something, and ``backend_detail`` only with more than one backend;
- durations in the start-up line use Go's notation (``500ms``, ``5s``, ``1m30s``);
- fields the latest poll did not produce (start-up, a poll round where every backend failed)
  print as 0 or as an empty state, and empty reasons print as ``unknown``, as PIG does;
- this guard's own additions appear only where PIG's line has nothing to say:
  ``failure_mode=open`` at the end under ``PIG_FAILURE_MODE=open`` (``open:failing`` while it
  forwards for want of metrics), and in ``backend_detail`` a backend's health when it is not
  available (``/ejected``, ``/probe``, ``/probing``, ``/full``) at the ``now`` given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final
from urllib.parse import urlsplit, urlunsplit

import attrs

from guard_adapters.config import Settings
from guard_core.decision import PublishedDecision
from guard_core.evaluation import Snapshot
from guard_core.gate import failing_open
from guard_core.guard import GuardState
from guard_core.health import Availability, availability
from guard_core.signals import PollSignals
from guard_core.tier import basic_limit, premium_reserved
from guard_core.ttft_learner import TtftSource

__all__ = (
    "PROGRAM",
    "BackendDetail",
    "RuntimeCounts",
    "current_snapshot",
    "go_duration",
    "runtime_counts",
    "startup_line",
    "status_line",
)

#: The program name at the start of the start-up line (PIG writes ``phala-inference-guard``).
PROGRAM: Final = "inference-guard"
_UNKNOWN: Final = "unknown"
#: The throughput learner's mode label; PIG only has the clean capacity cap.
_CAPACITY_MODE: Final = "cap"


@attrs.frozen(kw_only=True)
class BackendDetail:
    """One backend's in-flight count and the TTFT window of its latest good poll."""

    inflight: int = 0
    ttft_valid: bool = False
    ttft_p95: float = 0.0
    ttft_p99: float = 0.0


@attrs.frozen(kw_only=True)
class RuntimeCounts:
    """The status line's per-backend and tier figures (:func:`runtime_counts` reads them)."""

    #: Tier rejects since the previous good poll: ``(basic, premium)``.
    tier_reject_delta: tuple[int, int] = (0, 0)
    backends: Mapping[str, BackendDetail] = attrs.field(factory=dict)


# -- shared helpers (the metrics collector uses them too) --------------------------------------


def current_snapshot(state: GuardState) -> Snapshot | None:
    """The learner's snapshot behind the published decision, or ``None``.

    ``None`` before the first good poll and after a round where every backend failed: the
    published decision then carries no learner detail (the learner keeps its snapshot for the
    next good poll, but it is not what is published).
    """
    return state.published.snapshot


def runtime_counts(state: GuardState, backend_names: Sequence[str]) -> RuntimeCounts:
    """The tier reject deltas the latest poll published, and per backend its in-flight count
    and its own TTFT window."""
    details = {}
    for name in backend_names:
        figures = state.published.backend(name)
        ttft = figures.ttft if figures is not None else None
        details[name] = BackendDetail(
            inflight=state.traffic.inflight_of(name),
            ttft_valid=ttft is not None,
            ttft_p95=ttft.p95 if ttft is not None else 0.0,
            ttft_p99=ttft.p99 if ttft is not None else 0.0,
        )
    return RuntimeCounts(tier_reject_delta=state.published.tier_reject_delta, backends=details)


def go_duration(seconds: float) -> str:
    """``seconds`` written as Go's ``time.Duration.String`` writes it (``500ms``, ``1m0s``)."""
    nanos = round(seconds * 1e9)
    if nanos == 0:
        return "0s"
    sign = "-" if nanos < 0 else ""
    nanos = abs(nanos)
    if nanos < 1_000:
        return f"{sign}{nanos}ns"
    if nanos < 1_000_000:
        return f"{sign}{_decimal(nanos, 3)}µs"
    if nanos < 1_000_000_000:
        return f"{sign}{_decimal(nanos, 6)}ms"
    whole, fraction = divmod(nanos, 1_000_000_000)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = _decimal(secs * 1_000_000_000 + fraction, 9) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{text}"
    if minutes:
        return f"{sign}{minutes}m{text}"
    return sign + text


def _decimal(value: int, digits: int) -> str:
    """``value / 10**digits`` with the fraction's trailing zeros dropped."""
    whole, fraction = divmod(value, 10**digits)
    tail = f"{fraction:0{digits}d}".rstrip("0")
    return f"{whole}.{tail}" if tail else str(whole)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _masked(url: str) -> str:
    """``url`` with any password in it replaced, so the log never carries a secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:<redacted>@{host}"))


# -- start-up line ----------------------------------------------------------------------------


def startup_line(settings: Settings, *, version: str, program: str = PROGRAM) -> str:
    """The line written once at start, before the first ``pig_status`` line."""
    env = settings.env
    upstream = settings.backends[0].upstream if settings.backends else env.upstream
    fields = (
        f"listen={env.listen}",
        f"upstream={_masked(upstream)}",
        f"backends={len(settings.backends)}",
        f"dynamic={_bool(env.dynamic_pig_enabled)}/{_bool(env.dynamic_pig_enforce)}",
        f"metrics={len(settings.metrics_urls)}",
        f"queue={go_duration(env.pig_queue_wait_seconds)}",
        f"poll={go_duration(env.pig_queue_poll_ms / 1000)}",
        f"status_log={go_duration(env.pig_status_log_interval_seconds)}",
        "target_tps="
        f"{env.dynamic_single_user_tps_red:.1f}/{env.dynamic_single_user_tps_yellow:.1f}",
        f"capacity_learning={_CAPACITY_MODE}",
        f"learn={_bool(env.dynamic_single_user_tps_capacity_learn_enabled)}",
        f"ttft={_bool(env.dynamic_ttft_enabled)}",
        "upstream_error_classification=" + _bool(bool(env.upstream_error_classification_enabled)),
        f"sse_keepalive={_bool(bool(env.sse_keepalive_enabled))}",
        f"sse_early_bridge={_bool(bool(env.sse_early_bridge_enabled))}",
        f"global_cap={env.global_limit}",
    )
    return f"{program} {version} " + " ".join(fields)


# -- pig_status --------------------------------------------------------------------------------


def _or_unknown(text: str) -> str:
    return text or _UNKNOWN


def _count(value: int | None) -> int:
    return 0 if value is None else value


def _state_part(decision: PublishedDecision) -> str:
    state = _or_unknown(str(decision.state))
    reasons = decision.red_reasons or decision.yellow_reasons
    if reasons:
        state += ":" + ",".join(reasons)
    return state


def _backend_part(decision: PublishedDecision, snapshot: Snapshot | None) -> str:
    signals: PollSignals | None = snapshot.signals if snapshot is not None else None
    parts = [
        f"state={_state_part(decision)}",
        f"backend={decision.backend_count - decision.backend_failed}/{decision.backend_count}",
        f"running={decision.running}",
        f"waiting={decision.waiting}",
        f"prefill={signals.protected if signals is not None else 0}",
        f"decode={signals.decode if signals is not None else 0}",
    ]
    if signals is not None and signals.transition:
        parts.append("prefill_transition=1")
        if not signals.freeze:
            parts.append("prefill_settling=1")
    parts.append(f"kv={decision.kv_usage:.3f}")
    # As PIG: both rates are "na" together, when the generation rate is not valid.
    rate = signals.generation_tps if signals is not None else None
    if rate is None or signals is None:
        parts.append("gen_tps=na user_tps=na")
    else:
        user = signals.user_tps if signals.user_tps is not None else 0.0
        parts.append(f"gen_tps={rate:.1f} user_tps={user:.1f}")
    if snapshot is not None:
        ttft = snapshot.ttft
        if ttft.smoothed_p95 > 0:
            parts.append(f"ttft_p95={ttft.smoothed_p95:.2f}")
        if ttft.smoothed_p99 > 0:
            parts.append(f"ttft_p99={ttft.smoothed_p99:.2f}")
        if ttft.source not in (TtftSource.NONE, TtftSource.DISABLED):
            parts.append(f"ttft_src={ttft.source}")
    preemptions = int(snapshot.preemptions) if snapshot is not None else 0
    parts.append(f"preempt={preemptions}")
    return "backend={" + " ".join(parts) + "}"


def _pig_part(
    state: GuardState, snapshot: Snapshot | None, *, counts: RuntimeCounts, backend_unavailable: int
) -> str:
    gate = state.gate
    decision = state.published.decision
    cap = decision.cap
    if snapshot is not None:
        signals = snapshot.signals
        components = snapshot.components
        throughput = snapshot.throughput
        ttft = snapshot.ttft
        state_limit = components.state
        throughput_limit = _count(components.throughput)
        confidence, safe = str(signals.confidence), signals.safe_capacity
        projected = snapshot.throughput.projected
        learned, target = throughput.learned, throughput.target
        target_reason = throughput.target_reason
        ttft_limit = _count(components.ttft)
        ttft_learned, ttft_target = ttft.learned, ttft.target
        pressure = (
            f"{_count(components.pressure)}/{_or_unknown(snapshot.pressure_reason)}"
            f"/{_or_unknown(snapshot.pressure_target_reason)}"
        )
        prefill = f"{_count(components.prefill)}/{_or_unknown(snapshot.prefill_reason)}/unknown"
        availability = _count(components.availability)
        reject_delta = signals.reject_delta
        demand, tier_demand = int(signals.capacity_demand), int(signals.tier_demand)
        learn = f"{throughput.phase}/{_or_unknown(throughput.reason)}"
        ttft_learn = f"{ttft.phase}/{_or_unknown(ttft.reason)}/{_or_unknown(ttft.target_reason)}"
    else:
        state_limit = throughput_limit = safe = projected = learned = target = 0
        ttft_limit = ttft_learned = ttft_target = availability = reject_delta = 0
        demand = tier_demand = 0
        confidence = target_reason = ""
        pressure = prefill = "0/unknown/unknown"
        learn = "/unknown"
        ttft_learn = "/unknown/unknown"
    basic_reject_delta, premium_reject_delta = counts.tier_reject_delta
    fields = (
        f"limit={cap}",
        f"winner={_or_unknown(str(decision.final_reason))}",
        f"state_limit={state_limit}",
        f"throughput={throughput_limit}",
        f"estimate={confidence}/{safe}",
        f"projected={projected}",
        # The admission limit is the published cap itself.
        f"admit={cap}",
        f"cap={throughput_limit}",
        f"learned={learned}",
        f"target={target}",
        f"target_reason={_or_unknown(target_reason)}",
        f"ttft_limit={ttft_limit}",
        f"ttft_learned={ttft_learned}",
        f"ttft_target={ttft_target}",
        f"pressure={pressure}",
        f"prefill_limit={prefill}",
        f"avail={availability}",
        f"queue={gate.waiting}",
        f"reject={state.learner.dynamic_rejects}",
        f"reject_delta={reject_delta}",
        f"demand={demand}",
        f"tier_demand={tier_demand}",
        f"tier_reject_delta={basic_reject_delta}/{premium_reject_delta}",
        f"backend_unavailable={backend_unavailable}",
        # The tier part uses the published cap, not the gate's current limit (spec 10.3).
        f"tier_basic={gate.basic_inflight}/{basic_limit(cap, gate.premium_inflight)}",
        f"tier_premium={gate.premium_inflight}/{premium_reserved(cap, gate.premium_inflight)}",
        f"tier_waiting={gate.basic_waiting}/{gate.premium_waiting}",
        f"learn={learn}",
        f"ttft_learn={ttft_learn}",
    )
    return "pig={" + " ".join(fields) + "}"


def _backend_detail(
    state: GuardState, backend_names: Sequence[str], counts: RuntimeCounts, now: float | None
) -> str:
    parts = []
    for name in backend_names:
        figures = state.published.backend(name)
        failed = figures is not None and figures.failed
        # A failed backend's running and waiting print as 0 (its last good poll is not shown).
        running = figures.running if figures is not None and not failed else 0
        waiting = figures.waiting if figures is not None and not failed else 0
        detail = counts.backends.get(name, BackendDetail())
        part = f"{name}:{running}r/{waiting}w/{detail.inflight}i"
        if detail.ttft_valid:
            part += f"/ttft{detail.ttft_p95:.2f}/ttft99{detail.ttft_p99:.2f}"
        if failed:
            part += "/err"
        if now is not None:
            health = availability(state.health.of(name), now=now)
            if health is not Availability.AVAILABLE:
                part += f"/{health}"
        parts.append(part)
    return "backend_detail={" + ";".join(parts) + "}"


def status_line(
    state: GuardState,
    *,
    version: str,
    backend_names: Sequence[str],
    backend_unavailable_total: int,
    counts: RuntimeCounts | None = None,
    now: float | None = None,
) -> str:
    """One ``pig_status`` line for ``state``.

    ``backend_names`` are the configured backends in order; ``backend_unavailable_total`` is
    ``pig_backend_unavailable_total``; ``counts`` carries the runtime's own figures (tier
    reject deltas, per-backend in-flight and TTFT), all zero when omitted; ``now`` (the time
    the guard's events carry) shows each backend's health, left out when omitted.
    """
    counts = counts if counts is not None else RuntimeCounts()
    snapshot = current_snapshot(state)
    line = (
        f"pig_status v={version} "
        + _backend_part(state.published.decision, snapshot)
        + " "
        + _pig_part(state, snapshot, counts=counts, backend_unavailable=backend_unavailable_total)
    )
    if len(backend_names) > 1:
        line += " " + _backend_detail(state, backend_names, counts, now)
    if state.gate.config.fail_open:
        line += " failure_mode=open" + (":failing" if failing_open(state.gate) else "")
    return line
