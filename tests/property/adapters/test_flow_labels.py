"""Flow-control labels at the edges: headers read, recordings written, admin messages sent.

- without bands the tier is PIG's and there is no band label; with bands the tier follows the
  band picked; a tenant key is kept only when it is one printable ASCII value of bounded length;
- an arrival with a band and a tenant survives a recording line, and a line without them (a
  recording from before flow control) reads as an arrival with neither, byte for byte as before;
- an admin admission message carries band and tenant only when flow control gave them;
- a band's ``priority`` replaces only the value priority injection writes, never whether.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.admin_stream import admission_message
from guard_adapters.flow_config import parse_bands
from guard_adapters.flow_headers import MAX_TENANT_CHARS, band_and_tier, band_priority, tenant_key
from guard_adapters.openai_body import InjectionPolicy
from guard_adapters.openai_body import plan as body_plan
from guard_adapters.recording import decode_line, encode
from guard_core import Arrived, Tier, tier_from_header_values
from guard_core.bands import Band, BandSpec

THREE = BandSpec.of((Band("gold"), Band("silver"), Band("bronze")), "silver")
values = st.lists(st.sampled_from([b"gold", b" Bronze ", b"premium", b"silver", b"", b"\xff"]))


@given(values)
def test_without_bands_the_tier_is_pigs(given_values: list[bytes]) -> None:
    assert band_and_tier(None, given_values) == ("", tier_from_header_values(given_values))


@given(values)
def test_with_bands_the_tier_follows_the_band(given_values: list[bytes]) -> None:
    band, tier = band_and_tier(THREE, given_values)
    assert band in THREE.names
    assert (tier is Tier.PREMIUM) == (band == "gold")
    if len(given_values) != 1:
        assert band == "silver"


@given(st.lists(st.binary(max_size=200), max_size=3))
def test_a_tenant_key_is_one_sane_value(given_values: list[bytes]) -> None:
    key = tenant_key(given_values)
    if key:
        assert len(given_values) == 1
        assert key == given_values[0].strip(b" \t").decode("ascii")
        assert len(key) <= MAX_TENANT_CHARS
        assert key.isprintable()
        assert " " not in key


def test_tenant_keys() -> None:
    assert tenant_key([b" acme "]) == "acme"
    assert tenant_key([b"acme", b"acme"]) == ""
    assert tenant_key([b"a" * (MAX_TENANT_CHARS + 1)]) == ""
    assert tenant_key([b"caf\xc3\xa9"]) == ""


@given(st.sampled_from(["", "gold"]), st.sampled_from(["", "acme"]))
def test_recording_lines_keep_the_labels(band: str, tenant: str) -> None:
    arrived = Arrived(at=2.5, request_id=7, tier=Tier.BASIC, band=band, tenant=tenant)
    line = encode(arrived)
    assert decode_line(line, line_no=2) == arrived
    assert (b'"band"' in line) == bool(band)
    assert (b'"tenant"' in line) == bool(tenant)


def test_an_old_arrival_line_reads_without_labels() -> None:
    line = b'{"at":1.0,"request_id":3,"tier":"premium","body_bytes":10,"path":"","kind":"arrived"}'
    arrived = decode_line(line, line_no=2)
    assert isinstance(arrived, Arrived)
    assert (arrived.band, arrived.tenant) == ("", "")
    assert encode(arrived) == line + b"\n"


def test_admin_messages_carry_labels_only_with_flow_control() -> None:
    plain = admission_message(
        Arrived(at=0.0, request_id=1, tier=Tier.BASIC), at=0.1, outcome="admitted"
    )
    assert "band" not in plain
    assert "tenant" not in plain
    labelled = Arrived(at=0.0, request_id=1, tier=Tier.BASIC, band="silver", tenant="acme")
    message = admission_message(labelled, at=0.1, outcome="refused")
    assert (message["band"], message["tenant"]) == ("silver", "acme")


def test_a_band_priority_replaces_only_the_value_written() -> None:
    policy = InjectionPolicy(enabled=True, mode="all", premium_value=0, basic_value=10)
    bands = BandSpec.of((Band("gold"), Band("silver"), Band("bronze", priority=50)), "silver")
    for band, expected in (("bronze", 50), ("silver", 10), ("", 10)):
        plan = body_plan(
            policy, tier=Tier.BASIC, content_type=b"application/json", content_length=20
        )
        assert band_priority(bands, band, plan).priority_value == expected
        assert band_priority(bands, band, plan).action == plan.action
    plan = body_plan(policy, tier=Tier.BASIC, content_type=b"text/json", content_length=20)
    assert band_priority(None, "bronze", plan) is plan


def test_a_band_priority_is_read_from_the_spec() -> None:
    spec, problems = parse_bands("gold:priority=-5,silver:default,bronze:priority=x")
    assert spec is None
    assert problems == ["band 3 ('bronze:priority=x'): priority must be an integer"]
    spec, problems = parse_bands("gold:priority=-5,silver")
    assert problems == []
    assert spec is not None
    assert spec.bands[0].priority == -5
    assert spec.bands[1].priority is None
