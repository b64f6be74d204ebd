"""The two service tiers and the premium reservation (spec 0 item 4, 4.2).

Reads: the ``X-User-Tier`` header values as received, the admission cap and premium in-flight.
Guarantees:
- only a single header value that is ``premium`` after trimming and ASCII lower-casing makes a
  request premium; a missing, unknown, repeated or comma-joined value is basic;
- premium may use every slot of the cap; basic leaves ``max(1, premium_inflight + 1)`` slots
  free when the cap is above 1, and shares the single slot when the cap is exactly 1.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

__all__ = ("Tier", "basic_limit", "premium_reserved", "tier_from_header_values")

_PREMIUM = b"premium"
_OWS = b" \t"


class Tier(enum.StrEnum):
    """A request's service tier, as forwarded upstream in ``X-PIG-Tier``."""

    BASIC = "basic"
    PREMIUM = "premium"


def tier_from_header_values(values: Sequence[bytes]) -> Tier:
    """Classify a request from every ``X-User-Tier`` value it carried (in arrival order).

    Exactly one value is required; ``b" Premium "`` counts, ``b"premium, premium"`` does not.
    """
    if len(values) != 1:
        return Tier.BASIC
    if values[0].strip(_OWS).lower() == _PREMIUM:
        return Tier.PREMIUM
    return Tier.BASIC


def premium_reserved(limit: int, premium_inflight: int) -> int:
    """Slots basic requests must leave free for premium under cap ``limit``.

    0 when the cap is 1 or less; otherwise one more than premium currently holds, at least 1,
    never more than the cap.
    """
    if limit <= 1:
        return 0
    return min(limit, max(1, premium_inflight + 1))


def basic_limit(limit: int, premium_inflight: int) -> int:
    """How many basic requests may be in flight under cap ``limit``.

    >>> basic_limit(8, 0), basic_limit(8, 1), basic_limit(8, 2), basic_limit(1, 0)
    (7, 6, 5, 1)
    """
    if limit <= 0:
        return 0
    if limit == 1:
        return 1
    return limit - premium_reserved(limit, premium_inflight)
