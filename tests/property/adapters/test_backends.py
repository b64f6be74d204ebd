"""Where backends live and how pools lay out (guard_adapters.backends, model_pools.layout and
outside): pure reads of the settings."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.backends import RelayConfig, UpstreamTarget, budget, poll_sources
from guard_adapters.config import load_config
from guard_adapters.model_pools import ModelPools, outside

NAMES = ("a", "b", "c", "d")


@st.composite
def pools(draw: st.DrawFn) -> dict[str, tuple[str, ...]]:
    """Valid pools: disjoint sets of backends (as ``PIG_POOLS`` requires), each model on one."""
    group_of = draw(st.lists(st.integers(0, 2), min_size=len(NAMES), max_size=len(NAMES)))
    groups = sorted(set(group_of))
    members = {
        g: tuple(n for n, of in zip(NAMES, group_of, strict=True) if of == g) for g in groups
    }
    models = draw(
        st.dictionaries(
            st.sampled_from(["m1", "m2", "m3", "m4"]), st.sampled_from(groups), min_size=1
        )
    )
    return {model: members[group] for model, group in models.items()}


@given(pools())
def test_the_layout_gives_each_model_and_backend_its_pool(
    by_model: dict[str, tuple[str, ...]],
) -> None:
    model_pools = ModelPools(by_model)
    names, of_backend, of_model = model_pools.layout()
    assert len(set(names)) == len(names) == len(model_pools.pools())
    for model in by_model:
        assert names[of_model[model]] == model_pools.pool_of(model)
    for name, backends in model_pools.pools():
        for backend in backends:
            assert names[of_backend[backend]] == name


@given(st.one_of(st.none(), st.lists(st.sampled_from(NAMES), unique=True)))
def test_outside_is_every_backend_the_pool_does_not_name(allowed: list[str] | None) -> None:
    found = outside(NAMES, allowed)
    if allowed is None:
        assert found == frozenset()
    else:
        assert {NAMES[i] for i in found} == set(NAMES) - set(allowed)


def test_a_target_is_read_from_its_url_once() -> None:
    target = UpstreamTarget.from_url("x", "https://user:pw@example.org/base/")
    assert (target.host, target.port, target.authority, target.base_path) == (
        "example.org",
        443,
        "example.org",
        "/base",
    )
    assert UpstreamTarget.from_url("y", "http://10.0.0.1:8000").port == 8000
    assert budget(0) == math.inf
    assert budget(2.5) == 2.5


def test_the_relay_config_and_the_poll_sources_follow_the_settings() -> None:
    one = load_config(
        {"UPSTREAM": "http://127.0.0.1:8001", "PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS": "0"}
    )
    config = RelayConfig.of(one)
    assert [t.name for t in config.targets] == [b.name for b in one.backends]
    assert config.idle_timeout_s == math.inf
    assert config.routing.ring is None
    assert config.keying is None
    several = load_config(
        {
            "BACKENDS": "a=http://10.0.0.1:8000|http://10.0.0.1:8000/metrics,"
            "b=http://10.0.0.2:8000|http://10.0.0.2:8000/metrics",
            "PIG_ROUTING": "guard",
            "PIG_AFFINITY_HEADER": "X-Session",
        }
    )
    config = RelayConfig.of(several)
    assert config.routing.ring is not None
    assert config.keying is not None
    assert config.keying.header == b"x-session"
    sources = poll_sources(several)
    assert [(s.name, s.health_url) for s in sources] == [
        ("a", "http://10.0.0.1:8000/health"),
        ("b", "http://10.0.0.2:8000/health"),
    ]
