"""Request-body rewriting (spec 6.3), its plan table, and the output-token walk (spec 6.4)."""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import tracemalloc
from collections.abc import Iterator

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters._errors import AdapterError, BodyRewriteError, ConfigError
from guard_adapters.openai_body import (
    KIB,
    MIB,
    InjectionPolicy,
    Plan,
    PlanAction,
    StreamingRewriter,
    buffer_bucket,
    is_json_content_type,
    output_token_intent,
    plan,
    rewrite,
)
from guard_core.tier import Tier

JSON = b"application/json"
DEFAULT = InjectionPolicy()


def make_plan(
    policy: InjectionPolicy = DEFAULT,
    *,
    tier: Tier = Tier.PREMIUM,
    length: int | None = 100,
    content_type: bytes | str | None = JSON,
    slot_free: bool = True,
) -> Plan:
    return plan(
        policy, tier=tier, content_type=content_type, content_length=length, slot_free=slot_free
    )


PREMIUM = make_plan()
BASIC = make_plan(tier=Tier.BASIC)
APPEND = make_plan(InjectionPolicy(strategy="append_last", strip_empty_tool_calls=False))
APPEND_STRIP = make_plan(InjectionPolicy(strategy="append_last"))
STRIP_ONLY = make_plan(InjectionPolicy(enabled=False))
NO_STRIP = make_plan(InjectionPolicy(strip_empty_tool_calls=False))


def chunks_of(body: bytes, cuts: list[int]) -> Iterator[bytes]:
    previous = 0
    for cut in sorted(cuts):
        yield body[previous:cut]
        previous = cut
    yield body[previous:]


def streamed(body: bytes, rewrite_plan: Plan, cuts: list[int]) -> bytes:
    rewriter = StreamingRewriter(rewrite_plan)
    out = [rewriter.feed(chunk) for chunk in chunks_of(body, cuts)]
    out.append(rewriter.finish())
    return b"".join(out)


def byte_by_byte(body: bytes, rewrite_plan: Plan) -> bytes:
    return streamed(body, rewrite_plan, list(range(1, len(body))))


def check(body: bytes, rewrite_plan: Plan, expected: bytes) -> None:
    """The buffered rewrite gives ``expected``, and so do two extreme streaming splits."""
    assert rewrite(body, plan=rewrite_plan) == expected
    assert streamed(body, rewrite_plan, []) == expected
    assert byte_by_byte(body, rewrite_plan) == expected


def refused(body: bytes, rewrite_plan: Plan = PREMIUM) -> BodyRewriteError:
    with pytest.raises(BodyRewriteError) as caught:
        rewrite(body, plan=rewrite_plan)
    with pytest.raises(BodyRewriteError) as streamed_error:
        byte_by_byte(body, rewrite_plan)
    assert streamed_error.value.reason == caught.value.reason
    assert streamed_error.value.offset == caught.value.offset
    return caught.value


# -- the examples of spec 6.3 ---------------------------------------------------------------------


def test_an_empty_object_gets_only_the_priority() -> None:
    check(b"{}", PREMIUM, b'{"priority":-100}')
    check(b"{}", BASIC, b'{"priority":0}')
    check(b" \r\n\t{ \n } ", PREMIUM, b'{"priority":-100}')


def test_the_priority_is_written_first() -> None:
    out = rewrite(b'{"model":"m"}', plan=PREMIUM)
    assert out == b'{"priority":-100,"model":"m"}'
    assert len(out) == 29


def test_every_client_priority_is_dropped_duplicates_included() -> None:
    check(
        b'{"priority":-100,"model":"m","priority":-50}',
        BASIC,
        b'{"priority":0,"model":"m"}',
    )
    check(b'{"priority":{"a":[1,"}"]},"priority":"x"}', PREMIUM, b'{"priority":-100}')


@pytest.mark.parametrize(
    "key",
    [
        rb'"prior\u0069ty"',
        rb'"\u0070riority"',
        rb'"\u0070\u0072\u0069\u006F\u0072\u0069\u0074\u0079"',
    ],
)
def test_an_escaped_priority_key_is_dropped_too(key: bytes) -> None:
    check(b"{" + key + b': 5, "a": 1}', PREMIUM, b'{"priority":-100,"a":1}')


def test_keys_that_do_not_unescape_to_the_field_are_kept_as_sent() -> None:
    # \x is not a JSON escape: the key cannot be decoded, so it is not the field.
    check(rb'{"prior\x69ty":5}', PREMIUM, rb'{"priority":-100,"prior\x69ty":5}')
    check(
        rb'{"Priority":5,"priority ":6}', PREMIUM, rb'{"priority":-100,"Priority":5,"priority ":6}'
    )
    check(rb'{"a\"b":1}', PREMIUM, rb'{"priority":-100,"a\"b":1}')


def test_extra_body_priority_is_overwritten_in_place() -> None:
    body = b'{"model":"m", "extra_body": { "top_k" : 20, "priority" : 7 , "x": [1, 2] } }'
    check(
        body,
        PREMIUM,
        b'{"priority":-100,"model":"m","extra_body":{"top_k":20,"priority":-100,"x":[1, 2]}}',
    )
    check(
        b'{"extra_body":{"priority":1,"prior\\u0069ty":2}}',
        BASIC,
        b'{"priority":0,"extra_body":{"priority":0,"prior\\u0069ty":0}}',
    )


def test_extra_body_without_priority_gets_none_added() -> None:
    check(b'{"extra_body":{"top_k":20}}', PREMIUM, b'{"priority":-100,"extra_body":{"top_k":20}}')
    check(b'{"extra_body":{ }}', PREMIUM, b'{"priority":-100,"extra_body":{}}')
    # Not an object: copied as it is; a nested priority deeper down is not touched.
    check(b'{"extra_body":null }', PREMIUM, b'{"priority":-100,"extra_body":null }')
    check(
        b'{"extra_body":[{"priority":1}]}',
        PREMIUM,
        b'{"priority":-100,"extra_body":[{"priority":1}]}',
    )
    check(
        b'{"extra_body":{"sub":{"priority":1}}}',
        PREMIUM,
        b'{"priority":-100,"extra_body":{"sub":{"priority":1}}}',
    )


def test_empty_tool_calls_are_removed_from_messages() -> None:
    body = (
        b'{"messages": [ {"role": "assistant", "tool_calls": [ \n\t ], "content": "hi"},'
        b' {"tool_calls": [], "role": "user"}, {"role": "tool", "tool_calls":[]} ] }'
    )
    check(
        body,
        PREMIUM,
        b'{"priority":-100,"messages":[{"role":"assistant","content":"hi"},'
        b'{"role":"user"},{"role":"tool"}]}',
    )
    check(b'{"messages":[{"tool_calls":[]}]}', PREMIUM, b'{"priority":-100,"messages":[{}]}')
    check(
        b'{"messages":[{"tool_calls":[],"tool_calls":[ ]}]}',
        BASIC,
        b'{"priority":0,"messages":[{}]}',
    )


def test_other_tool_calls_stay() -> None:
    non_empty = b'{"messages":[{"tool_calls":[ {"id":"c"} ],"tool_calls":null}]}'
    check(
        non_empty,
        PREMIUM,
        b'{"priority":-100,"messages":[{"tool_calls":[ {"id":"c"} ],"tool_calls":null}]}',
    )
    nested = b'{"messages":[{"metadata":{"tool_calls":[]},"content":[{"tool_calls":[]}]}]}'
    check(nested, PREMIUM, b'{"priority":-100' + b"," + nested[1:])
    top = b'{"tool_calls":[],"messages":"not an array","x":{"messages":[{"tool_calls":[]}]}}'
    check(top, PREMIUM, b'{"priority":-100,' + top[1:])
    # Escaped tool_calls keys count as tool_calls, and non-object elements are copied.
    check(
        b'{"messages":[{"tool\\u005fcalls":[]}, "s", 1 , [ ], null]}',
        PREMIUM,
        b'{"priority":-100,"messages":[{},"s",1 ,[ ],null]}',
    )


def test_compact_messages() -> None:
    body = (
        b'{"messages":[{"role":"system","content":"be \\"brief\\""},{"role":"user","n":1 },'
        b'{"role":"assistant","tool_calls":[]},{"tool_calls":null},{},'
        b'{"role":"assistant","tool_calls":[{"id":"a"}],"content":null}]}'
    )
    expected = body.replace(b',"tool_calls":[]', b"")
    check(body, PREMIUM, b'{"priority":-100,' + expected[1:])
    check(body, NO_STRIP, b'{"priority":-100,' + body[1:])


def test_without_compat_cleanup_messages_are_copied() -> None:
    body = b'{"messages": [ {"tool_calls": [ ]} ] }'
    check(body, NO_STRIP, b'{"priority":-100,"messages":[ {"tool_calls": [ ]} ]}')


def test_sglang_generate_shape() -> None:
    body = (
        b'{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, '
        b'"temperature": 0}, "priority": 3, "stream": false}'
    )
    check(
        body,
        BASIC,
        b'{"priority":0,"text":"The capital of France is","sampling_params":{"max_new_tokens": 16, '
        b'"temperature": 0},"stream":false}',
    )


def test_cjk_and_other_utf8_pass_through_untouched() -> None:
    text = '"content":"你好世界。推理服务 — ünïcödé 🚀"}],"模型":"千问"}'
    body = ('{"messages":[{"role":"user",' + text).encode()
    expected = '{"priority":-100,"messages":[{"role":"user",' + text
    check(body, PREMIUM, expected.encode())


def test_strings_with_brackets_quotes_and_backslashes() -> None:
    body = (
        rb'{"a": "x\"}],{[", "b": "C:\\dir\\", "c": ["\\\"", "]}", {"d": "\\\\\"}"}],'
        rb' "e": "\u0022}", "tool_calls": []}'
    )
    check(
        body,
        PREMIUM,
        rb'{"priority":-100,"a":"x\"}],{[","b":"C:\\dir\\","c":["\\\"", "]}", {"d": "\\\\\"}"}],'
        rb'"e":"\u0022}","tool_calls":[]}',
    )
    messages = rb'{"messages":[{"content":"\"}],\"tool_calls\":[]","tool_calls":[]}]}'
    check(
        messages, PREMIUM, rb'{"priority":-100,"messages":[{"content":"\"}],\"tool_calls\":[]"}]}'
    )


def test_a_four_mib_string() -> None:
    piece = 'lorem ipsum \\" 中文 \\\\ '.encode()
    text = piece * (4 * MIB // len(piece) + 1)
    body = b'{"model":"m","messages":[{"role":"user","content":"' + text + b'","tool_calls":[]}]}'
    expected = (
        b'{"priority":-100,"model":"m","messages":[{"role":"user","content":"' + text + b'"}]}'
    )
    assert len(body) > 4 * MIB
    assert rewrite(body, plan=PREMIUM) == expected
    cuts = list(range(7919, len(body), 64 * KIB + 13))
    assert streamed(body, PREMIUM, cuts) == expected


@pytest.mark.parametrize(
    "body",
    [b"[]", b"[{}]", b"null", b"1", b'"{}"', b"true", b"", b"   \n", b"\xef\xbb\xbf{}", b"x{}"],
)
def test_non_objects_are_refused(body: bytes) -> None:
    error = refused(body)
    assert isinstance(error, AdapterError)


def test_trailing_bytes_dropped_by_field_scan_kept_by_append_last() -> None:
    body = b' {"a":1} {"b":2} garbage\n'
    check(body, PREMIUM, b'{"priority":-100,"a":1}')
    check(body, APPEND, b' {"a":1,"priority":-100} {"b":2} garbage\n')
    check(body, APPEND_STRIP, b'{"a":1,"priority":-100}')
    check(body, STRIP_ONLY, b'{"a":1}')


def test_literal_scalars_are_not_validated() -> None:
    check(b'{"a": tru}', PREMIUM, b'{"priority":-100,"a":tru}')
    check(b'{"a":1 "b":2, "c": nul }', PREMIUM, b'{"priority":-100,"a":1 "b":2,"c":nul }')
    check(b'{"a": }', PREMIUM, b'{"priority":-100,"a":}')


def test_whitespace_after_a_scalar_is_kept_and_between_tokens_dropped() -> None:
    body = b'{\n  "model" : "m" ,\n  "n" : 1 \n, "t": true\t}\n'
    check(body, PREMIUM, b'{"priority":-100,"model":"m","n":1 \n,"t":true\t}')


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{a:1}", "an object key is not a string"),
        (b'{"a":1,}', "an object key is not a string"),
        (b'{"a" 1}', "missing ':' after an object key"),
        (b'{"a":"x" "b":2}', "missing ',' between object members"),
        (b'{"a":[1,2}}', "mismatched '}'"),
        (b'{"a":{"b":1]}', "mismatched ']'"),
        (b'{"a":1]', "mismatched ']' closing an object"),
        (b'{"messages":[{"a":1}}', "mismatched '}' closing an array"),
        (b'{"messages":[{"a":1} {"b":2}]}', "missing ',' between array elements"),
        (b'{"messages":[{"a" 1}]}', "missing ':' after an object key"),
        (b'{"extra_body":{"a":"b" "c"}}', "missing ',' between object members"),
        (b'{"a":[1,2]', "the body ends before its top-level object does"),
        (b'{"a":"unterminated}', "the body ends before its top-level object does"),
        (b'{"a":1', "the body ends before its top-level object does"),
        (b"{", "the body ends before its top-level object does"),
        (b'{"messages":[{"tool_calls":[ ', "the body ends before its top-level object does"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes, reason: str) -> None:
    assert refused(body).reason == reason


def test_the_error_names_the_offset_and_pickles() -> None:
    error = refused(b'{"a":1, x}')
    assert error.offset == 8
    assert "byte 8" in str(error)
    assert refused(b'{"a":1').offset == 6
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.reason, clone.offset, str(clone)) == (error.reason, error.offset, str(error))


def test_a_failed_streaming_rewriter_stays_failed() -> None:
    rewriter = StreamingRewriter(PREMIUM)
    assert rewriter.feed(b'{"a":') == b'{"priority":-100,"a":'
    with pytest.raises(BodyRewriteError):
        rewriter.feed(b"1 2 ]")
    with pytest.raises(BodyRewriteError):
        rewriter.feed(b"}")
    with pytest.raises(BodyRewriteError):
        rewriter.finish()


def test_append_last_keeps_every_byte() -> None:
    check(b"{}", APPEND, b'{"priority":-100}')
    check(b"\n{ \n}", APPEND, b'\n{ \n"priority":-100}')
    check(b'{"a" : 1 }', APPEND, b'{"a" : 1 ,"priority":-100}')
    body = b'{ "priority": 5, "extra_body": {"priority": 7}, "messages": [{"tool_calls": []}] }'
    check(body, APPEND, body[:-1] + b',"priority":-100}')


def test_append_last_with_cleanup_writes_the_priority_last() -> None:
    body = b'{ "priority": 5, "extra_body": {"priority": 7}, "messages": [{"tool_calls": []}] } x'
    check(
        body,
        APPEND_STRIP,
        b'{"priority":5,"extra_body":{"priority": 7},"messages":[{}],"priority":-100}',
    )
    check(b" { } ", APPEND_STRIP, b'{"priority":-100}')


def test_cleanup_without_injection() -> None:
    body = b'{ "priority": 5, "extra_body": {"priority": 7}, "messages": [{"tool_calls": []}] } x'
    check(body, STRIP_ONLY, b'{"priority":5,"extra_body":{"priority": 7},"messages":[{}]}')
    check(b"{ }", STRIP_ONLY, b"{}")
    refused(b"[]", STRIP_ONLY)


def test_custom_field_and_values() -> None:
    policy = InjectionPolicy(field="qos_rank", premium_value=7, basic_value=-3)
    premium = make_plan(policy)
    basic = make_plan(policy, tier=Tier.BASIC)
    body = b'{"qos_rank":1,"priority":2,"extra_body":{"qos_rank":1,"priority":2}}'
    check(body, premium, b'{"qos_rank":7,"priority":2,"extra_body":{"qos_rank":7,"priority":2}}')
    check(body, basic, b'{"qos_rank":-3,"priority":2,"extra_body":{"qos_rank":-3,"priority":2}}')


def test_a_plan_that_neither_injects_nor_strips_passes_bytes_through() -> None:
    untouched = make_plan(InjectionPolicy(mode="premium_only"), tier=Tier.BASIC)
    for body in (b' {"priority": 1, "messages": [{"tool_calls": []}]} junk', b"not json"):
        check(body, untouched, body)


def test_bounds_on_held_state_apply_to_both_paths() -> None:
    small = attrs.evolve(PREMIUM, buffer_limit=8)
    check(b'{"messages":[{"tool_calls":[        ]}]}', small, b'{"priority":-100,"messages":[{}]}')
    error = refused(b'{"messages":[{"tool_calls":[         ]}]}', small)
    assert error.reason == "too many blanks inside a messages[].tool_calls array"
    assert error.offset == 36
    check(b'{"a":[[[[[[[[]]]]]]]]}', small, b'{"priority":-100,"a":[[[[[[[[]]]]]]]]}')
    error = refused(b'{"a":[[[[[[[[[]]]]]]]]]}', small)
    assert error.reason == "values nested deeper than the scanner buffer allows"
    assert error.offset == 13


def test_long_keys_stream_through() -> None:
    long_key = b'"' + b"k\\u0070" * 5000 + b'"'
    body = b'{"messages":[{' + long_key + b':[],"tool_calls":[]}],' + long_key + b":1}"
    expected = b'{"priority":-100,"messages":[{' + long_key + b":[]}]," + long_key + b":1}"
    check(body, PREMIUM, expected)


def test_a_31_mib_string_streams_with_bounded_memory() -> None:
    piece = b'The quick brown fox \\"jumps\\" over 34 lazy dogs. ' * 1310  # ~64 KiB
    count = 31 * MIB // len(piece)
    head = b'{"model":"m","messages":[{"role":"user","content":"'
    tail = b'"}],"max_tokens":16}'
    rewriter = StreamingRewriter(make_plan(length=len(head) + len(piece) * count + len(tail)))
    fed = emitted = 0
    tracemalloc.start()
    try:
        for chunk in (head, *([piece] * count), tail):
            fed += len(chunk)
            emitted += len(rewriter.feed(chunk)) - (16 if emitted == 0 else 0)
            # Everything but a few bytes of lookahead has come out already.
            assert fed - emitted <= 64
        emitted += len(rewriter.finish())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert emitted == fed
    assert fed > 31 * MIB - len(piece)
    assert peak < 4 * MIB


# -- the plan (spec 6.3 steps 1-9) -----------------------------------------------------------------


def test_the_default_plan_for_a_small_json_body() -> None:
    p = make_plan(length=1000)
    assert p.action == "buffered"
    assert (p.inject, p.strip, p.priority_value, p.counts, p.fail_open) == (
        True,
        True,
        -100,
        (),
        True,
    )
    assert p.buffer_limit == 4 * KIB
    assert p.reason == "safety_buffer"
    assert p.uses_slot
    assert p.outcome_counter(ok=True) == "rewritten"
    assert p.outcome_counter(ok=False) == "failed"
    assert make_plan(tier=Tier.BASIC).priority_value == 0


@pytest.mark.parametrize(
    ("length", "bucket"),
    [
        (1 * KIB, 4 * KIB),
        (0, 4 * KIB),
        (4 * KIB, 4 * KIB),
        (4 * KIB + 1, 8 * KIB),
        (64 * KIB, 64 * KIB),
        (65 * KIB, 128 * KIB),
        (2 * MIB, 2 * MIB),
        (8 * MIB, 2 * MIB),
        (None, 2 * MIB),
        (-1, 2 * MIB),
    ],
)
def test_buffer_bucketing(length: int | None, bucket: int) -> None:
    assert buffer_bucket(length, 2 * MIB) == bucket
    assert make_plan(length=length).buffer_limit == bucket


def test_bucketing_follows_the_configured_ceiling() -> None:
    assert buffer_bucket(100 * KIB, 64 * KIB) == 64 * KIB
    assert buffer_bucket(10, 1000) == 1000
    assert make_plan(InjectionPolicy(stream_buffer_bytes=MIB), length=3 * MIB).buffer_limit == MIB


@pytest.mark.parametrize(
    ("length", "action"),
    [
        (1, "buffered"),
        (2 * MIB, "buffered"),
        (2 * MIB + 1, "streaming"),
        (32 * MIB, "streaming"),
        (32 * MIB + 1, "unchanged"),
        (None, "unchanged"),
    ],
)
def test_buffered_up_to_two_mib_then_streamed_up_to_32(
    length: int | None, action: PlanAction
) -> None:
    p = make_plan(length=length)
    assert p.action == action
    if action == "unchanged":
        assert p.counts == ("skipped",)
        assert not p.uses_slot
        assert p.outcome_counter(ok=True) is None
    else:
        assert p.counts == ()


def test_premium_only_leaves_basic_bodies_byte_identical() -> None:
    policy = InjectionPolicy(mode="premium_only")
    basic = make_plan(policy, tier=Tier.BASIC, length=500)
    assert basic.action == "unchanged"
    assert basic.counts == ("skipped",)
    assert (basic.inject, basic.strip, basic.uses_slot) == (False, False, False)
    body = b'{ "messages": [ {"tool_calls": [] } ], "priority": 1 }  trailing'
    assert rewrite(body, plan=basic) == body
    premium = make_plan(policy, length=500)
    assert premium.action == "buffered"
    assert premium.inject


def test_disabled_injection() -> None:
    neither = make_plan(InjectionPolicy(enabled=False, strip_empty_tool_calls=False))
    assert (neither.action, neither.counts, neither.reason) == (
        "unchanged",
        (),
        "disabled",
    )
    strip = make_plan(InjectionPolicy(enabled=False), length=5000)
    assert (strip.action, strip.inject, strip.strip, strip.counts) == (
        "buffered",
        False,
        True,
        (),
    )
    assert strip.outcome_counter(ok=False) is None
    big = make_plan(InjectionPolicy(enabled=False), length=3 * MIB)
    assert big.action == "streaming"
    unknown = make_plan(InjectionPolicy(enabled=False), length=None)
    assert (unknown.action, unknown.counts) == ("unchanged", ())


@pytest.mark.parametrize(
    ("length", "content_type", "reason"),
    [(0, JSON, "no_body"), (100, b"text/plain", "not_json"), (0, b"text/plain", "no_body")],
)
def test_no_body_or_not_json(length: int, content_type: bytes, reason: str) -> None:
    opened = make_plan(length=length, content_type=content_type)
    assert (opened.action, opened.counts, opened.reason) == (
        "unchanged",
        ("skipped",),
        reason,
    )
    closed = make_plan(InjectionPolicy(fail_open=False), length=length, content_type=content_type)
    assert (closed.action, closed.counts) == ("reject", ("skipped",))
    strip_only = make_plan(
        InjectionPolicy(enabled=False, compat_fail_open=False),
        length=length,
        content_type=content_type,
    )
    assert (strip_only.action, strip_only.counts, strip_only.reason) == (
        "unchanged",
        (),
        reason,
    )


@pytest.mark.parametrize(
    ("content_type", "is_json"),
    [
        (None, True),
        (b"", True),
        ("", True),
        (b"application/json", True),
        (b"Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        (b"text/x-JSONish", True),
        (b"text/plain", False),
        ("multipart/form-data", False),
        (b"application/jso", False),
        ("application/\u0135son", False),
    ],
)
def test_content_type(content_type: bytes | str | None, is_json: bool) -> None:
    assert is_json_content_type(content_type) is is_json
    p = make_plan(content_type=content_type)
    assert p.action == ("buffered" if is_json else "unchanged")


def test_too_large_or_unknown_length_fail_open_and_closed() -> None:
    for length in (33 * MIB, None):
        assert make_plan(length=length).action == "unchanged"
        closed = make_plan(InjectionPolicy(fail_open=False), length=length)
        assert (closed.action, closed.counts) == ("reject", ("skipped",))


def test_separate_size_limits_for_priority_and_compat() -> None:
    compat_only = make_plan(InjectionPolicy(body_bytes=1000), length=5000)
    assert (compat_only.action, compat_only.inject, compat_only.strip, compat_only.counts) == (
        "buffered",
        False,
        True,
        ("skipped",),
    )
    assert compat_only.outcome_counter(ok=True) is None
    priority_only = make_plan(InjectionPolicy(compat_body_bytes=1000), length=5000)
    assert (priority_only.inject, priority_only.strip) == (True, False)


def test_a_busy_rewrite_slot() -> None:
    busy = make_plan(slot_free=False)
    assert (busy.action, busy.counts, busy.reason) == (
        "unchanged",
        ("skipped",),
        "slot_busy",
    )
    closed = make_plan(InjectionPolicy(fail_open=False), slot_free=False)
    assert (closed.action, closed.counts) == ("reject", ("skipped",))
    compat = make_plan(InjectionPolicy(enabled=False), slot_free=False)
    assert (compat.action, compat.counts) == ("unchanged", ())
    compat_closed = make_plan(
        InjectionPolicy(enabled=False, compat_fail_open=False), slot_free=False
    )
    assert compat_closed.action == "reject"


def test_strict_mode_buffers_everything_eligible() -> None:
    strict = make_plan(InjectionPolicy(fail_open=False), length=30 * MIB)
    assert (strict.action, strict.fail_open, strict.reason) == (
        "buffered",
        False,
        "strict",
    )
    assert strict.buffer_limit == 2 * MIB
    compat_strict = make_plan(InjectionPolicy(compat_fail_open=False), length=30 * MIB)
    assert (compat_strict.action, compat_strict.fail_open) == ("buffered", False)
    # The compat flag does not matter when cleanup is off.
    relaxed = InjectionPolicy(compat_fail_open=False, strip_empty_tool_calls=False)
    assert make_plan(relaxed, length=30 * MIB).action == "streaming"


def test_buffer_bytes_buffers_field_scan_only() -> None:
    policy = InjectionPolicy(buffer_bytes=8 * MIB)
    p = make_plan(policy, length=8 * MIB)
    assert (p.action, p.reason) == ("buffered", "buffer_bytes")
    assert make_plan(policy, length=8 * MIB + 1).action == "streaming"
    append = InjectionPolicy(buffer_bytes=8 * MIB, strategy="append_last")
    assert make_plan(append, length=4 * MIB).action == "streaming"


def test_policy_validation() -> None:
    with pytest.raises(ConfigError) as caught:
        InjectionPolicy(field="bad-name", body_bytes=0, buffer_bytes=-1, rewrite_limit=0)
    messages = caught.value.messages
    assert [m.split(":")[0] for m in messages] == [
        "BACKEND_PRIORITY_FIELD",
        "BACKEND_PRIORITY_BODY_BYTES",
        "BACKEND_PRIORITY_BUFFER_BYTES",
        "BACKEND_PRIORITY_REWRITE_LIMIT",
    ]
    with pytest.raises(ConfigError, match="BACKEND_PRIORITY_MODE"):
        InjectionPolicy(mode="some")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="BACKEND_PRIORITY_REWRITE_STRATEGY"):
        InjectionPolicy(strategy="last")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="OPENAI_COMPAT_BODY_BYTES"):
        InjectionPolicy(compat_body_bytes=0)
    # Injection settings are checked only while injection is on, compat size only with strip.
    InjectionPolicy(enabled=False, field="bad-name", body_bytes=0)
    InjectionPolicy(strip_empty_tool_calls=False, compat_body_bytes=0)


# -- properties: random documents ---------------------------------------------------------------


class Obj(tuple[tuple[str, object], ...]):
    """A decoded JSON object: its (key, value) members in order, duplicates kept."""

    __slots__ = ()


def decode(data: bytes) -> object:
    return json.loads(data, object_pairs_hook=Obj)


#: Characters that need escaping or look like JSON structure.
TRICKY = st.sampled_from('"\\/{}[],: \n\tu0aé中🚀\x00')
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.text(TRICKY, max_size=12)
)
names = (
    st.sampled_from(["priority", "messages", "extra_body", "tool_calls", "model", "n", ""])
    | st.text(TRICKY, max_size=6)
    | st.text(TRICKY, min_size=64, max_size=80)  # longer than any name of interest can be
)


def objects(values: st.SearchStrategy[object]) -> st.SearchStrategy[Obj]:
    return st.lists(st.tuples(names, values), max_size=5).map(Obj)


values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | objects(inner), max_leaves=12
)
message = st.lists(
    st.tuples(names, values)
    | st.tuples(st.just("tool_calls"), st.sampled_from([[], [Obj((("id", "c"),))], None, Obj()])),
    max_size=5,
).map(Obj)
members = st.lists(
    st.tuples(names, values)
    | st.tuples(st.just("priority"), values)
    | st.tuples(st.just("messages"), st.lists(message | values, max_size=4))
    | st.tuples(st.just("extra_body"), objects(values) | values)
    | st.tuples(
        st.just("extra_body"),
        st.lists(st.tuples(st.just("priority") | names, values), max_size=4).map(Obj),
    ),
    max_size=8,
).map(Obj)

BLANKS = ["", "", "", " ", "\n", "\t", "\r\n", "  \n  "]


def encode(value: object, rng: random.Random, *, ascii_only: bool) -> str:
    """JSON text for ``value`` with blanks sprinkled between tokens and some keys escaped.

    One document in three is compact throughout, as httpx and JSON.stringify write them.
    """
    palette = [""] if rng.random() < 1 / 3 else BLANKS

    def blank() -> str:
        return rng.choice(palette)

    def key(name: str) -> str:
        if not name or rng.random() >= 0.2:
            return json.dumps(name, ensure_ascii=ascii_only)
        escaped = (
            f"\\u{ord(c):04x}" if ord(c) < 0x10000 and rng.random() < 0.5 else json.dumps(c)[1:-1]
            for c in name
        )
        return '"' + "".join(escaped) + '"'

    def text(item: object) -> str:
        if isinstance(item, Obj):
            if not item:
                return "{" + blank() + "}"
            members = (
                blank() + key(k) + blank() + ":" + blank() + text(v) + blank() for k, v in item
            )
            return "{" + ",".join(members) + "}"
        if isinstance(item, list):
            if not item:
                return "[" + blank() + "]"
            return "[" + ",".join(blank() + text(v) + blank() for v in item) + "]"
        return json.dumps(item, ensure_ascii=ascii_only)

    return text(value)


def expected_members(document: Obj, rewrite_plan: Plan) -> Obj:
    """The document the rewrite should give, member by member."""
    value = rewrite_plan.priority_value
    out: list[tuple[str, object]] = []
    field_scan = rewrite_plan.inject and rewrite_plan.strategy == "field_scan"
    for name, original in document:
        member = original
        if field_scan and name == "priority":
            continue
        if field_scan and name == "extra_body" and isinstance(member, Obj):
            member = Obj((k, value if k == "priority" else v) for k, v in member)
        elif rewrite_plan.strip and name == "messages" and isinstance(member, list):
            member = [
                Obj((k, v) for k, v in item if not (k == "tool_calls" and v == []))
                if isinstance(item, Obj)
                else item
                for item in member
            ]
        out.append((name, member))
    if field_scan:
        out.insert(0, ("priority", value))
    elif rewrite_plan.inject:
        out.append(("priority", value))
    return Obj(out)


def same(a: object, b: object) -> bool:
    """Equality that tells objects from arrays and keeps member order."""
    if isinstance(a, Obj) or isinstance(b, Obj):
        return (
            isinstance(a, Obj)
            and isinstance(b, Obj)
            and len(a) == len(b)
            and all(ka == kb and same(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True))
        )
    if isinstance(a, list) or isinstance(b, list):
        return (
            isinstance(a, list)
            and isinstance(b, list)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


documents = st.tuples(members, st.randoms(use_true_random=False), st.booleans())
rewrite_plans = st.sampled_from([PREMIUM, BASIC, NO_STRIP, APPEND_STRIP, STRIP_ONLY])


@given(documents, rewrite_plans, st.sampled_from(["", " ", "\n\t", " trailing {]"]))
def test_rewritten_documents_parse_to_the_expected_members(
    drawn: tuple[Obj, random.Random, bool], rewrite_plan: Plan, trailer: str
) -> None:
    document, rng, ascii_only = drawn
    body = (rng.choice(BLANKS) + encode(document, rng, ascii_only=ascii_only) + trailer).encode()
    out = rewrite(body, plan=rewrite_plan)
    decoded = decode(out)
    source = decode(body.rstrip().removesuffix(b"trailing {]"))
    assert isinstance(source, Obj)
    assert same(decoded, expected_members(source, rewrite_plan))
    assert isinstance(decoded, Obj)
    if rewrite_plan.inject and rewrite_plan.strategy == "field_scan":
        assert out.startswith(b'{"priority":' + str(rewrite_plan.priority_value).encode())
        assert [k for k, _ in decoded].count("priority") == 1
    # A second pass changes nothing.
    if rewrite_plan is PREMIUM:
        assert rewrite(out, plan=PREMIUM) == out


@given(documents, rewrite_plans | st.just(APPEND), st.data())
def test_any_split_streams_to_the_same_bytes(
    drawn: tuple[Obj, random.Random, bool], rewrite_plan: Plan, data: st.DataObject
) -> None:
    document, rng, ascii_only = drawn
    body = encode(document, rng, ascii_only=ascii_only).encode() + b" \n"
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=12))
    whole = rewrite(body, plan=rewrite_plan)
    assert streamed(body, rewrite_plan, cuts) == whole
    assert byte_by_byte(body, rewrite_plan) == whole
    after_backslashes = [i + 1 for i, byte in enumerate(body) if byte == 0x5C]
    assert streamed(body, rewrite_plan, after_backslashes) == whole


@given(st.text(st.sampled_from('"\\a中'), min_size=900, max_size=5000), st.data())
def test_long_strings_dense_with_escapes(text: str, data: st.DataObject) -> None:
    # Long enough for the windowed escape pairing, whose window edges often split an escape.
    document = {"messages": [{"content": text, "tool_calls": []}], "k": [text], "e": text}
    body = json.dumps(document, ensure_ascii=False).encode()
    source = decode(body)
    assert isinstance(source, Obj)
    out = rewrite(body, plan=PREMIUM)
    assert same(decode(out), expected_members(source, PREMIUM))
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=6))
    assert streamed(body, PREMIUM, cuts) == out


@given(documents)
def test_append_last_inserts_before_the_closing_brace(
    drawn: tuple[Obj, random.Random, bool],
) -> None:
    document, rng, ascii_only = drawn
    text = encode(document, rng, ascii_only=ascii_only)
    body = (rng.choice(BLANKS) + text + rng.choice(BLANKS) + "tail").encode()
    close = body.index(text.encode()) + len(text.encode()) - 1
    inserted = (b"," if document else b"") + b'"priority":-100'
    out = rewrite(body, plan=APPEND)
    assert out == body[:close] + inserted + body[close:]


structural = st.sampled_from(list(b'{}[]",: \\\ntu0'))


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A JSON body with a few bytes inserted, removed or replaced."""
    document, rng, ascii_only = draw(documents)
    body = bytearray(encode(document, rng, ascii_only=ascii_only).encode())
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.integers(0, len(body)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        if action == "insert" or where == len(body):
            body.insert(where, draw(structural))
        elif action == "delete":
            del body[where]
        else:
            body[where] = draw(structural)
    return bytes(body)


def outcome(run: object) -> tuple[str, object]:
    assert callable(run)
    try:
        return ("ok", run())
    except BodyRewriteError as error:
        return ("error", (error.reason, error.offset))


@given(mangled() | st.binary(max_size=64), rewrite_plans | st.just(APPEND), st.data())
def test_any_bytes_give_output_or_body_rewrite_error_alike_for_every_split(
    body: bytes, rewrite_plan: Plan, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    whole = outcome(lambda: rewrite(body, plan=rewrite_plan))
    assert outcome(lambda: streamed(body, rewrite_plan, cuts)) == whole
    assert outcome(lambda: byte_by_byte(body, rewrite_plan)) == whole
    after_backslashes = [i + 1 for i, byte in enumerate(body) if byte == 0x5C]
    assert outcome(lambda: streamed(body, rewrite_plan, after_backslashes)) == whole


@given(st.binary(max_size=200), rewrite_plans)
def test_arbitrary_bytes_raise_nothing_but_body_rewrite_error(
    body: bytes, rewrite_plan: Plan
) -> None:
    with contextlib.suppress(BodyRewriteError):
        rewrite(body, plan=rewrite_plan)


# -- output-token intent (spec 6.4) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        (b'{"max_tokens": 100}', 100),
        (b'{"max_tokens": 0}', 0),
        (b'{"max_tokens": -0}', 0),
        (b' {"model":"m","max_completion_tokens":256} \n', 256),
        (b'{"max_output_tokens": "  512\\t"}', 512),
        (b'{"max_tokens": "+12"}', 12),
        (b'{"max_tokens": 100.0}', None),
        (b'{"max_tokens": 1e3}', None),
        (b'{"max_tokens": -1}', None),
        (b'{"max_tokens": "-1"}', None),
        (b'{"max_tokens": "1.5"}', None),
        (b'{"max_tokens": "1_000"}', None),
        (b'{"max_tokens": "12abc"}', None),
        (b'{"max_tokens": ""}', None),
        (b'{"max_tokens": true}', None),
        (b'{"max_tokens": null}', None),
        (b'{"max_tokens": [5]}', None),
        (b'{"max_tokens": 9223372036854775807}', 2**63 - 1),
        (b'{"max_tokens": 9223372036854775808}', None),
        (b'{"max_tokens": NaN}', None),
        (b'{"max_tokens": 100.0, "max_completion_tokens": 7}', 7),
        (b'{"max_completion_tokens": 7, "max_tokens": 9}', 7),
        (b'{"max_tokens": "x", "max_tokens": 3}', 3),
        (b'{"extra": {"max_tokens": 5}}', None),
        (b'{"max_tokens": 5} x', None),
        (b'{"max_tokens": 5}{}', None),
        (b'{"max_tokens": 5', None),
        (b'[{"max_tokens": 5}]', None),
        (b"5", None),
        (b"", None),
        (b'\xef\xbb\xbf{"max_tokens": 5}', None),
        (b'{"msg": "\xff\xfe", "max_tokens": 8}', 8),
        (b'{"max_\\u0074okens": 4}', 4),
    ],
)
def test_output_token_examples(body: bytes, tokens: int | None) -> None:
    assert output_token_intent(body) == tokens


def test_output_token_field_names() -> None:
    body = b'{"max_tokens": 10, "max_new_tokens": 20}'
    assert output_token_intent(body, ("max_new_tokens",)) == 20
    assert output_token_intent(body, ()) is None
    assert output_token_intent(bytearray(body)) == 10
    assert output_token_intent(b"[" * 100_000) is None


@given(
    st.dictionaries(st.text(max_size=5), values, max_size=5),
    st.integers(0, 2**63 - 1),
    st.booleans(),
)
def test_output_token_property(extra: dict[str, object], tokens: int, as_string: bool) -> None:
    extra.pop("max_tokens", None)
    extra.pop("max_completion_tokens", None)
    extra.pop("max_output_tokens", None)
    document = {**extra, "max_tokens": f" {tokens} " if as_string else tokens}
    body = json.dumps(document, indent=1).encode()
    assert output_token_intent(body) == tokens
    assert output_token_intent(body + b" x") is None


@given(st.binary(max_size=100))
def test_output_token_intent_never_raises(body: bytes) -> None:
    result = output_token_intent(body)
    assert result is None or result >= 0


def test_rewritten_bodies_keep_their_output_tokens() -> None:
    body = b'{"max_tokens": 64, "priority": 3, "messages": []}'
    assert output_token_intent(rewrite(body, plan=PREMIUM)) == 64
