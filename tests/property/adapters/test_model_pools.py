"""Model pools, pure (guard_adapters.model_pools): the setting, discovery, the request's model."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.model_pools import (
    discovered_pools,
    listed_models,
    model_not_found_body,
    models_document,
    parse_pools,
    request_model,
)

_NAMES = st.text(alphabet="abcdefghij0123456789-./:", min_size=1, max_size=12)


@given(st.dictionaries(st.sampled_from([f"b{n}" for n in range(6)]), _NAMES, min_size=1))
def test_one_model_per_backend_gives_one_pool_per_model(served: dict[str, str]) -> None:
    names = sorted(served)
    pools, problems = discovered_pools({b: [m] for b, m in served.items()}, names)
    assert problems == []
    assert pools is not None
    for model, backends in pools.by_model.items():
        assert sorted(backends) == sorted(b for b, m in served.items() if m == model)
    assert {name for name, _ in pools.pools()} == set(served.values())
    document = json.loads(models_document(pools))
    assert [m["id"] for m in document["data"]] == list(pools.models)


def test_overlapping_lists_that_differ_are_refused_and_equal_ones_share_a_pool() -> None:
    pools, problems = discovered_pools({"b0": ["a", "b"], "b1": ["a", "b"]}, ["b0", "b1"])
    assert problems == []
    assert pools is not None
    assert pools.pools() == (("a", frozenset({"b0", "b1"})),)
    assert pools.pool_of("b") == "a"
    none, problems = discovered_pools({"b0": ["a", "b"], "b1": ["a"]}, ["b0", "b1"])
    assert none is None
    assert "share backends (b0)" in problems[0]
    assert discovered_pools({}, ["b0"]) == (None, ["no backend listed a model on /v1/models"])


@given(st.binary(max_size=200))
def test_any_answer_lists_models_or_nothing(page: bytes) -> None:
    models = listed_models(page)
    assert all(isinstance(m, str) and m for m in models)
    assert len(models) == len(set(models))


def test_an_openai_list_is_read_and_the_setting_is_checked() -> None:
    page = b'{"object":"list","data":[{"id":"m1","object":"model"},{"id":"m2"},{"id":"m1"}]}'
    assert listed_models(page) == ["m1", "m2"]
    assert parse_pools("", ["b0"]) == (None, [])
    assert parse_pools("discover", ["b0"]) == (None, [])
    pools, problems = parse_pools(" m1 = b0 , b1 ; m2=b2 ", ["b0", "b1", "b2"])
    assert problems == []
    assert pools is not None
    assert pools.backends_for("m1") == ("b0", "b1")
    assert pools.backends_for("m3") is None


@given(model=_NAMES, tail=st.text(max_size=300), cut=st.integers(0, 400))
def test_the_requests_model_is_read_when_whole_and_never_made_up(
    model: str, tail: str, cut: int
) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": tail}]}).encode()
    assert request_model(body) == model
    found = request_model(body[:cut])
    assert found in (None, model)  # a cut body gives the model only once it is whole


def test_the_404_names_the_model_escaped() -> None:
    error = json.loads(model_not_found_body('x"y'))["error"]
    assert error["code"] == "model_not_found"
    assert 'x"y' in error["message"]
