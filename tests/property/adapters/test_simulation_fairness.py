"""``simulate`` with tenants: labels, per-tenant figures, and what tenant fairness changes.

- tenant labels are a pure function of their arguments, a prefix's labels are the prefix of the
  whole trace's, and ``t0`` gets about its share;
- Jain's index is 1 for equal values, ``1/n`` when one value takes everything, and in between;
- the per-tenant rows count every request once, and the summary's rates are the rows';
- on a real trace overloaded for a fixed cap, with a heavy tenant at 2x and 4x a light one's
  rate and with two seeds, turning tenant fairness on lowers the light tenants' reject rate,
  raises the heavy one's, and keeps the total admitted within 3 %.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from guard_adapters.config import load_config
from guard_adapters.fairness_results import HEAVY, TenantRow, chance_jain_index, jain_index
from guard_adapters.simulation import SimulationResult, parse_policy, simulate
from guard_adapters.traces import head, load_trace, scale_rate, tenant_labels, thinned
from guard_core.flow import FlowConfig
from guard_core.tenants import TenantConfig

AZURE = Path(__file__).parents[2] / "fixtures/traces/azure-llm-2023-conv.csv"


@given(st.integers(0, 300), st.integers(2, 12), st.floats(0.0, 0.9), st.integers(0, 9))
def test_labels_are_pure_and_prefix_stable(
    count: int, tenants: int, share: float, seed: int
) -> None:
    labels = tenant_labels(count, tenants, share, seed=seed)
    assert labels == tenant_labels(count, tenants, share, seed=seed)
    assert labels[: count // 2] == tenant_labels(count // 2, tenants, share, seed=seed)
    assert set(labels) <= {f"t{i}" for i in range(tenants)}


def test_the_heavy_tenant_gets_about_its_share() -> None:
    labels = tenant_labels(20_000, 10, 0.3, seed=1)
    assert labels.count(HEAVY) / len(labels) == pytest.approx(0.3, abs=0.02)
    light = [labels.count(f"t{i}") for i in range(1, 10)]
    assert max(light) / min(light) < 1.2


@example([8.263110171867809e-162, 0.0])  # squared, it underflowed (CI found it)
@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=20))
def test_jain_index_bounds(values: list[float]) -> None:
    index = jain_index(values)
    assert index is not None
    assert 1 / len(values) - 1e-9 <= index <= 1 + 1e-9
    assert jain_index([values[0]] * len(values)) == pytest.approx(1.0)
    if len(values) > 1:
        assert jain_index([1.0] + [0.0] * (len(values) - 1)) == pytest.approx(1 / len(values))


def _rows(counts: list[int], good: list[int]) -> list[TenantRow]:
    return [
        TenantRow(tenant=f"t{i + 1}", requests=n, rejected=0, good=g, goodput_per_s=0.0)
        for i, (n, g) in enumerate(zip(counts, good, strict=True))
    ]


@pytest.mark.parametrize(("counts", "p"), [([190] * 9, 0.11), ([40, 60, 80, 100], 0.3)])
def test_chance_jain_index_is_what_fair_coin_flips_score(counts: list[int], p: float) -> None:
    # Tenants served by the same coin: the mean index of many such runs is the reference.
    draws = random.Random(11)
    scores = []
    for _ in range(3000):
        good = [sum(draws.random() < p for _ in range(n)) for n in counts]
        shares = [g / n for g, n in zip(good, counts, strict=True)]
        index = jain_index(shares)
        assert index is not None
        scores.append(index)
    expected = chance_jain_index(_rows(counts, [round(p * n) for n in counts]))
    assert expected is not None
    assert sum(scores) / len(scores) == pytest.approx(expected, abs=0.004)
    assert expected < 1.0


@given(st.lists(st.integers(1, 500), min_size=1, max_size=12), st.floats(0.0, 1.0))
def test_chance_jain_index_bounds(counts: list[int], p: float) -> None:
    rows = _rows(counts, [round(p * n) for n in counts])
    index = chance_jain_index(rows)
    assert index is not None
    assert 1 / len(counts) - 1e-9 <= index <= 1 + 1e-9
    # Ten times the requests each, the same rate: closer to 1 (less left to chance).
    more = chance_jain_index(_rows([10 * n for n in counts], [10 * row.good for row in rows]))
    assert more is not None
    assert more >= index - 1e-12
    assert chance_jain_index([]) is None


@functools.cache
def _run(heavy_share: float, seed: int, fair: bool) -> SimulationResult:
    env = {"UPSTREAM": "http://sim:1", "GLOBAL_LIMIT": "40"}
    config = load_config(env).guard_config()
    if fair:
        config = attrs.evolve(config, flow=FlowConfig(tenants=TenantConfig()))
    trace = head(scale_rate(load_trace(AZURE), 1.5), 240)
    return simulate(
        trace, parse_policy("guard", config), seed=seed, tenants=10, heavy_share=heavy_share
    )


@given(
    st.lists(st.sampled_from(["t0", "t1", "t2"]), max_size=60),
    st.floats(0.01, 1.0),
    st.integers(0, 5),
)
def test_thinning_keeps_every_other_tenant_and_is_pure(
    labels: list[str], keep: float, seed: int
) -> None:
    kept = thinned(labels, HEAVY, keep, seed=seed)
    assert kept == thinned(labels, HEAVY, keep, seed=seed)
    assert all(k for label, k in zip(labels, kept, strict=True) if label != HEAVY)
    if keep == 1.0:
        assert all(kept)
    with pytest.raises(ValueError, match="kept share"):
        thinned(labels, HEAVY, 0.0, seed=seed)


def test_a_thinned_heavy_tenant_leaves_the_light_requests_as_they_were() -> None:
    trace = head(scale_rate(load_trace(AZURE), 1.5), 120)
    config = load_config({"UPSTREAM": "http://sim:1", "GLOBAL_LIMIT": "40"}).guard_config()
    policy = parse_policy("guard", config)
    whole = simulate(trace, policy, tenants=10, heavy_share=4 / 13)
    thin = simulate(trace, policy, tenants=10, heavy_share=4 / 13, heavy_keep=0.25)

    def arrivals(result: SimulationResult, heavy: bool) -> list[tuple[str, float, int]]:
        return [
            (o.tenant, o.arrival_s, o.prompt_tokens)
            for o in result.requests
            if (o.tenant == HEAVY) == heavy
        ]

    assert arrivals(thin, heavy=False) == arrivals(whole, heavy=False)
    sent, kept = len(arrivals(whole, heavy=True)), len(arrivals(thin, heavy=True))
    assert 0.15 * sent <= kept <= 0.35 * sent
    assert set(arrivals(thin, heavy=True)) <= set(arrivals(whole, heavy=True))
    with pytest.raises(ValueError, match="heavy_keep"):
        simulate(trace, policy, tenants=10, heavy_share=0.3, heavy_keep=1.5)


def test_the_rows_count_every_request_once() -> None:
    result = _run(0.3077, 0, True)
    fair = result.fairness
    assert fair is not None
    assert sum(row.requests for row in fair.tenants) == len(result.requests)
    refused = sum(not o.admitted for o in result.requests)
    assert sum(row.rejected for row in fair.tenants) == refused
    light = [row for row in fair.tenants if row.tenant != HEAVY]
    sent = sum(row.requests for row in light)
    assert fair.light_reject_rate == pytest.approx(sum(row.rejected for row in light) / sent)
    assert set(fair.as_json()) == {
        "jain_index_light",
        "light_reject_rate",
        "heavy_reject_rate",
        "light_goodput_per_s",
        "heavy_goodput_per_s",
    }


@pytest.mark.parametrize("heavy_share", [2 / 11, 4 / 13])
@pytest.mark.parametrize("seed", [0, 7])
def test_fairness_moves_refusals_from_light_tenants_to_the_heavy_one(
    heavy_share: float, seed: int
) -> None:
    unfair, fair = _run(heavy_share, seed, False), _run(heavy_share, seed, True)
    before, after = unfair.fairness, fair.fairness
    assert before is not None
    assert after is not None
    assert after.light_reject_rate < before.light_reject_rate
    assert after.heavy_reject_rate > before.heavy_reject_rate
    admitted = (sum(o.admitted for o in r.requests) for r in (unfair, fair))
    assert next(admitted) == pytest.approx(next(admitted), rel=0.03)
    assert after.jain_index_light is not None
    assert after.jain_index_light >= 0.95
