"""Tenant fairness within a band: weighted fair shares of slots and a fair short wait.

Reads: the trusted tenant key of each request (``PIG_TENANT_HEADER``), the weights
(``PIG_TENANT_WEIGHTS``), and per (band, tenant) the slots held, the requests waiting and the
service attained (requests, plus prompt tokens and ``output_weight`` times the output tokens
delivered, in units of ``token_unit``).
Guarantees:
- the table holds at most ``max_tenants`` entries; a new tenant takes the place of the least
  recently seen entry that holds and awaits nothing, and when every entry is busy it is counted
  as :data:`OTHER` (one shared entry); an entry with a slot or a waiter is never dropped, so
  counts never leak;
- waiters are ranked by slots held less their weighted fair share of the band's slots (the
  share among the band's active tenants: those holding or awaiting a slot), then attained
  service per weight, then the earliest last admission, then the key: a tenant is refused a
  free slot only when the tenants ranked before it would take every free slot before its
  rank comes (each slot a tenant takes moves it one slot up; only its waiting requests count,
  and not those the spare keeps out), so a tenant below its weighted fair share is never
  passed over for one above it;
- the spare (part of :func:`refused`): a tenant *ahead* (:func:`ahead`: holding at least its
  slot share, and recent service per weight over ``1 + ahead_margin`` times the band's) takes a
  free slot only while more than :func:`spare_slots` are free; no other tenant is ever refused
  by it. So a free slot is left to nobody only while no more than the spare is free and every
  waiter is ahead; with ``spare`` 0 (or a band too small for one whole spare slot) never
  (work-conserving);
- with ``lend`` off (:func:`at_share`), a tenant holding its weighted fair share of the band's
  slots (rounded down, at least one) takes no more, free slots or not: strict shares, not
  work-conserving;
- attained service is read per weight, less ``floor`` (the least service per weight among the
  band's active tenants, the same for every tenant, so admitting one moves no two others past
  each other), clamped to ``[0, max_lag]``: a newcomer starts level with the least served and
  cannot starve the others by its empty history, and a tenant that was served much in the past
  is passed over for at most ``max_lag`` units of service per weight by the others (the
  starvation bound; the short wait's 0.5 s cap still ends every wait); recent service is the
  same costs fading by ``e`` every ``recent_s``, computed from the events' ``at`` alone;
- nothing here reads a clock: ``at`` comes with each call and only orders entries by recency
  and decays recent service.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

from guard_core._errors import PolicyConfigError
from guard_core.settings import AtLeast, Greater, Within, require_valid, setting

__all__ = (
    "OTHER",
    "TenantConfig",
    "TenantStats",
    "TenantTable",
    "admitted",
    "ahead",
    "at_share",
    "fair_share",
    "left_queue",
    "queued",
    "rank",
    "ranks",
    "refused",
    "released",
    "resolve",
)

#: The shared entry of tenants beyond the table's cap (and of requests with no tenant key).
OTHER = "other"

#: Prompt bytes per token, the same rough rule the simulation uses for a chat body.
_BYTES_PER_TOKEN = 4

_Key = tuple[int, str]
#: Shares are fractions of slots: two ranks this close hold the same place.
_EPSILON = 1e-9


def _weights(
    value: Mapping[str, float] | Iterable[tuple[str, float]],
) -> tuple[tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    pairs = sorted(dict(items).items())
    for name, weight in pairs:
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
            raise PolicyConfigError(f"tenant {name!r}: a weight must be > 0, got {weight!r}")
    return tuple((str(name), float(weight)) for name, weight in pairs)


@attrs.frozen(kw_only=True)
class TenantConfig:
    """``PIG_TENANT_*``: who the tenants are and what each one's share weighs."""

    #: ``PIG_TENANT_WEIGHTS``: ``name=weight`` exceptions to the default weight of 1.
    weights: tuple[tuple[str, float], ...] = attrs.field(default=(), converter=_weights)
    #: ``PIG_TENANT_MAX``: entries the table keeps (least recently seen idle ones go first).
    max_tenants: int = setting(256, env="PIG_TENANT_MAX", rules=(AtLeast(1),))
    #: ``PIG_TENANT_TOKEN_UNIT``: prompt tokens that count as one request of attained service.
    token_unit: float = setting(1000.0, env="PIG_TENANT_TOKEN_UNIT", rules=(Greater(0),))
    #: ``PIG_TENANT_MAX_LAG``: the most service per unit of weight (in requests) a tenant's
    #: history may count against it over the least-served active tenant of its band.
    max_lag: float = setting(8.0, env="PIG_TENANT_MAX_LAG", rules=(AtLeast(0),))
    #: ``PIG_TENANT_OUTPUT_WEIGHT``: what one output token counts for against one prompt token
    #: (decoding a token costs the engine more than prefilling one; 0: output not counted).
    output_weight: float = setting(2.0, env="PIG_TENANT_OUTPUT_WEIGHT", rules=(AtLeast(0),))
    #: ``PIG_TENANT_RECENT_SECONDS``: how fast recent service fades (by ``e`` in this long).
    recent_s: float = setting(60.0, env="PIG_TENANT_RECENT_SECONDS", rules=(Greater(0),))
    #: ``PIG_TENANT_AHEAD_MARGIN``: a tenant is *ahead* when its recent service per weight is
    #: more than ``1 + margin`` times its band's.
    ahead_margin: float = setting(0.25, env="PIG_TENANT_AHEAD_MARGIN", rules=(AtLeast(0),))
    #: ``PIG_TENANT_SPARE``: the share of a band's slots a tenant ahead may not take: it gets a
    #: free slot only while more than that many are free, so the others find room (0: off).
    spare: float = setting(0.1, env="PIG_TENANT_SPARE", rules=(Within(0, 1),))
    #: ``PIG_TENANT_LEND``: whether a tenant may hold more than its weighted fair share of its
    #: band's slots while they are free (work-conserving); off, it never does (strict shares:
    #: what the others leave free stays free).
    lend: bool = setting(True, env="PIG_TENANT_LEND")

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    def weight(self, tenant: str) -> float:
        for name, weight in self.weights:
            if name == tenant:
                return weight
        return 1.0

    def cost(self, body_bytes: int | None) -> float:
        """The service one admitted request attains: 1, plus its prompt in token units."""
        tokens = max(0, body_bytes or 0) / _BYTES_PER_TOKEN
        return 1.0 + tokens / self.token_unit

    def output_cost(self, output_tokens: int | None) -> float:
        """The service a finished request's ``output_tokens`` add (0 when not counted)."""
        return self.output_weight * max(0, output_tokens or 0) / self.token_unit


@attrs.frozen
class TenantStats:
    """One tenant in one band."""

    inflight: int = 0
    waiting: int = 0
    service: float = 0.0
    served_at: float = -math.inf
    seen_at: float = -math.inf
    #: Service attained lately: each cost decays by ``e`` every ``recent_s``, as of ``recent_at``.
    recent: float = 0.0
    recent_at: float = -math.inf

    def recent_as_of(self, at: float, window_s: float) -> float:
        """The recent service, decayed to ``at``."""
        if self.recent <= 0 or at <= self.recent_at:
            return self.recent
        return self.recent * math.exp((self.recent_at - at) / window_s)

    @property
    def active(self) -> bool:
        return self.inflight > 0 or self.waiting > 0


@attrs.frozen
class TenantTable:
    """Every known (band, tenant) entry."""

    entries: Mapping[_Key, TenantStats] = attrs.field(factory=dict)


def _put(table: TenantTable, key: _Key, stats: TenantStats) -> TenantTable:
    entries = dict(table.entries)
    entries[key] = stats
    return TenantTable(entries)


def resolve(
    table: TenantTable, config: TenantConfig, band: int, tenant: str, *, at: float
) -> tuple[TenantTable, str]:
    """The table with ``tenant`` seen at ``at`` in ``band``, and the key it is counted under."""
    tenant = tenant or OTHER
    entries = table.entries
    key = (band, tenant)
    stats = entries.get(key)
    if stats is None and len(entries) >= config.max_tenants:
        idle = [(s.seen_at, k) for k, s in entries.items() if not s.active and k[1] != OTHER]
        if not idle:
            tenant, key = OTHER, (band, OTHER)
            stats = entries.get(key)
        else:
            dropped = dict(entries)
            del dropped[min(idle)[1]]
            table = TenantTable(dropped)
    stats = stats or TenantStats()
    return _put(table, key, attrs.evolve(stats, seen_at=at)), tenant


def _change(table: TenantTable, band: int, tenant: str, **delta: int) -> TenantTable:
    stats = table.entries.get((band, tenant), TenantStats())
    inflight = stats.inflight + delta.get("inflight", 0)
    waiting = stats.waiting + delta.get("waiting", 0)
    return _put(table, (band, tenant), attrs.evolve(stats, inflight=inflight, waiting=waiting))


def queued(table: TenantTable, band: int, tenant: str) -> TenantTable:
    return _change(table, band, tenant, waiting=1)


def left_queue(table: TenantTable, band: int, tenant: str) -> TenantTable:
    return _change(table, band, tenant, waiting=-1)


def released(
    table: TenantTable,
    config: TenantConfig,
    band: int,
    tenant: str,
    *,
    cost: float = 0.0,
    at: float,
) -> TenantTable:
    """``tenant`` gave a slot back at ``at``; its output (``cost``,
    :meth:`TenantConfig.output_cost`) adds to its attained service."""
    stats = table.entries.get((band, tenant), TenantStats())
    changed = attrs.evolve(
        stats,
        inflight=stats.inflight - 1,
        service=stats.service + cost,
        recent=stats.recent_as_of(at, config.recent_s) + cost,
        recent_at=max(at, stats.recent_at),
    )
    return _put(table, (band, tenant), changed)


def admitted(
    table: TenantTable,
    config: TenantConfig,
    band: int,
    tenant: str,
    *,
    cost: float,
    at: float,
    was_waiting: bool,
) -> TenantTable:
    """``tenant`` took a slot (from the queue when ``was_waiting``) and attained ``cost``."""
    stats = table.entries.get((band, tenant), TenantStats())
    weight = config.weight(tenant)
    # A newcomer starts level, per weight, with the least-served of the others.
    service = max(stats.service, _floor(table, config, band, tenant) * weight) + cost
    return _put(
        table,
        (band, tenant),
        attrs.evolve(
            stats,
            inflight=stats.inflight + 1,
            waiting=stats.waiting - (1 if was_waiting else 0),
            service=service,
            served_at=at,
            recent=stats.recent_as_of(at, config.recent_s) + cost,
            recent_at=at,
        ),
    )


def _floor(table: TenantTable, config: TenantConfig, band: int, tenant: str) -> float:
    """The least service per weight among the band's active tenants other than ``tenant`` (0
    if none)."""
    others = [
        (t, s) for (b, t), s in table.entries.items() if b == band and t != tenant and s.active
    ]
    return _band_floor(others, config) if others else 0.0


def _band_floor(actives: Iterable[tuple[str, TenantStats]], config: TenantConfig) -> float:
    """The least service per weight among ``actives``."""
    return min(s.service / config.weight(t) for t, s in actives)


def rank(
    stats: TenantStats,
    weight: float,
    tenant: str,
    *,
    share: float,
    floor: float,
    max_lag: float,
) -> tuple[float, float, float, str]:
    """Lower ranks go first: slots held beyond the weighted fair ``share`` (most below it
    first), attained service per weight above the band's least (``floor``, per weight),
    clamped to ``max_lag`` (the starvation bound), the earliest last admission, the key.

    Every tenant's service is read against the same per-weight floor, so a change of the
    floor (its least-served tenant admitted) moves no two unclamped tenants past each other."""
    above = min(max(stats.service / weight - floor, 0.0), max_lag)
    return (stats.inflight - share, above, stats.served_at, tenant)


def _weights_of(
    table: TenantTable, config: TenantConfig, band: int, tenant: str
) -> dict[str, float]:
    """The weight of each of the band's active tenants and of ``tenant``."""
    weights = {t: config.weight(t) for (b, t), s in table.entries.items() if b == band and s.active}
    weights[tenant] = config.weight(tenant)
    return weights


def fair_share(
    table: TenantTable, config: TenantConfig, band: int, tenant: str, slots: int
) -> float:
    """``tenant``'s weighted share of ``slots`` among the band's active tenants and itself."""
    weights = _weights_of(table, config, band, tenant)
    return slots * weights[tenant] / sum(weights.values())


def _level(table: TenantTable, config: TenantConfig, band: int, tenant: str, *, at: float) -> float:
    """The band's recent service per unit of weight, over its active tenants and ``tenant``."""
    total = weights = 0.0
    counted = False
    for (b, t), stats in table.entries.items():
        if b != band or not (stats.active or t == tenant):
            continue
        total += stats.recent_as_of(at, config.recent_s)
        weights += config.weight(t)
        counted = counted or t == tenant
    if not counted:
        weights += config.weight(tenant)
    return total / weights


def _is_ahead(
    stats: TenantStats,
    config: TenantConfig,
    tenant: str,
    *,
    level: float,
    share: float,
    at: float,
) -> bool:
    if level <= 0 or stats.inflight < share - _EPSILON:
        return False
    recent = stats.recent_as_of(at, config.recent_s)
    return recent / config.weight(tenant) > (1 + config.ahead_margin) * level


def ahead(
    table: TenantTable, config: TenantConfig, band: int, tenant: str, *, slots: int, at: float
) -> bool:
    """``tenant`` holds at least its weighted fair share of the band's ``slots`` and its recent
    service per weight is more than ``1 + ahead_margin`` times its band's (the recent service
    of the band's active tenants and itself, per unit of their weights)."""
    level = _level(table, config, band, tenant, at=at)
    stats = table.entries.get((band, tenant), TenantStats())
    share = fair_share(table, config, band, tenant, slots)
    return _is_ahead(stats, config, tenant, level=level, share=share, at=at)


def at_share(
    table: TenantTable, config: TenantConfig, band: int, tenant: str, *, slots: int
) -> bool:
    """``tenant`` holds all the band's ``slots`` its weighted fair share allows: the share
    rounded down, but at least one (so a band with more tenants than slots still serves)."""
    held = table.entries.get((band, tenant), TenantStats()).inflight
    share = fair_share(table, config, band, tenant, slots)
    return held >= max(1, math.floor(share + _EPSILON))


def spare_slots(config: TenantConfig, slots: int) -> int:
    """The slots of a band of ``slots`` that a tenant ahead may not take: ``spare`` of them,
    rounded down."""
    return math.floor(config.spare * slots + _EPSILON)


def refused(
    table: TenantTable,
    config: TenantConfig,
    band: int,
    tenant: str,
    *,
    slots: int,
    free: int,
    at: float,
) -> bool:
    """True when ``tenant`` may not take one of the band's ``free`` slots (of the ``slots`` it
    could hold in all): it is ahead (:func:`ahead`) and no more than its spare
    (:func:`spare_slots`) is free, or better-ranked waiters that may take a slot now would take
    every free one before its turn (a waiter the spare keeps from a slot does not count)."""
    keep = spare_slots(config, slots)
    if keep > 0 and free <= keep and ahead(table, config, band, tenant, slots=slots, at=at):
        return True
    # The ranking: would the better-ranked waiters take every free slot first?
    entries = table.entries
    actives = [(t, s) for (b, t), s in entries.items() if b == band and s.active]
    if not any(t != tenant and s.waiting > 0 for t, s in actives):
        return False  # nobody else waits: an idle share is lent to whoever asks
    level = _level(table, config, band, tenant, at=at) if 0 < free <= keep else 0.0
    weights = _weights_of(table, config, band, tenant)
    per_weight = slots / sum(weights.values())
    mine = entries.get((band, tenant), TenantStats())
    weight = weights[tenant]
    floor = _band_floor(actives, config)
    lag = config.max_lag
    own = rank(mine, weight, tenant, share=per_weight * weight, floor=floor, max_lag=lag)
    before = 0
    for other, stats in actives:
        if other == tenant or stats.waiting <= 0:
            continue
        weight = weights[other]
        share = per_weight * weight
        if level > 0 and _is_ahead(stats, config, other, level=level, share=share, at=at):
            continue  # the spare keeps it from the free slots
        theirs = rank(stats, weight, other, share=share, floor=floor, max_lag=lag)
        before += min(stats.waiting, _ahead(theirs, own))
        if before >= free:
            return True
    return False


def ranks(
    table: TenantTable, config: TenantConfig, band: int, *, slots: int
) -> dict[tuple[int, str], tuple[float, float, float, str]]:
    """The rank of every active tenant of ``band`` (as :func:`refused` ranks them)."""
    actives = [(t, s) for (b, t), s in table.entries.items() if b == band and s.active]
    if not actives:
        return {}
    total = sum(config.weight(t) for t, _ in actives)
    floor = _band_floor(actives, config)
    found = {}
    for tenant, stats in actives:
        weight = config.weight(tenant)
        share = slots * weight / total
        found[(band, tenant)] = rank(
            stats, weight, tenant, share=share, floor=floor, max_lag=config.max_lag
        )
    return found


def _ahead(theirs: tuple[float, float, float, str], own: tuple[float, float, float, str]) -> int:
    """How many slots a tenant ranked ``theirs`` takes before one ranked ``own`` gets one: each
    slot it takes moves it one slot closer to (or past) its share."""
    gap = own[0] - theirs[0]
    if gap > _EPSILON:
        return math.ceil(gap - _EPSILON)
    if abs(gap) <= _EPSILON and theirs[1:] < own[1:]:
        return 1
    return 0
