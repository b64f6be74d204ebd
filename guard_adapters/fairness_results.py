"""Per-tenant figures of a simulation run: who sent what, who was refused, who was served well.

Reads: the outcomes of a run (each with its tenant label; ``t0`` is the heavy tenant of
``simulate --tenants N --heavy-share F``) and the span the goodput is divided by.
Guarantees: pure summaries of plain values; a tenant's goodput counts its requests that were
:attr:`~guard_adapters.simulation_results.RequestOutcome.good`; Jain's index is taken over the
light tenants' *served share* (good requests over requests sent), so tenants that sent more or
less by chance are compared fairly: 1 when every light tenant is served alike, ``1/n`` when one
takes everything; ``None`` without light tenants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from guard_adapters.simulation_results import RequestOutcome

__all__ = (
    "HEAVY",
    "FairnessSummary",
    "TenantRow",
    "chance_jain_index",
    "jain_index",
    "summarise_tenants",
)

#: The heavy tenant's label.
HEAVY: Final = "t0"


@attrs.frozen(kw_only=True)
class TenantRow:
    tenant: str
    requests: int
    rejected: int
    #: Its requests that were good (goodput is this over the run's span).
    good: int
    goodput_per_s: float

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.requests if self.requests else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "reject_rate": self.reject_rate}


@attrs.frozen(kw_only=True)
class FairnessSummary:
    jain_index_light: float | None
    light_reject_rate: float
    heavy_reject_rate: float
    light_goodput_per_s: float
    heavy_goodput_per_s: float
    tenants: tuple[TenantRow, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "jain_index_light": self.jain_index_light,
            "light_reject_rate": self.light_reject_rate,
            "heavy_reject_rate": self.heavy_reject_rate,
            "light_goodput_per_s": self.light_goodput_per_s,
            "heavy_goodput_per_s": self.heavy_goodput_per_s,
        }


def jain_index(values: Sequence[float]) -> float | None:
    """``(sum x)^2 / (n * sum x^2)``; 1 for no spread; ``None`` for no values, 1 for all 0."""
    if not values:
        return None
    largest = max(abs(v) for v in values)
    if largest == 0:
        return 1.0
    # The index does not change with scale: divided by the largest, tiny values do not
    # underflow when squared.
    scaled = [v / largest for v in values]
    return sum(scaled) ** 2 / (len(scaled) * sum(v * v for v in scaled))


def chance_jain_index(rows: Sequence[TenantRow]) -> float | None:
    """The Jain index of served shares that ``rows`` would show *by chance alone*: if each of
    their requests had the same chance of being good (their pooled rate ``p``), each share is a
    binomial proportion with variance ``p(1 - p)/n_i``, and the index's expected numerator and
    denominator give ``(N^2 p^2 + V) / (N (N p^2 + V))`` for ``N`` tenants, ``V`` the sum of the
    variances. A perfectly fair server scores about this, not 1, when each tenant sends few
    requests; ``None`` without rows that sent any."""
    sent = [row for row in rows if row.requests > 0]
    if not sent:
        return None
    p = sum(row.good for row in sent) / sum(row.requests for row in sent)
    if p in (0.0, 1.0):
        return 1.0
    count = len(sent)
    spread = sum(p * (1 - p) / row.requests for row in sent)
    return (count * count * p * p + spread) / (count * (count * p * p + spread))


def summarise_tenants(
    outcomes: Sequence[RequestOutcome], duration_s: float
) -> FairnessSummary | None:
    """The fairness figures, or ``None`` when the run had no tenants."""
    by_tenant: dict[str, list[RequestOutcome]] = {}
    for outcome in outcomes:
        if outcome.tenant:
            by_tenant.setdefault(outcome.tenant, []).append(outcome)
    if not by_tenant:
        return None
    rows = []
    for tenant in sorted(by_tenant, key=lambda name: (len(name), name)):
        mine = by_tenant[tenant]
        good = sum(o.good for o in mine)
        rows.append(
            TenantRow(
                tenant=tenant,
                requests=len(mine),
                rejected=sum(not o.admitted for o in mine),
                good=good,
                goodput_per_s=good / duration_s if duration_s > 0 else 0.0,
            )
        )
    light = [row for row in rows if row.tenant != HEAVY]
    heavy = [row for row in rows if row.tenant == HEAVY]
    served = [row.good / row.requests for row in light if row.requests]

    def rate(group: Sequence[TenantRow]) -> float:
        sent = sum(row.requests for row in group)
        return sum(row.rejected for row in group) / sent if sent else 0.0

    return FairnessSummary(
        jain_index_light=jain_index(served),
        light_reject_rate=rate(light),
        heavy_reject_rate=rate(heavy),
        light_goodput_per_s=sum(row.goodput_per_s for row in light),
        heavy_goodput_per_s=sum(row.goodput_per_s for row in heavy),
        tenants=tuple(rows),
    )
