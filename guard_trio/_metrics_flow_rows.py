"""The page's flow-control block: bands and tenants, with bounded label sets.

Reads: the guard's flow state at scrape time (``GuardState.flow``: per band and per tenant
counts) and the outcomes counted by band (``GuardMetrics.band_outcomes``).
Guarantees: shown only while flow control is configured; the band label takes only the
configured band names; the tenant label takes at most :data:`TOP_TENANTS` tenant keys, those
holding or awaiting the most slots now (ties by key), and ``other`` for the sum of the rest (and
for requests without a tenant), so the page's size never grows with the number of tenants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from guard_adapters.outcome import Admission
from guard_core.flow import FlowState
from guard_core.tenants import OTHER
from guard_trio._metrics_page import MetricRow, counter, gauge
from guard_trio._metrics_scrape import Scrape

__all__ = ("FLOW_ROWS", "TOP_TENANTS", "tenant_samples")

#: Tenants shown by name per band; the rest are summed as ``other``.
TOP_TENANTS: Final = 10

Row = MetricRow[Scrape]
Pairs = list[tuple[dict[str, str], float]]


def _per_band(pick: Callable[[FlowState, int], int]) -> Callable[[Scrape], Pairs]:
    def get(s: Scrape) -> Pairs:
        flow = s.state.flow
        if flow is None:
            return []
        names = flow.config.bands.names
        return [({"band": name}, pick(flow, i)) for i, name in enumerate(names)]

    return get


def tenant_samples(flow: FlowState, field: str) -> Pairs:
    """``field`` (``inflight`` or ``waiting``) per band and tenant: the busiest
    :data:`TOP_TENANTS` of each band by name, the rest as ``other``."""
    pairs: Pairs = []
    names = flow.config.bands.names
    for band, name in enumerate(names):
        rows = [
            (tenant, stats)
            for (b, tenant), stats in flow.table.entries.items()
            if b == band and stats.active
        ]
        rows.sort(key=lambda row: (-(row[1].inflight + row[1].waiting), row[0]))
        named = [row for row in rows if row[0] != OTHER][:TOP_TENANTS]
        shown = {tenant for tenant, _ in named}
        for tenant, stats in named:
            pairs.append(({"band": name, "tenant": tenant}, getattr(stats, field)))
        rest = sum(getattr(stats, field) for tenant, stats in rows if tenant not in shown)
        pairs.append(({"band": name, "tenant": OTHER}, rest))
    return pairs


def _per_tenant(field: str) -> Callable[[Scrape], Pairs]:
    def get(s: Scrape) -> Pairs:
        flow = s.state.flow
        return [] if flow is None else tenant_samples(flow, field)

    return get


def _outcomes(s: Scrape) -> Pairs:
    """Every configured band with every way an admission ends, 0 until it happens."""
    flow = s.state.flow
    if flow is None:
        return []
    counted = s.m.band_outcomes
    pairs: Pairs = []
    for band in flow.config.bands.names:
        for admission in Admission:
            found = counted.get((band, admission.value))
            value = 0.0 if found is None else found.value
            pairs.append(({"band": band, "admission": admission.value}, value))
    return pairs


_FLOW: Final = "inference_guard_flow_"

#: With ``PIG_PRIORITY_BANDS`` or ``PIG_TENANT_HEADER``: each band's and busiest tenants' load.
FLOW_ROWS: Final[tuple[Row, ...]] = (
    gauge(_FLOW + "band_inflight", "Admitted requests in flight, by priority band.",
          _per_band(lambda flow, i: flow.inflight[i]), "band"),
    gauge(_FLOW + "band_waiting", "Requests waiting for a slot, by priority band.",
          _per_band(lambda flow, i: flow.waiting[i]), "band"),
    counter(_FLOW + "band_requests_total",
            "Admitted-path requests by band and how their admission ended"
            " (admitted, refused, abandoned).", _outcomes, "band,admission"),
    gauge(_FLOW + "tenant_inflight",
          f"Slots held by tenant: the {TOP_TENANTS} busiest of each band, the rest as other.",
          _per_tenant("inflight"), "band,tenant"),
    gauge(_FLOW + "tenant_waiting",
          f"Requests waiting by tenant: the {TOP_TENANTS} busiest of each band, the rest as"
          " other.", _per_tenant("waiting"), "band,tenant"),
)  # fmt: skip
