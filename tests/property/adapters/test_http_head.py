"""The fast request reader (guard_adapters.http_head) against the full one (h11 under the
guard's Downstream checks).

Properties: whatever the fast reader accepts, the full reader accepts as the same request (method,
target, headers in order, body length); on generated heads of every shape and on byte mutations of
valid ones. And the requests clients really send (an OpenAI SDK's, wrk's, curl's) are accepted, so
the fast path is the one they take.
"""

from __future__ import annotations

import h11
import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from guard_adapters.answers import RefusedRequest
from guard_adapters.http_head import read_simple_request
from guard_trio._downstream import Downstream


def _full_reader(data: bytes) -> tuple[h11.Request, int] | None:
    """What the guard's full reader makes of ``data``: the head and the body length h11 reads,
    or None when it refuses the head or the body is not whole in ``data``."""

    async def read() -> tuple[h11.Request, int] | None:
        ours, theirs = trio.testing.memory_stream_pair()
        await theirs.send_all(data)
        await theirs.aclose()
        down = Downstream(ours, "127.0.0.1")
        try:
            request = await down.next_request(5.0)
        except RefusedRequest:
            return None
        if request is None:
            return None
        size = 0
        try:
            while True:
                event = down.h11.next_event()
                if isinstance(event, h11.Data):
                    size += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return request, size
                else:
                    return None
        except h11.RemoteProtocolError:
            return None

    return trio.run(read)


def _agrees(data: bytes) -> None:
    fast = read_simple_request(data)
    if fast is None:
        return
    full = _full_reader(data)
    assert full is not None, data
    request, body = full
    assert fast.method == request.method
    assert fast.target == request.target
    assert fast.headers == tuple(request.headers)
    assert fast.body_length == body
    assert data[fast.head_end - 4 : fast.head_end] == b"\r\n\r\n"


_NAMES = st.sampled_from(
    [
        b"Host",
        b"host",
        b"HOST",
        b"Content-Length",
        b"content-length",
        b"Content_Length",
        b"Transfer-Encoding",
        b"Upgrade",
        b"Expect",
        b"Connection",
        b"X-User-Tier",
        b"X_User_Tier",
        b"X_PIG_Tier",
        b"Authorization",
        b"Accept",
        b"User-Agent",
        b"x-a_b",
        b"bad name",
        b"x:y",
        b"",
        b"\xff",
    ]
)
_VALUE_BYTES = st.sampled_from(
    [b"a", b"1", b"0", b" ", b"\t", b"\x00", b"\x80", b"\r", b"\n", b","]
)
_VALUES = st.one_of(
    st.sampled_from([b"", b"127.0.0.1", b"premium", b"12", b"012", b"-1", b"1 2", b"chunked"]),
    st.lists(_VALUE_BYTES, max_size=6).map(b"".join),
)
_LINES = st.lists(
    st.tuples(_NAMES, st.sampled_from([b":", b": ", b" :", b":\t"]), _VALUES),
    max_size=8,
)


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"POST", b"GET", b"CONNECT", b"PO ST", b"post", b""]))
    target = draw(
        st.sampled_from(
            [b"/v1/chat/completions", b"/v1/x?y=1", b"*", b"http://a/b", b"/a b", b"/\x80", b"/"]
        )
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"http/1.1"]))
    lines = draw(_LINES)
    if draw(st.booleans()):
        lines = [(b"Host", b": ", b"guard"), *lines]
    ending = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    head = method + b" " + target + b" " + version + ending
    head += b"".join(name + sep + value + ending for name, sep, value in lines)
    head += ending
    body = draw(st.binary(max_size=24))
    return head + body


@given(_requests())
@example(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
@example(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{}")
@example(b"CONNECT /x HTTP/1.1\r\nHost: x\r\n\r\n")
def test_what_the_fast_reader_accepts_the_full_reader_reads_the_same(data: bytes) -> None:
    _agrees(data)


_VALID = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Content-Type: application/json\r\nX-User-Tier: premium\r\nContent-Length: 4\r\n\r\n"
    b"{}{}"
)


@given(
    st.lists(
        st.tuples(st.integers(0, len(_VALID)), st.binary(max_size=2), st.integers(0, 2)),
        min_size=1,
        max_size=4,
    )
)
def test_mutations_of_a_valid_request_are_never_misread(
    edits: list[tuple[int, bytes, int]],
) -> None:
    data = _VALID
    for position, insert, remove in edits:
        at = min(position, len(data))
        data = data[:at] + insert + data[at + remove :]
    _agrees(data)


def test_the_requests_clients_send_take_the_fast_path() -> None:
    sdk = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Accept-Encoding: gzip, deflate\r\nAccept: application/json\r\n"
        b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.50.0\r\n"
        b"X-Stainless-Lang: python\r\nAuthorization: Bearer sk-x\r\nContent-Length: 2\r\n\r\n{}"
    )
    wrk = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:9\r\nContent-Length: 0\r\n\r\n"
    curl = (
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n"
    )
    for data in (sdk, wrk, curl):
        fast = read_simple_request(data)
        assert fast is not None
        _agrees(data)
    fast = read_simple_request(sdk)
    assert fast is not None
    assert fast.values(b"authorization") == [b"Bearer sk-x"]
    assert fast.body_length == 2
    assert sdk[fast.head_end :] == b"{}"


def test_what_needs_judgement_goes_to_the_full_reader() -> None:
    base = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    for extra in (
        b"Transfer-Encoding: chunked\r\n",
        b"Expect: 100-continue\r\n",
        b"Connection: close\r\n",
        b"Upgrade: websocket\r\n",
        b"Content-Length: 1\r\nContent-Length: 1\r\n",
        b"Host: y\r\n",
        b"X_User_Tier: premium\r\n",
        b"X-A: b\r\n c\r\n",
    ):
        assert read_simple_request(base + extra + b"\r\n") is None, extra
    assert read_simple_request(base) is None  # not whole yet
    assert read_simple_request(b"POST /x HTTP/1.0\r\nHost: x\r\n\r\n") is None
