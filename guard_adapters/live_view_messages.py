"""The admin stream's messages (schema version 1) read into values, and the stream's address.

Reads: the admin plane's event stream messages (``hello``, ``decision``, ``admission``), each
a decoded JSON value, and the admin plane's URL.

Guarantees:

- pure: no clock, no I/O; the readers never raise: a field of the wrong type or not finite is
  read as absent (``None``, empty), an unknown field is skipped;
- text from the stream is kept as printable ASCII (anything else becomes ``?``, so a server
  cannot send terminal escapes) and at most :data:`MAX_TEXT` characters, so its length is its
  width on a terminal;
- tier counts are kept in the order :func:`tier_key` gives (basic, premium, then by name);
- :func:`events_url` turns an admin plane URL (``http``, ``https``, ``ws``, ``wss``) into the
  WebSocket URL of ``/admin/events`` with the query string (and without any ``user:password@``
  part), or raises :class:`ValueError` saying what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Final
from urllib.parse import urlencode, urlsplit, urlunsplit

import attrs

__all__ = (
    "KINDS",
    "MAX_TEXT",
    "Admission",
    "BackendRow",
    "Counts",
    "Decision",
    "count_of",
    "events_url",
    "parse_message",
    "read_admission",
    "read_decision",
    "read_text",
    "read_texts",
    "tier_key",
)

#: The message kinds a client may ask for in ``?kinds=``.
KINDS: Final = ("decision", "admission")
#: The longest text kept from one field of a message.
MAX_TEXT: Final = 200
#: The tiers in the order they are shown; others follow in name order.
_TIER_ORDER: Final = ("basic", "premium")

#: The largest count or figure read (beyond it a field is read as absent).
_LARGEST: Final = 2**63

#: Counts per tier, in :func:`tier_key` order.
Counts = tuple[tuple[str, int], ...]


# -- the messages ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BackendRow:
    """One backend as the latest decision describes it (``None``: not in the message)."""

    name: str
    failed: bool = False
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    generation_tps: float | None = None
    ttft_avg_s: float | None = None


@attrs.frozen(kw_only=True)
class Decision:
    """One ``decision`` message: a poll round's published value."""

    at: float | None = None
    cap: int | None = None
    state: str = ""
    reasons: tuple[str, ...] = ()
    in_flight: int | None = None
    waiting: Counts = ()
    admitted: Counts = ()
    refused: Counts = ()
    backends: tuple[BackendRow, ...] = ()
    tps_observed: float | None = None
    tps_predicted: float | None = None
    ttft_observed_s: float | None = None
    ttft_predicted_s: float | None = None


@attrs.frozen(kw_only=True)
class Admission:
    """One ``admission`` message: a request's outcome."""

    at: float | None = None
    id: str = ""
    tier: str = ""
    outcome: str = ""
    reason: str | None = None
    waited_s: float | None = None
    predicted_tps: float | None = None
    predicted_ttft_s: float | None = None


# -- reading fields --------------------------------------------------------------------------------


def read_text(value: object) -> str | None:
    """``value`` as printable ASCII of at most :data:`MAX_TEXT` characters; ``None``: no text."""
    if not isinstance(value, str):
        return None
    return "".join(ch if " " <= ch <= "~" else "?" for ch in value[:MAX_TEXT])


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _LARGEST:
        return None
    return value


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _counts(value: object) -> Counts:
    if not isinstance(value, Mapping):
        return ()
    pairs = {}
    for key, count in value.items():
        name, number = read_text(key), _int(count)
        if name is not None and number is not None:
            pairs[name] = number
    return tuple(sorted(pairs.items(), key=lambda item: tier_key(item[0])))


def tier_key(tier: str) -> tuple[int, str]:
    """The sort key of a tier: basic, premium, then the others by name."""
    return (_TIER_ORDER.index(tier), "") if tier in _TIER_ORDER else (len(_TIER_ORDER), tier)


def read_texts(value: object) -> tuple[str, ...]:
    """The texts of a JSON list, trimmed, blank ones and other items skipped (a screen line
    ends trimmed, so a blank text would show as nothing); empty when ``value`` is none."""
    if not isinstance(value, list):
        return ()
    return tuple(trimmed for item in value if (trimmed := (read_text(item) or "").strip()))


def _pair(value: object, key: str) -> float | None:
    return _float(value.get(key)) if isinstance(value, Mapping) else None


def count_of(counts: Counts, tier: str) -> int | None:
    """``tier``'s count, or ``None`` when ``counts`` does not name it."""
    return next((count for name, count in counts if name == tier), None)


def _backend(value: object) -> BackendRow | None:
    if not isinstance(value, Mapping):
        return None
    name = read_text(value.get("name"))
    if name is None:
        return None
    return BackendRow(
        name=name,
        failed=value.get("failed") is True,
        running=_int(value.get("running")),
        waiting=_int(value.get("waiting")),
        kv_usage=_float(value.get("kv_usage")),
        generation_tps=_float(value.get("generation_tps")),
        ttft_avg_s=_float(value.get("ttft_avg_s")),
    )


def read_decision(message: Mapping[str, object]) -> Decision:
    """The fields of a ``decision`` message that are present and of the right type."""
    backends = message.get("backends")
    rows = [_backend(item) for item in backends] if isinstance(backends, list) else []
    return Decision(
        at=_float(message.get("at")),
        cap=_int(message.get("cap")),
        state=read_text(message.get("state")) or "",
        reasons=read_texts(message.get("reasons")),
        in_flight=_int(message.get("in_flight")),
        waiting=_counts(message.get("waiting")),
        admitted=_counts(message.get("admitted")),
        refused=_counts(message.get("refused")),
        backends=tuple(row for row in rows if row is not None),
        tps_observed=_pair(message.get("tps"), "observed"),
        tps_predicted=_pair(message.get("tps"), "predicted"),
        ttft_observed_s=_pair(message.get("ttft_s"), "observed"),
        ttft_predicted_s=_pair(message.get("ttft_s"), "predicted"),
    )


def read_admission(message: Mapping[str, object]) -> Admission:
    """The fields of an ``admission`` message that are present and of the right type."""
    return Admission(
        at=_float(message.get("at")),
        id=read_text(message.get("id")) or "",
        tier=read_text(message.get("tier")) or "",
        outcome=read_text(message.get("outcome")) or "",
        reason=read_text(message.get("reason")),
        waited_s=_float(message.get("waited_s")),
        predicted_tps=_float(message.get("predicted_tps")),
        predicted_ttft_s=_float(message.get("predicted_ttft_s")),
    )


def parse_message(text: str | bytes) -> object:
    """The decoded JSON value of one stream message, or ``None`` when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# -- the stream's address --------------------------------------------------------------------------

_SCHEMES: Final = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
_EVENTS_PATH: Final = "/admin/events"


def events_url(base: str, *, kinds: Sequence[str] = (), sample: float | None = None) -> str:
    """The ``ws``/``wss`` URL of the admin plane's event stream at ``base``.

    ``base`` may name the admin plane's root, ``/admin`` or ``/admin/events`` itself; ``kinds``
    and ``sample`` become the query string (none when empty and ``None``).
    """
    try:
        parts = urlsplit(base.strip())
        port = parts.port
    except ValueError as error:
        raise ValueError(f"not a URL: {base!r} ({error})") from None
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not an http, https, ws or wss URL: {base!r}")
    if not parts.hostname:
        raise ValueError(f"no host in {base!r}")
    if port == 0:
        raise ValueError(f"port 0 in {base!r}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {', '.join(unknown)} (known: {', '.join(KINDS)})")
    path = parts.path.rstrip("/")
    if not path.endswith(_EVENTS_PATH):
        path = path + "/events" if path.endswith("/admin") else path + _EVENTS_PATH
    query: list[tuple[str, str]] = []
    if kinds:
        query.append(("kinds", ",".join(dict.fromkeys(kinds))))
    if sample is not None:
        query.append(("sample", f"{sample:g}"))
    # Any user:password part is left out: the token travels in a header, never in the URL.
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((scheme, netloc, path, urlencode(query, safe=","), ""))
