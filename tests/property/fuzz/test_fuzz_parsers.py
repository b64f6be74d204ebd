"""Fuzz the request-side parsers with Hypothesis (catalogue row T34, the in-process part).

The adapters' own property tests check each parser's documented format in detail; this file
throws mutated real-world bytes at them instead, seeded from tests/fixtures (OpenAI and vLLM
SSE transcripts, vLLM and SGLang metrics pages, vLLM error bodies) and from request bodies in
the shapes OpenAI clients send. Every input is bounded in size, so no example can hang.

What must hold for every input:

- the body rewriter (``plan``, ``rewrite``, ``StreamingRewriter``, ``output_token_intent``):
  ``plan`` never raises for any policy that validates; ``rewrite`` raises nothing but
  :class:`BodyRewriteError`; the streamed rewrite gives the same bytes (or the same error) for
  any split; a valid JSON object comes out as a valid JSON object whose priority field holds
  the plan's value (first and only at the top level for ``field_scan``, last for
  ``append_last``), untouched when the plan does not inject; the output-token walk returns
  ``None`` or an int in [0, 2^63 - 1];
- the SSE scanner: nothing raises, and what it reports (done, where, limit reached) does not
  depend on how the stream is split into chunks; ``is_streaming_request`` never raises and
  agrees with a strict JSON reading of the body;
- the metrics parser: nothing but :class:`MetricsParseError`; every figure finite and
  non-negative; the bytes and the text of a page read alike, and so do LF and CRLF line ends;
- tier and auth headers: ``tier_from_header_values`` is premium only for exactly one value that
  is ``premium`` after trimming blanks and lower-casing; ``ProxyApp.authorized`` (reached
  through a ``GuardServer`` built from ``load_config``, which opens no socket) accepts exactly
  one ``Authorization`` header equal to ``Bearer <TOKEN>`` and raises for no bytes at all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import assume, given
from hypothesis import strategies as st

from guard_adapters._errors import BodyRewriteError, ConfigError, MetricsParseError
from guard_adapters.config import load_config
from guard_adapters.metrics import parse_metrics
from guard_adapters.openai_body import (
    InjectionPolicy,
    Plan,
    StreamingRewriter,
    output_token_intent,
    plan,
    rewrite,
)
from guard_adapters.sse import FirstUsefulEventScanner, is_streaming_request
from guard_core.observations import BackendSample
from guard_core.tier import Tier, tier_from_header_values
from guard_trio._server import GuardServer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
INT64_MAX = 2**63 - 1


def _read(folder: str, pattern: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((FIXTURES / folder).glob(pattern))]


SSE_TRANSCRIPTS = _read("sse", "*.txt")
METRICS_PAGES = _read("metrics", "*.prom")
ERROR_BODIES = _read("errors", "*.json")

#: Request bodies in the shapes real clients send (OpenAI SDK, curl, LangChain-style extras).
REQUEST_BODIES = [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,'
    b' "stream_options": {"include_usage": true}, "max_tokens": 64}',
    b'{"model":"m","priority":7,"messages":[{"role":"assistant","content":null,'
    b'"tool_calls":[]},{"role":"tool","tool_call_id":"c1","content":"{\\"t\\":21}"}],'
    b'"extra_body":{"priority":3,"top_k":5},"max_completion_tokens":"128"}',
    b'{\n  "model": "m",\n  "prompt": "Once upon",\n  "max_tokens": 16,\n  "n": 2\n}\n',
    b'{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],'
    b'"max_output_tokens":1e3,"reasoning":{"effort":"low"}}',
    b'{"text":"raw sglang","sampling_params":{"max_new_tokens":8},"\\u0070riority":1}',
    b'{"model":"m","messages":[{"role":"user","content":"\\ud83d\\ude80 \\"q\\" \\\\"}],'
    b'"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],'
    b'"tool_choice":"required"}',
    *ERROR_BODIES,
]

#: Byte strings that matter to the parsers, spliced into the seeds.
TOKENS = [
    *(bytes([b]) for b in b'{}[]",:\\ \t\r\n0-+.eE'),
    b"true",
    b"false",
    b"null",
    b"NaN",
    b"Infinity",
    b"1e400",
    b"-0",
    b'"priority"',
    b'"priority":',
    b'"extra_body":{',
    b'"messages":[',
    b'"tool_calls":[]',
    b'"stream":true',
    b'"max_tokens":',
    b"\\u0000",
    b"\\ud800",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\xc3(",
    b"\x00",
    b"[" * 40,
    b"{" * 40,
    b"data:",
    b"data: ",
    b"data: [DONE]",
    b"\n\n",
    b"\r\n\r\n",
    b": keep-alive\n\n",
    b'{"choices":[{"delta":{"content":"x"}}]}',
    b'{"type":"response.output_text.delta","delta":"x"}',
    b"vllm:num_requests_running",
    b"vllm:time_to_first_token_seconds_bucket",
    b"sglang:num_queue_reqs",
    b'{le="',
    b'{model_name="m",le="+Inf"}',
    b" 1e308",
    b" -1",
    b" +Inf",
    b" 1_0",
    b"# TYPE x gauge\n",
]


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes], *, max_size: int = 8192) -> bytes:
    """A seed cut to at most ``max_size`` bytes, then a few splices, deletions and flips."""
    seed = draw(st.sampled_from(seeds))
    start = draw(st.integers(0, max(0, len(seed) - 1)))
    data = bytearray(seed[start : start + max_size] if start and draw(st.booleans()) else seed)
    del data[max_size:]
    for _ in range(draw(st.integers(0, 6))):
        where = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["token", "byte", "delete", "flip", "duplicate", "cut"]))
        if action == "token":
            data[where:where] = draw(st.sampled_from(TOKENS))
        elif action == "byte":
            data[where:where] = bytes([draw(st.integers(0, 255))])
        elif action == "delete":
            del data[where : where + draw(st.integers(1, 16))]
        elif action == "flip" and where < len(data):
            data[where] ^= 1 << draw(st.integers(0, 7))
        elif action == "duplicate":
            end = min(len(data), where + draw(st.integers(1, 256)))
            data[end:end] = data[where:end]
        elif action == "cut":
            del data[where:]
        del data[max_size * 2 :]
    return bytes(data)


def split(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    previous = 0
    for cut in sorted(set(cuts)):
        yield data[previous:cut]
        previous = cut
    yield data[previous:]


def cut_points(data: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(data)), max_size=12)


# -- the body rewriter ---------------------------------------------------------------------------

policies = st.builds(
    InjectionPolicy,
    enabled=st.booleans(),
    mode=st.sampled_from(["all", "premium_only"]),
    strategy=st.sampled_from(["field_scan", "append_last"]),
    field=st.sampled_from(["priority", "p", "_x9", "prio_rity"]),
    premium_value=st.integers(-(2**40), 2**40),
    basic_value=st.integers(-(2**40), 2**40),
    body_bytes=st.integers(1, 64 * 1024),
    buffer_bytes=st.integers(0, 64 * 1024),
    stream_buffer_bytes=st.integers(1, 64 * 1024),
    fail_open=st.booleans(),
    strip_empty_tool_calls=st.booleans(),
    compat_body_bytes=st.integers(1, 64 * 1024),
    compat_fail_open=st.booleans(),
)
content_types = st.none() | st.sampled_from(
    [b"", b"application/json", b"APPLICATION/JSON; charset=utf-8", b"text/plain", "x-json\xe9"]
)
tiers = st.sampled_from([Tier.BASIC, Tier.PREMIUM])


@st.composite
def rewriting_plans(draw: st.DrawFn) -> Plan:
    """A plan from ``plan()`` itself for a body it rewrites (buffered or streaming)."""
    policy = draw(policies)
    if not policy.enabled and not policy.strip_empty_tool_calls:
        policy = attrs.evolve(policy, strip_empty_tool_calls=True)
    tier = Tier.PREMIUM if policy.mode == "premium_only" else draw(tiers)
    longest = min(policy.body_bytes, policy.compat_body_bytes)
    decided = plan(
        policy,
        tier=tier,
        content_type=draw(st.sampled_from([None, b"", b"application/json"])),
        content_length=draw(st.integers(1, longest)),
    )
    assert decided.uses_slot, decided
    return decided


def outcome(run: object) -> tuple[str, object]:
    assert callable(run)
    try:
        return ("ok", run())
    except BodyRewriteError as error:
        return ("error", (error.reason, error.offset))


def streamed(body: bytes, rewrite_plan: Plan, cuts: list[int]) -> bytes:
    rewriter = StreamingRewriter(rewrite_plan)
    out = [rewriter.feed(piece) for piece in split(body, cuts)]
    out.append(rewriter.finish())
    return b"".join(out)


@given(
    policies,
    tiers,
    content_types,
    st.none() | st.integers(-(2**63), 2**63),
    st.booleans(),
)
def test_plan_never_raises_and_is_consistent(
    policy: InjectionPolicy,
    tier: Tier,
    content_type: bytes | str | None,
    length: int | None,
    slot_free: bool,
) -> None:
    decided = plan(
        policy, tier=tier, content_type=content_type, content_length=length, slot_free=slot_free
    )
    assert decided.action in ("unchanged", "buffered", "streaming", "reject")
    assert 0 < decided.buffer_limit <= policy.stream_buffer_bytes
    if decided.inject or decided.strip:
        assert decided.uses_slot
    if decided.inject:
        assert decided.priority_value == policy.value_for(tier)
        assert policy.enabled
    if decided.action == "streaming":
        assert decided.fail_open


def test_policies_that_do_not_validate_raise_config_error_only() -> None:
    with pytest.raises(ConfigError):
        InjectionPolicy(field="1bad", stream_buffer_bytes=0)


@given(
    mutated(REQUEST_BODIES) | st.binary(max_size=512),
    rewriting_plans(),
    st.data(),
)
def test_mutated_bodies_raise_only_body_rewrite_error_and_stream_alike(
    body: bytes, rewrite_plan: Plan, data: st.DataObject
) -> None:
    whole = outcome(lambda: rewrite(body, plan=rewrite_plan))
    cuts = data.draw(cut_points(body))
    assert outcome(lambda: streamed(body, rewrite_plan, cuts)) == whole
    if whole[0] == "ok" and rewrite_plan.strategy == "field_scan" and rewrite_plan.inject:
        out = whole[1]
        assert isinstance(out, bytes)
        assert out.startswith(b'{"' + rewrite_plan.field.encode() + b'":')


def _members(data: bytes) -> list[tuple[str, object]]:
    document = json.loads(data, object_pairs_hook=list)
    assert isinstance(document, list)
    return document


def _valid_object(body: bytes) -> bool:
    """One JSON object as RFC 8259 text: UTF-8 without a BOM (``json.loads`` on bytes would
    also take a BOM, UTF-16 and UTF-32, which the rewriter refuses as not an object)."""
    try:
        document = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict)


def _no_constant(name: str) -> object:
    raise ValueError(name)


@given(mutated(REQUEST_BODIES, max_size=4096), rewriting_plans(), st.data())
def test_valid_objects_come_out_valid_with_the_planned_priority(
    body: bytes, rewrite_plan: Plan, data: st.DataObject
) -> None:
    assume(_valid_object(body))
    result = outcome(lambda: rewrite(body, plan=rewrite_plan))
    if result[0] == "error":
        # A valid object is refused only for the two documented bounds on held state.
        reason = str(result[1])
        assert "deeper" in reason or "blanks" in reason, reason
        return
    out = result[1]
    assert isinstance(out, bytes)
    cuts = data.draw(cut_points(body))
    assert streamed(body, rewrite_plan, cuts) == out
    members = _members(out)
    field = rewrite_plan.field
    before = [v for k, v in _members(body) if k == field]
    after = [v for k, v in members if k == field]
    value = rewrite_plan.priority_value
    if not rewrite_plan.inject:
        assert after == before
    elif rewrite_plan.strategy == "field_scan":
        assert members[0] == (field, value)
        assert after == [value]
    else:
        assert members[-1] == (field, value)
        assert after == [*before, value]
    if rewrite_plan.strip:
        for key, messages in members:
            if key == "messages" and isinstance(messages, list):
                for message in messages:
                    if isinstance(message, list):
                        assert ("tool_calls", []) not in message


@given(
    st.sampled_from([b"[", b"{", b'{"a":['[:6]]),
    st.integers(1, 20_000),
    st.sampled_from([b"", b"]", b"}", b"1"]),
    rewriting_plans(),
)
def test_deep_nesting_is_bounded(
    opener: bytes, depth: int, closer: bytes, rewrite_plan: Plan
) -> None:
    body = b'{"x":' + opener * depth + closer * depth + b"}"
    whole = outcome(lambda: rewrite(body, plan=rewrite_plan))
    assert outcome(lambda: streamed(body, rewrite_plan, [len(body) // 2])) == whole
    tokens = output_token_intent(body)
    assert tokens is None


@given(mutated(REQUEST_BODIES) | st.binary(max_size=512))
def test_output_token_intent_never_raises(body: bytes) -> None:
    tokens = output_token_intent(body)
    assert tokens is None or (isinstance(tokens, int) and 0 <= tokens <= INT64_MAX)
    if tokens is not None:  # only ever read from one JSON object (bad UTF-8 is replaced)
        assert _valid_object(body.decode("utf-8", "replace").encode())


# -- the SSE scanner -----------------------------------------------------------------------------


def scan(stream: bytes, cuts: list[int], limit: int) -> tuple[bool, bool, int, int | None]:
    scanner = FirstUsefulEventScanner(limit)
    reported_at: int | None = None
    fed = 0
    for piece in split(stream, cuts):
        if scanner.feed(piece):
            assert reported_at is None
            reported_at = fed
        fed += len(piece)
    scanner.feed(b"more after the end\n\n")
    return scanner.done, scanner.limit_reached, scanner.bytes_scanned, reported_at


def _chunk_start(stream: bytes, cuts: list[int], offset: int) -> int:
    """The start of the piece that holds byte ``offset - 1`` for a split at ``cuts``."""
    starts = [0, *sorted(c for c in set(cuts) if 0 < c < len(stream))]
    return max(s for s in starts if s < offset) if offset else 0


@given(
    mutated(SSE_TRANSCRIPTS, max_size=16384) | st.binary(max_size=512),
    st.data(),
    st.sampled_from([65536, 1, 7, 100, 4096]),
)
def test_the_scanner_never_depends_on_chunk_splits(
    stream: bytes, data: st.DataObject, limit: int
) -> None:
    whole = scan(stream, [], limit)
    cuts = data.draw(cut_points(stream))
    done, limit_reached, scanned, reported_at = scan(stream, cuts, limit)
    assert (done, limit_reached, scanned) == whole[:3]
    assert not (done and limit_reached)
    assert scanned <= limit
    if done:
        # Reported on the piece that holds the closing line break.
        assert reported_at == _chunk_start(stream, cuts, scanned)
        assert stream[scanned - 1 : scanned] == b"\n"
    byte_by_byte = scan(stream[:2048], list(range(len(stream[:2048]))), limit)
    assert byte_by_byte[:3] == scan(stream[:2048], [], limit)[:3]


@given(st.sampled_from(SSE_TRANSCRIPTS), st.data())
def test_real_transcripts_find_their_event_for_any_split(
    stream: bytes, data: st.DataObject
) -> None:
    whole = scan(stream, [], 65536)
    assert scan(stream.replace(b"\n", b"\r\n"), [], 65536)[0] == whole[0]
    cuts = data.draw(cut_points(stream))
    assert scan(stream, cuts, 65536)[:3] == whole[:3]


accepts = st.none() | st.sampled_from(
    [b"", b"*/*", b"TEXT/EVENT-STREAM", b"application/json, text/event-stream;q=0.9", b"\xff"]
)


@given(accepts, st.none() | mutated(REQUEST_BODIES) | st.binary(max_size=256))
def test_is_streaming_request_never_raises_and_reads_strict_json(
    accept: bytes | None, body: bytes | None
) -> None:
    answer = is_streaming_request(accept, body)
    if accept and b"text/event-stream" in accept.lower():
        assert answer
        return
    try:
        document = json.loads(body or b"", parse_constant=_no_constant)
    except (ValueError, RecursionError):
        assert not answer
        return
    assert answer == (isinstance(document, dict) and document.get("stream") is True)


# -- the metrics parser --------------------------------------------------------------------------


def _sample_or_error(page: bytes | str) -> tuple[str, object]:
    try:
        return ("ok", parse_metrics(page))
    except MetricsParseError as error:
        return ("error", (error.reason, error.line_no))


def _check_figures(sample: BackendSample) -> None:
    """Every figure is a non-negative number (a sum may overflow to +inf); bounds are not NaN."""
    figures: list[float | None] = [
        sample.running,
        sample.waiting,
        sample.kv_usage,
        sample.preemptions,
        sample.generation_tokens,
        sample.generation_tps,
    ]
    if sample.ttft is not None:
        figures += [sample.ttft.count, sample.ttft.sum, *(n for _, n in sample.ttft.buckets)]
        assert not any(math.isnan(bound) for bound, _ in sample.ttft.buckets)
    for figure in figures:
        assert figure is None or figure >= 0, figure  # false for NaN too


@given(mutated(METRICS_PAGES, max_size=16384) | st.binary(max_size=512))
def test_metrics_pages_raise_only_metrics_parse_error(page: bytes) -> None:
    result = _sample_or_error(page)
    if result[0] == "ok":
        assert isinstance(result[1], BackendSample)
        _check_figures(result[1])
    try:
        text = page.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert _sample_or_error(text) == result


@given(mutated(METRICS_PAGES, max_size=16384))
def test_crlf_pages_read_like_lf_pages(page: bytes) -> None:
    assume(b"\r" not in page)
    lf = _sample_or_error(page)
    crlf = _sample_or_error(page.replace(b"\n", b"\r\n"))
    if lf[0] == "error":  # the same line is refused; its quoted text keeps the \r
        assert crlf[0] == "error"
        assert isinstance(crlf[1], tuple)
        assert isinstance(lf[1], tuple)
        assert crlf[1][1] == lf[1][1]
    else:
        assert crlf == lf


# -- tier and auth headers -----------------------------------------------------------------------

header_values = st.binary(max_size=24) | st.sampled_from(
    [b"premium", b" Premium\t", b"PREMIUM", b"premium,premium", b"premiu", b"\xa0premium", b""]
)


@given(st.lists(header_values, max_size=4))
def test_tier_is_premium_only_for_one_premium_value(values: list[bytes]) -> None:
    tier = tier_from_header_values(values)
    expected = len(values) == 1 and values[0].strip(b" \t").lower() == b"premium"
    assert (tier is Tier.PREMIUM) == expected


TOKEN = "s3cr3t-Token_42"
EXPECTED_AUTHORIZATION = b"Bearer " + TOKEN.encode()


def _authorized(environ: dict[str, str]) -> Callable[[list[tuple[bytes, bytes]]], bool]:
    """``ProxyApp.authorized`` of a guard built from ``environ`` (the engine reads trio's clock
    when it is built, hence the short ``trio.run``; nothing is bound or started)."""

    async def build() -> GuardServer:
        return GuardServer(load_config(environ))

    return trio.run(build).app.authorized


@cache
def _app_authorized() -> Callable[[list[tuple[bytes, bytes]]], bool]:
    return _authorized({"UPSTREAM": "http://127.0.0.1:9", "TOKEN": TOKEN})


authorization_values = (
    st.binary(max_size=64)
    | st.binary(min_size=4096, max_size=70_000).map(lambda b: EXPECTED_AUTHORIZATION + b)
    | st.sampled_from(
        [
            EXPECTED_AUTHORIZATION,
            b"bearer " + TOKEN.encode(),
            b"Bearer  " + TOKEN.encode(),
            b"Bearer " + TOKEN.encode() + b" ",
            b"Bearer " + TOKEN[:-1].encode(),
            b"Basic " + TOKEN.encode(),
            b"Bearer ",
            b"Bearer " + TOKEN.encode() + b"\xff",
            b"\x80\xff" * 8,
            TOKEN.encode(),
        ]
    )
)
other_headers = st.lists(
    st.tuples(st.sampled_from([b"host", b"x-user-tier", b"proxy-authorization"]), header_values),
    max_size=3,
)


@given(st.lists(authorization_values, max_size=3), other_headers, st.randoms())
def test_authorized_accepts_exactly_one_exact_bearer_header(
    values: list[bytes], others: list[tuple[bytes, bytes]], rng: object
) -> None:
    headers = [(b"authorization", value) for value in values] + others
    rng.shuffle(headers)  # type: ignore[attr-defined]
    authorized = _app_authorized()
    expected = len(values) == 1 and values[0] == EXPECTED_AUTHORIZATION
    assert authorized(headers) is expected


def test_no_token_configured_authorizes_nothing() -> None:
    authorized = _authorized({"UPSTREAM": "http://127.0.0.1:9"})
    assert not authorized([(b"authorization", b"Bearer ")])
    assert not authorized([(b"authorization", b"Bearer None")])
    assert not authorized([])
