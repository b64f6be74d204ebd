"""Who may read the admin plane: the guard's ``TOKEN``, as a bearer token or a Basic password.

Reads: a request's header list (lower-case names) and the digest of the configured token
(:func:`guard_adapters.exchange.token_digest`).
Guarantees:
- :func:`admin_credentials_match` accepts exactly one ``Authorization`` header that is either
  ``Bearer <TOKEN>`` or ``Basic <base64 of user:TOKEN>`` (any user name, the token as the
  password: what a browser sends after its login prompt); both are compared by
  :func:`~guard_adapters.exchange.token_matches`, in constant time (neither the token's length
  nor any of its bytes changes how the comparison runs); with no token configured nothing
  matches;
- :data:`CHALLENGE` is the ``WWW-Authenticate`` value a refusal carries, so that a browser
  asks for the password and then sends it with every request to the admin plane (its page,
  its fetches and its WebSocket handshake).
"""

from __future__ import annotations

import base64
import binascii
from typing import Final

from guard_adapters.exchange import Headers, header_values, token_matches

__all__ = ("CHALLENGE", "admin_credentials_match")

#: The challenge of a 401 from the admin plane.
CHALLENGE: Final = b'Basic realm="inference-guard admin", charset="UTF-8"'


def _basic_password(credentials: bytes) -> bytes | None:
    """The password of Basic credentials (``user:password`` in base64), or None."""
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = decoded.partition(b":")
    return password if colon else None


def admin_credentials_match(headers: Headers, expected: bytes | None) -> bool:
    """Whether ``headers`` carry the token (see the module rules)."""
    values = header_values(headers, b"authorization")
    if expected is None or len(values) != 1:
        return False
    value = values[0]
    scheme, _, credentials = value.partition(b" ")
    if scheme.lower() == b"basic":
        password = _basic_password(credentials)
        if password is None:
            return False
        value = b"Bearer " + password
    return token_matches(((b"authorization", value),), expected)
