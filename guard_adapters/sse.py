"""Find the first useful server-sent event of a generation stream (semantic TTFT, spec 8.5).

Reads: the response body bytes written downstream, in whatever chunks the proxy happens to
read them; and, for :func:`is_streaming_request`, a request's ``Accept`` header and body.

What counts as an event
    The stream is cut into lines at ``\\n``; one ``\\r`` at the end of a line is dropped (so
    CRLF streams read like LF ones; a lone ``\\r`` does not end a line). An empty line closes
    the event being collected. Of the other lines only those beginning with ``data:`` matter:
    that prefix and at most one following space are removed and the rest is one data line.
    Comments (``:`` ...), ``event:``, ``id:``, ``retry:`` and any other line are skipped.
    A closed event's data lines are joined with ``\\n`` and trimmed; an empty result and
    ``[DONE]`` are skipped, and anything that is not a JSON object is skipped too.

What makes an event useful
    * Chat and completions: some ``choices[i].delta`` holds ``reasoning_content``,
      ``reasoning``, ``content``, ``tool_calls`` or ``function_call`` with a value that carries
      something: a string with a non-space character, a non-empty array or object, or any other
      non-null value (numbers and booleans, ``false`` and ``0`` included). ``role`` and
      ``refusal`` do not count, so the role-only opening chunk of a chat stream is not useful.
    * Responses API: the top-level ``delta`` is a string with a non-space character, and the
      event either has no string ``type`` or its lower-cased ``type`` mentions ``output_text``,
      ``reasoning``, ``tool`` or ``function_call``. The last word is this project's addition:
      PIG's list leaves out ``response.function_call_arguments.delta``, so a Responses stream
      that only calls a function would never give a sample, although the same output in a
      chat stream (``tool_calls``) does.

Guarantees
    * Pure and sans-IO: no clock, no I/O, no global state. Nothing raises for any bytes.
    * The answer does not depend on how the stream is split into chunks; :meth:`feed` reports
      the first useful event on the call whose chunk holds that event's closing line break.
    * An event whose closing empty line has not arrived is never counted.
    * Only the first :data:`SCAN_LIMIT_BYTES` bytes are examined. Memory held is the current
      partial line and the current event's data lines, never more than that limit. Once the
      useful event is found or the limit is used up, :meth:`feed` returns at once.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ("SCAN_LIMIT_BYTES", "FirstUsefulEventScanner", "is_streaming_request")

#: How many bytes of a stream are examined at most (PIG's 64 KiB).
SCAN_LIMIT_BYTES: Final = 65536

_DATA_PREFIX: Final = b"data:"
_DONE: Final = b"[DONE]"
#: ``choices[i].delta`` members that carry generated output.
_DELTA_FIELDS: Final = ("reasoning_content", "reasoning", "content", "tool_calls", "function_call")
#: Words of a Responses event ``type`` whose top-level ``delta`` is generated output.
_RESPONSES_TYPE_WORDS: Final = ("output_text", "reasoning", "tool", "function_call")
#: Bytes trimmed around a joined payload (the ASCII white space).
_ASCII_SPACE: Final = b" \t\n\r\x0b\x0c"
#: Characters trimmed around a delta string: Unicode white space as Go's unicode.IsSpace
#: defines it (narrower than Python's str.isspace, which also takes \x1c-\x1f).
_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_EVENT_STREAM: Final = b"text/event-stream"


class FirstUsefulEventScanner:
    """Watches one response body for its first useful event; see the module notes.

    Call :meth:`feed` with each chunk after writing it downstream, until it returns True (take
    the TTFT sample then) or :attr:`finished` is True. The scanner never looks at a byte past
    the useful event or past the limit, so feeding more afterwards is harmless and free.
    """

    __slots__ = ("_data", "_done", "_limit", "_limit_reached", "_line", "_scanned")

    def __init__(self, limit: int = SCAN_LIMIT_BYTES) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        self._limit = limit
        self._scanned = 0
        self._done = False
        self._limit_reached = False
        #: The line being received, without its end (empty between lines).
        self._line = bytearray()
        #: The data lines of the event being collected.
        self._data: list[bytes | bytearray] = []

    @property
    def done(self) -> bool:
        """The first useful event has been seen."""
        return self._done

    @property
    def limit_reached(self) -> bool:
        """The limit was used up without a useful event; nothing more is examined."""
        return self._limit_reached

    @property
    def finished(self) -> bool:
        """Either :attr:`done` or :attr:`limit_reached`: further chunks are ignored."""
        return self._done or self._limit_reached

    @property
    def bytes_scanned(self) -> int:
        """Bytes examined so far. Once :attr:`done`, the offset just past the line break that
        closed the useful event (bytes after it in the same chunk are not counted)."""
        return self._scanned

    def feed(self, chunk: bytes | bytearray) -> bool:
        """Examine the next bytes of the stream.

        True exactly once: on the chunk that completes the first useful event.
        """
        if self._done or self._limit_reached or not chunk:
            return False
        room = self._limit - self._scanned
        view = chunk if len(chunk) <= room else chunk[:room]
        start = 0
        while True:
            end = view.find(b"\n", start)
            if end < 0:
                self._line += view[start:]
                break
            line: bytes | bytearray
            if self._line:
                self._line += view[start:end]
                line = bytes(self._line)
                self._line.clear()
            else:
                line = view[start:end]
            if self._take_line(line):
                self._scanned += end + 1
                self._done = True
                self._release()
                return True
            start = end + 1
        self._scanned += len(view)
        if self._scanned >= self._limit:
            self._limit_reached = True
            self._release()
        return False

    def _release(self) -> None:
        self._line = bytearray()
        self._data = []

    def _take_line(self, line: bytes | bytearray) -> bool:
        """Handle one complete line; True when it closed a useful event."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if not self._data:
                return False
            payload = b"\n".join(self._data)
            self._data = []
            return _useful_payload(payload)
        if line.startswith(_DATA_PREFIX):
            value = line[len(_DATA_PREFIX) :]
            if value.startswith(b" "):
                value = value[1:]
            self._data.append(value)
        return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _useful_payload(payload: bytes) -> bool:
    text = payload.strip(_ASCII_SPACE)
    if not text.startswith(b"{"):
        # Also covers "" and [DONE]: neither can be an object.
        return False
    try:
        # Invalid UTF-8 inside strings is replaced, as Go's decoder does, not refused.
        document = json.loads(text.decode("utf-8", "replace"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and _useful_document(document)


def _carries_output(value: object) -> bool:
    if value is None:
        return False
    if isinstance(value, str):
        return bool(value.strip(_SPACE))
    if isinstance(value, list | dict):
        return bool(value)
    return True


def _useful_document(document: dict[str, Any]) -> bool:
    choices = document.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and any(
                _carries_output(delta.get(name)) for name in _DELTA_FIELDS
            ):
                return True
    delta = document.get("delta")
    if not isinstance(delta, str) or not delta.strip(_SPACE):
        return False
    kind = document.get("type")
    if not isinstance(kind, str):
        return True
    lowered = kind.lower()
    return any(word in lowered for word in _RESPONSES_TYPE_WORDS)


def is_streaming_request(accept: bytes | None, body: bytes | None) -> bool:
    """Whether an admitted request takes the streaming path (and is scanned for TTFT).

    True when ``accept`` contains ``text/event-stream`` in any ASCII case, or when ``body`` is
    a JSON object whose top-level ``stream`` is the literal ``true``. A body that is not
    complete, valid JSON (the caller passes whatever it has) gives False; nothing raises.
    This widens PIG, which looks at ``Accept`` only (spec 15, quirk 7).
    """
    if accept and _EVENT_STREAM in accept.lower():
        return True
    # ``true`` cannot be written with escapes, so a body without it cannot ask to stream.
    if not body or b"true" not in body:
        return False
    try:
        document = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and document.get("stream") is True
