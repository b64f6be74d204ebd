"""Upstream 500 reclassification: client-caused backend errors become 400 or 422 (spec 7).

Reads: the upstream status, its Content-Type and the complete body (the caller buffers at most
:data:`BODY_LIMIT` bytes and asks :func:`is_candidate` first).
Guarantees:
- only a 500 with a JSON media type and a body of at most 64 KiB is ever looked at; anything
  else, and any body that does not parse as an OpenAI-style error object, is left unchanged;
- only messages that name a client mistake are rewritten (validation, context length, bad JSON,
  unusable image or media URL); engine deaths, CUDA errors, OOMs, scheduler failures and
  timeouts are never rewritten;
- a rewrite changes only the status, ``error.code`` and ``error.type``; the message and every
  other field are kept. The body is written with sorted keys and ``<``, ``>``, ``&`` escaped, as
  PIG (Go) writes it; like Go, a lone UTF-16 surrogate escape becomes U+FFFD;
- a body Go could not decode either (nesting too deep, a number beyond float64) is left unchanged,
  and no body, however malformed, makes :func:`reclassify` raise.

Beyond PIG's phrase list it also recognises vLLM's newer ``max_tokens=N cannot be greater than``
wording, media fetches that failed with an HTTP 4xx (``Failed to fetch media from URL: HTTP
403 error``), JSON delimiter errors, SGLang's context-length message and SGLang's flat error
body (``{"object": "error", "message": ...}``); vLLM's other media refusals (image too many
pixels, malformed data URL, domain not allowed, download too large); and, as a last rule,
request validation that names no family: the ``(parameter=...)`` suffix vLLM's
``VLLMValidationError`` adds to its text, or a FastAPI validation entry located in the request
body (``'loc': ('body', ...)``; FastAPI's response validation, a server bug, points at
``'response'`` instead).
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable
from typing import Any

import attrs

__all__ = (
    "BODY_LIMIT",
    "ClientErrorKind",
    "Reclassified",
    "is_candidate",
    "reclassify",
)

#: Bodies longer than this are never read for reclassification.
BODY_LIMIT = 64 * 1024

_INTERNAL = "InternalServerError"


class ClientErrorKind(enum.StrEnum):
    """Which family of client mistake a rewritten error belongs to."""

    VALIDATION = "validation"
    CONTEXT_LENGTH = "context_length"
    JSON_DECODE = "json_decode"
    IMAGE_INPUT = "image_input"


@attrs.frozen
class Reclassified:
    """The response to send instead of the upstream 500."""

    status: int
    error_type: str
    kind: ClientErrorKind
    body: bytes


def _media_type(content_type: str | bytes | None) -> str:
    if content_type is None:
        return ""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return content_type.partition(";")[0].strip().lower()


def is_candidate(status: int, content_type: str | bytes | None, content_length: int | None) -> bool:
    """Whether a response is worth buffering for :func:`reclassify`.

    ``content_length`` is ``None`` when the upstream did not declare one (chunked); the caller
    then reads at most ``BODY_LIMIT + 1`` bytes and passes the body through if it is longer.
    """
    if status != 500:
        return False
    media = _media_type(content_type)
    if media != "application/json" and not media.endswith("+json"):
        return False
    return content_length is None or content_length <= BODY_LIMIT


# -- phrase rules, checked in order on the lower-cased message ---------------------------------

_JSON_DECODE_PHRASES = (
    "jsondecodeerror",
    "expecting value:",
    "extra data:",
    "unterminated string",
    "invalid control character",
    "property name enclosed in double quotes",
)
_JSON_DELIMITER = re.compile(r"expecting '.' delimiter: line \d+ column \d+")
_OUTPUT_TOKENS_TOO_LARGE = re.compile(r"\w*tokens=\S+ cannot be greater than ")
_MEDIA_FETCH_HTTP = re.compile(r"failed to fetch media from url: http (\d{3})\b")
_DNS_PHRASES = ("name or service not known", "temporary failure in name resolution", "ssl:")
_MEDIA_PHRASES = (
    "failed to fetch media from url: invalid url",
    "failed to fetch media from url: remote media download exceeds",
    "invalid data url",
    "must be from one of the allowed domains",
)
_IMAGE_TOO_LARGE = re.compile(r"image dimensions \d+x\d+ \(\d+ pixels\) exceed the maximum of \d+")
_VALIDATION_PARAMETER = re.compile(r"\(parameter=[^\s,()]+(?:, value=.*)?\)", re.DOTALL)
_REQUEST_BODY_LOC = re.compile(r"'loc': [(\[]?'body\b")


def _is_validation(message: str) -> bool:
    return "vllmvalidationerror" in message


def _is_context_length(message: str) -> bool:
    if "maximum context length" in message:
        return True
    if "context length" in message and "exceed" in message:
        return True
    if "is longer than the model's context length" in message:  # SGLang
        return True
    return _OUTPUT_TOKENS_TOO_LARGE.search(message) is not None  # vLLM >= 0.20


def _is_json_decode(message: str) -> bool:
    if any(phrase in message for phrase in _JSON_DECODE_PHRASES):
        return True
    return _JSON_DELIMITER.search(message) is not None


def _is_image_input(message: str) -> bool:
    if (
        "failed to load image" in message
        or "cannot identify image file" in message
        or "unidentifiedimageerror" in message
        or "clientconnectordnserror" in message
    ):
        return True
    if "url=" in message and ("message='forbidden'" in message or "403" in message):
        return True
    if "cannot connect to host" in message and any(p in message for p in _DNS_PHRASES):
        return True
    fetch = _MEDIA_FETCH_HTTP.search(message)
    if fetch is not None:
        status = int(fetch.group(1))
        # 408 and 429 from the media host are transient, not the client's fault.
        return 400 <= status < 500 and status not in (408, 429)
    if any(phrase in message for phrase in _MEDIA_PHRASES):
        return True
    return _IMAGE_TOO_LARGE.search(message) is not None


def _is_request_validation(message: str) -> bool:
    # Checked after every family above, so a context-length or media message that also carries
    # VLLMValidationError's "(parameter=...)" suffix keeps its more precise kind.
    if _VALIDATION_PARAMETER.search(message) is not None:
        return True
    return _REQUEST_BODY_LOC.search(message) is not None


_Rule = tuple[Callable[[str], bool], int, str, ClientErrorKind]

#: (predicate, new status, new ``error.type``, kind), first match wins.
RULES: tuple[_Rule, ...] = (
    (_is_validation, 400, "BadRequestError", ClientErrorKind.VALIDATION),
    (_is_context_length, 400, "BadRequestError", ClientErrorKind.CONTEXT_LENGTH),
    (_is_json_decode, 400, "BadRequestError", ClientErrorKind.JSON_DECODE),
    (_is_image_input, 422, "UnprocessableEntityError", ClientErrorKind.IMAGE_INPUT),
    (_is_request_validation, 400, "BadRequestError", ClientErrorKind.VALIDATION),
)


def _error_object(document: Any) -> dict[str, Any] | None:
    """The dict holding ``message``/``type``/``code``: ``error`` or, for SGLang, the top level."""
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict):
        return error
    if error is None and document.get("object") == "error" and "message" in document:
        return document
    return None


def _code_is_500(error: dict[str, Any], error_type: str) -> bool:
    code = error.get("code")
    if code is None:
        return error_type == _INTERNAL
    if isinstance(code, bool):
        return False
    if isinstance(code, int | float):
        return code == 500
    if isinstance(code, str):
        try:
            return float(code.strip()) == 500
        except ValueError:
            return False
    return False


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; a body holding them is passed through untouched.
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    # 1e400 would become inf and be written back as the non-JSON "Infinity"; Go refuses it too.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:32]}")
    return value


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _dump_like_go(document: Any) -> bytes:
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # '<', '>', '&' can only occur inside strings, so a plain replace is exact.
    text = (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )
    # A "\ud800" escape without its pair decodes to a lone surrogate, which UTF-8 cannot hold.
    return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


def reclassify(status: int, content_type: str | bytes | None, body: bytes) -> Reclassified | None:
    """The rewritten response for a client-caused 500, or ``None`` to pass it through as is."""
    if not is_candidate(status, content_type, len(body)):
        return None
    try:
        document = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):  # ValueError covers UnicodeDecodeError too
        return None
    error = _error_object(document)
    if error is None:
        return None
    error_type = error.get("type")
    if error_type is None:
        error_type = ""
    if not isinstance(error_type, str) or error_type not in ("", _INTERNAL):
        return None
    if not _code_is_500(error, error_type):
        return None
    message = error.get("message")
    if not isinstance(message, str) or not message:
        return None
    lowered = message.lower()
    for matches, new_status, new_type, kind in RULES:
        if matches(lowered):
            error["code"] = new_status
            error["type"] = new_type
            try:
                rewritten = _dump_like_go(document)
            except RecursionError:  # nesting just shallow enough to read can be too deep to write
                return None
            return Reclassified(new_status, new_type, kind, rewritten)
    return None
