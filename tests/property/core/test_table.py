"""guard_core.table: a Table shows what a dict copied and changed the same way shows, every version
of it stays as it was, and a change copies a bounded part of it."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard_core import table as table_module
from guard_core.table import Table, filed, forgotten

#: A small key space, so that changes hit the same keys often (filed again, forgotten, re-filed),
#: and long enough runs that tables merge their changes many times over.
_KEYS = st.integers(min_value=0, max_value=6) | st.integers(min_value=0, max_value=40)
_OPS = st.lists(
    st.tuples(st.sampled_from(("set", "del")), _KEYS, st.integers()), min_size=1, max_size=400
)
_START = st.dictionaries(_KEYS, st.integers(), max_size=30)


def _same(table: Mapping[int, int], expected: dict[int, int]) -> None:
    assert list(table) == list(expected)
    assert list(table.items()) == list(expected.items())
    assert list(table.values()) == list(expected.values())
    assert list(table.keys()) == list(expected.keys())
    assert len(table) == len(expected)
    assert table == expected
    assert expected == table
    assert dict(table) == expected
    for key in range(-1, 42):
        assert (key in table) is (key in expected)
        assert table.get(key) == expected.get(key)
        assert table.get(key, "none") == expected.get(key, "none")
        if key in expected:
            assert table[key] == expected[key]


#: Where small tables stay plain dicts: never (every change makes a table), at a few entries (so
#: runs cross between the two both ways), and the module's own bound.
_SMALL_BOUNDS = (0, 8, table_module._SMALL)


@pytest.mark.parametrize("small", _SMALL_BOUNDS)
@settings(max_examples=300)
@given(start=_START, ops=_OPS)
def test_every_version_of_a_table_shows_what_the_same_dict_copies_show(
    small: int, start: dict[int, int], ops: list[tuple[str, int, int]]
) -> None:
    with mock.patch.object(table_module, "_SMALL", small):
        _follow(start, ops)


def _follow(start: dict[int, int], ops: list[tuple[str, int, int]]) -> None:
    start_copy = dict(start)
    table: Mapping[int, int] = start
    expected = dict(start)
    versions: list[tuple[Mapping[int, int], dict[int, int]]] = []
    for op, key, value in ops:
        if op == "set":
            table = filed(table, key, value)
            expected = {**expected, key: value}
        else:
            table = forgotten(table, key)
            expected = {k: v for k, v in expected.items() if k != key}
        _same(table, expected)
        versions.append((table, expected))
    # Persistence: no later change touched an earlier version, nor the mapping it began from.
    for version, seen in versions:
        _same(version, seen)
    assert start == start_copy


@given(start=_START, key=_KEYS, value=st.integers())
def test_a_key_forgotten_and_filed_again_goes_last_as_in_a_dict(
    start: dict[int, int], key: int, value: int
) -> None:
    table = Table(start).without(key)
    table = filed(table, key, value)
    expected = dict(start)
    expected.pop(key, None)
    expected[key] = value
    _same(table, expected)


def test_forgetting_a_key_it_does_not_hold_gives_the_same_table() -> None:
    table = Table({1: 1})
    assert forgotten(table, 2) is table


def test_a_change_copies_at_most_about_the_square_root_of_the_table() -> None:
    table: Mapping[int, int] = Table({key: key for key in range(10_000)})
    for key in range(10_000, 12_000):
        table = forgotten(filed(table, key, key), key - 10_000)
        assert isinstance(table, Table)
        # The changes held on top of the base: what the next change copies.
        assert len(table._changes) + len(table._gone) <= max(16, int(len(table._base) ** 0.5))
    assert len(table) == 10_000
    assert list(table) == list(range(2_000, 12_000))


def test_a_small_table_is_a_plain_dict_and_a_large_one_a_table() -> None:
    small = filed({1: 1}, 2, 2)
    assert type(small) is dict
    large = filed({key: key for key in range(table_module._SMALL)}, -1, -1)
    assert isinstance(large, Table)
    shrunk: Mapping[int, int] = large
    for key in range(table_module._SMALL):
        shrunk = forgotten(shrunk, key)
    assert type(shrunk) is dict  # merged back into a dict once small again
    assert shrunk == {-1: -1}


def test_a_table_pickles_to_an_equal_table() -> None:
    table = Table({1: 1, 2: 2}).set(3, 3)
    assert isinstance(table, Table)
    table = table.without(1)
    assert isinstance(table, Table)
    copied = pickle.loads(pickle.dumps(table))
    assert copied == {2: 2, 3: 3}
    assert list(copied) == [2, 3]
    assert repr(copied) == "Table({2: 2, 3: 3})"
