"""The picker's gRPC server on its own, driven by grpcio's client (C core): health, an unknown
method, a refusal and a slot given back when the call is cancelled."""

from __future__ import annotations

from typing import Any

import grpc
import h2.config
import h2.connection
import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from guard_adapters.exchange import TOO_MANY_REQUESTS_BODY
from guard_adapters.grpc_wire import HealthStatus, frame, health_response
from tests.integration.envoy_rig import start_picker

HEALTH = "/grpc.health.v1.Health/Check"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def health_request(service: str) -> bytes:
    encoded = service.encode()
    return bytes((0x0A, len(encoded))) + encoded if encoded else b""


def request_headers(path: str = "/v1/chat/completions", tier: str = "basic") -> bytes:
    pairs = [(":method", "POST"), (":path", path), ("content-length", "64"), ("x-user-tier", tier)]
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=headers))
    return bytes(message.SerializeToString())


async def test_health_serves_liveness_and_readiness_and_refuses_unknown_services(
    nursery: trio.Nursery, start_sim: Any
) -> None:
    backend, _sim = await start_sim()
    _server, port, _url = await start_picker(nursery, {"UPSTREAM": backend})

    def check() -> dict[str, Any]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary(HEALTH)
            said: dict[str, Any] = {}
            for service in (
                "",
                "liveness",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
            ):
                said[service] = method(health_request(service), timeout=5)
            try:
                method(health_request("nope"), timeout=5)
            except grpc.RpcError as error:
                said["nope"] = error.code()
            try:
                channel.unary_unary("/no.Such/Method")(b"", timeout=5)
            except grpc.RpcError as error:
                said["method"] = error.code()
            return said

    said = await trio.to_thread.run_sync(check)
    serving = health_response(HealthStatus.SERVING)
    assert said[""] == said["liveness"] == said["readiness"] == serving
    assert said["envoy.service.ext_proc.v3.ExternalProcessor"] == serving
    assert said["nope"] == grpc.StatusCode.NOT_FOUND
    assert said["method"] == grpc.StatusCode.UNIMPLEMENTED


async def test_a_refusal_is_an_immediate_429_and_a_cancelled_call_gives_its_slot_back(
    nursery: trio.Nursery, start_sim: Any, until: Any
) -> None:
    backend, _sim = await start_sim()
    server, port, _url = await start_picker(
        nursery,
        {
            "UPSTREAM": backend,
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "1",
            "PIG_QUEUE_WAIT_SECONDS": "0",
        },
    )
    admitted = trio.Event()
    release = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def hold_then_cancel() -> ext_proc.ProcessingResponse:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            process = channel.stream_stream(PROCESS)

            def messages() -> Any:
                yield request_headers(tier="premium")
                trio.from_thread.run(release.wait, trio_token=token)

            answers = process(messages())
            first = ext_proc.ProcessingResponse.FromString(next(answers))
            trio.from_thread.run_sync(admitted.set, trio_token=token)
            trio.from_thread.run(release.wait, trio_token=token)
            answers.cancel()  # the HTTP request went away: Envoy resets the call
            return first

    def refused_call() -> ext_proc.ProcessingResponse:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            answers = channel.stream_stream(PROCESS)(iter([request_headers()]))
            return ext_proc.ProcessingResponse.FromString(next(answers))

    async with trio.open_nursery() as calls:
        held: list[ext_proc.ProcessingResponse] = []

        async def hold() -> None:
            held.append(await trio.to_thread.run_sync(hold_then_cancel))

        calls.start_soon(hold)
        await admitted.wait()
        assert server.engine.state.gate.inflight == 1
        refusal = await trio.to_thread.run_sync(refused_call)
        release.set()
    route = held[0].request_headers.response.header_mutation.set_headers
    assert route[0].header.key == "x-gateway-destination-endpoint"
    assert route[0].header.raw_value == backend.removeprefix("http://").encode()
    lb = held[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == backend.removeprefix("http://")
    immediate = refusal.immediate_response
    assert immediate.status.code == 429
    assert immediate.body == TOO_MANY_REQUESTS_BODY
    said = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert said["retry-after"] == b"1"
    assert said["x-request-id"]
    assert "inference" in immediate.details  # the guard's name, never an internal reason
    await until(lambda: server.engine.state.gate.inflight == 0)


async def test_calls_ended_and_reset_in_one_read_leave_the_server_serving(
    nursery: trio.Nursery, start_sim: Any, until: Any
) -> None:
    """A peer that half-closes a call and resets it in the same write (Envoy does, when the
    request ends at once): the picker's answers to the gone stream are dropped, the slot comes
    back, and the connection and the server go on."""
    backend, _sim = await start_sim()
    server, port, _url = await start_picker(
        nursery, {"UPSTREAM": backend, "DYNAMIC_PIG_ENABLED": "false", "GLOBAL_LIMIT": "8"}
    )
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    request = frame(request_headers())
    for index in range(40):
        stream_id = client.get_next_available_stream_id()
        head = [(":method", "POST"), (":scheme", "http"), (":path", PROCESS)]
        client.send_headers(stream_id, [*head, (":authority", "picker"), ("te", "trailers")])
        client.send_data(stream_id, request, end_stream=index % 2 == 0)
        client.reset_stream(stream_id)
    await stream.send_all(client.data_to_send())
    await until(lambda: server.engine.state.gate.inflight == 0)
    assert server.engine.state.requests == {}
    await stream.aclose()
    # The server still answers a whole call on a new connection.
    refusal = await trio.to_thread.run_sync(one_call, port)
    assert refusal.request_headers.response.header_mutation.set_headers


def one_call(port: int) -> ext_proc.ProcessingResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answers = channel.stream_stream(PROCESS)(iter([request_headers()]))
        return ext_proc.ProcessingResponse.FromString(next(answers))
