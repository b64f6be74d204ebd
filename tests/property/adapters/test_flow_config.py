"""``PIG_PRIORITY_BANDS`` / ``PIG_TENANT_*``: parsed into the flow config, every problem at once.

- an unset environment has no flow config (PIG's gate alone), and neither has one that only sets
  the tenant weights' companions to their defaults;
- a band list reads back as the bands it names, in order, with its reserves, waits and default;
- any text either parses or yields problems, and never raises; a written spec reads back equal;
- a broken band list or weight list is reported by ``load_config`` with the variable's name,
  together with the other problems.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters._errors import ConfigError
from guard_adapters.config import load_config
from guard_adapters.flow_config import parse_bands, parse_weights
from guard_core.bands import PIG_BANDS, Band, BandSpec

BASE = {"UPSTREAM": "http://backend:8000"}


def test_unset_means_no_flow_control() -> None:
    assert load_config(BASE).guard_config().flow is None


def test_a_band_list_reads_as_written() -> None:
    env = {
        **BASE,
        "PIG_PRIORITY_BANDS": " Premium:reserve=0.1 , standard:default, batch:wait=0,"
        "bulk:reserve=2",
        "PIG_TENANT_HEADER": "X-Tenant",
        "PIG_TENANT_WEIGHTS": "acme=3, small=0.5",
    }
    settings = load_config(env)
    flow = settings.guard_config().flow
    assert flow is not None
    assert flow.bands.names == ("premium", "standard", "batch", "bulk")
    assert flow.bands.default == 1
    assert flow.bands.bands[0].reserve == pytest.approx(0.1)
    assert flow.bands.bands[2].wait_s == 0.0
    assert flow.bands.bands[3].reserve == 2
    assert flow.tenants is not None
    assert flow.tenants.weight("acme") == 3.0
    assert flow.tenants.weight("small") == 0.5
    assert flow.tenants.weight("anyone") == 1.0
    assert settings.tenant_header == b"x-tenant"


def test_a_tenant_header_alone_keeps_pig_bands() -> None:
    flow = load_config({**BASE, "PIG_TENANT_HEADER": "x-org"}).guard_config().flow
    assert flow is not None
    assert flow.bands == PIG_BANDS
    assert flow.tenants is not None


def test_every_problem_is_reported_with_its_variable() -> None:
    env = {
        **BASE,
        "PIG_PRIORITY_BANDS": "a:reserve=x,a,b:what=1,c:reserve=1.5,d:default,e:default",
        "PIG_TENANT_WEIGHTS": "t=0,u",
        "PIG_TENANT_MAX": "0",
        "PIG_TENANT_HEADER": "bad header",
    }
    with pytest.raises(ConfigError) as caught:
        load_config(env)
    text = str(caught.value)
    for needle in ("reserve must be a number", "unknown option", "1.5", "only one band"):
        assert "PIG_PRIORITY_BANDS: " in text
        assert needle in text
    assert text.count("PIG_TENANT_WEIGHTS:") == 2
    assert "PIG_TENANT_MAX:" in text
    assert "PIG_TENANT_HEADER:" in text


@given(st.text(st.sampled_from("ab:=,.0123 -xdefaultreservewait"), max_size=40))
def test_any_text_parses_or_says_why(text: str) -> None:
    spec, problems = parse_bands(text)
    assert (spec is None) or not problems
    weights, wproblems = parse_weights(text)
    assert (weights is None) or not wproblems


names = st.sampled_from(["premium", "standard", "batch", "gold", "free"])


@given(
    st.lists(
        st.tuples(
            names,
            st.none() | st.sampled_from([0.05, 0.25, 1.0, 3.0]),
            st.none() | st.sampled_from([0.0, 0.2, 0.5]),
        ),
        min_size=1,
        max_size=4,
        unique_by=lambda item: item[0],
    ),
    st.data(),
)
def test_a_written_spec_reads_back(
    bands: list[tuple[str, float | None, float | None]], data: st.DataObject
) -> None:
    default = data.draw(st.sampled_from([None, *(name for name, _, _ in bands)]))
    parts = []
    for name, reserve, wait in bands:
        part = name
        if reserve is not None:
            part += f":reserve={reserve:g}"
        if wait is not None:
            part += f":wait={wait:g}"
        if name == default:
            part += ":default"
        parts.append(part)
    spec, problems = parse_bands(",".join(parts))
    assert problems == []
    expected = BandSpec.of([Band(n, reserve=r, wait_s=w) for n, r, w in bands], default)
    assert spec == expected
