"""Cap composition: the published cap is the ordered minimum of the stage caps (spec 0 item 5).

Reads: one value per stage, in the fixed order hard_global, state, ttft, throughput, pressure,
prefill, availability (a stage that does not apply passes ``None``), and an optional override.
Guarantees:
- the cap equals the smallest applicable component, clamped at 0;
- the reason is the first component in that order holding the minimum (so a tie names the
  earlier stage, and the first component at or below 0 names a closed intake);
- an override (``backend_waiting`` or ``backend_unavailable``) closes intake whatever the
  components say, and names itself.
"""

from __future__ import annotations

import attrs

from guard_core._errors import PolicyConfigError
from guard_core.decision import LimitReason

__all__ = ("COMPONENT_ORDER", "CapComponents", "ComposedCap", "compose")

#: The order in which stage caps are compared; earlier names win ties.
COMPONENT_ORDER: tuple[LimitReason, ...] = (
    LimitReason.HARD_GLOBAL,
    LimitReason.STATE,
    LimitReason.TTFT,
    LimitReason.THROUGHPUT,
    LimitReason.PRESSURE,
    LimitReason.PREFILL,
    LimitReason.AVAILABILITY,
)

_OVERRIDES = frozenset({LimitReason.BACKEND_WAITING, LimitReason.BACKEND_UNAVAILABLE})


def _check_override(_instance: object, _attribute: object, value: LimitReason | None) -> None:
    if value is not None and value not in _OVERRIDES:
        raise PolicyConfigError(f"override must be backend_waiting or backend_unavailable: {value}")


@attrs.frozen(kw_only=True)
class CapComponents:
    """The cap each stage of the pipeline would allow, before composition."""

    hard_global: int
    state: int
    ttft: int | None = None
    throughput: int | None = None
    pressure: int | None = None
    prefill: int | None = None
    availability: int | None = None
    #: Closes intake regardless of the components.
    override: LimitReason | None = attrs.field(default=None, validator=_check_override)

    def ordered(self) -> tuple[tuple[LimitReason, int | None], ...]:
        """The components paired with their reason names, in composition order."""
        return (
            (LimitReason.HARD_GLOBAL, self.hard_global),
            (LimitReason.STATE, self.state),
            (LimitReason.TTFT, self.ttft),
            (LimitReason.THROUGHPUT, self.throughput),
            (LimitReason.PRESSURE, self.pressure),
            (LimitReason.PREFILL, self.prefill),
            (LimitReason.AVAILABILITY, self.availability),
        )


@attrs.frozen
class ComposedCap:
    """The published cap and the component that set it."""

    cap: int
    reason: LimitReason


def compose(components: CapComponents) -> ComposedCap:
    """Compose stage caps into the published cap; see the module rules."""
    if components.override is not None:
        return ComposedCap(0, components.override)
    best_reason = LimitReason.HARD_GLOBAL
    best = max(0, components.hard_global)
    for reason, value in components.ordered()[1:]:
        if value is None:
            continue
        if best == 0:
            break
        clamped = max(0, value)
        if clamped < best:
            best, best_reason = clamped, reason
    return ComposedCap(best, best_reason)
