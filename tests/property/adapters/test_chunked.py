"""The relay's chunked body reader, checked against h11 (the parser the rest of the guard uses).

Properties: for any split of a valid body the payload, the end and the leftover are exact; the
pieces the reader calls forwardable, with the rest re-framed, make a body h11 decodes to the
same payload; and on mutated input the reader accepts exactly what h11 accepts, with the same
payload.
"""

from __future__ import annotations

import itertools

import h11
from hypothesis import assume, given
from hypothesis import strategies as st

from guard_adapters.chunked import ChunkedBodyReader, ChunkedFramingError, frame

_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _h11_decode(body: bytes) -> tuple[bytes, bool] | None:
    """(payload, ended) as h11 reads ``body`` after a chunked head; None if h11 refuses it."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(_HEAD + body)
    payload = bytearray()
    try:
        while True:
            event = client.next_event()
            if isinstance(event, h11.Data):
                payload += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(payload), True
            elif event is h11.NEED_DATA:
                return bytes(payload), False
    except h11.RemoteProtocolError:
        return None


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@st.composite
def chunked_bodies(draw: st.DrawFn, *, trailers: bool = True) -> tuple[bytes, bytes]:
    """(encoded body, payload)."""
    chunks = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=6))
    parts = []
    for chunk in chunks:
        size = b"%x" % len(chunk)
        if draw(st.booleans()):
            size = size.upper()
        if draw(st.integers(0, 5)) == 0:
            size = b"0" + size
        if draw(st.integers(0, 5)) == 0:
            size += b";name=value"
        elif draw(st.integers(0, 8)) == 0:
            size += b" "
        parts.append(size + b"\r\n" + chunk + b"\r\n")
    parts.append(b"0\r\n")
    if trailers:
        for name in draw(st.lists(st.sampled_from([b"x-a", b"checksum"]), max_size=2)):
            parts.append(name + b": v\r\n")
    parts.append(b"\r\n")
    return b"".join(parts), b"".join(chunks)


def _read_all(pieces: list[bytes]) -> tuple[bytes, bytes, bool, bytes]:
    """(payload, relayed chunked bytes, done, leftover)."""
    reader = ChunkedBodyReader()
    payload = bytearray()
    relayed = bytearray()
    leftover = bytearray()
    for piece in pieces:
        if reader.done:  # bytes after the end come back untouched
            leftover += reader.feed(piece).leftover
            continue
        read = reader.feed(piece)
        payload += read.payload
        if read.passthrough is not None:
            relayed += read.passthrough
        elif read.payload:
            relayed += frame(read.payload)
        leftover += read.leftover
        if read.done and _h11_decode(b"0\r\n" + read.trailer) != (b"", True):
            # The relay hands the trailer section to h11, which refuses this one.
            raise ChunkedFramingError("bad trailer section")
    return bytes(payload), bytes(relayed), reader.done, bytes(leftover)


@given(chunked_bodies(), st.binary(max_size=20), st.lists(st.integers(0, 400), max_size=8))
def test_any_split_gives_the_payload_the_end_and_the_leftover(
    encoded: tuple[bytes, bytes], junk: bytes, cuts: list[int]
) -> None:
    body, expected = encoded
    payload, relayed, done, leftover = _read_all(_split(body + junk, cuts))
    assert payload == expected
    assert done
    assert leftover == junk
    # What a relay forwards (plus its own end of message) is a body h11 reads the same way.
    assert _h11_decode(relayed + b"0\r\n\r\n") == (expected, True)


@given(chunked_bodies(trailers=False), st.lists(st.integers(0, 400), max_size=8))
def test_whole_canonical_chunks_pass_through_unchanged(
    encoded: tuple[bytes, bytes], cuts: list[int]
) -> None:
    body, _ = encoded
    assume(b";" not in body and b" \r\n" not in body)
    reader = ChunkedBodyReader()
    # One piece per chunk boundary: every piece is whole chunks, so all of them pass through.
    boundaries = []
    pos = 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            break
        pos = end + 2 + size + 2
        boundaries.append(pos)
    start = 0
    for boundary in boundaries:
        read = reader.feed(body[start:boundary], want_payload=False)
        assert read.passthrough == body[start:boundary]
        assert read.payload == b""
        start = boundary
    read = reader.feed(body[start:], want_payload=False)
    assert read.done
    assert read.passthrough == b""


@given(
    chunked_bodies(),
    st.lists(st.tuples(st.integers(0, 300), st.binary(max_size=3)), min_size=1, max_size=3),
    st.lists(st.integers(0, 400), max_size=4),
)
def test_mutated_input_is_accepted_exactly_when_h11_accepts_it(
    encoded: tuple[bytes, bytes], edits: list[tuple[int, bytes]], cuts: list[int]
) -> None:
    body = bytearray(encoded[0])
    for position, replacement in edits:
        at = position % (len(body) + 1)
        body[at : at + len(replacement)] = replacement
    mutated = bytes(body)
    reference = _h11_decode(mutated)
    try:
        payload, _relayed, done, leftover = _read_all(_split(mutated, cuts))
    except ChunkedFramingError:
        assert reference is None, mutated
        return
    assert reference is not None, mutated
    h11_payload, h11_done = reference
    if done:
        # h11 stops at the end of the message too; what follows is for the next message.
        assert h11_done
        assert payload == h11_payload
        assert mutated.endswith(leftover)
    else:
        assert not h11_done
        assert payload == h11_payload


def test_bad_framing_is_refused() -> None:
    for body in (
        b"zz\r\nabc\r\n",  # not hex
        b"3\nabc\r\n",  # bare LF after the size
        b"3\r\nabcXY",  # chunk data not followed by CRLF
        b" 3\r\nabc\r\n",  # blank before the size
        b"+3\r\nabc\r\n",  # sign
        b"0x3\r\nabc\r\n",  # prefix
        b"1" * 21 + b"\r\n",  # more than 20 digits
    ):
        reader = ChunkedBodyReader()
        try:
            reader.feed(body)
        except ChunkedFramingError:
            assert _h11_decode(body) is None
        else:
            raise AssertionError(body)


def test_a_size_line_without_end_is_bounded() -> None:
    reader = ChunkedBodyReader()
    try:
        for _ in range(10):
            reader.feed(b"1" * 1000)
    except ChunkedFramingError:
        return
    raise AssertionError("an endless size line was buffered")
