"""Admitted and protected path matching (spec 1, 2.1)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import DEFAULT_QOS_PATHS, PathPolicy, PolicyConfigError


@pytest.mark.parametrize(
    ("path", "exact", "suffix"),
    [
        ("/v1/chat/completions", True, True),
        ("/v1/chat/completions?stream=true", True, True),
        ("/openai/v1/chat/completions", False, True),
        ("/v1/chat/completions/", False, False),
        ("/v1/completions", True, True),
        ("/v1/responses", True, True),
        ("/v1/models", False, False),
        ("/V1/chat/completions", False, False),
        ("", False, False),
    ],
)
def test_exact_and_suffix_matching(path: str, exact: bool, suffix: bool) -> None:
    assert PathPolicy().matches(path) is exact
    assert PathPolicy(suffix_match=True).matches(path) is suffix


@pytest.mark.parametrize(
    "paths",
    [(), ("v1/chat",), ("/v1/chat completions",), ("/a", "/a"), ("/v1/chat?x=1",), ("/ü",)],
)
def test_invalid_path_lists_are_refused(paths: tuple[str, ...]) -> None:
    with pytest.raises(PolicyConfigError):
        PathPolicy(paths)


@given(st.from_regex(r"/[A-Za-z0-9_./-]{0,20}", fullmatch=True), st.text(max_size=20))
def test_a_configured_path_always_matches_itself(path: str, query: str) -> None:
    policy = PathPolicy((path,))
    assert policy.matches(path)
    assert policy.matches(f"{path}?{query}")
    assert PathPolicy((path,), suffix_match=True).matches("/prefix" + path)


def test_defaults_are_pigs() -> None:
    assert DEFAULT_QOS_PATHS == ("/v1/chat/completions", "/v1/completions", "/v1/responses")
