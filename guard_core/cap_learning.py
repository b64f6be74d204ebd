"""A learned cap's progress: what each of the two cap learners carries between polls.

Reads: nothing; a value only, filled by :mod:`guard_core.ttft_learner` and
:mod:`guard_core.throughput_learner`, whose states extend it.
Guarantees: a frozen value; both learners keep their learned cap, the target it moves to, the
healthy polls counted toward the next step up, and the phase and reasons they are in under the
same names, so that the status line and the metrics page read either learner the same way.
"""

from __future__ import annotations

import attrs

__all__ = ("CapLearning",)


@attrs.frozen(kw_only=True)
class CapLearning:
    """One learner's cap so far (all 0 and empty before its first poll)."""

    #: The cap learned so far, and the one it is moving to.
    learned: int = 0
    target: int = 0
    #: Healthy polls in a row, counted toward the next step up.
    healthy_count: int = 0
    #: The learner's phase, why it is in it, and what set the target (``""``: nothing yet).
    phase: str = ""
    reason: str = ""
    target_reason: str = ""
