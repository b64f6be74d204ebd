"""The learning pipeline's settings, with PIG's defaults (spec 2.6).

Reads: nothing; built by the config adapter from the environment, or directly by tests.
Guarantees: every value is validated when built by the rules its field carries
(:mod:`guard_core.settings`; ``PolicyConfigError`` names the variable and the value), so the stages
never meet an out-of-range threshold. Each default and range is written here once; the config
adapter reads them from these fields.
"""

from __future__ import annotations

from typing import Any

import attrs

from guard_core.settings import AtLeast, Greater, NotAbove, Within, require_valid, setting
from guard_core.signal_state import SignalThresholds

__all__ = ("PolicyConfig",)

_PRESSURE = "pressure_enabled"
_USER_TPS = "user_tps_enabled"
_TTFT = "ttft_enabled"


@attrs.frozen(kw_only=True)
class PolicyConfig:
    """Every threshold of the capacity learner, each with its ``DYNAMIC_*`` variable and range.

    A stage's ranges apply only while the stage is on (``when``), as PIG checks them.
    """

    #: ``GLOBAL_LIMIT``: no stage ever allows more.
    global_limit: int = setting(512, env="GLOBAL_LIMIT", rules=(AtLeast(0),))
    signals: SignalThresholds = attrs.field(
        default=attrs.Factory(
            lambda self: SignalThresholds.from_global_limit(self.global_limit), takes_self=True
        )
    )
    # DYNAMIC_PRESSURE_*
    pressure_enabled: bool = setting(True, env="DYNAMIC_PRESSURE_LIMIT_ENABLED")
    pressure_headroom: int = setting(
        1, env="DYNAMIC_PRESSURE_HEADROOM", rules=(AtLeast(0),), when=_PRESSURE
    )
    pressure_min_limit: int = setting(
        1, env="DYNAMIC_PRESSURE_MIN_LIMIT", rules=(AtLeast(0),), when=_PRESSURE
    )
    pressure_learn_ratio: float = setting(
        0.75,
        env="DYNAMIC_PRESSURE_LEARN_RATIO",
        rules=(Within(0, 1, low_open=True),),
        when=_PRESSURE,
    )
    pressure_learn_min_running: int = setting(
        16, env="DYNAMIC_PRESSURE_LEARN_MIN_RUNNING", rules=(AtLeast(0),), when=_PRESSURE
    )
    # DYNAMIC_SINGLE_USER_TPS_*
    user_tps_enabled: bool = setting(True, env="DYNAMIC_SINGLE_USER_TPS_ENABLED")
    user_tps_yellow: float = setting(
        25.0, env="DYNAMIC_SINGLE_USER_TPS_YELLOW", rules=(Greater(0),), when=_USER_TPS
    )
    user_tps_red: float = setting(
        20.0,
        env="DYNAMIC_SINGLE_USER_TPS_RED",
        rules=(Greater(0), NotAbove("user_tps_yellow")),
        when=_USER_TPS,
    )
    user_tps_min_running: int = setting(
        1, env="DYNAMIC_SINGLE_USER_TPS_MIN_RUNNING", rules=(Greater(0),), when=_USER_TPS
    )
    user_tps_yellow_consecutive: int = setting(
        2, env="DYNAMIC_SINGLE_USER_TPS_YELLOW_CONSECUTIVE", rules=(Greater(0),), when=_USER_TPS
    )
    user_tps_red_consecutive: int = setting(
        3, env="DYNAMIC_SINGLE_USER_TPS_RED_CONSECUTIVE", rules=(Greater(0),), when=_USER_TPS
    )
    prefill_grace_min_s: float = setting(
        2.0,
        env="DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MIN_SECONDS",
        rules=(AtLeast(0), NotAbove("prefill_grace_max_s")),
        when=_USER_TPS,
    )
    prefill_grace_max_s: float = setting(
        30.0, env="DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MAX_SECONDS"
    )
    prefill_grace_bytes_per_s: float = setting(
        65536.0,
        env="DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_BODY_BYTES_PER_SECOND",
        rules=(Greater(0),),
        when=_USER_TPS,
    )
    prefill_grace_multiplier: float = setting(
        1.0,
        env="DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MULTIPLIER",
        rules=(Greater(0),),
        when=_USER_TPS,
    )
    capacity_ratio: float = setting(
        0.42,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO",
        rules=(Within(0, 1, low_open=True), NotAbove("capacity_ratio_max")),
        when=_USER_TPS,
    )
    capacity_ratio_max: float = setting(
        0.85,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_MAX",
        rules=(Within(0, 1),),
        when=_USER_TPS,
    )
    capacity_smoothing: float = setting(
        0.85,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_SMOOTHING",
        rules=(Within(0, 1, high_open=True),),
        when=_USER_TPS,
    )
    capacity_learn_enabled: bool = setting(
        True, env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_LEARN_ENABLED"
    )
    capacity_step_up: float = setting(
        0.02,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_STEP_UP",
        rules=(Within(0, 1, low_open=True),),
        when=_USER_TPS,
    )
    capacity_healthy_consecutive: int = setting(
        10,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_CONSECUTIVE",
        rules=(Greater(0),),
        when=_USER_TPS,
    )
    capacity_healthy_multiplier: float = setting(
        1.5,
        env="DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_MULTIPLIER",
        rules=(AtLeast(1),),
        when=_USER_TPS,
    )
    # DYNAMIC_TTFT_* (the adapter reads a threshold that is not positive as its default)
    ttft_enabled: bool = setting(True, env="DYNAMIC_TTFT_ENABLED")
    ttft_target_s: float = setting(
        1.0,
        env="DYNAMIC_TTFT_TARGET_SECONDS",
        rules=(Greater(0), NotAbove("ttft_red_s")),
        when=_TTFT,
    )
    ttft_red_s: float = setting(3.0, env="DYNAMIC_TTFT_RED_SECONDS")
    ttft_p99_target_s: float = setting(
        3.0, env="DYNAMIC_TTFT_P99_TARGET_SECONDS", rules=(NotAbove("ttft_p99_red_s"),), when=_TTFT
    )
    ttft_p99_red_s: float = setting(8.0, env="DYNAMIC_TTFT_P99_RED_SECONDS")

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    def evolve(self, **changes: Any) -> PolicyConfig:
        return attrs.evolve(self, **changes)
