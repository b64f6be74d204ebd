"""gRPC framing (guard_adapters.grpc_wire) and the ext_proc messages (guard_adapters.ext_proc)."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.ext_proc import (
    DESTINATION_HEADER,
    ExtProcError,
    Phase,
    answer,
    carry_on,
    read,
    route_to,
)
from guard_adapters.grpc_wire import (
    GrpcStatus,
    GrpcWireError,
    HealthStatus,
    MessageReader,
    frame,
    health_response,
    health_service,
    trailers,
)

messages = st.lists(st.binary(max_size=300), max_size=8)


@given(messages, st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20))
def test_messages_come_out_whole_and_in_order_however_the_bytes_are_split(
    sent: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(frame(m) for m in sent)
    reader = MessageReader()
    received: list[bytes] = []
    position = 0
    for cut in cuts * (len(data) // max(1, sum(cuts)) + 1):
        received += reader.feed(data[position : position + cut])
        position += cut
        if position >= len(data):
            break
    received += reader.feed(data[position:])
    assert received == sent
    assert reader.pending == 0


def test_compressed_or_oversized_messages_are_refused() -> None:
    with pytest.raises(GrpcWireError):
        MessageReader().feed(b"\x01\x00\x00\x00\x01x")
    with pytest.raises(GrpcWireError):
        MessageReader(max_bytes=10).feed(b"\x00\x00\x00\x00\x0b")


@given(st.text(max_size=40))
def test_health_requests_read_back_their_service(service: str) -> None:
    encoded = service.encode()
    request = bytes((0x0A,)) + _varint(len(encoded)) + encoded if encoded else b""
    assert health_service(request) == service


def test_health_responses_and_trailers() -> None:
    assert health_response(HealthStatus.SERVING) == b"\x08\x01"
    assert health_response(HealthStatus.UNKNOWN) == b""
    assert trailers(GrpcStatus.OK) == [(b"grpc-status", b"0")]
    assert trailers(GrpcStatus.NOT_FOUND, "no such service: x%") == [
        (b"grpc-status", b"5"),
        (b"grpc-message", b"no such service: x%25"),
    ]
    with pytest.raises(GrpcWireError):
        health_service(b"\x0a\x05ab")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


header_values = st.binary(min_size=0, max_size=20)


@given(st.dictionaries(st.sampled_from(["x-user-tier", "content-length", ":path"]), header_values))
def test_request_headers_read_as_the_proxy_sees_them(pairs: dict[str, bytes]) -> None:
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k.upper() if k[0] != ":" else k, raw_value=v)
            for k, v in pairs.items()
        ]
    )
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=headers))
    received = read(message.SerializeToString())
    assert received.phase == Phase.REQUEST_HEADERS
    assert received.headers == [(k.encode(), v) for k, v in pairs.items()]


def test_a_message_that_does_not_parse_is_an_error() -> None:
    with pytest.raises(ExtProcError):
        read(b"\xff\xff\xff")
    with pytest.raises(ExtProcError):
        read(b"")  # no phase


@given(st.sampled_from(["10.0.0.1:8000", "127.0.0.1:1"]), st.booleans())
def test_a_route_names_the_endpoint_in_the_header_and_the_metadata(
    endpoint: str, body_phase: bool
) -> None:
    phase = Phase.REQUEST_BODY if body_phase else None
    response = ext_proc.ProcessingResponse.FromString(
        route_to(endpoint, [(b"x-request-id", b"r-1")], phase=phase)
    )
    part = response.request_body if body_phase else response.request_headers
    said = {h.header.key: h.header.raw_value for h in part.response.header_mutation.set_headers}
    assert said == {DESTINATION_HEADER: endpoint.encode(), "x-request-id": b"r-1"}
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == endpoint


def test_an_answer_and_the_pass_through_answers() -> None:
    response = ext_proc.ProcessingResponse.FromString(
        answer(429, [(b"retry-after", b"2")], b'{"error":{}}')
    )
    assert response.immediate_response.status.code == 429
    assert response.immediate_response.body == b'{"error":{}}'
    assert response.immediate_response.details == "inference_guard"
    for phase in (Phase.REQUEST_HEADERS, Phase.RESPONSE_HEADERS, Phase.RESPONSE_BODY):
        parsed = ext_proc.ProcessingResponse.FromString(carry_on(phase))
        assert parsed.WhichOneof("response") == phase
    stamped = ext_proc.ProcessingResponse.FromString(
        carry_on(Phase.RESPONSE_HEADERS, headers=[(b"x-request-id", b"r-2")])
    )
    mutation = stamped.response_headers.response.header_mutation.set_headers
    assert [(h.header.key, h.header.raw_value) for h in mutation] == [("x-request-id", b"r-2")]
