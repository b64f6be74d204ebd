"""The prompt-block LRU cache of guard_adapters.prefix_cache, against a plain list model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.prefix_cache import MOONCAKE_BLOCK_TOKENS, PrefixCache

#: Few distinct ids, so that requests share blocks often.
block_lists = st.lists(st.integers(0, 12), max_size=10)
requests = st.tuples(block_lists, st.integers(0, 6_000))


class ListModel:
    """The same rules written the slow, obvious way: a list, most recently used last."""

    def __init__(self, capacity: int, block_tokens: int) -> None:
        self.capacity = capacity
        self.block_tokens = block_tokens
        self.held: list[int] = []

    def lookup_and_insert(self, ids: list[int], prompt: int) -> int:
        hits = 0
        while hits < len(ids) and ids[hits] in self.held:
            hits += 1
        cached = max(0, min(hits * self.block_tokens, prompt - 1))
        for block in reversed(ids):
            if block in self.held:
                self.held.remove(block)
            self.held.append(block)
        self.held = self.held[max(0, len(self.held) - self.capacity) :]
        return cached


@given(
    capacity=st.integers(0, 10),
    block_tokens=st.sampled_from([1, 16, 512]),
    calls=st.lists(requests, max_size=40),
)
def test_the_cache_matches_the_list_model_and_keeps_its_bounds(
    capacity: int, block_tokens: int, calls: list[tuple[list[int], int]]
) -> None:
    cache = PrefixCache(capacity, block_tokens)
    model = ListModel(capacity, block_tokens)
    for ids, prompt in calls:
        cached = cache.lookup_and_insert(ids, prompt)
        assert cached == model.lookup_and_insert(ids, prompt)
        assert 0 <= cached <= max(0, prompt - 1)
        assert cached <= len(ids) * block_tokens
        assert cached % block_tokens == 0 or cached == prompt - 1
        assert len(cache) <= capacity
        assert len(cache) == len(model.held)
        assert all(block in cache for block in model.held)


@given(
    ids=st.lists(st.integers(0, 10**9), unique=True, min_size=1, max_size=30),
    extra=st.integers(0, 5),
    prompt=st.integers(1, 20_000),
)
def test_a_repeated_request_hits_all_its_blocks(ids: list[int], extra: int, prompt: int) -> None:
    cache = PrefixCache(len(ids) + extra, 512)
    assert cache.lookup_and_insert(ids, prompt) == 0  # cold
    assert cache.lookup_and_insert(ids, prompt) == min(len(ids) * 512, prompt - 1)


@given(
    shared=st.integers(0, 8),
    own=st.integers(0, 8),
    other=st.integers(0, 8),
)
def test_a_shared_prefix_is_reused_up_to_the_first_difference(
    shared: int, own: int, other: int
) -> None:
    first = [*range(shared), *range(100, 100 + own)]
    second = [*range(shared), *range(200, 200 + other), *range(100, 100 + own)]
    cache = PrefixCache(64, 512)
    cache.lookup_and_insert(first, 10**6)
    # the blocks after the difference are cached too, but they follow a miss: not reusable
    expected = (shared + (own if other == 0 else 0)) * 512
    assert cache.lookup_and_insert(second, 10**6) == expected


def test_the_whole_prompt_is_never_cached() -> None:
    cache = PrefixCache(10, 512)
    cache.lookup_and_insert([1, 2], 1000)
    assert cache.lookup_and_insert([1, 2], 1000) == 999  # two blocks would be 1024 > 1000
    assert cache.lookup_and_insert([1, 2], 1024) == 1023
    assert cache.lookup_and_insert([1, 2], 1025) == 1024
    assert cache.lookup_and_insert([1], 1) == 0
    assert cache.lookup_and_insert([1], 0) == 0


def test_under_pressure_the_least_recent_go_and_a_prompts_tail_before_its_head() -> None:
    cache = PrefixCache(4, 512)
    cache.lookup_and_insert([1, 2, 3, 4, 5, 6], 3000)  # six blocks, room for four
    assert len(cache) == 4
    assert [block in cache for block in range(1, 7)] == [True] * 4 + [False] * 2
    assert cache.lookup_and_insert([1, 2, 3, 4, 5, 6], 3000) == 4 * 512
    cache = PrefixCache(3, 512)
    cache.lookup_and_insert([1], 100)
    cache.lookup_and_insert([2], 100)
    cache.lookup_and_insert([3], 100)
    cache.lookup_and_insert([1], 100)  # 1 is used again: 2 is now the least recent
    cache.lookup_and_insert([4], 100)
    assert [block in cache for block in (1, 2, 3, 4)] == [True, False, True, True]


def test_a_cache_with_no_room_never_hits() -> None:
    cache = PrefixCache(0)
    assert cache.block_tokens == MOONCAKE_BLOCK_TOKENS == 512
    for _ in range(3):
        assert cache.lookup_and_insert([1, 2, 3], 2000) == 0
    assert len(cache) == 0


@pytest.mark.parametrize(
    ("capacity", "block_tokens", "error"),
    [(-1, 512, ValueError), (4, 0, ValueError), (1.5, 512, TypeError), (4, True, TypeError)],
)
def test_bad_sizes_are_refused(capacity: object, block_tokens: object, error: type) -> None:
    with pytest.raises(error):
        PrefixCache(capacity, block_tokens)  # type: ignore[arg-type]
