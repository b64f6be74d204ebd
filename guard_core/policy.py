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

from guard_core.settings import (
    AtLeast,
    Greater,
    NotAbove,
    Rule,
    Within,
    default_of,
    require_valid,
    setting,
)
from guard_core.signal_state import SignalThresholds

__all__ = ("PolicyConfig",)


def _pressure(default: float, env: str, *rules: Rule) -> Any:
    """A ``DYNAMIC_PRESSURE_*`` setting: its rules apply while the pressure stage is on."""
    return setting(default, env=env, rules=rules, when="pressure_enabled")


def _user_tps(default: float, env: str, *rules: Rule) -> Any:
    """A ``DYNAMIC_SINGLE_USER_TPS_*`` setting: its rules apply while that stage is on."""
    return setting(default, env=env, rules=rules, when="user_tps_enabled")


def _ttft(default: float, env: str, *rules: Rule) -> Any:
    """A ``DYNAMIC_TTFT_*`` setting: its rules apply while the TTFT stage is on."""
    return setting(default, env=env, rules=rules, when="ttft_enabled")


_TPS = "DYNAMIC_SINGLE_USER_TPS_"


@attrs.frozen(kw_only=True)
class PolicyConfig:
    """Every threshold of the capacity learner, each with its ``DYNAMIC_*`` variable and range.

    A stage's ranges apply only while the stage is on, as PIG checks them.
    """

    #: ``GLOBAL_LIMIT``: no stage ever allows more.
    global_limit: int = setting(
        default_of(SignalThresholds, "global_limit"), env="GLOBAL_LIMIT", rules=(AtLeast(0),)
    )
    signals: SignalThresholds = attrs.field(
        default=attrs.Factory(
            lambda self: SignalThresholds.from_global_limit(self.global_limit), takes_self=True
        )
    )
    # DYNAMIC_PRESSURE_*
    pressure_enabled: bool = setting(True, env="DYNAMIC_PRESSURE_LIMIT_ENABLED")
    pressure_headroom: int = _pressure(1, "DYNAMIC_PRESSURE_HEADROOM", AtLeast(0))
    pressure_min_limit: int = _pressure(1, "DYNAMIC_PRESSURE_MIN_LIMIT", AtLeast(0))
    pressure_learn_ratio: float = _pressure(
        0.75, "DYNAMIC_PRESSURE_LEARN_RATIO", Within(0, 1, low_open=True)
    )
    pressure_learn_min_running: int = _pressure(
        16, "DYNAMIC_PRESSURE_LEARN_MIN_RUNNING", AtLeast(0)
    )
    # DYNAMIC_SINGLE_USER_TPS_*
    user_tps_enabled: bool = setting(True, env=_TPS + "ENABLED")
    user_tps_yellow: float = _user_tps(25.0, _TPS + "YELLOW", Greater(0))
    user_tps_red: float = _user_tps(20.0, _TPS + "RED", Greater(0), NotAbove("user_tps_yellow"))
    user_tps_min_running: int = _user_tps(1, _TPS + "MIN_RUNNING", Greater(0))
    user_tps_yellow_consecutive: int = _user_tps(2, _TPS + "YELLOW_CONSECUTIVE", Greater(0))
    user_tps_red_consecutive: int = _user_tps(3, _TPS + "RED_CONSECUTIVE", Greater(0))
    prefill_grace_min_s: float = _user_tps(
        2.0, _TPS + "PREFILL_GRACE_MIN_SECONDS", AtLeast(0), NotAbove("prefill_grace_max_s")
    )
    prefill_grace_max_s: float = setting(30.0, env=_TPS + "PREFILL_GRACE_MAX_SECONDS")
    prefill_grace_bytes_per_s: float = _user_tps(
        65536.0, _TPS + "PREFILL_GRACE_BODY_BYTES_PER_SECOND", Greater(0)
    )
    prefill_grace_multiplier: float = _user_tps(1.0, _TPS + "PREFILL_GRACE_MULTIPLIER", Greater(0))
    capacity_ratio: float = _user_tps(
        0.42,
        _TPS + "CAPACITY_RATIO",
        Within(0, 1, low_open=True),
        NotAbove("capacity_ratio_max"),
    )
    capacity_ratio_max: float = _user_tps(0.85, _TPS + "CAPACITY_RATIO_MAX", Within(0, 1))
    capacity_smoothing: float = _user_tps(
        0.85, _TPS + "CAPACITY_SMOOTHING", Within(0, 1, high_open=True)
    )
    capacity_learn_enabled: bool = setting(True, env=_TPS + "CAPACITY_LEARN_ENABLED")
    capacity_step_up: float = _user_tps(
        0.02, _TPS + "CAPACITY_RATIO_STEP_UP", Within(0, 1, low_open=True)
    )
    capacity_healthy_consecutive: int = _user_tps(
        10, _TPS + "CAPACITY_HEALTHY_CONSECUTIVE", Greater(0)
    )
    capacity_healthy_multiplier: float = _user_tps(
        1.5, _TPS + "CAPACITY_HEALTHY_MULTIPLIER", AtLeast(1)
    )
    # DYNAMIC_TTFT_* (the adapter reads a threshold that is not positive as its default)
    ttft_enabled: bool = setting(True, env="DYNAMIC_TTFT_ENABLED")
    ttft_target_s: float = _ttft(
        1.0, "DYNAMIC_TTFT_TARGET_SECONDS", Greater(0), NotAbove("ttft_red_s")
    )
    ttft_red_s: float = setting(3.0, env="DYNAMIC_TTFT_RED_SECONDS")
    ttft_p99_target_s: float = _ttft(
        3.0, "DYNAMIC_TTFT_P99_TARGET_SECONDS", NotAbove("ttft_p99_red_s")
    )
    ttft_p99_red_s: float = setting(8.0, env="DYNAMIC_TTFT_P99_RED_SECONDS")

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    def evolve(self, **changes: Any) -> PolicyConfig:
        return attrs.evolve(self, **changes)
