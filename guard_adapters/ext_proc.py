"""Envoy's external processing protocol (``envoy.service.ext_proc.v3``) in the guard's terms,
sans-IO: what a message from Envoy says, and the messages the endpoint picker answers with.

Reads: serialised ``ProcessingRequest`` messages (from :class:`~guard_adapters.grpc_wire.
MessageReader`) and the picker's decisions.
Guarantees:
- :func:`read` gives the phase of a message and, for headers, the header list as the proxy
  sees one (lower-case names, byte values, ``raw_value`` preferred, pseudo-headers kept);
  a message that does not parse raises :class:`ExtProcError`;
- :func:`route_to` names the chosen backend the way the Gateway API Inference Extension's
  endpoint-picker protocol does: the ``x-gateway-destination-endpoint`` header and the same
  value under the ``envoy.lb`` dynamic metadata namespace, and it sets the request's
  ``X-Request-Id``;
- :func:`answer` is an ``ImmediateResponse``: Envoy sends that status, headers and body to the
  client and never reaches a backend (the guard's 429 keeps PIG's body and ``Retry-After``);
  its ``details`` name the guard, never an internal reason;
- :func:`carry_on` lets a phase through (a body phase unchanged, from a cache: Envoy 1.40
  ignores a processing-mode override in a body answer, so a streamed response body keeps
  coming to the picker after its first useful event, and each chunk costs only this answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import message as protobuf_message
from google.protobuf import struct_pb2

__all__ = (
    "DESTINATION_HEADER",
    "LB_NAMESPACE",
    "ExtProcError",
    "Phase",
    "Received",
    "answer",
    "carry_on",
    "read",
    "route_to",
)

#: The header and metadata key that name the endpoint Envoy sends the request to.
DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
LB_NAMESPACE: Final = "envoy.lb"
#: What Envoy logs as the reason of an answer the picker made (never shown to a client).
_DETAILS: Final = "inference_guard"

Headers = list[tuple[bytes, bytes]]


class ExtProcError(Exception):
    """A message from Envoy that is not a ``ProcessingRequest`` the picker reads."""


class Phase:
    """The ``ProcessingRequest`` phases, by their field names."""

    REQUEST_HEADERS: Final = "request_headers"
    REQUEST_BODY: Final = "request_body"
    REQUEST_TRAILERS: Final = "request_trailers"
    RESPONSE_HEADERS: Final = "response_headers"
    RESPONSE_BODY: Final = "response_body"
    RESPONSE_TRAILERS: Final = "response_trailers"


@attrs.frozen
class Received:
    """One message from Envoy: its phase, the headers (header phases), the body bytes (body
    phases) and whether it ends its direction."""

    phase: str
    headers: Headers = attrs.field(factory=list)
    body: bytes = b""
    end_of_stream: bool = False


def read(message: bytes) -> Received:
    """What one serialised ``ProcessingRequest`` says (see the module rules)."""
    request = ext_proc.ProcessingRequest()
    try:
        request.ParseFromString(message)
    except protobuf_message.DecodeError as exc:
        raise ExtProcError(f"not a ProcessingRequest: {exc}") from None
    phase = request.WhichOneof("request")
    if phase is None:
        raise ExtProcError("a ProcessingRequest without a phase")
    part: Any = getattr(request, phase)
    if phase in (Phase.REQUEST_HEADERS, Phase.RESPONSE_HEADERS):
        return Received(phase, _headers(part.headers), end_of_stream=part.end_of_stream)
    if phase in (Phase.REQUEST_BODY, Phase.RESPONSE_BODY):
        return Received(phase, body=part.body, end_of_stream=part.end_of_stream)
    return Received(phase, _headers(part.trailers), end_of_stream=True)


def _headers(header_map: Any) -> Headers:
    return [
        (header.key.lower().encode("latin-1"), header.raw_value or header.value.encode("latin-1"))
        for header in header_map.headers
    ]


def _set_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[Any]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=name.decode("latin-1"), raw_value=value),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for name, value in headers
    ]


def route_to(
    endpoint: str, headers: Sequence[tuple[bytes, bytes]] = (), *, phase: str | None = None
) -> bytes:
    """The answer that sends the request to ``endpoint`` (``host:port``) with ``headers`` set
    on it (its ``X-Request-Id``): to its headers, or (``phase`` :attr:`Phase.REQUEST_BODY`,
    when the body was needed to choose) to its buffered body, whose answer may still change
    the request's headers."""
    mutation = ext_proc.HeaderMutation(
        set_headers=_set_headers([(DESTINATION_HEADER.encode(), endpoint.encode()), *headers])
    )
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoint
    common = ext_proc.CommonResponse(header_mutation=mutation)
    if phase == Phase.REQUEST_BODY:
        response = ext_proc.ProcessingResponse(
            request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
        )
    else:
        response = ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return bytes(response.SerializeToString())


def answer(status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    """An ``ImmediateResponse``: the client gets ``status``, ``headers`` and ``body`` from Envoy."""
    response = ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(set_headers=_set_headers(headers)),
            body=body,
            details=_DETAILS,
        )
    )
    return bytes(response.SerializeToString())


_CARRY_ON: dict[str, bytes] = {}


def carry_on(phase: str, *, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """The answer that lets ``phase`` through, with ``headers`` set on it (a headers phase)."""
    cached = None if headers else _CARRY_ON.get(phase)
    if cached is not None:
        return cached
    if phase in (Phase.REQUEST_HEADERS, Phase.RESPONSE_HEADERS):
        common = ext_proc.CommonResponse()
        if headers:
            common.header_mutation.CopyFrom(
                ext_proc.HeaderMutation(set_headers=_set_headers(headers))
            )
        part: Any = ext_proc.HeadersResponse(response=common)
    elif phase in (Phase.REQUEST_BODY, Phase.RESPONSE_BODY):
        part = ext_proc.BodyResponse()
    else:
        part = ext_proc.TrailersResponse()
    encoded = bytes(ext_proc.ProcessingResponse(**{phase: part}).SerializeToString())
    if not headers:
        _CARRY_ON[phase] = encoded
    return encoded
