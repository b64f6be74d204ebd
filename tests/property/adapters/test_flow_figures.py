"""tools/flow_figures.py's fluid reference: the max-min (water-filling) split of admissions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.load_tool import load_tool

figures = load_tool("flow_figures")


@given(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.floats(0, 6000))
def test_the_water_level_splits_capacity_max_min(demands: list[int], capacity: float) -> None:
    level = figures.water_level(demands, capacity)
    given_out = sum(min(d, level) for d in demands)
    if capacity <= sum(demands):
        # Everything is handed out, and nobody below the level is cut.
        assert abs(given_out - capacity) <= 1e-6 * max(1.0, capacity)
    else:
        assert level >= max(demands)  # every demand is met
        assert given_out == sum(demands)


def test_the_fluid_reference_reads_the_light_tenants() -> None:
    # Capacity 30 for demands 5, 10, 10 (light) and 40 (heavy): the level is 25 / 3, so the
    # small tenant is served whole and the two others each lose a sixth.
    entry = {
        "all": {"admitted": 30},
        "tenants": [
            {"tenant": "t0", "requests": 40},
            {"tenant": "t1", "requests": 5},
            {"tenant": "t2", "requests": 10},
            {"tenant": "t3", "requests": 10},
        ],
    }
    assert abs(figures.fluid_light_reject(entry) - (0 + 1 / 6 + 1 / 6) / 3) < 1e-9
