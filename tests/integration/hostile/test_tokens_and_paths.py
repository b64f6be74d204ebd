"""Token checks (T35) and the forward-path rules (T37) of ../shared/spec/reliability.md.

T35: every protected route (``/pig/metrics``, ``/v1/metrics``, ``/v1/upstream-status``,
``/v1/attestation/report`` and a generation route with API auth on) answers every wrong
``Authorization`` variant with the same 401, byte for byte, without the token or anything
internal in it or in the logs; the right token passes.

T37: no request target may make the guard's checks see one path while the backend receives
another. With ``PIG_FORWARD_PATHS`` set, nothing outside it (admin routes of vLLM/SGLang, their
encoded, dot-segment, case and absolute-form variants) reaches the backend, and the allowed
routes still pass. With the default (every path forwarded, as PIG), the ambiguous variants are
still refused, and whatever is forwarded is, even for a lenient backend that decodes twice,
folds case, merges slashes and resolves dot segments, never a protected generation route.
"""

from __future__ import annotations

import logging
import posixpath
import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import h11
import pytest
import trio

from tests.integration.hostile.conftest import CountingUpstream, raw_exchange

TOKEN = "s3cret-Token-0123456789"
CHAT = "/v1/chat/completions"
PROTECTED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
CHAT_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


# -- a backend that answers 200 to anything and remembers every target --------------------------


def echo_backend(targets: list[bytes]) -> Callable[[trio.SocketStream, CountingUpstream], Any]:
    async def script(stream: trio.SocketStream, upstream: CountingUpstream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                upstream.requests += 1
                targets.append(bytes(event.target))
            elif isinstance(event, h11.EndOfMessage):
                body = b'{"ok":true}'
                out = conn.send(
                    h11.Response(
                        status_code=200,
                        headers=[
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    )
                )
                out = (out or b"") + (conn.send(h11.Data(data=body)) or b"")
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return

    return script


def parse(data: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The first response in ``data``: status, headers (lower-cased names, in order), body."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    length = next((int(v) for n, v in headers if n == b"content-length"), len(rest))
    return status, headers, rest[:length]


def raw_request(
    method: bytes, target: bytes, headers: list[bytes], body: bytes = b"", host: bytes = b"guard"
) -> bytes:
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: " + host, *headers]
    if body or method == b"POST":
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# -- T35 -----------------------------------------------------------------------------------------


WRONG_AUTH: dict[str, list[bytes]] = {
    "no header": [],
    "Basic scheme": [b"Authorization: Basic czNjcmV0OnBhc3N3b3Jk"],
    "lowercase bearer": [b"Authorization: bearer " + TOKEN.encode()],
    "two spaces inside": [b"Authorization: Bearer  " + TOKEN.encode()],
    "tab inside": [b"Authorization: Bearer\t" + TOKEN.encode()],
    "scheme only": [b"Authorization: Bearer"],
    "empty token": [b"Authorization: Bearer "],
    "empty header": [b"Authorization:"],
    "right prefix, wrong token": [b"Authorization: Bearer " + TOKEN.encode()[:-1]],
    "right token plus a byte": [b"Authorization: Bearer " + TOKEN.encode() + b"x"],
    "bytes 0x80-0xff": [b"Authorization: Bearer " + bytes(range(0x80, 0x100))],
    "token then 0xff": [b"Authorization: Bearer " + TOKEN.encode() + b"\xff"],
    "two headers, both right": [
        b"Authorization: Bearer " + TOKEN.encode(),
        b"Authorization: Bearer " + TOKEN.encode(),
    ],
    "two headers, one right": [
        b"Authorization: Bearer nope",
        b"Authorization: Bearer " + TOKEN.encode(),
    ],
    "8 KiB token": [b"Authorization: Bearer " + b"A" * 8192],
}
RIGHT = [b"Authorization: Bearer " + TOKEN.encode()]


class _Report:
    """Stands in for the attestation handler: the test is about the check in front of it."""

    async def report(self, *, method: bytes, query: str) -> tuple[int, list[Any], bytes]:
        return 200, [(b"content-type", b"application/json")], b'{"report":"stub"}'


async def test_t35_every_wrong_token_gets_the_same_401(
    start_sim: Any, start_guard: Any, figure: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sim, _ = await start_sim()
    base, server = await start_guard(
        {"UPSTREAM": sim, "TOKEN": TOKEN, "DYNAMIC_PIG_ENABLED": "false"}
    )
    server.app.attestation = _Report()
    assert server.app.routes.api_auth
    routes = [
        (b"GET", b"/pig/metrics", b""),
        (b"GET", b"/v1/metrics", b""),
        (b"GET", b"/v1/upstream-status", b""),
        (b"GET", b"/v1/attestation/report", b""),
        (b"POST", b"/v1/attestation/report", b""),  # auth comes before the method check
        (b"POST", CHAT.encode(), CHAT_BODY),
    ]
    slowest = 0.0
    for method, path, body in routes:
        seen: dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]] = {}
        for case, auth in WRONG_AUTH.items():
            started = time.perf_counter()
            result = await raw_exchange(base, raw_request(method, path, auth, body), quiet_s=2.0)
            slowest = max(slowest, time.perf_counter() - started)
            assert result.data, (path, case)
            status, headers, reply = parse(result.data)
            # Each answer names its own request; everything else must be the same bytes.
            assert len([v for n, v in headers if n == b"x-request-id"]) == 1, (path, case)
            seen[case] = (status, [(n, v) for n, v in headers if n != b"x-request-id"], reply)
            assert status == 401, (path, case, result.data[:200])
            assert TOKEN.encode() not in result.data
        first = seen["no header"]
        different = [case for case, reply in seen.items() if reply != first]
        assert not different, (path, different, first)
        _status, _headers, reply = first
        assert reply in (
            b"unauthorized\n",
            b'{"error":{"message":"Invalid or missing Authorization header",'
            b'"type":"AuthenticationError","param":null,"code":401}}\n',
        )
        right = parse((await raw_exchange(base, raw_request(method, path, RIGHT, body))).data)
        expected = 405 if (method, path) == (b"POST", b"/v1/attestation/report") else 200
        assert right[0] == expected, (path, right)
        assert TOKEN.encode() not in right[2]
        figure(
            "T35",
            f"{method.decode()} {path.decode()}",
            f"{len(WRONG_AUTH)} wrong variants: one 401 shape; right token {right[0]}",
            "byte-identical 401s; right token 200",
        )
    # Optional whitespace around a field value is not part of it (RFC 9110 5.5).
    spaced = [b"Authorization:   Bearer " + TOKEN.encode() + b"  "]
    assert (
        parse((await raw_exchange(base, raw_request(b"GET", b"/pig/metrics", spaced))).data)[0]
        == 200
    )
    # A token too long for the head limit is refused before routing.
    huge = [b"Authorization: Bearer " + b"A" * 20_000]
    big = await raw_exchange(base, raw_request(b"GET", b"/pig/metrics", huge))
    assert big.status == 431
    assert TOKEN not in caplog.text
    assert "A" * 1000 not in caplog.text
    figure("T35", "20 KB token", f"{big.status}", "1 MB token gets 431")
    figure("T35", "slowest 401", f"{slowest * 1000:.1f} ms", "no 500, token never echoed")


async def test_t35_digest_comparison_takes_any_bytes() -> None:
    """The comparison itself: every byte value and length, no exception, only the exact token."""
    from guard_adapters.config import load_config
    from guard_trio._proxy import ProxyApp
    from guard_trio._server import GuardServer

    server = GuardServer(load_config({"TOKEN": TOKEN, "LISTEN": "127.0.0.1:0"}))
    app: ProxyApp = server.app
    rng = random.Random(35)
    for _ in range(300):
        value = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        assert not app.authorized([(b"authorization", value)])
    assert app.authorized([(b"authorization", b"Bearer " + TOKEN.encode())])
    assert not app.authorized([(b"authorization", b"Bearer " + TOKEN.encode() + b"\x00")])
    no_token = GuardServer(load_config({"LISTEN": "127.0.0.1:0"})).app
    assert not no_token.authorized([(b"authorization", b"Bearer ")])
    assert not no_token.authorized([(b"authorization", b"Bearer")])


# -- T37 -----------------------------------------------------------------------------------------

ADMIN_ROUTES = (
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/scale_elastic_ep",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/health",
    "/load",
    "/ping",
    "/version",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
#: Targets a backend could read as another path than the guard: refused in every mode.
AMBIGUOUS = (
    "//v1/../sleep",
    "/v1/../sleep",
    "/v1/%2e%2e/sleep",
    "/v1/%2E%2E/sleep",
    "/%2e%2e/sleep",
    "/./sleep",
    "/v1/./chat/completions",
    "/v1/chat/completions/..;/sleep",
    "/v1/chat/completions/../../sleep",
    "/v1/chat/completions%2f..%2f..%2fsleep",
    "/v1/models/../../sleep",
    "/v1/models%2F..%2F..%2Fsleep",
    "/v1/..%2fsleep",
    "/v1%2f..%2fsleep",
    "/v1/%252e%252e/sleep",
    "/v1\\..\\sleep",
    "/sleep%00",
    "/v1/chat/completions%00",
    "/sleep%20",
    "/sleep;jsessionid=1",
    "/v1/chat/completions;x",
    "/sleep#frag",
    "/v1/models#/../../sleep",
    "/sleep%3F",
    "//v1/chat/completions",
    "/v1//chat/completions",
    "/v1/chat%2Fcompletions",
    "/%ff/sleep",
    "/V1/chat/completions",
    "/v1/Chat/Completions",
    "/v1/chat/completions/",
    "/V1/CHAT/COMPLETIONS/",
    "/PIG/metrics",
    "/healthz/",
    "*",
    "sleep",
)


def lenient(target: bytes) -> str:
    """The path a very lenient backend could make of ``target``: absolute form dropped,
    fragment and ``;`` params cut, decoded twice, backslashes as slashes, slashes merged, dot
    segments resolved, case folded, trailing slash dropped."""
    text = target.decode("latin-1")
    if "://" in text:
        text = "/" + text.split("://", 1)[1].partition("/")[2]
    text = text.partition("?")[0].partition("#")[0]
    text = unquote(unquote(text))
    text = text.partition("#")[0].partition("?")[0].replace("\\", "/")
    text = "/".join(segment.partition(";")[0] for segment in text.split("/"))
    text = text.replace("\x00", "").strip()
    text = posixpath.normpath("/" + text)
    return text.lower().rstrip("/") or "/"


async def _send(base: str, method: str, target: str, auth: bool, body: bytes = b"") -> Any:
    headers = RIGHT if auth else []
    data = raw_request(method.encode(), target.encode("latin-1"), headers, body)
    started = time.perf_counter()
    result = await raw_exchange(base, data, quiet_s=2.0)
    return result, time.perf_counter() - started


async def test_t37_allowlist_forwards_nothing_else(
    start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    targets: list[bytes] = []
    upstream = await start_upstream(echo_backend(targets))
    port = upstream.base.rsplit(":", 1)[1]
    base, _server = await start_guard(
        {
            "UPSTREAM": upstream.base,
            "TOKEN": TOKEN,
            "DYNAMIC_PIG_ENABLED": "false",
            "PIG_FORWARD_PATHS": "/v1/models",
        }
    )
    variants = [
        *ADMIN_ROUTES,
        *(route.upper() for route in ADMIN_ROUTES[:4]),
        *(route + "/" for route in ADMIN_ROUTES[:4]),
        *("/%" + format(ord(route[1]), "02x") + route[2:] for route in ADMIN_ROUTES[:4]),
        *AMBIGUOUS,
        f"http://127.0.0.1:{port}/sleep",
        f"HTTP://127.0.0.1:{port}/wake_up",
        f"http://127.0.0.1:{port}/v1/../sleep",
        "/v1/chat/completions/../../sleep?x=/v1/models",
        "/v1/models/../sleep",
        "/v1/models/x",
        "/v1/models.json",
    ]
    slowest = 0.0
    statuses: set[int | None] = set()
    for target in variants:
        for method in ("GET", "POST"):
            result, took = await _send(base, method, target, auth=True, body=b"{}")
            slowest = max(slowest, took)
            statuses.add(result.status)
            assert result.status in (400, 403, 404), (method, target, result.data[:120])
    assert upstream.requests == 0, targets
    assert slowest < 1.0
    figure(
        "T37",
        f"{len(variants) * 2} admin/encoded variants, allowlist on",
        f"0 upstream; statuses {sorted(s or 0 for s in statuses)}; max {slowest * 1000:.1f} ms",
        "0 reach upstream; 403/404 <= 50 ms",
    )
    # The allowed routes still pass.
    allowed = [
        ("GET", "/v1/models", False),
        ("GET", "/v1/models?limit=1", False),
        ("POST", CHAT, True),
    ]
    for method, target, auth in allowed:
        result, _took = await _send(base, method, target, auth, CHAT_BODY)
        assert result.status == 200, (target, result.data[:200])
    assert targets == [b"/v1/models", b"/v1/models?limit=1", CHAT.encode()]
    # A generation route still needs the token, and a GET to it is not forwarded either.
    denied, _ = await _send(base, "POST", CHAT, auth=False, body=CHAT_BODY)
    assert denied.status == 401
    got, _ = await _send(base, "GET", CHAT, auth=True)
    assert got.status == 404
    assert upstream.requests == 3
    figure("T37", "allowlisted routes", "3/3 forwarded, 200", "allowlisted routes still pass")


async def test_t37_default_mode_never_lets_a_path_change_meaning(
    start_upstream: Any, start_guard: Any, figure: Any
) -> None:
    """PIG-compatible forwarding: other paths go through, but never as a protected route."""
    targets: list[bytes] = []
    upstream = await start_upstream(echo_backend(targets))
    port = upstream.base.rsplit(":", 1)[1]
    base, _server = await start_guard(
        {"UPSTREAM": upstream.base, "TOKEN": TOKEN, "DYNAMIC_PIG_ENABLED": "false"}
    )
    # PIG forwards the backend's other routes as they are.
    for route in ADMIN_ROUTES[:5]:
        result, _ = await _send(base, "POST", route, auth=False)
        assert result.status == 200
    assert targets == [route.encode() for route in ADMIN_ROUTES[:5]]
    del targets[:]
    refused = 0
    for target in AMBIGUOUS:
        result, _ = await _send(base, "POST", target, auth=False, body=CHAT_BODY)
        assert result.status in (400, 404), (target, result.data[:120])
        refused += 1
    assert targets == []
    # Random targets built from the pieces that confuse parsers: whatever reaches the backend
    # without a token must not be a generation route even to a lenient backend.
    pieces = [
        "/", "/", "v1", "chat", "completions", "responses", ".", "..", "%2e", "%2E", "%2f",
        "%252e", ";", ";x", "V1", "Chat", "%00", "%20", "\\", "//", "#", "?", "%63",
        f"http://127.0.0.1:{port}",
    ]  # fmt: skip
    rng = random.Random(37)
    forwarded = 0
    for _ in range(150):
        target = "/" + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 9)))
        before = len(targets)
        result, _ = await _send(base, "POST", target, auth=False, body=CHAT_BODY)
        if len(targets) > before:
            forwarded += 1
            got = targets[-1]
            assert lenient(got) not in PROTECTED, (target, got)
            # The backend got the path the guard routed on (origin form, same bytes).
            assert got.partition(b"?")[0] == target.encode().partition(b"?")[0] or "://" in target
        else:
            assert result.status in (400, 401, 404, 431), (target, result.data[:120])
    figure(
        "T37",
        "default mode: ambiguous + 150 random targets",
        f"{refused} ambiguous refused, 0 forwarded; {forwarded} random forwarded, none protected",
        "no auth/QoS bypass through normalisation",
    )
