"""The intake guard: any request waiting inside the engine closes intake (spec 5.5 step 8).

Reads: the summed backend waiting count and how many backends failed this poll.
Guarantees:
- waiting > 0 gives a closed cap with reason ``backend_waiting`` until a poll shows 0 waiting;
  learned values are untouched, so intake reopens where it was;
- every backend failed gives a closed cap with reason ``backend_unavailable``;
- otherwise availability is the state's cap.
"""

from __future__ import annotations

import attrs

from guard_core.decision import LimitReason

__all__ = ("IntakeOutcome", "guard_intake")


@attrs.frozen(kw_only=True)
class IntakeOutcome:
    #: The availability component.
    availability: int
    #: When set, the pressure and prefill components are forced to 0 and intake is closed.
    override: LimitReason | None


def guard_intake(
    *, waiting: int, backend_count: int, backend_failed: int, state_limit: int
) -> IntakeOutcome:
    if waiting > 0:
        return IntakeOutcome(availability=state_limit, override=LimitReason.BACKEND_WAITING)
    if backend_count > 0 and backend_failed >= backend_count:
        return IntakeOutcome(availability=0, override=LimitReason.BACKEND_UNAVAILABLE)
    return IntakeOutcome(availability=state_limit, override=None)
