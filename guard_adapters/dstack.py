"""The two dstack guest-agent calls a report needs, GetQuote and Info, without any I/O.

Reads: the configured endpoint (a Unix socket path or an http(s) base URL), the 64-byte
report_data, and the status and body of each reply.
Guarantees:
- :func:`quote_request` and :func:`info_request` describe the HTTP/1.1 request to send (always
  ``POST`` with ``Content-Type: application/json``, ``Connection: close``, a Content-Length);
  the body of GetQuote is ``{"report_data": "<128 lowercase hex>"}``, that of Info ``{}``;
- :func:`parse_quote` accepts only a 2xx reply whose JSON object has a non-empty hex ``quote``
  long enough to hold a TDX report body and whose report_data (bytes 568..632 of the quote, and
  the ``report_data`` field when present) equals the bytes sent; anything else raises
  :class:`DstackError` with a short reason, never a partial result;
- :func:`parse_info` accepts only a 2xx JSON object; a ``tcb_info`` string that holds JSON is
  replaced by the parsed value and ``cloud_vendor`` / ``cloud_product`` are dropped.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

from guard_adapters._errors import AdapterError
from guard_adapters._json import json_object

__all__ = (
    "QUOTE_REPORT_DATA",
    "DstackError",
    "DstackRequest",
    "Endpoint",
    "Quote",
    "info_request",
    "parse_info",
    "parse_quote",
    "quote_request",
)

#: Where a TDX v4 quote keeps report_data: a 48-byte header, then the TD report body in which
#: report_data is the last 64 bytes.
QUOTE_REPORT_DATA: Final = slice(568, 632)
_USER_AGENT: Final = b"inference-guard/dstack"
_TEXT_LIMIT: Final = 200


class DstackError(AdapterError):
    """The agent's reply cannot be used."""


@attrs.frozen
class Endpoint:
    """Where the agent listens: a socket path, or host, port, scheme and a path prefix."""

    socket_path: str | None = None
    host: str = "dstack"
    port: int = 0
    secure: bool = False
    host_header: str = "dstack"
    prefix: str = ""

    @classmethod
    def from_settings(cls, base_url: str | None, socket_path: str | None) -> Endpoint:
        if base_url is None:
            return cls(socket_path=socket_path or "/var/run/dstack.sock")
        parts = urlsplit(base_url)
        secure = parts.scheme.lower() == "https"
        if not parts.hostname:
            raise DstackError(f"dstack endpoint has no host: {base_url!r}")
        return cls(
            host=parts.hostname,
            port=parts.port or (443 if secure else 80),
            secure=secure,
            host_header=parts.netloc.rpartition("@")[2],
            prefix=parts.path.rstrip("/"),
        )

    def describe(self) -> str:
        if self.socket_path is not None:
            return f"unix:{self.socket_path}"
        return f"{'https' if self.secure else 'http'}://{self.host_header}{self.prefix}"


@attrs.frozen
class DstackRequest:
    target: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    method: bytes = b"POST"


@attrs.frozen
class Quote:
    quote: str
    event_log: str
    vm_config: str


def _request(endpoint: Endpoint, method_name: str, body: bytes) -> DstackRequest:
    headers = (
        (b"Host", endpoint.host_header.encode()),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
        (b"User-Agent", _USER_AGENT),
        (b"Connection", b"close"),
    )
    return DstackRequest(f"{endpoint.prefix}/{method_name}", headers, body)


def quote_request(endpoint: Endpoint, report_data: bytes) -> DstackRequest:
    if not 0 < len(report_data) <= 64:
        raise ValueError("report_data is 1 to 64 bytes")
    body = json.dumps({"report_data": report_data.hex()}).encode()
    return _request(endpoint, "GetQuote", body)


def info_request(endpoint: Endpoint) -> DstackRequest:
    return _request(endpoint, "Info", b"{}")


def _short(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + "..."


def _json_object(status: int, body: bytes) -> dict[str, Any]:
    if not 200 <= status < 300:
        detail = _short(body)
        try:
            parsed = json.loads(body)
        except ValueError:
            pass
        else:
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
                detail = _short(parsed["error"].encode())
        raise DstackError(f"agent answered HTTP {status}" + (f": {detail}" if detail else ""))
    return json_object(body, "agent reply", DstackError)


def _text_field(reply: dict[str, Any], name: str) -> str:
    value = reply.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DstackError(f"{name} is not a string")
    return value


def _hex_bytes(text: str, name: str) -> bytes:
    if text.startswith(("0x", "0X")):
        text = text[2:]
    try:
        if not text.isascii() or " " in text:
            raise ValueError
        return bytes.fromhex(text)
    except ValueError:
        raise DstackError(f"{name} is not hex") from None


def parse_quote(status: int, body: bytes, sent: bytes) -> Quote:
    """The GetQuote reply, checked to carry ``sent`` as its report_data."""
    reply = _json_object(status, body)
    quote = _text_field(reply, "quote")
    if not quote:
        raise DstackError("agent returned an empty quote")
    raw = _hex_bytes(quote, "quote")
    if len(raw) < QUOTE_REPORT_DATA.stop:
        raise DstackError(f"quote too short for a TDX report ({len(raw)} bytes)")
    expected = sent.ljust(64, b"\0")
    if raw[QUOTE_REPORT_DATA] != expected:
        raise DstackError("quote does not carry the requested report_data")
    echoed = _text_field(reply, "report_data")
    if echoed and _hex_bytes(echoed, "report_data") != expected:
        raise DstackError("agent echoed a different report_data")
    return Quote(
        quote=quote,
        event_log=_text_field(reply, "event_log"),
        vm_config=_text_field(reply, "vm_config"),
    )


def parse_info(status: int, body: bytes) -> dict[str, Any]:
    """The Info reply as a report shows it."""
    info = _json_object(status, body)
    tcb = info.get("tcb_info")
    if isinstance(tcb, str):
        with contextlib.suppress(ValueError):
            info["tcb_info"] = json.loads(tcb)
    info.pop("cloud_vendor", None)
    info.pop("cloud_product", None)
    return info
