"""gRPC's framing over HTTP/2, sans-IO: length-prefixed messages, the response heads and
trailers, and the two messages of the standard health service.

Reads: the bytes of one HTTP/2 stream's DATA frames, in order, as they arrive (split anywhere).
Guarantees:
- :class:`MessageReader` gives each whole message once, in order, whatever the split; a
  compressed message (the guard never offers compression), or one longer than ``max_bytes``,
  raises :class:`GrpcWireError` and nothing after it is read;
- :func:`frame` and :func:`trailers` write what a gRPC client reads: a 5-byte prefix (not
  compressed, big-endian length) before each message, ``grpc-status`` (and a percent-encoded
  ``grpc-message``) in the trailers;
- the health messages (``grpc.health.v1``) are read and written by hand: one optional string
  field in, one enum field out, so no generated code is needed for them.
"""

from __future__ import annotations

import enum

__all__ = (
    "GRPC_HEADERS",
    "GrpcStatus",
    "GrpcWireError",
    "HealthStatus",
    "MessageReader",
    "frame",
    "health_response",
    "health_service",
    "trailers",
)

#: The response head of every gRPC answer.
GRPC_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b":status", b"200"),
    (b"content-type", b"application/grpc+proto"),
)
#: The largest message read: an ext_proc body chunk is at most what Envoy buffers.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024


class GrpcWireError(Exception):
    """The bytes of a stream are not gRPC messages the guard reads."""


class GrpcStatus(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14
    UNIMPLEMENTED = 12


class HealthStatus(enum.IntEnum):
    """``grpc.health.v1.HealthCheckResponse.ServingStatus``."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3


class MessageReader:
    """Whole messages out of a stream's DATA bytes (see the module rules)."""

    __slots__ = ("_buffer", "_max_bytes")

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._buffer = bytearray()
        self._max_bytes = max_bytes

    def feed(self, data: bytes) -> list[bytes]:
        """The messages ``data`` completes (none while a message is still partial)."""
        buffer = self._buffer
        buffer += data
        messages: list[bytes] = []
        while len(buffer) >= 5:
            if buffer[0] != 0:
                raise GrpcWireError("compressed message (no compression was offered)")
            length = int.from_bytes(buffer[1:5], "big")
            if length > self._max_bytes:
                raise GrpcWireError(f"message of {length} bytes (at most {self._max_bytes})")
            if len(buffer) < 5 + length:
                break
            messages.append(bytes(buffer[5 : 5 + length]))
            del buffer[: 5 + length]
        return messages

    @property
    def pending(self) -> int:
        """Bytes of a partial message held."""
        return len(self._buffer)


def frame(message: bytes) -> bytes:
    """One message as it goes in DATA frames."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def trailers(status: GrpcStatus, message: str = "") -> list[tuple[bytes, bytes]]:
    """The trailers that end a gRPC answer."""
    out = [(b"grpc-status", str(int(status)).encode())]
    if message:
        out.append((b"grpc-message", _percent_encoded(message)))
    return out


def _percent_encoded(message: str) -> bytes:
    """gRPC's encoding of ``grpc-message``: printable ASCII but ``%`` as it is, the rest of the
    UTF-8 bytes as ``%XX``."""
    return b"".join(
        bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
        for byte in message.encode("utf-8")
    )


def health_service(request: bytes) -> str:
    """The ``service`` a ``HealthCheckRequest`` names ("" for the server as a whole)."""
    position = 0
    service = ""
    while position < len(request):
        key, position = _varint(request, position)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, position = _varint(request, position)
            value = request[position : position + length]
            if len(value) < length:
                raise GrpcWireError("truncated health request")
            position += length
            if field == 1:
                service = value.decode("utf-8", "replace")
        elif wire == 0:
            _, position = _varint(request, position)
        else:
            raise GrpcWireError(f"unexpected wire type {wire} in a health request")
    return service


def health_response(status: HealthStatus) -> bytes:
    """A ``HealthCheckResponse`` saying ``status``."""
    return bytes((0x08, int(status))) if status else b""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise GrpcWireError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
