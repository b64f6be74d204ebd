"""Lanes: metric labels from the request body size and the requested output tokens (spec 6.4).

Reads: the request's Content-Length (``None`` when unknown or chunked), the output-token intent
found in the body (``None`` when classification is off or found nothing), the static thresholds
and, for adaptive thresholds, the recent positive intents and the load state.
Guarantees: a lane never caps anything; it only labels metrics and the ``X-PIG-Lane`` header.
Thresholds are strictly increasing; adaptive thresholds never fall below the static ones and
relax back to them as the load state worsens.
"""

from __future__ import annotations

import enum
import math
from types import MappingProxyType
from typing import Any

import attrs

from guard_core._errors import PolicyConfigError
from guard_core.decision import LoadState
from guard_core.settings import AtLeast, Greater, NotAbove, Within, require_valid, setting

__all__ = (
    "AdaptiveOutputConfig",
    "AdaptiveOutputState",
    "Lane",
    "Thresholds",
    "body_lane",
    "combine_lanes",
    "output_lane",
)


class Lane(enum.StrEnum):
    """A lane label. ``GLOBAL`` labels totals across lanes in the metrics."""

    GLOBAL = "global"
    DEFAULT = "default"
    MEDIUM_BODY = "medium_body"
    LONG_BODY = "long_body"
    VERY_LONG_BODY = "very_long_body"
    MEDIUM_OUTPUT = "medium_output"
    LONG_OUTPUT = "long_output"
    VERY_LONG_OUTPUT = "very_long_output"
    UNKNOWN_BODY = "unknown_body"

    @property
    def severity(self) -> int:
        """unknown_body 4 > very_long_* 3 > long_* 2 > medium_* 1 > default 0."""
        return _SEVERITY[self]


_SEVERITY = MappingProxyType(
    {
        Lane.GLOBAL: 0,
        Lane.DEFAULT: 0,
        Lane.MEDIUM_BODY: 1,
        Lane.MEDIUM_OUTPUT: 1,
        Lane.LONG_BODY: 2,
        Lane.LONG_OUTPUT: 2,
        Lane.VERY_LONG_BODY: 3,
        Lane.VERY_LONG_OUTPUT: 3,
        Lane.UNKNOWN_BODY: 4,
    }
)


def _strictly_increasing_positive(
    _instance: object, attribute: attrs.Attribute[Any], value: tuple[int, int, int]
) -> None:
    medium, long, very_long = value
    if not 0 < medium < long < very_long:
        raise PolicyConfigError(
            f"{attribute.name} must be > 0 and strictly increasing, got {value}"
        )


@attrs.frozen
class Thresholds:
    """Lower bounds (inclusive) of the medium, long and very long lanes."""

    values: tuple[int, int, int] = attrs.field(validator=_strictly_increasing_positive)

    def level(self, amount: int) -> int:
        """0 below medium, 1 medium, 2 long, 3 very long."""
        medium, long, very_long = self.values
        if amount >= very_long:
            return 3
        if amount >= long:
            return 2
        if amount >= medium:
            return 1
        return 0


#: ``MEDIUM_BODY_BYTES`` / ``LONG_BODY_BYTES`` / ``VERY_LONG_BODY_BYTES``.
DEFAULT_BODY_THRESHOLDS = Thresholds((60_000, 100_000, 524_288))
#: ``MEDIUM_OUTPUT_TOKENS`` / ``LONG_OUTPUT_TOKENS`` / ``VERY_LONG_OUTPUT_TOKENS``.
DEFAULT_OUTPUT_THRESHOLDS = Thresholds((1024, 4096, 8192))

_BODY_LANES = (Lane.DEFAULT, Lane.MEDIUM_BODY, Lane.LONG_BODY, Lane.VERY_LONG_BODY)
_OUTPUT_LANES = (Lane.DEFAULT, Lane.MEDIUM_OUTPUT, Lane.LONG_OUTPUT, Lane.VERY_LONG_OUTPUT)


def body_lane(content_length: int | None, thresholds: Thresholds = DEFAULT_BODY_THRESHOLDS) -> Lane:
    """The lane of a body of ``content_length`` bytes; unknown length is ``unknown_body``."""
    if content_length is None or content_length < 0:
        return Lane.UNKNOWN_BODY
    return _BODY_LANES[thresholds.level(content_length)]


def output_lane(tokens: int, thresholds: Thresholds = DEFAULT_OUTPUT_THRESHOLDS) -> Lane:
    """The lane of a request that asks for up to ``tokens`` output tokens."""
    return _OUTPUT_LANES[thresholds.level(tokens)]


def combine_lanes(body: Lane, output: Lane | None) -> Lane:
    """The more severe of the two lanes; on a tie the body lane stays."""
    if output is None or output.severity <= body.severity:
        return body
    return output


# -- adaptive output thresholds ----------------------------------------------------------------


_UNIT = Within(0, 1)


@attrs.frozen(kw_only=True)
class AdaptiveOutputConfig:
    """``ADAPTIVE_OUTPUT_*`` settings, PIG's defaults and ranges."""

    static: Thresholds = DEFAULT_OUTPUT_THRESHOLDS
    window: int = setting(512, env="ADAPTIVE_OUTPUT_WINDOW", rules=(Greater(0),))
    min_samples: int = setting(
        32, env="ADAPTIVE_OUTPUT_MIN_SAMPLES", rules=(AtLeast(0), NotAbove("window"))
    )
    medium_quantile: float = setting(
        0.50, env="ADAPTIVE_OUTPUT_MEDIUM_QUANTILE", rules=(_UNIT, NotAbove("long_quantile"))
    )
    long_quantile: float = setting(
        0.90, env="ADAPTIVE_OUTPUT_LONG_QUANTILE", rules=(_UNIT, NotAbove("very_quantile"))
    )
    very_quantile: float = setting(0.99, env="ADAPTIVE_OUTPUT_VERY_QUANTILE", rules=(_UNIT,))
    green_relax: float = setting(1.0, env="ADAPTIVE_OUTPUT_GREEN_RELAX", rules=(_UNIT,))
    yellow_relax: float = setting(
        0.5, env="ADAPTIVE_OUTPUT_YELLOW_RELAX", rules=(_UNIT, NotAbove("green_relax"))
    )
    red_relax: float = setting(
        0.0, env="ADAPTIVE_OUTPUT_RED_RELAX", rules=(_UNIT, NotAbove("yellow_relax"))
    )

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    @property
    def quantiles(self) -> tuple[float, float, float]:
        """The medium, long and very long quantiles."""
        return (self.medium_quantile, self.long_quantile, self.very_quantile)

    def relax(self, state: LoadState) -> float:
        if state is LoadState.RED:
            return self.red_relax
        if state is LoadState.YELLOW:
            return self.yellow_relax
        return self.green_relax


def _round_half_away(value: float) -> int:
    return math.floor(value + 0.5) if value >= 0 else -math.floor(-value + 0.5)


def _increasing(values: tuple[int, int, int]) -> tuple[int, int, int]:
    medium, long, very_long = values
    long = max(long, medium + 1)
    return medium, long, max(very_long, long + 1)


@attrs.frozen
class AdaptiveOutputState:
    """The most recent positive output-token intents, oldest first, at most ``window`` of them."""

    samples: tuple[int, ...] = ()

    def observe(self, tokens: int, config: AdaptiveOutputConfig) -> AdaptiveOutputState:
        """Remember one intent; zero and negative values are ignored."""
        if tokens <= 0:
            return self
        return AdaptiveOutputState((*self.samples, tokens)[-config.window :])

    def learned(self, config: AdaptiveOutputConfig) -> Thresholds:
        """Thresholds learned from the samples, never below the static ones."""
        n = len(self.samples)
        if n == 0 or n < config.min_samples:
            return config.static
        ordered = sorted(self.samples)

        def quantile(q: float) -> int:
            return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

        static = config.static.values
        q_medium, q_long, q_very_long = config.quantiles
        learned = (
            max(static[0], quantile(q_medium)),
            max(static[1], quantile(q_long)),
            # The very long lane starts just above the top quantile, so that quantile itself
            # still counts as long.
            max(static[2], quantile(q_very_long) + 1),
        )
        return Thresholds(_increasing(learned))

    def effective(self, config: AdaptiveOutputConfig, state: LoadState) -> Thresholds:
        """Thresholds in force: static plus the learned excess, scaled by the state's relax."""
        factor = config.relax(state)
        static = config.static.values
        learned = self.learned(config).values
        relaxed = tuple(
            s + _round_half_away((v - s) * factor) for s, v in zip(static, learned, strict=True)
        )
        return Thresholds(_increasing((relaxed[0], relaxed[1], relaxed[2])))
