"""``guard_adapters.admin_auth``: the admin plane's token check, bearer or Basic.

Checks: the bearer token and Basic credentials with the token as password (any user) are
accepted; a wrong token, a wrong scheme, malformed Basic credentials, two Authorization headers
or no configured token are not; Hypothesis: for arbitrary header values, a value is accepted
exactly when it is one of those two spellings of the token.
"""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.admin_auth import CHALLENGE, admin_credentials_match
from guard_adapters.exchange import token_digest

TOKEN = "s3cret-token"
DIGEST = token_digest(TOKEN)


def basic(user: bytes, password: bytes) -> bytes:
    return b"Basic " + base64.b64encode(user + b":" + password)


def accepted(*values: bytes, digest: bytes | None = DIGEST) -> bool:
    return admin_credentials_match([(b"authorization", v) for v in values], digest)


@pytest.mark.parametrize(
    "value",
    [
        b"Bearer " + TOKEN.encode(),
        basic(b"admin", TOKEN.encode()),
        basic(b"", TOKEN.encode()),
        basic(b"anyone at all", TOKEN.encode()),
        b"basic " + base64.b64encode(b"x:" + TOKEN.encode()),  # the scheme is case-blind
    ],
)
def test_the_token_is_accepted(value: bytes) -> None:
    assert accepted(value)


@pytest.mark.parametrize(
    "value",
    [
        b"Bearer wrong",
        b"Bearer " + TOKEN.encode() + b" ",
        b"bearer " + TOKEN.encode(),  # as the proxy's own check: exactly "Bearer <TOKEN>"
        TOKEN.encode(),
        basic(b"admin", b"wrong"),
        basic(TOKEN.encode(), b""),  # the token as the user name is not the password
        b"Basic " + base64.b64encode(TOKEN.encode()),  # no colon
        b"Basic not*base64",
        b"Basic ",
        b"Digest " + TOKEN.encode(),
    ],
)
def test_anything_else_is_refused(value: bytes) -> None:
    assert not accepted(value)


def test_two_headers_or_none_or_no_token_configured_are_refused() -> None:
    good = b"Bearer " + TOKEN.encode()
    assert not accepted(good, good)
    assert not accepted()
    assert not accepted(good, digest=token_digest(""))


def test_the_challenge_asks_for_basic_credentials() -> None:
    assert CHALLENGE.startswith(b"Basic realm=")


@given(st.binary(max_size=80), st.binary(max_size=40))
def test_a_value_is_accepted_exactly_when_it_spells_the_token(value: bytes, user: bytes) -> None:
    token = TOKEN.encode()
    assert accepted(value) == (value == b"Bearer " + token)
    colonless = user.replace(b":", b"")
    assert accepted(basic(colonless, value)) == (value == token)
