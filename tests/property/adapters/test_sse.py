"""``guard_adapters.sse``: the semantic-TTFT scanner and the streaming-path test (spec 8.5).

* Real transcripts (``tests/fixtures/sse``, see the README there): each file is pinned by size
  and SHA-256, and for each the offset at which the first useful event completes is written out,
  with a piece of that event, as read from the file by hand.
* Hypothesis: any split of a transcript (LF, CRLF or a mix) into chunks gives the same offset;
  generated streams of not-useful events followed by a useful one give the useful one's end;
  arbitrary bytes never raise and keep the scanner's invariants.
* The rules one by one: line ends, comments and other fields, data-line prefixes, joining,
  trimming, ``[DONE]``, JSON shapes, what counts as useful in chat and Responses events.
* The 64 KiB limit: padding of comments or role-only events pushes a useful event out of reach.
* ``is_streaming_request``: ``Accept`` or ``"stream": true``, and nothing raises.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.sse import SCAN_LIMIT_BYTES, FirstUsefulEventScanner, is_streaming_request

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "sse"


class Transcript(NamedTuple):
    size: int
    sha256: str
    #: Where the first useful event's closing blank line ends; None: no useful event.
    offset: int | None
    #: Which event that is, counting every blank-line-terminated block from 1.
    ordinal: int | None
    #: A piece of that event, found nowhere else in the file.
    piece: bytes


TRANSCRIPTS: dict[str, Transcript] = {
    # Event 1 is the role-only opening chunk (content ""); event 2 holds the first token.
    "vllm-0.24-crusoe-llama3.3-70b-chat-content-usage-done.txt": Transcript(
        4011,
        "080b3cff4ea924baf71653e99d3913bf16421e3d8f59038df9342214410fe8d9",
        528,
        2,
        b'"delta":{"content":"1"}',
    ),
    "openai-chat-gpt4o-content-usage-done.txt": Transcript(
        8761,
        "e2aad469b71d1d4894ff833ea147020a9d875eb7ce644a0ff355581690a4cbfd",
        553,
        2,
        b'"delta":{"content":"I\'m"}',
    ),
    "openai-chat-gpt4o-logprobs.txt": Transcript(
        1599,
        "83b060bae42eb41c4f1edbb7c1542b954b37d9dfd1910b964ddebc9677e6ae85",
        681,
        2,
        b'"delta":{"content":"Foo"}',
    ),
    # Only refusal deltas: PIG's field list does not include refusal.
    "openai-chat-gpt4o-refusal-deltas.txt": Transcript(
        3486,
        "173417d553406f034f643e5db3f8d591fb691ebac56f5ae39a22cc7d455c5353",
        None,
        None,
        b"",
    ),
    # The opening chunk already carries a non-empty tool_calls array.
    "openai-chat-gpt4o-tool-call-single.txt": Transcript(
        3129,
        "2018feb66ae13fcf5333d61b95849decc68d3f63bd38172889367e1afb1e04f7",
        425,
        1,
        b'"tool_calls":[{"index":0,"id":"call_4XzlGBLtUe9dy3GVNV4jhq7h"',
    ),
    "openai-chat-gpt4o-tool-calls-parallel.txt": Transcript(
        7728,
        "f82268f2fefd5cfbc7eeb59c297688be2f6ca0849a6e4f17851b517310841d9b",
        658,
        2,
        b'"delta":{"tool_calls":[{"index":0,"id":"call_JMW1whyEaYG438VE1OIflxA2"',
    ),
    # Event 1 has reasoning_content "" and content null.
    "deepseek-api-chat-reasoning_content-deltas.txt": Transcript(
        67651,
        "0ff1c6baf394c3c8a68bf1169d7d9b7d612f65053da682bd9980e324cfd1eb66",
        650,
        2,
        b'"reasoning_content":"H"',
    ),
    # Two comment blocks, then two chunks with content "" and reasoning null.
    "openrouter-chat-reasoning-deltas-sse-comments.txt": Transcript(
        6038,
        "c95a5357af277d8e2a3b0828c493141400a0f9935bde6cb6ebbc27f338dfd942",
        1228,
        5,
        b'"reasoning":"This"',
    ),
    # created, in_progress and output_item.added come first.
    "openai-responses-gpt4o-function-call-args-deltas.txt": Transcript(
        4576,
        "b8bfdad05c5aa7aed56b34f3f4145a577ddeabc1f773c9155788186787e7f774",
        2094,
        4,
        b'"type":"response.function_call_arguments.delta",'
        b'"item_id":"fc_67e554a1de488191af0831d35cbe082e0794405d35281ae2",'
        b'"output_index":0,"delta":"{\\""}',
    ),
    # ... and content_part.added before the first output_text.delta.
    "openai-responses-gpt4o-output-text-deltas.txt": Transcript(
        5398,
        "d03a397c59bf48daaa8f0fdef66df4f9cc0d33acf41ca00f313f97635cce5727",
        2276,
        5,
        b'"type":"response.output_text.delta","item_id":"msg_67e554a28bec8191b56d3e2331eff88006c52f0e'
        b'511c76ed","output_index":0,"content_index":0,"delta":"The"}',
    ),
    # A reasoning item is added and done (no delta) before the function call's arguments.
    "openai-responses-streaming-usage-seqnum.txt": Transcript(
        14991,
        "e67f7baf47c19101225fae5dcffd3f9398069f8a8331c053dac6cdc559bc617c",
        7798,
        6,
        b'"type":"response.function_call_arguments.delta","sequence_number":5,',
    ),
}
NAMES = sorted(TRANSCRIPTS)
FOUND = sorted(name for name in NAMES if TRANSCRIPTS[name].offset is not None)


def transcript(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def scan(chunks: list[bytes], limit: int = SCAN_LIMIT_BYTES) -> tuple[int | None, int]:
    """Feed ``chunks``; (index of the chunk that reported the useful event, bytes scanned)."""
    scanner = FirstUsefulEventScanner(limit)
    reported = None
    for index, chunk in enumerate(chunks):
        if scanner.feed(chunk):
            assert reported is None, "reported twice"
            reported = index
        assert not (scanner.done and scanner.limit_reached)
        assert scanner.bytes_scanned <= limit
    assert scanner.done == (reported is not None)
    assert scanner.finished == (scanner.done or scanner.limit_reached)
    return reported, scanner.bytes_scanned


def completion(stream: bytes, limit: int = SCAN_LIMIT_BYTES) -> int | None:
    """The offset at which the first useful event of ``stream`` completes, fed whole."""
    scanner = FirstUsefulEventScanner(limit)
    if scanner.feed(stream):
        return scanner.bytes_scanned
    return None


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(min(cut, len(data)) for cut in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def chat(delta: object) -> bytes:
    """A chat-completions chunk as one ``data:`` event."""
    document = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(document).encode() + b"\n\n"


def responses(kind: object, delta: object) -> bytes:
    document: dict[str, object] = {"delta": delta}
    if kind is not None:
        document["type"] = kind
    return b"event: x\ndata: " + json.dumps(document).encode() + b"\n\n"


ROLE_ONLY = chat({"role": "assistant", "content": ""})
USEFUL = chat({"content": "Hi"})


# -- the real transcripts ----------------------------------------------------------------------


def test_every_shared_transcript_is_here_and_pinned() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.txt")) == NAMES
    for name, expected in TRANSCRIPTS.items():
        data = transcript(name)
        assert len(data) == expected.size, name
        assert hashlib.sha256(data).hexdigest() == expected.sha256, name


@pytest.mark.parametrize("name", NAMES)
def test_first_useful_event_of_each_transcript(name: str) -> None:
    data = transcript(name)
    expected = TRANSCRIPTS[name]
    scanner = FirstUsefulEventScanner()
    assert scanner.feed(data) == (expected.offset is not None)
    if expected.offset is None:
        assert not scanner.done
        assert not scanner.limit_reached
        assert scanner.bytes_scanned == len(data)
        return
    assert scanner.done
    assert scanner.bytes_scanned == expected.offset
    # The offset is the end of the expected event, the ordinal-th blank-line-closed block.
    events = data[: expected.offset].split(b"\n\n")
    assert events[-1] == b""
    assert len(events) - 1 == expected.ordinal
    assert data.count(expected.piece) == 1
    assert expected.piece in events[-2]


@pytest.mark.parametrize("name", FOUND)
def test_byte_by_byte_reports_on_the_closing_line_break(name: str) -> None:
    data = transcript(name)
    offset = TRANSCRIPTS[name].offset
    assert offset is not None
    reported, scanned = scan([data[i : i + 1] for i in range(min(len(data), offset + 50))])
    assert reported == offset - 1
    assert data[offset - 2 : offset] == b"\n\n"
    assert scanned == offset


def test_the_event_before_the_useful_one_is_not_enough() -> None:
    for name in FOUND:
        data = transcript(name)
        offset = TRANSCRIPTS[name].offset
        assert offset is not None
        assert completion(data[: offset - 1]) is None, name


def test_long_transcript_passes_the_limit_only_after_the_useful_event() -> None:
    data = transcript("deepseek-api-chat-reasoning_content-deltas.txt")
    assert len(data) > SCAN_LIMIT_BYTES
    scanner = FirstUsefulEventScanner()
    assert scanner.feed(data)
    assert not scanner.limit_reached
    assert not scanner.feed(data)
    assert scanner.bytes_scanned == 650


@given(name=st.sampled_from(NAMES), cuts=st.lists(st.integers(min_value=0), max_size=40))
def test_any_split_of_a_transcript_gives_the_same_offset(name: str, cuts: list[int]) -> None:
    data = transcript(name)
    cuts = [cut % (len(data) + 1) for cut in cuts]
    chunks = split(data, cuts)
    reported, scanned = scan(chunks)
    offset = TRANSCRIPTS[name].offset
    if offset is None:
        assert reported is None
        assert scanned == len(data)
        return
    assert reported is not None
    before = sum(len(chunk) for chunk in chunks[:reported])
    assert before < offset <= before + len(chunks[reported])
    assert scanned == offset


def crlf(data: bytes, pattern: list[bool]) -> tuple[bytes, list[int]]:
    """``data`` with line ``i`` ending in CRLF when ``pattern[i % len(pattern)]``; and, for each
    original offset that follows a line break, where it lands in the new text."""
    lines = data.split(b"\n")
    out = bytearray()
    landing = [0]
    for index, line in enumerate(lines[:-1]):
        out += line
        out += b"\r\n" if pattern and pattern[index % len(pattern)] else b"\n"
        landing.append(len(out))
    out += lines[-1]
    return bytes(out), landing


@pytest.mark.parametrize("name", NAMES)
def test_crlf_transcripts_give_the_same_event(name: str) -> None:
    data = transcript(name)
    converted, landing = crlf(data, [True])
    assert converted == data.replace(b"\n", b"\r\n")
    offset = TRANSCRIPTS[name].offset
    if offset is None:
        assert completion(converted) is None
        return
    lines_before = data[:offset].count(b"\n")
    assert completion(converted) == offset + lines_before == landing[lines_before]


@given(
    name=st.sampled_from(FOUND),
    pattern=st.lists(st.booleans(), min_size=1, max_size=7),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_mixed_line_ends_split_anywhere(name: str, pattern: list[bool], cuts: list[int]) -> None:
    data = transcript(name)
    converted, landing = crlf(data, pattern)
    offset = TRANSCRIPTS[name].offset
    assert offset is not None
    expected = landing[data[:offset].count(b"\n")]
    chunks = split(converted, [cut % (len(converted) + 1) for cut in cuts])
    reported, scanned = scan(chunks)
    assert reported is not None
    assert scanned == expected


# -- the rules one by one ----------------------------------------------------------------------


def test_role_only_and_empty_openers_are_not_useful() -> None:
    assert completion(ROLE_ONLY) is None
    assert completion(chat({"role": "assistant", "content": None, "refusal": None})) is None
    assert completion(chat({})) is None
    assert completion(ROLE_ONLY + USEFUL) == len(ROLE_ONLY + USEFUL)


def test_an_event_counts_only_once_its_blank_line_arrives() -> None:
    body = USEFUL[:-1]
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(body)
    assert not scanner.feed(b"\r")
    assert scanner.feed(b"\n")
    assert scanner.bytes_scanned == len(body) + 2
    # A stream that stops without the blank line gives nothing.
    assert completion(USEFUL[:-1]) is None
    assert completion(USEFUL[:-2]) is None


def test_a_lone_carriage_return_does_not_end_a_line() -> None:
    assert completion(USEFUL.replace(b"\n", b"\r")) is None
    # "\r\r\n": only one carriage return is dropped, so the line is not blank.
    assert completion(USEFUL[:-2] + b"\r\r\n") is None
    assert completion(USEFUL[:-2] + b"\n\r\n") == len(USEFUL) + 1


def test_crlf_and_lf_mix_within_one_event() -> None:
    stream = b'id: 7\r\ndata: {"choices":[{"delta":\ndata: {"content":"x"}}]}\r\n\r\n'
    assert completion(stream) == len(stream)


@pytest.mark.parametrize(
    "stream",
    [
        b': data: {"delta":"x"}\n\n',
        b':data: {"delta":"x"}\n\n',
        b'event: data: {"delta":"x"}\n\n',
        b'id: {"delta":"x"}\n\n',
        b'retry: {"delta":"x"}\n\n',
        b'DATA: {"delta":"x"}\n\n',
        b'Data: {"delta":"x"}\n\n',
        b'data {"delta":"x"}\n\n',
        b' data: {"delta":"x"}\n\n',
        b'message: {"delta":"x"}\n\n',
        b"data: [DONE]\n\n",
        b"data:[DONE]\n\n",
        b"data:  [DONE] \n\n",
        b"data:\n\n",
        b"data: \n\n",
        b"data: \ndata: \n\n",
        b"\n\n\n",
        b'data: ["not", "an", "object"]\n\n',
        b'data: "text"\n\n',
        b"data: 42\n\n",
        b"data: null\n\n",
        b'data: {"delta":"x"\n\n',
        b'data: {"delta":"x"} {}\n\n',
        b'data: {"delta":"x", "n": NaN}\n\n',
        b'data: {"delta":"x", "n": Infinity}\n\n',
        b'data: {"delta":"x", "n": -Infinity}\n\n',
        b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n",
        b"data: " + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"\n\n",
    ],
)
def test_lines_and_payloads_that_never_count(stream: bytes) -> None:
    assert completion(stream) is None
    assert completion(stream + USEFUL) == len(stream + USEFUL)


@pytest.mark.parametrize(
    "line",
    [
        b'data: {"delta":"x"}',
        b'data:{"delta":"x"}',
        b'data:  {"delta":"x"}',
        b'data:\t{"delta":"x"}',
        b'data: \t {"delta":"x"} \t ',
        b'data: {"delta":"\xff"}',
        b'data: {"delta":"x","delta":"y"}',
    ],
)
def test_data_line_prefixes_and_trimming(line: bytes) -> None:
    stream = line + b"\n\n"
    assert completion(stream) == len(stream)


def test_data_lines_are_joined_with_a_line_break() -> None:
    stream = b'data: {"choices":\ndata: [{"delta":\ndata:{"content":"x"}}]}\n\n'
    assert completion(stream) == len(stream)
    # The joint is a line break: inside a string it is a control character, so invalid JSON.
    stream = b'data: {"delta":"a\ndata: b"}\n\n'
    assert completion(stream) is None


def test_other_fields_between_data_lines_do_not_break_the_event() -> None:
    stream = (
        b'event: message\ndata: {"choices":\n: comment\nid: 3\nretry: 10\nfoo\n'
        b'data: [{"delta":{"content":"x"}}]}\n\n'
    )
    assert completion(stream) == len(stream)


def test_done_then_more_events() -> None:
    stream = b"data: [DONE]\n\n" + ROLE_ONLY + USEFUL
    assert completion(stream) == len(stream)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "content", "tool_calls"])
@pytest.mark.parametrize(
    ("value", "useful"),
    [
        ("x", True),
        (" x ", True),
        ("\u00a0", False),
        ("", False),
        (" ", False),
        ("\n\t\r ", False),
        ("\u3000\u2003", False),
        ("\x1f", True),
        ([], False),
        ([{}], True),
        ([None], True),
        ({}, False),
        ({"name": ""}, True),
        (None, False),
        (False, True),
        (True, True),
        (0, True),
        (0.0, True),
        (-1, True),
    ],
)
def test_what_makes_a_chat_delta_field_useful(field: str, value: object, useful: bool) -> None:
    event = chat({"role": "assistant", field: value})
    assert (completion(event) == len(event)) is useful


def test_function_call_delta_counts() -> None:
    event = chat({"function_call": {"name": "f", "arguments": ""}})
    assert completion(event) == len(event)
    assert completion(chat({"function_call": {}})) is None


@pytest.mark.parametrize("field", ["role", "refusal", "audio", "Content", "text", "tool_call"])
def test_other_delta_fields_do_not_count(field: str) -> None:
    assert completion(chat({field: "something"})) is None


def test_any_choice_may_carry_the_output() -> None:
    document = {
        "choices": [{"delta": {"role": "assistant"}}, {"index": 1, "delta": {"content": "x"}}]
    }
    event = b"data: " + json.dumps(document).encode() + b"\n\n"
    assert completion(event) == len(event)


@pytest.mark.parametrize(
    "document",
    [
        {"choices": {"0": {"delta": {"content": "x"}}}},
        {"choices": [{"delta": "x"}]},
        {"choices": [{"delta": ["content", "x"]}]},
        {"choices": ["x", 1, None]},
        {"choices": [{"message": {"content": "x"}}]},
        {"choices": [{"content": "x"}]},
        {"choices": None},
        {"delta": {"content": "x"}},
        {"content": "x"},
        {"text": "x"},
    ],
)
def test_shapes_that_carry_nothing(document: dict[str, object]) -> None:
    assert completion(b"data: " + json.dumps(document).encode() + b"\n\n") is None


@pytest.mark.parametrize(
    ("kind", "useful"),
    [
        (None, True),
        (7, True),
        (["response.refusal.delta"], True),
        ("response.output_text.delta", True),
        ("RESPONSE.OUTPUT_TEXT.DELTA", True),
        ("response.reasoning_summary_text.delta", True),
        ("response.reasoning_text.delta", True),
        ("response.custom_tool_call_input.delta", True),
        ("response.function_call_arguments.delta", True),
        ("response.refusal.delta", False),
        ("response.audio.transcript.delta", False),
        ("response.created", False),
        ("", False),
    ],
)
def test_responses_delta_by_type(kind: object, useful: bool) -> None:
    event = responses(kind, "The")
    assert (completion(event) == len(event)) is useful


@pytest.mark.parametrize("delta", ["", " ", "\n", None, 1, True, ["x"], {"text": "x"}])
def test_responses_delta_must_be_a_non_blank_string(delta: object) -> None:
    assert completion(responses("response.output_text.delta", delta)) is None


def test_chat_and_responses_rules_combine() -> None:
    # A non-useful choice does not stop the top-level delta from counting, and vice versa.
    document = {"type": "x.output_text", "delta": "y", "choices": [{"delta": {"role": "r"}}]}
    event = b"data: " + json.dumps(document).encode() + b"\n\n"
    assert completion(event) == len(event)
    document = {"type": "response.created", "delta": "y", "choices": [{"delta": {"content": "c"}}]}
    event = b"data: " + json.dumps(document).encode() + b"\n\n"
    assert completion(event) == len(event)


def test_after_the_useful_event_nothing_more_is_examined() -> None:
    scanner = FirstUsefulEventScanner()
    assert scanner.feed(USEFUL + USEFUL)
    assert scanner.bytes_scanned == len(USEFUL)
    assert not scanner.feed(USEFUL)
    assert not scanner.feed(b"\xff" * 100_000)
    assert scanner.bytes_scanned == len(USEFUL)
    assert scanner.done
    assert scanner.finished
    assert not scanner.limit_reached


def test_empty_chunks_change_nothing() -> None:
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(b"")
    assert scanner.bytes_scanned == 0
    assert not scanner.finished
    assert scanner.feed(USEFUL)


def test_bytearray_chunks_work_too() -> None:
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(bytearray(ROLE_ONLY[:10]))
    assert scanner.feed(bytearray(ROLE_ONLY[10:] + USEFUL))
    assert scanner.bytes_scanned == len(ROLE_ONLY + USEFUL)


# -- the scan limit ----------------------------------------------------------------------------


def padding(unit: bytes, total: int) -> bytes:
    """Whole copies of ``unit`` and one comment block, exactly ``total`` bytes of no use."""
    copies, rest = divmod(total, len(unit))
    if rest and rest < 3:
        copies -= 1
        rest += len(unit)
    tail = b":" + b"x" * (rest - 3) + b"\n\n" if rest else b""
    pad = unit * copies + tail
    assert len(pad) == total
    return pad


@pytest.mark.parametrize(
    "unit",
    [b": keep-alive\n\n", ROLE_ONLY, b"event: ping\ndata: [DONE]\n\n", b"\n", b"\r\n"],
)
def test_useful_event_beyond_the_limit_is_never_counted(unit: bytes) -> None:
    pad = padding(unit, SCAN_LIMIT_BYTES)
    for chunks in ([pad + USEFUL], [pad, USEFUL], split(pad + USEFUL, list(range(0, 70_000, 999)))):
        scanner = FirstUsefulEventScanner()
        assert not any(scanner.feed(chunk) for chunk in chunks)
        assert scanner.limit_reached
        assert scanner.finished
        assert not scanner.done
        assert scanner.bytes_scanned == SCAN_LIMIT_BYTES
        assert not scanner.feed(USEFUL)
        assert scanner.bytes_scanned == SCAN_LIMIT_BYTES


def test_a_useful_event_ending_exactly_at_the_limit_counts() -> None:
    stream = padding(ROLE_ONLY, SCAN_LIMIT_BYTES - len(USEFUL)) + USEFUL
    assert len(stream) == SCAN_LIMIT_BYTES
    assert completion(stream) == SCAN_LIMIT_BYTES
    assert completion(stream + USEFUL) == SCAN_LIMIT_BYTES
    # One byte later and its blank line is out of reach.
    late = padding(ROLE_ONLY, SCAN_LIMIT_BYTES - len(USEFUL) + 1) + USEFUL
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(late)
    assert scanner.limit_reached


def test_a_useful_event_straddling_the_limit_is_not_counted() -> None:
    long_event = chat({"content": "x" * (SCAN_LIMIT_BYTES + 10)})
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(long_event)
    assert scanner.limit_reached


def test_limit_reached_is_not_set_by_a_short_stream() -> None:
    scanner = FirstUsefulEventScanner()
    assert not scanner.feed(ROLE_ONLY * 10)
    assert not scanner.limit_reached
    assert not scanner.finished


def test_a_smaller_limit() -> None:
    assert completion(ROLE_ONLY + USEFUL, limit=len(ROLE_ONLY + USEFUL)) is not None
    scanner = FirstUsefulEventScanner(limit=len(ROLE_ONLY + USEFUL) - 1)
    assert not scanner.feed(ROLE_ONLY + USEFUL)
    assert scanner.limit_reached
    for bad in (0, -1):
        with pytest.raises(ValueError, match="limit"):
            FirstUsefulEventScanner(limit=bad)


# -- generated streams -------------------------------------------------------------------------

_NOT_USEFUL = st.sampled_from(
    [
        b": OPENROUTER PROCESSING\n\n",
        b": keep-alive\n\n",
        ROLE_ONLY,
        chat({"role": "assistant", "content": None, "reasoning_content": ""}),
        chat({"refusal": "no"}),
        chat({}),
        chat({"tool_calls": []}),
        b"data: [DONE]\n\n",
        b"data: not json\n\n",
        b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n',
        responses("response.output_text.delta", " "),
        responses("response.refusal.delta", "no"),
        b'id: 1\nretry: 5\ndata: {"choices":[]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n',
        b"\n",
    ]
)
_USEFUL = st.sampled_from(
    [
        USEFUL,
        chat({"reasoning_content": "H"}),
        chat({"reasoning": "This"}),
        chat({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}),
        chat({"content": False}),
        responses("response.output_text.delta", "The"),
        responses("response.function_call_arguments.delta", '{"'),
        responses(None, "x"),
        b'data: {"choices":\ndata: [{"delta":{"content":"x"}}]}\n\n',
    ]
)
_ANY_EVENT = st.one_of(_NOT_USEFUL, _USEFUL, st.binary(max_size=40))


@given(
    before=st.lists(_NOT_USEFUL, max_size=12),
    useful=_USEFUL,
    after=st.lists(_ANY_EVENT, max_size=5),
    use_crlf=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=15),
)
def test_generated_streams_report_the_first_useful_event(
    before: list[bytes],
    useful: bytes,
    after: list[bytes],
    use_crlf: bool,
    cuts: list[int],
) -> None:
    head = b"".join(before) + useful
    stream = head + b"".join(after)
    if use_crlf:
        head = head.replace(b"\n", b"\r\n")
        stream = stream.replace(b"\n", b"\r\n")
    reported, scanned = scan(split(stream, cuts))
    assert reported is not None
    assert scanned == len(head)


@given(
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.sampled_from(
                [
                    b"data:",
                    b"data: ",
                    b"\n",
                    b"\r\n",
                    b"\r",
                    b":",
                    b"{",
                    b"}",
                    b'"choices":[{"delta":{"content":',
                    b'"x"}}]',
                    b'"delta":"y"',
                    b"[DONE]",
                    b"\xff\xfe",
                    b"NaN",
                ]
            ),
        ),
        max_size=60,
    ),
    limit=st.sampled_from([SCAN_LIMIT_BYTES, 1, 7, 64, 300]),
)
def test_arbitrary_bytes_never_raise(chunks: list[bytes], limit: int) -> None:
    reported, scanned = scan(chunks, limit)
    total = sum(map(len, chunks))
    if reported is None:
        assert scanned == min(total, limit)
    # Fed whole, the answer is the same.
    whole = FirstUsefulEventScanner(limit)
    assert whole.feed(b"".join(chunks)) == (reported is not None)
    assert whole.bytes_scanned == scanned


# -- is_streaming_request ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "accept",
    [
        b"text/event-stream",
        b"TEXT/Event-Stream",
        b"application/json, text/event-stream;q=0.9",
        b"  text/event-stream  ",
        b"xtext/event-streamx",
    ],
)
def test_accept_with_event_stream_streams(accept: bytes) -> None:
    assert is_streaming_request(accept, None)
    assert is_streaming_request(accept, b'{"stream": false}')
    assert is_streaming_request(accept, b"\xff not json")


@pytest.mark.parametrize(
    "accept", [None, b"", b"*/*", b"application/json", b"text/event_stream", b"text/event- stream"]
)
def test_other_accept_values_do_not(accept: bytes | None) -> None:
    assert not is_streaming_request(accept, None)
    assert not is_streaming_request(accept, b'{"model":"m"}')


@pytest.mark.parametrize(
    "body",
    [
        b'{"stream": true}',
        b'{"model":"m","messages":[],"stream":true}',
        b' \r\n\t{"stream" :\ttrue } \n',
        b'{"str\\u0065am": true}',
        b'{"stream": false, "stream": true}',
        b'{"stream": true, "stream_options": {"include_usage": true}}',
        '{"stream": true, "prompt": "h\u00e9"}'.encode(),
    ],
)
def test_bodies_asking_to_stream(body: bytes) -> None:
    assert is_streaming_request(None, body)
    assert is_streaming_request(b"application/json", body)


@pytest.mark.parametrize(
    "body",
    [
        None,
        b"",
        b"true",
        b"[true]",
        b'[{"stream": true}]',
        b'{"stream": "true"}',
        b'{"stream": 1}',
        b'{"stream": false}',
        b'{"stream": null}',
        b'{"Stream": true}',
        b'{"stream": true, "stream": false}',
        b'{"extra_body": {"stream": true}}',
        b'{"stream_options": {"stream": true}}',
        b'{"stream": true',
        b'{"stream": true}}',
        b'{"stream": true, "x": NaN}',
        b'{"stream": tru}',
        b'{"stream": true, "p": "\xff"}',
        b'{"stream": true}' + b"\x00",
        b"[" * 100_000 + b"true" + b"]" * 100_000,
        b'{"a":' * 5000 + b"true" + b"}" * 5000,
    ],
)
def test_bodies_that_do_not_ask_to_stream(body: bytes | None) -> None:
    assert not is_streaming_request(None, body)


@given(
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.text(max_size=5),
        st.lists(st.booleans(), max_size=2),
    ),
    others=st.dictionaries(st.text(max_size=6), st.booleans(), max_size=4),
)
def test_stream_field_must_be_the_literal_true(value: object, others: dict[str, bool]) -> None:
    document = {**others, "stream": value}
    body = json.dumps(document).encode()
    assert is_streaming_request(None, body) is (value is True)
    assert is_streaming_request(b"text/event-stream", body)


@given(accept=st.one_of(st.none(), st.binary(max_size=60)), body=st.one_of(st.none(), st.binary()))
def test_streaming_request_never_raises(accept: bytes | None, body: bytes | None) -> None:
    result = is_streaming_request(accept, body)
    assert isinstance(result, bool)
    if accept is not None and b"text/event-stream" in accept.lower():
        assert result
