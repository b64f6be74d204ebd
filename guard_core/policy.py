"""The learning pipeline's settings, with PIG's defaults (spec 2.6).

Reads: nothing; built by the config adapter from the environment, or directly by tests.
Guarantees: every value is validated when built (``PolicyConfigError`` names the setting), so the
stages never meet an out-of-range threshold.
"""

from __future__ import annotations

from typing import Any

import attrs

from guard_core._errors import require
from guard_core.signal_state import SignalThresholds

__all__ = ("PolicyConfig",)


@attrs.frozen(kw_only=True)
class PolicyConfig:
    """Every threshold of the capacity learner. Names follow the ``DYNAMIC_*`` variables."""

    #: ``GLOBAL_LIMIT``: no stage ever allows more.
    global_limit: int = 512
    signals: SignalThresholds = attrs.field(
        default=attrs.Factory(
            lambda self: SignalThresholds.from_global_limit(self.global_limit), takes_self=True
        )
    )
    # DYNAMIC_PRESSURE_*
    pressure_enabled: bool = True
    pressure_headroom: int = 1
    pressure_min_limit: int = 1
    pressure_learn_ratio: float = 0.75
    pressure_learn_min_running: int = 16
    # DYNAMIC_SINGLE_USER_TPS_*
    user_tps_enabled: bool = True
    user_tps_yellow: float = 25.0
    user_tps_red: float = 20.0
    user_tps_min_running: int = 1
    user_tps_yellow_consecutive: int = 2
    user_tps_red_consecutive: int = 3
    prefill_grace_min_s: float = 2.0
    prefill_grace_max_s: float = 30.0
    prefill_grace_bytes_per_s: float = 65536.0
    prefill_grace_multiplier: float = 1.0
    capacity_ratio: float = 0.42
    capacity_ratio_max: float = 0.85
    capacity_smoothing: float = 0.85
    capacity_learn_enabled: bool = True
    capacity_step_up: float = 0.02
    capacity_healthy_consecutive: int = 10
    capacity_healthy_multiplier: float = 1.5
    # DYNAMIC_TTFT_*
    ttft_enabled: bool = True
    ttft_target_s: float = 1.0
    ttft_red_s: float = 3.0
    ttft_p99_target_s: float = 3.0
    ttft_p99_red_s: float = 8.0

    def __attrs_post_init__(self) -> None:
        require(self.global_limit >= 0, "GLOBAL_LIMIT must be >= 0")
        if self.pressure_enabled:
            require(self.pressure_headroom >= 0, "DYNAMIC_PRESSURE_HEADROOM must be >= 0")
            require(self.pressure_min_limit >= 0, "DYNAMIC_PRESSURE_MIN_LIMIT must be >= 0")
            require(
                0 < self.pressure_learn_ratio <= 1, "DYNAMIC_PRESSURE_LEARN_RATIO must be in (0, 1]"
            )
            require(
                self.pressure_learn_min_running >= 0,
                "DYNAMIC_PRESSURE_LEARN_MIN_RUNNING must be >= 0",
            )
        if self.user_tps_enabled:
            require(
                0 < self.user_tps_red <= self.user_tps_yellow,
                "DYNAMIC_SINGLE_USER_TPS_RED must be > 0 and <= DYNAMIC_SINGLE_USER_TPS_YELLOW",
            )
            require(
                self.user_tps_min_running > 0, "DYNAMIC_SINGLE_USER_TPS_MIN_RUNNING must be > 0"
            )
            require(
                self.user_tps_yellow_consecutive > 0 and self.user_tps_red_consecutive > 0,
                "DYNAMIC_SINGLE_USER_TPS_*_CONSECUTIVE must be > 0",
            )
            require(
                0 <= self.prefill_grace_min_s <= self.prefill_grace_max_s,
                "prefill grace: MIN must be >= 0 and MAX >= MIN",
            )
            require(
                self.prefill_grace_bytes_per_s > 0, "prefill grace bytes per second must be > 0"
            )
            require(self.prefill_grace_multiplier > 0, "prefill grace multiplier must be > 0")
            require(0 < self.capacity_ratio <= 1, "CAPACITY_RATIO must be in (0, 1]")
            require(
                self.capacity_ratio <= self.capacity_ratio_max <= 1,
                "CAPACITY_RATIO_MAX must be in [CAPACITY_RATIO, 1]",
            )
            require(0 <= self.capacity_smoothing < 1, "CAPACITY_SMOOTHING must be in [0, 1)")
            require(0 < self.capacity_step_up <= 1, "CAPACITY_RATIO_STEP_UP must be in (0, 1]")
            require(
                self.capacity_healthy_consecutive > 0, "CAPACITY_HEALTHY_CONSECUTIVE must be > 0"
            )
            require(
                self.capacity_healthy_multiplier >= 1, "CAPACITY_HEALTHY_MULTIPLIER must be >= 1"
            )
        if self.ttft_enabled:
            require(self.ttft_target_s > 0, "DYNAMIC_TTFT_TARGET_SECONDS must be > 0")
            require(
                self.ttft_red_s >= self.ttft_target_s, "DYNAMIC_TTFT_RED_SECONDS must be >= target"
            )
            require(
                self.ttft_p99_red_s >= self.ttft_p99_target_s,
                "DYNAMIC_TTFT_P99_RED_SECONDS must be >= the p99 target",
            )

    def evolve(self, **changes: Any) -> PolicyConfig:
        return attrs.evolve(self, **changes)
