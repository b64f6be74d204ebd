"""The guard's own answers (guard_adapters.answers) and the exchange's small rules: the early
bridge, a request's framing, the early-refusal peek (guard_adapters.exchange)."""

from __future__ import annotations

import json

import h11
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.answers import (
    RefusalAnswers,
    body_refusal,
    declared_length,
    head_refusal,
    stamped,
    whole_response,
    whole_response_bytes,
    with_close,
)
from guard_adapters.exchange import (
    BRIDGE_SAFE_BODY,
    EARLY_DRAIN_BYTES,
    TOO_MANY_REQUESTS_BODY,
    framed,
    opens_bridge,
    peek_first,
)

names = st.sampled_from([b"content-type", b"x-request-id", b"X-Request-Id", b"server", b"via"])
values = st.binary(min_size=1, max_size=12).filter(lambda v: b"\r" not in v and b"\n" not in v)
header_lists = st.lists(st.tuples(names, st.sampled_from([b"a", b"b/c", b"42"])), max_size=6)


def parsed(data: bytes) -> tuple[h11.Response, bytes]:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "g")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    head = client.next_event()
    assert isinstance(head, h11.Response)
    body = b""
    while True:
        event = client.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        else:
            assert isinstance(event, h11.EndOfMessage)
            return head, body


@given(st.sampled_from([200, 400, 404, 413, 429, 504, 599]), header_lists, st.binary(max_size=64))
def test_whole_response_bytes_parse_back_to_the_answer(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    head, received = parsed(whole_response_bytes(status, headers, body))
    assert head.status_code == status
    assert received == body
    assert (b"content-length", str(len(body)).encode()) in head.headers


@given(header_lists, st.sampled_from(["", "req-1", "ig-00ff-7"]))
def test_an_answer_carries_one_request_id_the_requests(
    headers: list[tuple[bytes, bytes]], trace_id: str
) -> None:
    result = stamped(headers, trace_id)
    ids = [v for n, v in result if n.lower() == b"x-request-id"]
    if trace_id:
        assert ids == [trace_id.encode()]
    else:
        assert result == headers


@given(header_lists)
def test_with_close_says_close_once(headers: list[tuple[bytes, bytes]]) -> None:
    events = whole_response(200, [*headers, (b"connection", b"keep-alive")], b"x")
    closed = with_close(events[0])
    assert isinstance(closed, h11.Response)
    assert [v for n, v in closed.headers if n == b"connection"] == [b"close"]
    assert with_close(events[1]) is events[1]


@given(st.integers(min_value=0, max_value=10**9))
def test_declared_length(length: int) -> None:
    assert declared_length([(b"content-length", str(length).encode())]) == length
    assert declared_length([(b"transfer-encoding", b"chunked")]) is None
    assert declared_length([]) == 0
    assert declared_length([(b"content-length", b"x1")]) is None


def test_refusal_bodies_speak_in_client_terms() -> None:
    for status in (400, 408, 413, 418):
        headers, body = body_refusal(status)
        assert (b"connection", b"close") in headers
        assert json.loads(body)["error"]["code"] == status
    headers, body = head_refusal(431)
    assert (b"connection", b"close") in headers
    assert body.endswith(b"\n")


@given(st.one_of(st.none(), st.integers(min_value=1, max_value=120)), st.booleans())
def test_the_cached_429_is_the_429_with_its_id(predicted_s: int | None, predicted: bool) -> None:
    answers = RefusalAnswers(b"2", predicted=predicted)
    first = answers.whole(predicted_s, "req-9")
    assert answers.whole(predicted_s, "req-9") == first
    head, body = parsed(first)
    assert body == TOO_MANY_REQUESTS_BODY
    said = dict(head.headers)
    assert said[b"x-request-id"] == b"req-9"
    wanted = str(predicted_s).encode() if predicted and predicted_s is not None else b"2"
    assert said[b"retry-after"] == wanted
    assert RefusalAnswers(None, predicted=True).headers(predicted_s) == (
        (b"content-type", b"application/json"),
    )


@given(st.integers(min_value=0, max_value=2 * BRIDGE_SAFE_BODY), st.booleans(), st.booleans())
def test_the_bridge_opens_only_for_a_small_held_streaming_body_on_a_quiet_pool(
    size: int, streaming: bool, quiet: bool
) -> None:
    body = b'{"stream": ' + (b"true" if streaming else b"false") + b', "p": "'
    body += b"x" * max(0, size - len(body) - 2) + b'"}'
    opened = opens_bridge([], [body], quiet=quiet)
    assert opened == (quiet and streaming and len(body) < BRIDGE_SAFE_BODY)
    assert not opens_bridge([(b"accept", b"text/event-stream")], None, quiet=True)
    assert opens_bridge([(b"accept", b"text/event-stream")], [b"{}"], quiet=True)


@given(header_lists, st.sampled_from([None, b"content-length", b"transfer-encoding"]))
def test_a_request_without_framing_says_it_has_no_body(
    headers: list[tuple[bytes, bytes]], framing: bytes | None
) -> None:
    given_headers = headers if framing is None else [*headers, (framing, b"5")]
    result = framed(given_headers)
    assert result[: len(given_headers)] == given_headers
    added = result[len(given_headers) :]
    assert added == ([(b"content-length", b"0")] if framing is None else [])


@given(st.one_of(st.none(), st.integers(min_value=0, max_value=4 * EARLY_DRAIN_BYTES)))
def test_the_head_is_judged_first_only_when_the_body_is_worth_it(length: int | None) -> None:
    long = length is None or length > EARLY_DRAIN_BYTES
    assert peek_first(length, classify=False, pooled=False) == long
    assert peek_first(length, classify=True, pooled=False)
    assert not peek_first(length, classify=True, pooled=True)
