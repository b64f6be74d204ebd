"""The short wait's length: how long a refused request may wait for a slot (spec 4.3).

Reads: the latest published decision (its source, load state, red reasons, KV usage, running
and waiting counts), the refusal code, and the gate's wait settings (``PIG_QUEUE_WAIT_SECONDS``,
the KV and waiting red thresholds).
Guarantees: a pure function of those; never above ``min(PIG_QUEUE_WAIT_SECONDS, 0.5 s)``; 0 (no
wait) for ``backend_unavailable`` or a configured wait of 0; shortened to 0.25 s or 0.1 s when
the decision shows the backends under pressure, since a slot is then unlikely to free soon.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from guard_core.decision import (
    DecisionSource,
    LoadState,
    PublishedDecision,
    RejectCode,
    StateReason,
)

if TYPE_CHECKING:
    from guard_core.gate import GateConfig

__all__ = ("MAX_SHORT_WAIT_S", "short_wait_s")

#: The longest a request is ever held before it is forwarded or refused.
MAX_SHORT_WAIT_S = 0.5
_RED_WAIT_S = 0.1
_PRESSURE_WAIT_S = 0.25
_KV_CRITICAL = 0.95


def short_wait_s(decision: PublishedDecision, code: RejectCode, config: GateConfig) -> float:
    """How long a refused request may wait for a slot (spec 4.3); 0 means reject at once.

    The wait is shortened to 0.25 s or 0.1 s when the latest poll shows the backend under
    pressure, since a slot is then unlikely to free up, and is never longer than configured.
    """
    if code is RejectCode.BACKEND_UNAVAILABLE or config.queue_wait_s <= 0:
        return 0.0
    wait = min(config.queue_wait_s, MAX_SHORT_WAIT_S)
    if decision.source is not DecisionSource.METRICS:
        return wait
    for reason in decision.red_reasons:
        if reason in (StateReason.PREEMPTIONS, StateReason.KV_CACHE):
            return min(wait, _RED_WAIT_S)
        if reason in (StateReason.WAITING, StateReason.SCHEDULER_PRESSURE_CAPACITY):
            wait = min(wait, _PRESSURE_WAIT_S)
    if decision.state is LoadState.RED:
        return min(wait, _RED_WAIT_S)
    kv = decision.kv_usage
    if (config.kv_red > 0 and kv >= config.kv_red) or kv >= _KV_CRITICAL:
        return min(wait, _RED_WAIT_S)
    waiting = decision.waiting
    if decision.cap > 0 and waiting > 0 and decision.running >= math.ceil(0.9 * decision.cap):
        return min(wait, _PRESSURE_WAIT_S)
    if config.waiting_red > 0 and waiting >= max(1, config.waiting_red // 2):
        return min(wait, _PRESSURE_WAIT_S)
    if (
        decision.state is LoadState.YELLOW
        and waiting > 0
        and config.queue_wait_s >= _PRESSURE_WAIT_S
    ):
        return min(wait, _PRESSURE_WAIT_S)
    return wait
