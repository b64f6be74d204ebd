"""The exchange outcome and the request id rule (guard_adapters.outcome)."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.exchange import upstream_headers
from guard_adapters.outcome import Admission, ExchangeNotes, ExchangeOutcome, client_trace_id
from guard_core import Lane, RejectCode, Tier

_SAFE = "ABCXYZabcxyz0189._:@/+=-"


@given(st.text(alphabet=_SAFE, min_size=1, max_size=128))
def test_a_sane_id_is_kept_as_sent(value: str) -> None:
    assert client_trace_id([value.encode()]) == value


@given(st.binary(max_size=200))
def test_any_other_single_value_is_refused_or_is_safe(value: bytes) -> None:
    got = client_trace_id([value])
    stripped = value.strip()
    if got is None:
        assert not re.fullmatch(rb"[A-Za-z0-9._:@/+=\-]{1,128}", stripped)
    else:
        assert got.encode() == stripped
        assert 1 <= len(got) <= 128
        assert re.fullmatch(r"[A-Za-z0-9._:@/+=\-]+", got)


@pytest.mark.parametrize(
    "values",
    [
        [],
        [b"a", b"b"],
        [b"a" * 129],
        [b"has space"],
        [b'quote"'],
        [b"line\r\nbreak"],
        [b"caf\xc3\xa9"],
        [b""],
    ],
)
def test_missing_repeated_long_or_unsafe_ids_are_not_the_clients(values: list[bytes]) -> None:
    assert client_trace_id(values) is None


@given(
    st.builds(
        ExchangeNotes,
        trace_id=st.text(alphabet=_SAFE, max_size=10),
        request_id=st.none() | st.integers(1, 10**6),
        admitted_path=st.booleans(),
        tier=st.none() | st.sampled_from(list(Tier)),
        lane=st.sampled_from(list(Lane)),
        admission=st.none() | st.sampled_from(list(Admission)),
        code=st.none() | st.sampled_from(list(RejectCode)),
        waited_s=st.floats(0, 1),
        status=st.integers(0, 599),
        upstream_errors=st.integers(0, 3),
    )
)
def test_the_outcome_is_the_notes_frozen(notes: ExchangeNotes) -> None:
    noted = {field.name: getattr(notes, field.name) for field in attrs.fields(ExchangeNotes)}
    outcome = notes.outcome()
    assert isinstance(outcome, ExchangeOutcome)
    assert {name: getattr(outcome, name) for name in noted} == noted
    for name in ("status", "trace_id", "code"):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(outcome, name, noted[name])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        notes.status = 1  # the notes are the outcome now: nothing changes after the end


@given(st.lists(st.binary(min_size=0, max_size=8), max_size=3))
def test_the_backend_gets_the_guards_id_only(client_ids: list[bytes]) -> None:
    headers = [(b"host", b"guard"), *((b"x-request-id", v) for v in client_ids)]
    out = upstream_headers(
        headers,
        authority=b"backend",
        backend=b"b1",
        peer=b"127.0.0.1",
        tier=None,
        lane=Lane.DEFAULT,
        body_length=0,
        trace_id=b"ig-1",
    )
    assert [v for n, v in out if n == b"x-request-id"] == [b"ig-1"]
    kept = upstream_headers(
        headers,
        authority=b"backend",
        backend=b"b1",
        peer=b"127.0.0.1",
        tier=None,
        lane=Lane.DEFAULT,
        body_length=0,
    )
    assert [v for n, v in kept if n == b"x-request-id"] == client_ids
