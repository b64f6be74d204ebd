"""A request's tier, priority band and tenant, from its trusted headers (flow control).

Reads: the values of the tier header (``X-User-Tier``) and, when ``PIG_TENANT_HEADER`` names
one, of the tenant header, as received; the configured bands.
Guarantees:
- without bands configured the tier is exactly PIG's (:func:`~guard_core.tier_from_header_values`)
  and the band is "" (the core then reads the tier alone);
- with bands, the band is the one the single tier value names (else the default band) and the
  tier is the band's (the first band premium, the others basic), so every reader of tiers
  agrees with the band;
- the tenant is the single tenant value, trimmed, when it is printable ASCII of at most
  :data:`MAX_TENANT_CHARS` characters; anything else (no header configured, absent, repeated,
  too long, odd bytes) is "" (counted as the shared ``other`` tenant);
- :func:`band_priority` gives a body-rewrite plan the band's own ``priority`` when it has one,
  and leaves every other plan (and every decision of whether to write) as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs

from guard_adapters.openai_body import Plan
from guard_core.bands import BandSpec, band_from_header_values
from guard_core.tier import Tier, tier_from_header_values

__all__ = ("MAX_TENANT_CHARS", "RequestLabels", "band_and_tier", "band_priority", "tenant_key")

#: The longest tenant key kept; a longer value is no tenant of its own.
MAX_TENANT_CHARS: Final = 128
_OWS = b" \t"


def band_and_tier(spec: BandSpec | None, values: Sequence[bytes]) -> tuple[str, Tier]:
    """The band name ("" without bands) and the tier, from the tier header's values."""
    if spec is None:
        return "", tier_from_header_values(values)
    index = band_from_header_values(spec, values)
    return spec.bands[index].name, spec.tier_of(index)


def tenant_key(values: Sequence[bytes]) -> str:
    """The tenant from the tenant header's values ("" when there is none to trust)."""
    if len(values) != 1:
        return ""
    value = values[0].strip(_OWS)
    if not value or len(value) > MAX_TENANT_CHARS:
        return ""
    if not all(0x21 <= byte <= 0x7E for byte in value):
        return ""
    return value.decode("ascii")


def band_priority(spec: BandSpec | None, band: str, plan: Plan) -> Plan:
    """``plan`` with the trusted priority of ``band`` when the band names one."""
    if spec is None or not band:
        return plan
    priority = spec.bands[spec.index_of(band)].priority
    if priority is None or priority == plan.priority_value:
        return plan
    return attrs.evolve(plan, priority_value=priority)


@attrs.frozen
class RequestLabels:
    """How the proxy reads a request's labels: the configured bands and tenant header."""

    bands: BandSpec | None = None
    #: ``PIG_TENANT_HEADER`` in lower case (None: no tenants).
    tenant_header: bytes | None = None

    def of(self, values: Callable[[bytes], Sequence[bytes]]) -> tuple[Tier, str, str]:
        """The tier, band and tenant, from a request's header values (``values(name)``)."""
        band, tier = band_and_tier(self.bands, values(b"x-user-tier"))
        header = self.tenant_header
        return tier, band, "" if header is None else tenant_key(values(header))
