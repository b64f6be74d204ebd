"""A request's affinity key: which requests should land on the same backend.

Reads: the leading bytes of a request's JSON body (at most ``body_limit`` of them are looked at;
a body cut anywhere, even mid-string or mid-escape, is fine) and, when the gateway in front
sets one, the value of a trusted session header (the caller reads it; the header's name is
configured, e.g. ``PIG_AFFINITY_HEADER``). Nothing else: no I/O, clock or randomness.

The key, in order of precedence:

1. ``session``: the trusted header's value, when non-empty;
2. ``user``: the OpenAI ``user`` field, a non-empty string at the body's top level (seen only
   when it lies within the bytes looked at);
3. ``prefix``: the leading ``prefix_bytes`` bytes of the prompt as a stream: for chat bodies
   the ``messages`` up to and including the first ``user`` one (the system prompt and the
   conversation's opening), each as its role, a unit separator, its text (a string
   ``content``, or the ``text`` of its content parts, joined) and a record separator; for
   completions the ``prompt`` (a string, the first of a list of strings, or token ids written
   as decimal numbers). Every later turn of a conversation repeats that opening, so a
   conversation keeps its key, and its backend keeps its history's prefix cache warm; two
   conversations share a key only when they open the same way.

The key is the first 8 bytes of a blake2b digest of the kind and the material, as an unsigned
integer (what :func:`guard_core.affinity.choose` takes).

Guarantees: :func:`affinity_key` never raises on any bytes: garbage, a non-object, or a body
whose prompt cannot be found in the bytes looked at gives ``None``; the same leading
``prefix_bytes`` of the prompt stream give the same key whatever follows them; the result is
deterministic (no process-salted ``hash``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Final

import attrs

__all__ = (
    "DEFAULT_BODY_LIMIT",
    "DEFAULT_PREFIX_BYTES",
    "AffinityKey",
    "AffinityKeying",
    "affinity_key",
    "key_of",
    "leading_string",
    "prompt_stream",
)

#: Prompt bytes a prefix key covers: about 1,000 tokens, past a typical shared system prompt.
DEFAULT_PREFIX_BYTES: Final = 4096
#: Body bytes looked at.
DEFAULT_BODY_LIMIT: Final = 65536
_MAX_DEPTH: Final = 32
_UNIT: Final = b"\x1f"
_RECORD: Final = b"\x1e"

_SPACE = re.compile(r"[ \t\r\n]*")
#: A string's body up to (not including) its closing quote or the end of the text.
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|-|true|false|null|t|tr|tru|f|fa|fal|fals|n|nu|nul")
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?$")
_DECODER = json.JSONDecoder(strict=False)


@attrs.frozen
class AffinityKey:
    """A key and where it came from: ``session``, ``user`` or ``prefix``."""

    key: int
    kind: str


def key_of(kind: str, material: bytes) -> int:
    """The integer key of ``material`` of this kind (blake2b, 8 bytes, big-endian)."""
    digest = hashlib.blake2b(kind.encode("ascii") + b"\0" + material, digest_size=8).digest()
    return int.from_bytes(digest, "big")


class _Malformed(Exception):
    """Not JSON as far as it goes."""


class _Cut:
    """A marker for a value the text ended inside of (an unfinished scalar)."""


_CUT: Final = _Cut()


class _Reader:
    """A lenient JSON reader over a possibly cut text: at the end of the text every open
    string, array and object is closed with what it holds so far, and :attr:`ended` is set."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.ended = False
        #: The top-level member whose value the text ended inside of ("" when none).
        self.cut_member = ""

    def _skip_space(self) -> bool:
        """Skip blanks; False (and ended) at the end of the text."""
        match = _SPACE.match(self.text, self.pos)
        self.pos = match.end() if match else self.pos
        if self.pos >= len(self.text):
            self.ended = True
            return False
        return True

    def value(self, depth: int = 0) -> object:
        if depth > _MAX_DEPTH:
            raise _Malformed("nested too deep")
        if not self._skip_space():
            return _CUT
        char = self.text[self.pos]
        if char == '"':
            return self.string()
        if char == "{":
            return self.members(depth)
        if char == "[":
            return self.elements(depth)
        match = _SCALAR.match(self.text, self.pos)
        if not match or not match.group():
            raise _Malformed(f"unexpected {char!r}")
        self.pos = match.end()
        if self.pos >= len(self.text):
            self.ended = True
            return _CUT
        literal = match.group()
        constants: dict[str, object] = {"true": True, "false": False, "null": None}
        if literal in constants:
            return constants[literal]
        try:
            return float(literal) if any(c in literal for c in ".eE") else int(literal)
        except ValueError:
            raise _Malformed(f"bad number {literal!r}") from None

    def string(self) -> str:
        start = self.pos + 1
        match = _STRING_BODY.match(self.text, start)
        end = match.end() if match else start
        raw = self.text[start:end]
        if end < len(self.text) and self.text[end] == '"':
            self.pos = end + 1
        else:
            self.ended = True
            self.pos = len(self.text)
            raw = _PARTIAL_ESCAPE.sub("", raw)
        try:
            decoded = _DECODER.decode(f'"{raw}"')
        except ValueError:
            raise _Malformed("bad string") from None
        if not isinstance(decoded, str):  # pragma: no cover - a quoted text is always a str
            raise _Malformed("bad string")
        return decoded

    def _opened(self, close: str) -> bool:
        """Step into a container: False when it is empty (``close`` follows) or the text ends."""
        self.pos += 1
        if not self._skip_space():
            return False
        if self.text[self.pos] == close:
            self.pos += 1
            return False
        return True

    def _next_item(self, close: str) -> bool:
        """Step past what follows an item: True at a ``,``, False at ``close`` or the end."""
        if self.ended or not self._skip_space():
            return False
        char = self.text[self.pos]
        self.pos += 1
        if char == close:
            return False
        if char != ",":
            raise _Malformed(f"expected , or {close}")
        return True

    def elements(self, depth: int) -> list[object]:
        items: list[object] = []
        more = self._opened("]")
        while more:
            item = self.value(depth + 1)
            if item is not _CUT:
                items.append(item)
            more = self._next_item("]")
        return items

    def members(self, depth: int) -> dict[str, object]:
        found: dict[str, object] = {}
        more = self._opened("}")
        while more:
            if not self._skip_space():
                return found
            if self.text[self.pos] != '"':
                raise _Malformed("a key must be a string")
            name = self.string()
            if self.ended or not self._skip_space():
                return found
            if self.text[self.pos] != ":":
                raise _Malformed("expected :")
            self.pos += 1
            item = self.value(depth + 1)
            if item is not _CUT:
                found.setdefault(name, item)
            if self.ended and depth == 0:
                self.cut_member = name
            more = self._next_item("}")
        return found


def _text_of(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        return "".join(parts)
    return None


def prompt_stream(document: dict[str, object], limit: int) -> bytes | None:
    """The leading ``limit`` bytes of the prompt stream of a (possibly partial) body; ``None``
    when it names neither ``messages`` nor ``prompt``."""
    messages = document.get("messages")
    if isinstance(messages, list):
        out = bytearray()
        for message in messages:
            if len(out) >= limit:
                break
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            text = _text_of(message.get("content"))
            out += (role if isinstance(role, str) else "").encode("utf-8", "surrogatepass")
            out += _UNIT
            out += (text or "").encode("utf-8", "surrogatepass")
            out += _RECORD
            if role == "user":
                break  # the conversation's opening: every later turn repeats it
        return bytes(out[:limit]) if out else None
    prompt = document.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            prompt = " ".join(str(item) for item in prompt)
        else:
            prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")[:limit]
    return None


def _leading(
    body: bytes | bytearray | memoryview, body_limit: int
) -> tuple[dict[str, object], str | None] | None:
    """The top-level members found in the body's first ``body_limit`` bytes, and the member the
    cut fell inside (if any); ``None`` for anything but the start of a JSON object."""
    text = bytes(body[: max(0, body_limit)]).decode("utf-8", "replace")
    reader = _Reader(text)
    try:
        if not reader._skip_space() or text[reader.pos] != "{":
            return None
        document = reader.members(0)
    except (_Malformed, RecursionError):
        return None
    return document, reader.cut_member


def leading_string(
    body: bytes | bytearray | memoryview, name: str, *, body_limit: int = DEFAULT_BODY_LIMIT
) -> str | None:
    """A top-level string member of a (possibly cut) JSON body, when it lies whole within its
    first ``body_limit`` bytes (the request's ``model``, for example); else ``None``."""
    read = _leading(body, body_limit)
    if read is None:
        return None
    document, cut_member = read
    value = document.get(name)
    return value if isinstance(value, str) and cut_member != name else None


def affinity_key(
    body: bytes | bytearray | memoryview,
    *,
    session: str | bytes | None = None,
    prefix_bytes: int = DEFAULT_PREFIX_BYTES,
    body_limit: int = DEFAULT_BODY_LIMIT,
) -> AffinityKey | None:
    """The request's affinity key (see the module notes), or ``None`` when it has none."""
    if session:
        material = session if isinstance(session, bytes) else session.encode("utf-8", "replace")
        return AffinityKey(key_of("session", material), "session")
    read = _leading(body, body_limit)
    if read is None:
        return None
    document, cut_member = read
    user = document.get("user")
    if isinstance(user, str) and user and cut_member != "user":
        return AffinityKey(key_of("user", user.encode("utf-8", "surrogatepass")), "user")
    stream = prompt_stream(document, max(1, prefix_bytes))
    if stream is None:
        return None
    return AffinityKey(key_of("prefix", stream), "prefix")


@attrs.frozen
class AffinityKeying:
    """How the proxy keys requests under ``PIG_ROUTING=guard``: the trusted session header's
    name (lower case; empty: none) and ``PIG_AFFINITY_PREFIX_BYTES``."""

    header: bytes = b""
    prefix_bytes: int = DEFAULT_PREFIX_BYTES

    def key(self, headers: Sequence[tuple[bytes, bytes]], body: list[bytes] | None) -> int | None:
        """The request's key: the session header when set, else the held body's ``user`` or
        prompt prefix; None without either (a streamed body is not looked into)."""
        session = next((v for n, v in headers if n == self.header), None) if self.header else None
        if not session and body is None:
            return None
        found = affinity_key(
            b"".join(body) if body else b"", session=session, prefix_bytes=self.prefix_bytes
        )
        return None if found is None else found.key
