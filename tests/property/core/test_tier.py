"""Tier classification and the premium reservation (spec 0 item 4 and 4.2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import Tier, basic_limit, premium_reserved, tier_from_header_values


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([b"premium"], Tier.PREMIUM),
        ([b"Premium"], Tier.PREMIUM),
        ([b"  PREMIUM\t"], Tier.PREMIUM),
        ([], Tier.BASIC),
        ([b""], Tier.BASIC),
        ([b"basic"], Tier.BASIC),
        ([b"gold"], Tier.BASIC),
        ([b"premium", b"premium"], Tier.BASIC),
        ([b"premium,premium"], Tier.BASIC),
        ([b"premium, basic"], Tier.BASIC),
        ([b"pre mium"], Tier.BASIC),
        ([b"premium\x00"], Tier.BASIC),
    ],
)
def test_tier_header(values: list[bytes], expected: Tier) -> None:
    assert tier_from_header_values(values) is expected


@given(st.lists(st.binary(max_size=12), min_size=2, max_size=4))
def test_more_than_one_value_is_always_basic(values: list[bytes]) -> None:
    assert tier_from_header_values(values) is Tier.BASIC


@pytest.mark.parametrize(
    ("limit", "premium_inflight", "basic", "reserved"),
    [
        # The worked numbers of spec 4.2.
        (8, 0, 7, 1),
        (8, 1, 6, 2),
        (8, 2, 5, 3),
        (1, 0, 1, 0),
        # Edges: a closed cap, and premium holding everything.
        (0, 0, 0, 0),
        (2, 0, 1, 1),
        (8, 7, 0, 8),
        (8, 20, 0, 8),
    ],
)
def test_worked_tier_numbers(limit: int, premium_inflight: int, basic: int, reserved: int) -> None:
    assert basic_limit(limit, premium_inflight) == basic
    assert premium_reserved(limit, premium_inflight) == reserved


@given(st.integers(-3, 600), st.integers(0, 600))
def test_basic_plus_reserve_is_the_cap(limit: int, premium_inflight: int) -> None:
    basic = basic_limit(limit, premium_inflight)
    reserved = premium_reserved(limit, premium_inflight)
    assert 0 <= basic <= max(limit, 0)
    assert 0 <= reserved <= max(limit, 0)
    if limit > 1:
        assert basic + reserved == limit
        # Basic always leaves at least one slot beyond what premium already holds.
        assert basic <= limit - min(limit, premium_inflight + 1)
    elif limit == 1:
        assert (basic, reserved) == (1, 0)
    else:
        assert (basic, reserved) == (0, 0)
