"""Request bodies of the OpenAI-style routes: backend priority, compat cleanup, output tokens.

What is read
    An admitted request's tier, ``Content-Type``, ``Content-Length`` and body bytes, and the
    :class:`InjectionPolicy` (PIG's ``BACKEND_PRIORITY_*`` and ``OPENAI_COMPAT_*`` settings,
    spec 2.2 and 2.5). Nothing here does I/O, reads a clock or keeps global state; the 64 rewrite
    slots and the counters belong to the caller.

What is offered
    :func:`plan`
        Spec 6.3 steps 1-9 as a value: leave the body alone, rewrite it in memory, rewrite it as it
        streams, or refuse the request; plus which counter to bump now and the bucketed scanner
        buffer. One deliberate difference from PIG (PRODUCT.md, quirk 4): a basic request in
        ``premium_only`` mode is always left byte-identical, even with compat cleanup on.
    :func:`rewrite` and :class:`StreamingRewriter`
        The single-pass body scanner, whole or incrementally. Both give the same bytes for any
        split of the input, and the same :class:`~guard_adapters._errors.BodyRewriteError` for
        malformed input (the caller restores the original bytes when it is fail-open).
    :func:`output_token_intent`
        Spec 6.4's strict walk for the requested output tokens.

The rewrite formats (spec 6.3)
    ``field_scan`` (the default) skips leading whitespace, requires ``{``, writes
    ``{"<field>":<V>`` first and then every other top-level member as ``,`` + the key literal as
    sent + ``:`` + the value, dropping the whitespace between top-level tokens. Values are copied
    byte for byte: strings and composites exactly, other scalars up to the next ``,``, ``}`` or
    ``]`` (so whitespace after them stays, and they are never validated: ``tru`` passes). Every
    top-level member named like the field (compared as sent, or unescaped when the literal holds
    a backslash) is dropped; an ``extra_body`` object is re-emitted without whitespace with each
    of its field members given the trusted value in place; a ``messages`` array (compat cleanup
    on) is re-emitted without whitespace, its object elements member by member without any
    ``tool_calls`` member whose value is an empty array. Anything after the closing top-level
    ``}`` is dropped.

    ``append_last`` keeps every byte (leading whitespace and trailing data included) and puts
    ``,"<field>":<V>`` -- without the comma for an object with no members -- just before the
    closing top-level ``}``. With compat cleanup on it uses the ``field_scan`` re-emission
    instead, with the trusted member written last and the client's own field members (top level
    and ``extra_body``) left as they were. Compat cleanup without injection is the same
    re-emission with no trusted member at all.

    Refused (:class:`BodyRewriteError`): a body whose first non-blank byte is not ``{``, a key
    that is not a string, a missing ``:`` or ``,``, a closing bracket of the wrong kind, and a
    body that ends before its top-level object does. Two bounds keep the scanner's memory within
    ``Plan.buffer_limit`` whatever the body: composites nested deeper than that many levels, and
    more than that many blank bytes between a ``messages[i].tool_calls`` ``[`` and its first
    element, are refused too (on both paths alike, so their outputs never differ).

Performance
    The scanner works on whole blocks, never byte by byte in Python: a string's end is found with
    ``bytes.find`` (once escaped quotes get dense, escapes are paired up by ``bytes.replace``
    over growing windows instead), composites jump from bracket to bracket with a compiled
    pattern, runs of plain members (a key without escapes, then a string or scalar) are matched
    whole, a compact ``messages`` element holding only strings and scalars is recognised by one
    pattern and copied as it is, and output is assembled from zero-copy ``memoryview`` slices
    joined once per call. ``bench/bench_body_rewrite.py`` measures it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final, Literal

import attrs

from guard_adapters._errors import BodyRewriteError, ConfigError
from guard_adapters._rules import Identifier, OneOf
from guard_core.settings import AtLeast, Greater, Rule, problems, setting
from guard_core.tier import Tier

__all__ = (
    "DEFAULT_OUTPUT_TOKEN_FIELDS",
    "BodyRewriteError",
    "CounterName",
    "InjectionPolicy",
    "Plan",
    "PlanAction",
    "StreamingRewriter",
    "as_utf8_json",
    "buffer_bucket",
    "is_json_content_type",
    "output_token_intent",
    "plan",
    "rewrite",
)

KIB: Final = 1024
MIB: Final = 1024 * KIB
#: The smallest scanner buffer bucket (spec 6.3 step 9, spec 12).
_MIN_BUCKET: Final = 4 * KIB
#: The default output-token field names of spec 2.4.
DEFAULT_OUTPUT_TOKEN_FIELDS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")

#: ``BACKEND_PRIORITY_MODE`` values, the default first.
PRIORITY_MODES: Final = ("all", "premium_only")
#: ``BACKEND_PRIORITY_REWRITE_STRATEGY`` values, the default first.
REWRITE_STRATEGIES: Final = ("field_scan", "append_last")
#: What a built :class:`InjectionPolicy` checks even with injection off (PIG does not).
_CHECKED_WHEN_OFF: Final = frozenset(
    {
        "BACKEND_PRIORITY_MODE",
        "BACKEND_PRIORITY_REWRITE_STRATEGY",
        "BACKEND_PRIORITY_STREAM_BUFFER_BYTES",
        "OPENAI_COMPAT_BODY_BYTES",
    }
)


def _injecting(default: object, env: str, *rules: Rule) -> Any:
    """A ``BACKEND_PRIORITY_*`` setting whose rules PIG applies while injection is on."""
    return setting(default, env=env, rules=rules, when="enabled")


#: The injector counters a caller bumps: ``pig_backend_priority_{rewrite,skipped,failed}_total``.
CounterName = Literal["rewritten", "skipped", "failed"]


# -- policy --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class InjectionPolicy:
    """The settings of spec 2.2 (compat cleanup) and 2.5 (priority injection), PIG's defaults.

    Each field names the variable it is read from (``metadata["env"]``, see
    :mod:`guard_core.settings`) and holds its default, which the config adapter uses. As in PIG,
    the injection ranges are checked only while injection is on and the compat size only while
    stripping is on (the config adapter checks exactly these rules); a built policy also keeps
    ``mode``, ``strategy`` and ``stream_buffer_bytes`` with injection off. A bad value raises
    :class:`~guard_adapters._errors.ConfigError` naming every offending variable.
    """

    enabled: bool = setting(True, env="BACKEND_PRIORITY_INJECTION_ENABLED")
    mode: Literal["all", "premium_only"] = _injecting(
        PRIORITY_MODES[0], "BACKEND_PRIORITY_MODE", OneOf(PRIORITY_MODES)
    )
    strategy: Literal["field_scan", "append_last"] = _injecting(
        REWRITE_STRATEGIES[0], "BACKEND_PRIORITY_REWRITE_STRATEGY", OneOf(REWRITE_STRATEGIES)
    )
    field: str = _injecting("priority", "BACKEND_PRIORITY_FIELD", Identifier())
    premium_value: int = setting(-100, env="BACKEND_PRIORITY_PREMIUM_VALUE")
    basic_value: int = setting(0, env="BACKEND_PRIORITY_BASIC_VALUE")
    body_bytes: int = _injecting(32 * MIB, "BACKEND_PRIORITY_BODY_BYTES", Greater(0))
    buffer_bytes: int = _injecting(0, "BACKEND_PRIORITY_BUFFER_BYTES", AtLeast(0))
    stream_buffer_bytes: int = _injecting(
        2 * MIB, "BACKEND_PRIORITY_STREAM_BUFFER_BYTES", Greater(0)
    )
    #: The configured count follows ``GLOBAL_LIMIT`` (see the config adapter); 64 at most.
    rewrite_limit: int = _injecting(64, "BACKEND_PRIORITY_REWRITE_LIMIT", Greater(0))
    fail_open: bool = setting(True, env="BACKEND_PRIORITY_FAIL_OPEN")
    strip_empty_tool_calls: bool = setting(True, env="OPENAI_COMPAT_STRIP_EMPTY_TOOL_CALLS")
    compat_body_bytes: int = setting(
        32 * MIB,
        env="OPENAI_COMPAT_BODY_BYTES",
        rules=(Greater(0),),
        when="strip_empty_tool_calls",
    )
    compat_fail_open: bool = setting(True, env="OPENAI_COMPAT_FAIL_OPEN")

    def __attrs_post_init__(self) -> None:
        # The rules as PIG applies them, except that the mode, the strategy and the scanner
        # ceiling shape the compat cleanup too, so a built policy keeps them with injection off.
        values = {**attrs.asdict(self, recurse=False), "enabled": True}
        found = [
            str(problem)
            for problem in problems(InjectionPolicy, values)
            if self.enabled or problem.variables[0] in _CHECKED_WHEN_OFF
        ]
        if found:
            raise ConfigError(found)

    def value_for(self, tier: Tier) -> int:
        """The trusted priority written for ``tier``."""
        return self.premium_value if tier is Tier.PREMIUM else self.basic_value


# -- plan ----------------------------------------------------------------------------------------


#: What the caller does with the body:
#:
#: ``"unchanged"``
#:     forward the body (and its Content-Length) exactly as received;
#: ``"buffered"``
#:     read the whole body, :func:`rewrite` it, send it with the new Content-Length; on
#:     :class:`BodyRewriteError` send the original bytes when ``Plan.fail_open``, else reject;
#: ``"streaming"``
#:     pipe the body through a :class:`StreamingRewriter` with Content-Length removed (chunked);
#:     an error aborts the upstream request body, which then answers 429 as an upstream failure;
#: ``"reject"``
#:     answer 429 without contacting a backend.
PlanAction = Literal["unchanged", "buffered", "streaming", "reject"]


@attrs.frozen(kw_only=True)
class Plan:
    """The outcome of :func:`plan`, and everything :func:`rewrite` needs.

    ``inject``: the trusted member is written (the request is priority-eligible); ``strip``: the
    compat cleanup of ``messages`` applies. ``counts`` lists the counters to bump now (only
    ``"skipped"`` is ever decided up front); :meth:`outcome_counter` names the one to bump once a
    rewrite has finished. ``uses_slot`` tells whether the plan holds a rewrite slot, from before
    the body is read until the upstream has read the rewritten body to its end.
    ``fail_open``: on a failed buffered rewrite, forward the original bytes (otherwise reject).
    ``buffer_limit``: the bucketed scanner buffer (4 KiB x 2^k, at most the stream buffer).
    ``reason``: a short label for logs, never shown to clients.
    """

    action: PlanAction
    inject: bool = False
    strip: bool = False
    priority_value: int = 0
    field: str = "priority"
    strategy: Literal["field_scan", "append_last"] = "field_scan"
    counts: tuple[CounterName, ...] = ()
    buffer_limit: int = 2 * MIB
    fail_open: bool = True
    reason: str = ""

    @property
    def uses_slot(self) -> bool:
        """Whether the plan rewrites, and so holds one of the caller's rewrite slots."""
        return self.action in ("buffered", "streaming")

    def outcome_counter(self, *, ok: bool) -> CounterName | None:
        """The counter to bump when the rewrite ends: only priority-eligible plans are counted."""
        if not self.inject or not self.uses_slot:
            return None
        return "rewritten" if ok else "failed"


def buffer_bucket(content_length: int | None, cap: int) -> int:
    """The scanner buffer for a body of ``content_length`` bytes (``None``/negative: unknown).

    4 KiB up to 4 KiB, else the smallest 4 KiB x 2^k that holds the body, never above ``cap``;
    an unknown length gets ``cap``.

    >>> [buffer_bucket(n, 2 * MIB) for n in (1024, 64 * KIB, 65 * KIB, 8 * MIB, None)]
    [4096, 65536, 131072, 2097152, 2097152]
    """
    if content_length is None or content_length < 0:
        return cap
    size = _MIN_BUCKET
    while size < content_length and size < cap:
        size *= 2
    return min(size, cap)


def is_json_content_type(content_type: bytes | str | None) -> bool:
    """PIG's test: an empty or missing type, or one holding ``json`` in any ASCII case."""
    if content_type is None:
        return True
    raw = (
        content_type.encode("latin-1", "replace") if isinstance(content_type, str) else content_type
    )
    return not raw or b"json" in raw.lower()


def plan(
    policy: InjectionPolicy,
    *,
    tier: Tier,
    content_type: bytes | str | None,
    content_length: int | None,
    slot_free: bool = True,
) -> Plan:
    """Decide what happens to an admitted request's body (spec 6.3 steps 1-9).

    ``content_length`` is ``None`` (or negative) for an unknown length or a chunked body, 0 for
    no body. ``slot_free`` says whether the caller could take a rewrite slot; a caller may plan
    once with the default, take a slot only when :attr:`Plan.uses_slot`, and plan again with
    ``slot_free=False`` when none was free.
    """
    cl = -1 if content_length is None or content_length < 0 else content_length
    base = Plan(
        action="unchanged",
        priority_value=policy.value_for(tier),
        field=policy.field,
        strategy=policy.strategy,
        buffer_limit=buffer_bucket(content_length, policy.stream_buffer_bytes),
    )

    def decided(action: PlanAction, reason: str, counts: tuple[CounterName, ...] = ()) -> Plan:
        return attrs.evolve(base, action=action, reason=reason, counts=counts)

    def skip_or_fail(reason: str) -> Plan:
        # A priority request left unrewritten: counted, then forwarded or refused.
        action: PlanAction = "unchanged" if policy.fail_open else "reject"
        return decided(action, reason, ("skipped",))

    # 1. Is a trusted priority to be written at all?
    inject = policy.enabled and (policy.mode == "all" or tier is Tier.PREMIUM)
    if policy.enabled and not inject:
        # PRODUCT.md: premium_only leaves basic bodies byte-identical, compat cleanup or not.
        return decided("unchanged", "premium_only_basic", ("skipped",))
    strip = policy.strip_empty_tool_calls
    # 2.
    if not inject and not strip:
        return decided("unchanged", "disabled")
    # 3. No body; 4. a type other than JSON.
    for reason, applies in (
        ("no_body", cl == 0),
        ("not_json", not is_json_content_type(content_type)),
    ):
        if applies:
            return skip_or_fail(reason) if inject else decided("unchanged", reason)
    # 5. Only a known length within the limits is eligible.
    priority_ok = inject and 0 <= cl <= policy.body_bytes
    compat_ok = strip and 0 <= cl <= policy.compat_body_bytes
    # 6.
    counts: tuple[CounterName, ...] = ()
    if inject and not priority_ok:
        if not policy.fail_open:
            return decided("reject", "not_eligible", ("skipped",))
        counts = ("skipped",)
    # 7.
    if not priority_ok and not compat_ok:
        return decided("unchanged", "not_eligible", counts)
    # 8.
    if not slot_free:
        if priority_ok:
            return skip_or_fail("slot_busy")
        return decided("unchanged" if policy.compat_fail_open else "reject", "slot_busy", counts)
    # 9. Every fail-open flag that concerns this body must allow forwarding the original.
    fail_open = (not priority_ok or policy.fail_open) and (not compat_ok or policy.compat_fail_open)
    action: PlanAction
    if priority_ok and policy.strategy == "field_scan" and cl <= policy.buffer_bytes:
        action, reason = "buffered", "buffer_bytes"
    elif not fail_open:
        action, reason = "buffered", "strict"
    elif cl <= base.buffer_limit:
        action, reason = "buffered", "safety_buffer"
    else:
        action, reason = "streaming", "streaming"
    return attrs.evolve(
        base,
        action=action,
        inject=priority_ok,
        strip=compat_ok,
        counts=counts,
        fail_open=fail_open,
        reason=reason,
    )


# -- the scanner ---------------------------------------------------------------------------------

_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C
_COMMA: Final = 0x2C
_COLON: Final = 0x3A
_LBRACE: Final = 0x7B
_RBRACE: Final = 0x7D
_LBRACKET: Final = 0x5B
_RBRACKET: Final = 0x5D
_BLANKS: Final = frozenset(b" \t\r\n")
# Backslash runs up to this long before a quote are counted in Python; longer ones are paired
# up in windows (_dense_string_end), so that a body of backslashes cannot make the scan slow.
_SHORT_RUN: Final = 16
# After this many escaped quotes in one string, the rest of it is read in windows.
_ESCAPED_QUOTES: Final = 4
_FIRST_WINDOW: Final = 1024
_LAST_WINDOW: Final = 1024 * 1024

_BLANK_RUN = re.compile(rb"[ \t\r\n]*+")
_COMPOSITE_STOP = re.compile(rb'[\[\]{}"]')
_SCALAR_END = re.compile(rb"[,}\]]")
# Blanks, then a key literal without escapes, blanks, ``:`` and blanks.
_SIMPLE_KEY = re.compile(rb'[ \t\r\n]*+("[^"\\]*+")[ \t\r\n]*+:[ \t\r\n]*+')
_NOT_SCALAR_START: Final = frozenset(b"{[,}]")
# A whole object with no blanks between its tokens, keys without escapes, and only strings
# and non-empty scalars as values (looked for only within _FLAT_WINDOW bytes).
_STRING_LITERAL = rb'"[^"\\]*+(?:\\[\s\S][^"\\]*+)*+"'
_FLAT_MEMBER = rb'"[^"\\]*+":(?:' + _STRING_LITERAL + rb'|[^\s"{\[,}\]][^,}\]]*+)'
_COMPACT_FLAT_OBJECT = re.compile(rb"\{(?:" + _FLAT_MEMBER + rb"(?:," + _FLAT_MEMBER + rb")*+)?+\}")
_FLAT_WINDOW: Final = 64 * 1024

# Frame kinds.
_TOP, _OBJ, _ARR, _COMPOSITE, _STRING, _SCALAR, _TOOLS_OPEN = range(7)
# Phases of _TOP, _OBJ (and _ARR, which uses _FIRST, _VALUE and _AFTER).
_START, _FIRST, _KEY, _KEY_READ, _COLON_NEXT, _VALUE, _AFTER, _DONE = range(8)
# What happens to the member whose key was just read.
_COPY, _DROP, _EXTRA, _MESSAGES, _REPLACE, _TOOLS = range(6)

_MESSAGES_KEY: Final = b"messages"
_EXTRA_BODY_KEY: Final = b"extra_body"
_TOOL_CALLS_KEY: Final = b"tool_calls"


class _Frame:
    """One open construct of the scanner's stack; which slots matter depends on ``kind``."""

    __slots__ = (
        "blanks",
        "closers",
        "emit",
        "emitted",
        "esc",
        "in_string",
        "key",
        "kind",
        "member",
        "names",
        "phase",
    )

    # Set only by the kinds that use them: key (objects), closers (composites), blanks
    # (_TOOLS_OPEN).
    key: bytearray
    closers: bytearray
    blanks: bytearray
    names: dict[bytes, int]

    def __init__(self, kind: int, *, emit: bool = True, phase: int = _FIRST) -> None:
        self.kind = kind
        self.emit = emit
        self.phase = phase
        self.emitted = False
        self.esc = False
        self.in_string = False
        self.member = _COPY


def _string_end(buf: bytes, pos: int, esc: bool) -> tuple[int, bool]:
    """Where the string whose content resumes at ``pos`` closes.

    ``esc`` says the previous content byte was an unpaired backslash. Returns the index of the
    closing quote and ``False``, or ``-1`` and whether the input ends inside an escape.
    """
    if esc:
        if pos >= len(buf):
            return -1, True
        pos += 1
    q = buf.find(b'"', pos)
    if (q > pos and buf[q - 1] != _BACKSLASH) or q == pos:
        return q, False  # the common case: no backslash just before the quote
    n = len(buf)
    for _ in range(_ESCAPED_QUOTES):
        # The backslashes just before the quote (or the end) decide: an odd run escapes it.
        end = n if q < 0 else q
        j = end - 1
        stop = max(pos - 1, end - _SHORT_RUN)
        while j > stop and buf[j] == _BACKSLASH:
            j -= 1
        if j == stop and j >= pos:
            break  # a long run of backslashes: leave it to the windows
        if (end - 1 - j) % 2 == 0:
            return q, False
        if q < 0:
            return -1, True
        pos = q + 1
        q = buf.find(b'"', pos)
    return _dense_string_end(buf, pos)


def _dense_string_end(buf: bytes, pos: int) -> tuple[int, bool]:
    """:func:`_string_end` for content with many escapes, from a position outside any escape.

    Escapes are paired up from the left, as a JSON reader does, by two replacements over a
    window of the input (``\\\\`` first, then ``\\"``, each by two bytes that are not
    quotes), so that the first quote left in the window is the closing one. Windows start at
    1 KiB and double, so a short string costs little and a long one is read in big blocks.
    """
    n = len(buf)
    size = _FIRST_WINDOW
    while pos < n:
        stop = min(n, pos + size)
        window = buf[pos:stop].replace(b"\\\\", b"__").replace(b'\\"', b"__")
        q = window.find(b'"')
        if q >= 0:
            return pos + q, False
        if window[-1] == _BACKSLASH:  # an escape whose second byte is past the window
            if stop >= n:
                return -1, True
            stop += 1
        pos = stop
        size = min(2 * size, _LAST_WINDOW)
    return -1, False


def _key_name(literal: bytes) -> bytes | None:
    """A key literal (quotes included) as the name it stands for, ``None`` if not decodable."""
    inner = literal[1:-1]
    if _BACKSLASH not in inner:
        return inner
    try:
        name = json.loads(literal.decode("utf-8"))  # decoded first: no encoding sniffing
    except ValueError:
        return None
    return name.encode("utf-8", "surrogatepass") if isinstance(name, str) else None


class _Scanner:
    """The incremental single-pass rewriter behind :func:`rewrite` and StreamingRewriter.

    Every call consumes all the bytes it is given: what cannot be decided yet is kept in the
    frames (a short key, blanks after ``tool_calls: [``, an open escape), never as input.
    """

    def __init__(self, plan: Plan) -> None:
        field = plan.field.encode("utf-8", "surrogatepass")
        fragment = json.dumps(plan.field).encode() + b":" + str(plan.priority_value).encode()
        self._field = field
        self._limit = max(1, plan.buffer_limit)
        self._passthrough = not plan.inject and not plan.strip
        append_last = plan.inject and plan.strategy == "append_last"
        field_scan = plan.inject and not append_last
        self._verbatim = append_last and not plan.strip
        self._drop_field = field_scan
        self._replace_extra = field_scan
        self._strip = plan.strip
        # Opening and closing of the top-level object.
        self._open = b"{" + fragment if field_scan else b"{"
        self._last = fragment if append_last else None
        # Keys longer than this literal cannot spell any name the scanner looks for (each
        # character takes at most six bytes, as a \\u escape).
        longest = max(len(field), len(_MESSAGES_KEY), len(_EXTRA_BODY_KEY), len(_TOOL_CALLS_KEY))
        self._key_bound = 6 * longest + 2
        self._replacement = b":" + str(plan.priority_value).encode()
        # Key literals (as sent, or unescaped and re-quoted) that need more than a copy.
        quoted = b'"' + field + b'"'
        self._top_names: dict[bytes, int] = {}
        if self._replace_extra:
            self._top_names[b'"' + _EXTRA_BODY_KEY + b'"'] = _EXTRA
        if self._strip:
            self._top_names[b'"' + _MESSAGES_KEY + b'"'] = _MESSAGES
        if self._drop_field:
            self._top_names[quoted] = _DROP
        self._extra_names = {quoted: _REPLACE}
        self._message_names = {b'"' + _TOOL_CALLS_KEY + b'"': _TOOLS}
        top = _Frame(_TOP, phase=_START)
        top.names = self._top_names
        top.key = bytearray()
        top.emitted = field_scan
        self._stack = [top]
        self._out: list[bytes | memoryview] = []
        self._base = 0  # bytes consumed by earlier calls, for error offsets
        self._error: BodyRewriteError | None = None

    # -- driving ---------------------------------------------------------------------------------

    def run(self, data: bytes, *, final: bool) -> bytes:
        if self._error is not None:
            raise self._error
        out = self._out
        try:
            if self._passthrough:
                out.append(data)
            else:
                self._scan(data)
            self._base += len(data)
            if final and not self._passthrough and self._stack[0].phase != _DONE:
                self._fail("the body ends before its top-level object does", 0)
            return b"".join(out)
        except BodyRewriteError as exc:
            self._error = exc
            raise
        finally:
            out.clear()

    def _fail(self, reason: str, pos: int | None) -> None:
        raise BodyRewriteError(reason, None if pos is None else self._base + pos)

    def _scan(self, buf: bytes) -> None:
        n = len(buf)
        mv = memoryview(buf)
        stack = self._stack
        pos = 0
        while pos < n:
            frame = stack[-1]
            kind = frame.kind
            if kind == _COMPOSITE:
                pos = self._composite(frame, buf, mv, pos, n)
            elif kind == _STRING:
                pos = self._string(frame, buf, mv, pos, n)
            elif kind == _SCALAR:
                pos = self._scalar(frame, buf, mv, pos, n)
            elif kind == _ARR:
                pos = self._array(frame, buf, mv, pos, n)
            elif kind == _TOOLS_OPEN:
                pos = self._tools_open(frame, buf, mv, pos, n)
            else:
                pos = self._object(frame, buf, mv, pos, n)

    # -- values copied as they are ------------------------------------------------------------

    def _push_value(self, byte: int, buf: bytes, mv: memoryview, pos: int, *, emit: bool) -> int:
        """Copy (or skip) a value byte for byte, as far as the input goes; returns the position.

        A string or scalar that ends within ``buf`` is handled at once; otherwise a frame is
        pushed to carry on with.
        """
        if byte == _QUOTE:
            q, esc = _string_end(buf, pos + 1, False)
            if q >= 0:
                if emit:
                    self._out.append(mv[pos : q + 1])
                return q + 1
            frame = _Frame(_STRING, emit=emit)
            frame.esc = esc
            self._stack.append(frame)
            if emit:
                self._out.append(mv[pos:])
            return len(buf)
        if byte in (_LBRACE, _LBRACKET):
            frame = _Frame(_COMPOSITE, emit=emit)
            frame.closers = bytearray((_RBRACE if byte == _LBRACE else _RBRACKET,))
            if emit:
                self._out.append(mv[pos : pos + 1])
            self._stack.append(frame)
            return pos + 1
        match = _SCALAR_END.search(buf, pos)
        if match is not None:
            end = match.start()
            if emit and end > pos:
                self._out.append(mv[pos:end])
            return end
        self._stack.append(_Frame(_SCALAR, emit=emit))
        if emit:
            self._out.append(mv[pos:])
        return len(buf)

    def _string_rest(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """The rest of a string begun in an earlier chunk: the index after its closing quote, or
        -1 when this chunk ends inside it too (the chunk emitted, the escape state kept)."""
        q, esc = _string_end(buf, pos, frame.esc)
        if q < 0:
            frame.esc = esc
            if frame.emit:
                self._out.append(mv[pos:n])
            return -1
        return q + 1

    def _string(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        end = self._string_rest(frame, buf, mv, pos, n)
        if end < 0:
            return n
        if frame.emit:
            self._out.append(mv[pos:end])
        self._stack.pop()
        return end

    def _scalar(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        match = _SCALAR_END.search(buf, pos)
        end = n if match is None else match.start()
        if frame.emit and end > pos:
            self._out.append(mv[pos:end])
        if match is not None:
            self._stack.pop()
        return end

    def _composite(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        start = pos
        closers = frame.closers
        if frame.in_string:
            pos = self._string_rest(frame, buf, mv, pos, n)
            if pos < 0:
                return n
            frame.in_string = False
        search = _COMPOSITE_STOP.search
        limit = self._limit
        while True:
            match = search(buf, pos)
            if match is None:
                break
            i = match.start()
            byte = buf[i]
            if byte == _QUOTE:
                q, esc = _string_end(buf, i + 1, False)
                if q < 0:
                    frame.in_string = True
                    frame.esc = esc
                    break
                pos = q + 1
            elif byte in (_LBRACE, _LBRACKET):
                closers.append(_RBRACE if byte == _LBRACE else _RBRACKET)
                if len(closers) > limit:
                    self._fail("values nested deeper than the scanner buffer allows", i)
                pos = i + 1
            elif closers[-1] != byte:
                self._fail(f"mismatched {chr(byte)!r}", i)
            else:
                closers.pop()
                pos = i + 1
                if not closers:
                    if frame.emit:
                        self._out.append(mv[start:pos])
                    self._stack.pop()
                    return pos
        if frame.emit:
            self._out.append(mv[start:n])
        return n

    # -- objects: the top level, extra_body and messages[i] --------------------------------------

    def _object(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """Members of the top level, ``extra_body`` or a message, until a child frame opens."""
        out = self._out
        stack = self._stack
        depth = len(stack)
        verbatim = self._verbatim and frame.kind == _TOP
        while pos < n:
            phase = frame.phase
            if phase == _KEY_READ:
                pos = self._read_key(frame, buf, mv, pos, n)
                if len(stack) != depth:
                    return pos
                continue
            if phase == _DONE:
                if verbatim:
                    out.append(mv[pos:n])
                return n
            byte = buf[pos]
            if byte in _BLANKS:
                end = pos + 1
                if end < n and buf[end] in _BLANKS:
                    end = _BLANK_RUN.match(buf, end).end()  # type: ignore[union-attr]
                if verbatim:
                    out.append(mv[pos:end])
                pos = end
                continue
            if phase == _AFTER:
                if byte == _COMMA:
                    if verbatim:
                        out.append(b",")
                    frame.phase = _KEY
                    pos += 1
                    continue
                return self._close_object(frame, byte, pos)
            elif phase == _VALUE:
                pos = self._start_member_value(frame, byte, buf, mv, pos)
                if len(stack) != depth:
                    return pos
            elif phase == _COLON_NEXT:
                if byte != _COLON:
                    self._fail("missing ':' after an object key", pos)
                self._after_colon(frame)
                frame.phase = _VALUE
                pos += 1
            elif phase == _START:
                if byte != _LBRACE:
                    self._fail("the body is not a JSON object", pos)
                out.append(b"{" if verbatim else self._open)
                frame.phase = _FIRST
                pos += 1
            elif byte == _RBRACE and phase == _FIRST:
                return self._close_object(frame, byte, pos)
            else:
                pos = self._start_key(frame, byte, buf, mv, pos, verbatim=verbatim)
                if len(stack) != depth:
                    return pos
        return pos

    def _simple_members(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """Copy whole members that need no decision, as many as follow each other.

        A shortcut through the state machine, for the common case: a key without escapes that
        names nothing of interest, then a string or a non-empty scalar (which may end in a later
        chunk). Stops (consuming nothing of it) at the first member that is anything else.
        """
        out = self._out
        names = frame.names
        match_key = _SIMPLE_KEY.match
        while True:
            match = match_key(buf, pos)
            if match is None:
                return pos
            key = match.group(1)
            if key in names:
                return pos
            start = match.end()
            if start >= n:
                return pos
            byte = buf[start]
            if byte in _NOT_SCALAR_START:
                return pos
            out.append(b"," + key + b":" if frame.emitted else key + b":")
            frame.emitted = True
            frame.phase = _AFTER
            # The value runs on into the next chunk when it does not end here: a frame
            # carries on with it.
            pos = self._push_value(byte, buf, mv, start, emit=True)
            if pos >= n:
                return pos
            if buf[pos] in _BLANKS:
                pos = _BLANK_RUN.match(buf, pos).end()  # type: ignore[union-attr]
            if pos >= n or buf[pos] != _COMMA:
                return pos
            frame.phase = _KEY
            pos += 1

    def _start_key(
        self, frame: _Frame, byte: int, buf: bytes, mv: memoryview, pos: int, *, verbatim: bool
    ) -> int:
        """Where a member's key must begin."""
        if byte != _QUOTE:
            self._fail("an object key is not a string", pos)
        if verbatim:
            frame.emitted = True
            frame.member = _COPY
            frame.phase = _COLON_NEXT
            return self._push_value(_QUOTE, buf, mv, pos, emit=True)
        shortcut = self._simple_members(frame, buf, mv, pos, len(buf))
        if shortcut != pos:
            return shortcut
        q, _ = _string_end(buf, pos + 1, False)
        if q >= 0:
            literal = buf[pos : q + 1]
            self._begin_member(frame, self._member_kind(frame, literal), literal)
            return q + 1
        frame.key = bytearray(b'"')
        frame.esc = False
        frame.phase = _KEY_READ
        return pos + 1

    def _read_key(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """Carry on with a key literal that began in an earlier chunk."""
        key = frame.key
        q, esc = _string_end(buf, pos, frame.esc)
        if q < 0:
            key += mv[pos:n]
            frame.esc = esc
            if len(key) > self._key_bound:
                # Too long to be a name of interest: emit it as it comes.
                self._begin_member(frame, _COPY, bytes(key))
                rest = _Frame(_STRING)
                rest.esc = esc
                self._stack.append(rest)
                frame.key = bytearray()
            return n
        key += mv[pos : q + 1]
        literal = bytes(key)
        frame.key = bytearray()
        self._begin_member(frame, self._member_kind(frame, literal), literal)
        return q + 1

    def _member_kind(self, frame: _Frame, literal: bytes) -> int:
        names = frame.names
        kind = names.get(literal)
        if kind is not None:
            return kind
        if len(literal) > self._key_bound or _BACKSLASH not in literal:
            return _COPY
        name = _key_name(literal)
        if name is None:
            return _COPY
        return names.get(b'"' + name + b'"', _COPY)

    def _begin_member(self, frame: _Frame, member: int, literal: bytes) -> None:
        """A key has been read: emit it unless its member may vanish."""
        frame.member = member
        frame.phase = _COLON_NEXT
        if member == _DROP:
            return
        if member == _TOOLS:
            frame.key = bytearray(literal)  # held until the value shows whether it is []
            return
        self._out.append(b"," + literal if frame.emitted else literal)
        frame.emitted = True

    def _after_colon(self, frame: _Frame) -> None:
        member = frame.member
        if member == _REPLACE:
            self._out.append(self._replacement)
        elif member not in (_DROP, _TOOLS):
            self._out.append(b":")

    def _start_member_value(
        self, frame: _Frame, byte: int, buf: bytes, mv: memoryview, pos: int
    ) -> int:
        member = frame.member
        frame.phase = _AFTER
        if member == _COPY:
            return self._push_value(byte, buf, mv, pos, emit=True)
        if member in (_DROP, _REPLACE):
            return self._push_value(byte, buf, mv, pos, emit=False)
        if member == _EXTRA and byte == _LBRACE:
            child = _Frame(_OBJ)
            child.key = bytearray()
            child.names = self._extra_names
            self._out.append(b"{")
            self._stack.append(child)
            return pos + 1
        if member == _MESSAGES and byte == _LBRACKET:
            self._out.append(b"[")
            self._stack.append(_Frame(_ARR))
            return pos + 1
        if member == _TOOLS:
            if byte == _LBRACKET:
                opening = _Frame(_TOOLS_OPEN)
                opening.blanks = bytearray()
                self._stack.append(opening)
                return pos + 1
            self._emit_held_key(frame)
        return self._push_value(byte, buf, mv, pos, emit=True)

    def _emit_held_key(self, frame: _Frame) -> None:
        literal = bytes(frame.key)
        frame.key = bytearray()
        self._out.append((b"," + literal if frame.emitted else literal) + b":")
        frame.emitted = True

    def _close_object(self, frame: _Frame, byte: int, pos: int) -> int:
        """At the byte after an object's last member (or its ``{``): it must be ``}``."""
        if byte != _RBRACE:
            if byte == _RBRACKET:
                self._fail("mismatched ']' closing an object", pos)
            self._fail("missing ',' between object members", pos)
        if frame.kind == _TOP:
            if self._last is not None:
                self._out.append((b"," if frame.emitted else b"") + self._last + b"}")
            else:
                self._out.append(b"}")
            frame.phase = _DONE
        else:
            self._out.append(b"}")
            self._stack.pop()
        return pos + 1

    def _tools_open(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """Just after ``"tool_calls": [`` in a message: is it empty?"""
        if buf[pos] in _BLANKS:
            end = _BLANK_RUN.match(buf, pos).end()  # type: ignore[union-attr]
            room = self._limit - len(frame.blanks)
            if end - pos > room:
                self._fail("too many blanks inside a messages[].tool_calls array", pos + room)
            frame.blanks += mv[pos:end]
            if end >= n:
                return end
            pos = end
        stack = self._stack
        stack.pop()
        owner = stack[-1]
        if buf[pos] == _RBRACKET:
            owner.key = bytearray()  # the whole member goes
            return pos + 1
        self._emit_held_key(owner)
        self._out.append(b"[" + bytes(frame.blanks))
        rest = _Frame(_COMPOSITE)
        rest.closers = bytearray((_RBRACKET,))
        stack.append(rest)
        return pos

    # -- messages ----------------------------------------------------------------------------------

    def _array(self, frame: _Frame, buf: bytes, mv: memoryview, pos: int, n: int) -> int:
        """Elements of the top-level ``messages`` array, until a child frame opens."""
        out = self._out
        stack = self._stack
        depth = len(stack)
        while pos < n:
            byte = buf[pos]
            if byte in _BLANKS:
                pos = _BLANK_RUN.match(buf, pos).end()  # type: ignore[union-attr]
                continue
            phase = frame.phase
            if phase == _AFTER:
                if byte == _COMMA:
                    out.append(b",")
                    frame.phase = _VALUE
                    pos += 1
                    continue
                if byte == _RBRACKET:
                    out.append(b"]")
                    stack.pop()
                    return pos + 1
                if byte == _RBRACE:
                    self._fail("mismatched '}' closing an array", pos)
                self._fail("missing ',' between array elements", pos)
            if phase == _FIRST and byte == _RBRACKET:
                out.append(b"]")
                stack.pop()
                return pos + 1
            frame.phase = _AFTER
            if byte == _LBRACE:
                # A compact message of strings and scalars (so no tool_calls array) is already
                # in its output form.
                flat = _COMPACT_FLAT_OBJECT.match(buf, pos, min(n, pos + _FLAT_WINDOW))
                if flat is not None:
                    out.append(mv[pos : flat.end()])
                    pos = flat.end()
                    continue
                out.append(b"{")
                child = _Frame(_OBJ)
                child.key = bytearray()
                child.names = self._message_names
                stack.append(child)
                return pos + 1
            pos = self._push_value(byte, buf, mv, pos, emit=True)
            if len(stack) != depth:
                return pos
        return pos


# -- public rewriting API --------------------------------------------------------------------------


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if type(data) is bytes else bytes(data)


_UTF8_BOM: Final = b"\xef\xbb\xbf"


def as_utf8_json(body: bytes) -> bytes | None:
    """``body`` as the rewrite must read it to see what the backend will see: a UTF-8 byte
    order mark dropped (JSON parsers skip it, so a client's own priority behind one must not
    slip past the rewrite), or None for JSON in UTF-16 or UTF-32 (a byte order mark, or a NUL
    among the first bytes, as ``json.loads`` detects them), which the rewrite cannot read."""
    if body.startswith(_UTF8_BOM):
        return body[len(_UTF8_BOM) :]
    head = body[:4]
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) >= 2 and b"\x00" in head):
        return None
    return body


def rewrite(body: bytes | bytearray | memoryview, *, plan: Plan) -> bytes:
    """The whole body rewritten as ``plan`` says (the buffered path of spec 6.3).

    A plan that neither injects nor strips returns the body as it is. Raises
    :class:`BodyRewriteError` for a body the scanner refuses; nothing else for any bytes.
    """
    return _Scanner(plan).run(_as_bytes(body), final=True)


class StreamingRewriter:
    """:func:`rewrite`, fed piece by piece (the streaming path of spec 6.3).

    ``feed`` returns whatever output is settled so far, ``finish`` the rest once the body has
    ended. The concatenated results equal ``rewrite(whole_body, plan=plan)`` for any split of the
    body, and a malformed body raises :class:`BodyRewriteError` from the first call that sees the
    fault (the same error again from any later call). Apart from the chunk being processed, the
    rewriter keeps at most ``plan.buffer_limit`` bytes (plus a few short keys) of state.
    """

    __slots__ = ("_scanner",)

    def __init__(self, plan: Plan) -> None:
        self._scanner = _Scanner(plan)

    def feed(self, chunk: bytes | bytearray | memoryview) -> bytes:
        """Scan the next piece of the body; returns the output that is ready."""
        return self._scanner.run(_as_bytes(chunk), final=False)

    def finish(self) -> bytes:
        """Signal the end of the body; returns the remaining output or raises."""
        return self._scanner.run(b"", final=True)


# -- output-token intent (spec 6.4) -------------------------------------------------------------

_INT64_MAX: Final = 2**63 - 1
_DECIMAL = re.compile(r"[+-]?[0-9]+")
# What Go's strings.TrimSpace removes (unicode.IsSpace).
_GO_SPACE: Final = "".join(
    map(chr, (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F))
) + "".join(map(chr, (*range(0x2000, 0x200B), 0x205F, 0x3000)))


class _Number(str):
    """A JSON number literal, kept as written."""

    __slots__ = ()


class _Invalid:
    """A JSON value decoded only to be skipped (floats and the like)."""

    __slots__ = ()


class _Members(list[tuple[str, object]]):
    """A JSON object's members, in document order, duplicates kept."""

    __slots__ = ()


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str) -> int | None:
    """Go's ``strconv.ParseInt(text, 10, 64)``, keeping only non-negative results."""
    if _DECIMAL.fullmatch(text) is None:
        return None
    value = int(text)
    if value < 0 or value > _INT64_MAX:
        return None
    return value


def _token_value(value: object) -> int | None:
    if isinstance(value, _Number):
        return _parse_int(str(value))
    if isinstance(value, str):
        return _parse_int(value.strip(_GO_SPACE))
    return None


def output_token_intent(
    body: bytes | bytearray | memoryview,
    field_names: Sequence[str] = DEFAULT_OUTPUT_TOKEN_FIELDS,
) -> int | None:
    """The output tokens a JSON request asks for, or ``None`` (spec 6.4).

    The body must be exactly one JSON object (blanks around it allowed, nothing else after it).
    Its top-level members are taken in document order; the first whose key is in
    ``field_names`` and whose value is valid wins. Valid values are a number literal that is a
    plain non-negative integer (``100.0`` and ``1e3`` are not) and a string that holds one after
    trimming (an optional sign is allowed, as Go's ``ParseInt`` allows it). Values above 2^63 - 1
    are invalid. Malformed JSON, a non-object, or no valid member give ``None``.
    """
    fields = frozenset(field_names)
    try:
        document = json.loads(
            bytes(body).decode("utf-8", "replace"),
            parse_int=_Number,
            parse_float=lambda _literal: _Invalid(),
            parse_constant=_reject_constant,
            object_pairs_hook=_Members,
        )
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, _Members):
        return None
    for key, value in document:
        if key in fields:
            tokens = _token_value(value)
            if tokens is not None:
                return tokens
    return None
