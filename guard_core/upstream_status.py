"""The one-digit answer of ``/v1/upstream-status`` (spec 9.1).

Reads: the gate state (its cap via :func:`~guard_core.gate.current_limit`, its in-flight and
waiting counts per tier) and the published decision it holds (backend availability, the backend
``waiting`` of the latest poll, and the load state), or ``None`` before the server is ready.
Guarantees:
- the digit is one of 0 (green), 1 (yellow), 2 (red), 3 (not initialised), and the first rule
  that applies decides it:
  3 before initialisation; 2 when intake is closed, anyone waits for a slot, no backend is
  usable, the backends report waiting requests, or the state is red; 1 when the state is yellow;
  then, from the counts at the current cap, 2 when the cap or the basic share is used up, 1
  when either is near, 0 otherwise;
- "near" means at most one slot left, or at least 85 % of it in use.

Kept deliberately (spec 15 item 14): with the cap at 1 or 2 the basic share is a single slot,
so even an idle guard is "near" and answers 1. That is honest rather than a bug: a guard with
room for one or two requests has almost no headroom, and callers steering load should see it.
"""

from __future__ import annotations

import enum

from guard_core.decision import LoadState
from guard_core.gate import GateState, current_limit
from guard_core.tier import basic_limit

__all__ = ("UpstreamStatus", "upstream_status_digit")


class UpstreamStatus(enum.IntEnum):
    """The digit written as the body (``f"{digit}\\n"`` prints the bare number)."""

    GREEN = 0
    YELLOW = 1
    RED = 2
    NOT_INITIALISED = 3


def _near(limit: int, used: int) -> bool:
    return limit - used <= 1 or used * 100 >= limit * 85


def upstream_status_digit(gate: GateState | None) -> UpstreamStatus:
    """The status digit for ``gate``; ``None`` means the server is not initialised yet.

    The result is an :class:`int` (an :class:`UpstreamStatus`).
    """
    if gate is None:
        return UpstreamStatus.NOT_INITIALISED
    limit, closed = current_limit(gate)
    decision = gate.decision
    if (
        closed is not None
        or limit <= 0
        or gate.waiting > 0
        or decision.backend_unavailable
        or decision.waiting > 0
        or decision.state is LoadState.RED
    ):
        return UpstreamStatus.RED
    if decision.state is LoadState.YELLOW:
        return UpstreamStatus.YELLOW
    # Green or disabled: judge by how full the cap is. ``gate.waiting`` is the per-tier waiting
    # total, which PIG checks twice (queue length and tier waiting); it is already handled above.
    inflight = gate.inflight
    basic = basic_limit(limit, gate.premium_inflight)
    if inflight >= limit or (basic > 0 and gate.basic_inflight >= basic):
        return UpstreamStatus.RED
    if _near(limit, inflight) or _near(basic, gate.basic_inflight):
        return UpstreamStatus.YELLOW
    return UpstreamStatus.GREEN
