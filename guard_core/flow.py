"""Flow control: priority bands and tenant fairness on top of the admission gate, as one state.

Reads: a :class:`FlowConfig` (bands from ``PIG_PRIORITY_BANDS``, tenants from
``PIG_TENANT_HEADER`` and ``PIG_TENANT_WEIGHTS``), the band name and tenant key each request
arrived with, the gate's cap and counts, and the attempt's outcome.
Guarantees:
- it only ever refuses what the gate would admit (:func:`refusal`), never admits what the gate
  refuses, and never evicts a held slot; its waits are the gate's (a band's ``wait`` only
  shortens them), so every wait still ends by its deadline, at most 0.5 s after arrival;
- its counts per band and per (band, tenant) match the requests the guard tracks whatever the
  order of events: every change comes through :func:`arrived`, :func:`settled`,
  :func:`abandoned` and :func:`finished`, called by :mod:`guard_core.requests` in the same step
  as the gate's;
- with no tenant header configured, every request is one tenant and only the band rules
  apply; with :data:`~guard_core.bands.PIG_BANDS`, the band rules refuse exactly what PIG's
  tier rule refuses;
- with tenants, :func:`refusal` adds the tenant rules of :mod:`guard_core.tenants` (fair
  order, the spare, and strict shares with ``PIG_TENANT_LEND=false``), and
  :func:`spare_reserve` gives a learner that predicts the room a tenant ahead must leave; a
  finished request's output tokens add to its tenant's attained service;
- :func:`retry_order` ranks the waiters as :func:`refusal` does (band, then tenant, then
  arrival), for a runtime to retry them in: the short wait served in fair order; a runtime
  makes at most :data:`RETRY_PASSES` passes over that order per wake-up and stops a pass once
  :func:`retry_has_room` is false, since no retry can then be admitted: a wake-up costs at most
  ``RETRY_PASSES`` retries per waiter, not one pass per wait that ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from guard_core import tenants as tenant_rules
from guard_core._values import replace
from guard_core.bands import PIG_BANDS, BandSpec, band_refusal, headroom
from guard_core.decision import RejectCode
from guard_core.gate import GateState, current_limit
from guard_core.tenants import TenantConfig, TenantTable

if TYPE_CHECKING:
    from guard_core.requests import Tracked

__all__ = (
    "RETRY_PASSES",
    "FlowConfig",
    "FlowState",
    "abandoned",
    "arrived",
    "finished",
    "refusal",
    "retry_has_room",
    "retry_order",
    "settled",
    "spare_reserve",
    "waiters_in_order",
)


@attrs.frozen(kw_only=True)
class FlowConfig:
    """Bands and, when a tenant header is configured, tenant fairness."""

    bands: BandSpec = PIG_BANDS
    #: ``None``: no tenant header (``PIG_TENANT_HEADER`` unset), no tenant fairness.
    tenants: TenantConfig | None = None


@attrs.frozen
class FlowState:
    """Admitted and waiting requests per band, and the tenant table."""

    config: FlowConfig
    inflight: tuple[int, ...]
    waiting: tuple[int, ...]
    table: TenantTable = attrs.field(factory=TenantTable)

    @classmethod
    def initial(cls, config: FlowConfig) -> FlowState:
        zeros = (0,) * len(config.bands.bands)
        return cls(config, zeros, zeros)


def _bump(counts: tuple[int, ...], index: int, delta: int) -> tuple[int, ...]:
    if delta == 0:
        return counts
    return (*counts[:index], counts[index] + delta, *counts[index + 1 :])


def arrived(flow: FlowState, band: str, tenant: str, *, at: float) -> tuple[FlowState, int, str]:
    """A request arrived: its band index and the tenant key it is counted under."""
    index = flow.config.bands.index_of(band)
    tenants = flow.config.tenants
    if tenants is None:
        return flow, index, ""
    table, key = tenant_rules.resolve(flow.table, tenants, index, tenant, at=at)
    return replace(flow, table=table), index, key


def refusal(
    flow: FlowState,
    band: int,
    tenant: str,
    *,
    limit: int,
    inflight: int,
    at: float,
) -> RejectCode | None:
    """Why a request of ``band`` and ``tenant`` may not take the slot the gate would give it
    under cap ``limit`` with ``inflight`` admitted at ``at``, or ``None``."""
    spec = flow.config.bands
    code = band_refusal(spec, band, limit=limit, inflight=inflight, waiting=flow.waiting)
    if code is not None:
        return code
    tenants = flow.config.tenants
    if tenants is None:
        return None
    slots, free = _room(flow, band, limit=limit, inflight=inflight)
    table = flow.table
    if not tenants.lend and tenant_rules.at_share(table, tenants, band, tenant, slots=slots):
        return RejectCode.TIER_PRIORITY
    if tenant_rules.refused(table, tenants, band, tenant, slots=slots, free=free, at=at):
        return RejectCode.TIER_PRIORITY
    return None


def _room(flow: FlowState, band: int, *, limit: int, inflight: int) -> tuple[int, int]:
    """The slots ``band`` could hold under cap ``limit`` with ``inflight`` admitted (what it
    holds plus what it may still take, at least one) and the free part of them."""
    free = max(1, limit - headroom(flow.config.bands, band, limit) - inflight)
    return flow.inflight[band] + free, free


def spare_reserve(
    flow: FlowState, band: int, tenant: str, *, limit: int, inflight: int, at: float
) -> int:
    """The band's spare slots when ``tenant`` is ahead of its band, else 0: the room a learner
    that predicts (rather than counts slots) keeps free of it for the others."""
    tenants = flow.config.tenants
    if tenants is None:
        return 0
    slots, _free = _room(flow, band, limit=limit, inflight=inflight)
    keep = tenant_rules.spare_slots(tenants, slots)
    if keep <= 0 or not tenant_rules.ahead(flow.table, tenants, band, tenant, slots=slots, at=at):
        return 0
    return keep


def settled(
    flow: FlowState,
    band: int,
    tenant: str,
    *,
    was_waiting: bool,
    admitted: bool,
    waits: bool,
    body_bytes: int | None,
    at: float,
) -> FlowState:
    """An attempt ended as admitted, waiting (``waits``) or refused (neither)."""
    inflight, waiting, table = flow.inflight, flow.waiting, flow.table
    tenants = flow.config.tenants
    if admitted:
        inflight = _bump(inflight, band, 1)
        waiting = _bump(waiting, band, -1 if was_waiting else 0)
        if tenants is not None:
            cost = tenants.cost(body_bytes)
            table = tenant_rules.admitted(
                table, tenants, band, tenant, cost=cost, at=at, was_waiting=was_waiting
            )
    elif waits and not was_waiting:
        waiting = _bump(waiting, band, 1)
        if tenants is not None:
            table = tenant_rules.queued(table, band, tenant)
    elif not waits and was_waiting:
        waiting = _bump(waiting, band, -1)
        if tenants is not None:
            table = tenant_rules.left_queue(table, band, tenant)
    else:
        return flow
    return replace(flow, inflight=inflight, waiting=waiting, table=table)


def abandoned(flow: FlowState, band: int, tenant: str) -> FlowState:
    """A waiter's client left."""
    table = flow.table
    if flow.config.tenants is not None:
        table = tenant_rules.left_queue(table, band, tenant)
    return replace(flow, waiting=_bump(flow.waiting, band, -1), table=table)


def finished(
    flow: FlowState, band: int, tenant: str, *, output_tokens: int | None = None, at: float
) -> FlowState:
    """An admitted request gave its slot back, having delivered ``output_tokens`` (if known)."""
    table = flow.table
    tenants = flow.config.tenants
    if tenants is not None:
        cost = tenants.output_cost(output_tokens)
        table = tenant_rules.released(table, tenants, band, tenant, cost=cost, at=at)
    return replace(flow, inflight=_bump(flow.inflight, band, -1), table=table)


def retry_order(
    flow: FlowState, requests: Mapping[int, Tracked], *, limit: int, inflight: int
) -> tuple[int, ...]:
    """The waiting requests' ids in the order they should retry when room comes back: higher
    bands first, then the tenant furthest below its fair share (as :func:`refusal` ranks),
    then the earliest arrival. A runtime that retries in this order gives room the gate does
    not count in slots (the predictive learner's) to the fairest waiter that fits."""
    spec = flow.config.bands
    tenants = flow.config.tenants
    ranks: dict[tuple[int, str], tuple[float, float, float, str]] = {}
    if tenants is not None:
        for band in range(len(spec.bands)):
            slots, _free = _room(flow, band, limit=limit, inflight=inflight)
            ranks.update(tenant_rules.ranks(flow.table, tenants, band, slots=slots))
    waiting = [
        (tracked.band, ranks.get((tracked.band, tracked.tenant), _NO_RANK), tracked.arrived_at, rid)
        for rid, tracked in requests.items()
        if tracked.queued is not None
    ]
    waiting.sort()
    return tuple(rid for *_, rid in waiting)


_NO_RANK = (0.0, 0.0, 0.0, "")


def waiters_in_order(
    flow: FlowState, requests: Mapping[int, Tracked], gate: GateState
) -> tuple[int, ...]:
    """:func:`retry_order` under ``gate``'s current cap and the slots it holds."""
    return retry_order(flow, requests, limit=current_limit(gate)[0], inflight=gate.inflight)


#: The most passes over :func:`retry_order` a runtime makes on one wake-up: the second lets a
#: waiter passed over for one ranked before it take the slot that one left (its wait ended
#: without it); further passes rarely admit anyone and cost a pass each.
RETRY_PASSES = 2


def retry_has_room(gate: GateState) -> bool:
    """Whether a retry now could still be admitted: false while the gate is open and every
    slot of its cap (and of ``GLOBAL_LIMIT``) is held. A waiter not retried then keeps its wait,
    and its own timer (its fallback re-check, its deadline) still ends it."""
    limit, closed = current_limit(gate)
    if closed is not None:
        return True  # a closed gate refuses each waiter at once: let the retries end them
    return gate.inflight < min(limit, gate.config.global_limit)
