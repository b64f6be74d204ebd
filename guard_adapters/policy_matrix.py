"""The policy benchmark's matrix: traces x rates x engine profiles, every policy in each cell.

Reads: trace files, engine profiles and the guard's settings; runs :func:`simulate` (pure, in
virtual time) for each policy of each cell.
Guarantees:
- every cell runs the same trace, seed and premium share under: no policy, a static cap for
  every value of the sweep (the best of them, by prompt-aware goodput, is the "best static cap
  in hindsight"), PIG's learner (``guard``) and the predictive learner;
- the verdicts of a cell are computed from the simulated outcomes only: the ratios to the best
  static cap and to PIG's learner, the admitted users' p5 speed, the TTFT p95 beyond each
  request's unloaded prefill time, the premium reject rate (judged only where premium demand
  alone is below capacity, which a premium-only run with no policy decides), and for a slowdown
  cell the polls until the cap fell and the seconds until it came back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs

from guard_adapters.engine_model import PROFILES, EngineProfile, idle_prefill_s
from guard_adapters.simulation import (
    GOOD_TPS,
    GOOD_TTFT_S,
    RequestOutcome,
    SimulationResult,
    parse_policy,
    quantile,
    simulate,
)
from guard_adapters.traces import TraceRequest, head, premium_flags, read_trace, scale_rate
from guard_core import GuardConfig, Tier

__all__ = (
    "PREMIUM_SHARE",
    "PROFILE_NAMES",
    "RATES",
    "STATIC_SWEEP",
    "Cell",
    "CellResult",
    "PolicyRow",
    "default_cells",
    "load_cell_trace",
    "run_cell",
)

STATIC_SWEEP: Final = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
RATES: Final = (1.0, 2.0, 4.0)
PROFILE_NAMES: Final = ("a100-qwen2-7b", "2xa100-tp2-qwen2.5-32b", "a100-qwen2-7b-kv5g")
TRACES: Final = {
    "conv": "azure-llm-2023-conv.csv",
    "mooncake": "mooncake-fast25-conversation-trace.jsonl",
}
PREMIUM_SHARE: Final = 0.2
#: Premium demand counts as "below capacity" when, alone and unguarded, this share of it is good.
_PREMIUM_ALONE_GOOD: Final = 0.95


@attrs.frozen(kw_only=True)
class Cell:
    trace: str
    rate: float
    profile: str
    #: ``(at_s, duration_s, factor)`` engine slowdowns.
    slowdowns: tuple[tuple[float, float, float], ...] = ()
    #: Keep only the first seconds of arrivals (after rate scaling); ``None`` keeps all.
    duration_s: float | None = None

    @property
    def name(self) -> str:
        text = f"{self.trace} x{self.rate:g} {self.profile}"
        for at, length, factor in self.slowdowns:
            text += f" slow x{factor:g} at {at:g}s for {length:g}s"
        return text


def default_cells(*, duration_s: float | None = None) -> list[Cell]:
    """The full matrix of the issue: 2 traces x 3 rates x 3 profiles, and the slowdown cell."""
    cells = [
        Cell(trace=trace, rate=rate, profile=profile, duration_s=duration_s)
        for trace in TRACES
        for rate in RATES
        for profile in PROFILE_NAMES
    ]
    cells.append(
        Cell(
            trace="conv",
            rate=2.0,
            profile="a100-qwen2-7b",
            slowdowns=((1200.0, 300.0, 8.0),),
            duration_s=duration_s,
        )
    )
    return cells


@attrs.frozen(kw_only=True)
class PolicyRow:
    policy: str
    goodput_per_s: float
    goodput_prompt_aware_per_s: float
    user_tps_p5: float | None
    user_tps_p50: float | None
    #: p95 over admitted requests of TTFT minus that request's unloaded prefill time.
    ttft_excess_p95_s: float | None
    ttft_p95_s: float | None
    premium_reject_rate: float
    basic_reject_rate: float
    admitted: int
    requests: int


@attrs.frozen(kw_only=True)
class CellResult:
    cell: Cell
    rows: tuple[PolicyRow, ...]
    best_static: PolicyRow
    pig: PolicyRow
    predictive: PolicyRow
    none: PolicyRow
    premium_below_capacity: bool
    #: Slowdown cells: polls from the slowdown's start until the predictive cap fell below half
    #: its level before, and seconds from the slowdown's end until it was back to 80 % of it.
    cap_down_polls: int | None = None
    cap_back_s: float | None = None

    @property
    def versus_static(self) -> float:
        best = self.best_static.goodput_prompt_aware_per_s
        return self.predictive.goodput_prompt_aware_per_s / best if best > 0 else math.inf

    @property
    def versus_pig(self) -> float:
        pig = self.pig.goodput_prompt_aware_per_s
        return self.predictive.goodput_prompt_aware_per_s / pig if pig > 0 else math.inf

    def failures(self) -> list[str]:
        """The acceptance criteria this cell misses, in words (empty: all met)."""
        missed = []
        if self.versus_static < 0.98:
            missed.append(f"prompt-aware goodput {self.versus_static:.3f}x the best static cap")
        p5 = self.predictive.user_tps_p5
        if p5 is not None and p5 < GOOD_TPS:
            missed.append(f"admitted users' p5 {p5:.1f} tok/s")
        excess = self.predictive.ttft_excess_p95_s
        if excess is not None and excess > GOOD_TTFT_S:
            missed.append(f"TTFT p95 {excess:.2f} s beyond the unloaded prefill")
        if self.premium_below_capacity and self.predictive.premium_reject_rate > 0.01:
            missed.append(f"premium rejects {100 * self.predictive.premium_reject_rate:.1f} %")
        if self.cell.slowdowns:
            if self.cap_down_polls is None or self.cap_down_polls > 5:
                missed.append(f"cap down after {self.cap_down_polls} polls")
            if self.cap_back_s is None or self.cap_back_s > 30:
                missed.append(f"cap back after {self.cap_back_s} s")
        return missed


def _excess(outcome: RequestOutcome, profile: EngineProfile) -> float | None:
    ttft = outcome.ttft_s
    if ttft is None:
        return None
    uncached = max(1, outcome.prompt_tokens - outcome.cached_prompt_tokens)
    return ttft - idle_prefill_s(profile, uncached)


def _row(result: SimulationResult, profile: EngineProfile) -> PolicyRow:
    everyone = result.summary["all"]
    outcomes = result.requests
    excess = [e for e in (_excess(o, profile) for o in outcomes if o.admitted) if e is not None]

    def reject_rate(tier: Tier) -> float:
        asked = [o for o in outcomes if o.tier is tier]
        return sum(not o.admitted for o in asked) / len(asked) if asked else 0.0

    return PolicyRow(
        policy=result.policy,
        goodput_per_s=everyone.goodput_per_s,
        goodput_prompt_aware_per_s=everyone.goodput_prompt_aware_per_s,
        user_tps_p5=everyone.user_tps_p5,
        user_tps_p50=everyone.user_tps_p50,
        ttft_excess_p95_s=quantile(sorted(excess), 0.95),
        ttft_p95_s=everyone.ttft_p95_s,
        premium_reject_rate=reject_rate(Tier.PREMIUM),
        basic_reject_rate=reject_rate(Tier.BASIC),
        admitted=everyone.admitted,
        requests=everyone.requests,
    )


def load_cell_trace(cell: Cell, trace_dir: Path) -> list[TraceRequest]:
    requests = list(read_trace(trace_dir / TRACES[cell.trace]).requests)
    requests = list(scale_rate(requests, cell.rate))
    if cell.duration_s is not None:
        requests = list(head(requests, cell.duration_s))
    return requests


def _slowdown_recovery(
    result: SimulationResult, slowdowns: tuple[tuple[float, float, float], ...], poll_s: float
) -> tuple[int | None, float | None]:
    at, length, _ = slowdowns[0]
    end = at + length
    before = [p.cap for p in result.series if at - 120 <= p.at < at and p.cap is not None]
    if not before:
        return None, None
    level = sorted(before)[len(before) // 2]
    down = next(
        (p.at for p in result.series if p.at >= at and p.cap is not None and p.cap <= level / 2),
        None,
    )
    back = next(
        (p.at for p in result.series if p.at >= end and p.cap is not None and p.cap >= 0.8 * level),
        None,
    )
    down_polls = None if down is None else max(0, math.ceil((down - at) / poll_s))
    return down_polls, None if back is None else back - end


def run_cell(
    cell: Cell,
    trace_dir: Path,
    *,
    guard_config: GuardConfig | None = None,
    static_sweep: Sequence[int] = STATIC_SWEEP,
    seed: int = 0,
    poll_interval_s: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> CellResult:
    """Run every policy in one cell."""
    profile = PROFILES[cell.profile]
    trace = load_cell_trace(cell, trace_dir)
    config = guard_config if guard_config is not None else GuardConfig()
    policies = ["none", *(f"static:{n}" for n in static_sweep), "guard", "predictive"]
    results: dict[str, SimulationResult] = {}
    for text in policies:
        if progress is not None:
            progress(f"{cell.name}: {text}")
        results[text] = simulate(
            trace,
            parse_policy(text, config),
            profile=profile,
            seed=seed,
            premium_share=PREMIUM_SHARE,
            poll_interval_s=poll_interval_s,
            slowdowns=cell.slowdowns,
        )
    rows = {text: _row(result, profile) for text, result in results.items()}
    statics = [rows[f"static:{n}"] for n in static_sweep]
    best = max(statics, key=lambda row: row.goodput_prompt_aware_per_s)
    # Premium demand alone, unguarded: below capacity when nearly all of it is served well.
    flags = premium_flags(len(trace), PREMIUM_SHARE, seed=seed)
    premium_only = [r for r, premium in zip(trace, flags, strict=True) if premium]
    alone = simulate(
        premium_only,
        "none",
        profile=profile,
        seed=seed,
        premium_share=1.0,
        slowdowns=cell.slowdowns,
    )
    good = sum(o.good_prompt_aware for o in alone.requests)
    below = bool(premium_only) and good >= _PREMIUM_ALONE_GOOD * len(premium_only)
    down = back = None
    if cell.slowdowns:
        down, back = _slowdown_recovery(results["predictive"], cell.slowdowns, poll_interval_s)
    return CellResult(
        cell=cell,
        rows=tuple(rows.values()),
        best_static=best,
        pig=rows["guard"],
        predictive=rows["predictive"],
        none=rows["none"],
        premium_below_capacity=below,
        cap_down_polls=down,
        cap_back_s=back,
    )
