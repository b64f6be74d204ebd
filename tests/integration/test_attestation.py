"""The attestation handler at its real boundaries: a fake dstack agent speaking HTTP/1.1 on a Unix
socket (serving the recorded replies in tests/fixtures/attestation), a stand-in NVML module that
hands back pynvml's own ctypes structures filled from the Hopper samples, a real subprocess for
the command fallback, a loopback HTTP server for the URL fallback, and the real pynvml without a
driver."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import pynvml  # type: ignore[import-untyped]
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from guard_adapters.config import load_config
from guard_trio._attestation import AttestationHandler

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "attestation"
QUOTE_REPLY = json.loads((FIXTURES / "getquote_response.json").read_text())
INFO_REPLY = json.loads((FIXTURES / "info_wire_derived.json").read_text())
HOPPER_REPORT = bytes.fromhex((FIXTURES / "hopper_attestation_report.hex").read_text().strip())
HOPPER_CHAIN = (FIXTURES / "hopper_cert_chain.pem").read_bytes()
DEVICE_CA = (FIXTURES / "nvidia_device_identity_ca.pem").read_bytes()
NONCE = "a1" * 32
TOP_KEYS = {
    "signing_address",
    "signing_algo",
    "signing_public_key",
    "request_nonce",
    "intel_quote",
    "quote",
    "event_log",
    "vm_config",
    "info",
    "nvidia_payload",
    "version",
    "all_attestations",
}


# -- the fake dstack agent


class FakeAgent:
    """A dstack guest agent on a Unix socket; ``mode`` scripts how GetQuote (or Info) misbehaves."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.info_mode = "ok"
        self.requests: list[tuple[str, str, dict[bytes, bytes], bytes]] = []

    async def serve(self, path: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            request: h11.Request | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert request is not None
            target = request.target.decode()
            self.requests.append((request.method.decode(), target, dict(request.headers), body))
            mode = self.mode if target == "/GetQuote" else self.info_mode
            if mode == "hang":
                await trio.sleep_forever()
            if mode == "truncated":
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b'{"quote": "04'
                )
                return
            status, payload = self._reply(target, body, mode)
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
            out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
            out += conn.send(h11.Data(data=payload)) or b""
            out += conn.send(h11.EndOfMessage()) or b""
            await stream.send_all(out)

    def _reply(self, target: str, body: bytes, mode: str) -> tuple[int, bytes]:
        if mode == "error400":
            return 400, b'{\n  "error": "Report data is too long"\n}'
        if mode == "error500":
            return 500, b"internal failure"
        if mode == "garbage":
            return 200, b"<html>not json</html>"
        if target == "/Info":
            return 200, json.dumps(
                {**INFO_REPLY, "cloud_vendor": "x", "cloud_product": "y"}
            ).encode()
        assert target == "/GetQuote", target
        sent = bytes.fromhex(json.loads(body)["report_data"]).ljust(64, b"\0")
        if mode == "wrong_report_data":
            sent = bytes(64)
        quote = bytearray.fromhex(QUOTE_REPLY["quote"])
        quote[568:632] = sent  # what the dstack simulator does; the signature no longer verifies
        reply = {**QUOTE_REPLY, "quote": quote.hex(), "report_data": sent.hex()}
        if mode == "no_quote":
            del reply["quote"]
        elif mode == "empty_quote":
            reply["quote"] = ""
        return 200, json.dumps(reply).encode()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~107 bytes, and pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="att", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def agent(nursery: trio.Nursery, short_dir: Path) -> FakeAgent:
    fake = FakeAgent()
    fake.socket_path = str(short_dir / "dstack.sock")  # type: ignore[attr-defined]
    await nursery.start(fake.serve, fake.socket_path)  # type: ignore[attr-defined]
    return fake


# -- the stand-in NVML module


class FakeNvml:
    """pynvml's surface for evidence collection; returns pynvml's real ctypes structures."""

    NVMLError = pynvml.NVMLError
    c_nvmlSystemConfComputeSettings_v1_t = pynvml.c_nvmlSystemConfComputeSettings_v1_t

    def __init__(
        self,
        *,
        gpus: int = 1,
        arch: int = 9,
        cc: int = 1,
        errors: dict[tuple[str, int | None], int] | None = None,
        report_size: int | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        self.gpus, self.arch, self.cc = gpus, arch, cc
        self.errors = errors or {}
        self.report_size = report_size
        self.hold = hold
        self.calls: list[str] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def _maybe_fail(self, name: str, index: int | None = None) -> None:
        self.calls.append(name if index is None else f"{name}:{index}")
        code = self.errors.get((name, index))
        if code is not None:
            raise pynvml.NVMLError(code)

    def nvmlInit(self) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self._maybe_fail("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        with self._lock:
            self.active -= 1

    def nvmlSystemGetConfComputeState(self) -> Any:
        self._maybe_fail("cc_state")
        state = pynvml.c_nvmlConfComputeSystemState_t()
        state.ccFeature, state.environment, state.devToolsMode = self.cc, 2, 0
        return state

    def nvmlSystemGetConfComputeSettings(self, _pointer: Any) -> int:
        return 0  # settings stay zero: no protected-PCIe multi-GPU mode

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("count")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._maybe_fail("handle", index)
        return index

    def nvmlDeviceGetArchitecture(self, handle: int) -> int:
        self._maybe_fail("arch", handle)
        return self.arch

    def nvmlDeviceGetConfComputeGpuCertificate(self, handle: int) -> Any:
        self._maybe_fail("cert", handle)
        cert = pynvml.c_nvmlConfComputeGpuCertificate_t()
        cert.attestationCertChainSize = len(HOPPER_CHAIN)
        for i, byte in enumerate(HOPPER_CHAIN):
            cert.attestationCertChain[i] = byte
        return cert

    def nvmlDeviceGetConfComputeGpuAttestationReport(self, handle: int, nonce: bytes) -> Any:
        self._maybe_fail("report", handle)
        if self.hold is not None:
            self.hold.wait(10)
        report = pynvml.c_nvmlConfComputeGpuAttestationReport_t()
        for i, byte in enumerate(nonce):
            report.nonce[i] = byte
        raw = bytearray(HOPPER_REPORT)
        raw[4:36] = nonce
        for i, byte in enumerate(raw):
            report.attestationReport[i] = byte
        report.attestationReportSize = len(raw) if self.report_size is None else self.report_size
        return report


def make_handler(agent: FakeAgent | None, nvml: Any = None, **env: str) -> AttestationHandler:
    environ = {"ATTESTATION_DSTACK_ENDPOINT": getattr(agent, "socket_path", "/nonexistent.sock")}
    environ.update(env)
    kwargs: dict[str, Any] = {"dstack_timeout_s": 0.5, "nvml_timeout_s": 2.0}
    if nvml is not None:
        kwargs["nvml_loader"] = lambda: nvml
    return AttestationHandler(load_config(environ), **kwargs)


async def get(handler: AttestationHandler, query: str = f"nonce={NONCE}") -> tuple[int, Any]:
    status, headers, body = await handler.report(method=b"GET", query=query)
    assert body.endswith(b"\n")
    if status in (200, 400, 500):
        assert (b"content-type", b"application/json") in headers
        return status, json.loads(body)
    return status, body


def quote_report_data(report: dict[str, Any]) -> bytes:
    """What a verifier reads: report_data from the quote bytes, not from any JSON field."""
    return bytes.fromhex(report["intel_quote"])[568:632]


def self_signed(path: Path) -> bytes:
    """Write a fresh self-signed certificate to ``path``; return its SPKI SHA-256."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "guard.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # Independent path: openssl extracts the SPKI DER itself.
    if shutil.which("openssl"):
        der = subprocess.run(
            f"openssl x509 -in {path} -pubkey -noout | openssl pkey -pubin -outform DER",
            shell=True,
            check=True,
            capture_output=True,
        ).stdout
    else:  # pragma: no cover - openssl is on the CI image
        der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    return hashlib.sha256(der).digest()


# -- success paths


async def test_v1_ecdsa_report(agent: FakeAgent) -> None:
    nvml = FakeNvml()
    handler = make_handler(agent, nvml)
    status, report = await get(handler)
    assert status == 200, report
    assert set(report) == TOP_KEYS
    assert report["all_attestations"] == [
        {k: v for k, v in report.items() if k != "all_attestations"}
    ]
    assert report["intel_quote"] == report["quote"]
    assert report["version"] == 1
    assert report["signing_algo"] == "ecdsa"
    assert report["request_nonce"] == NONCE
    address = bytes.fromhex(report["signing_address"].removeprefix("0x"))
    assert len(address) == 20
    assert quote_report_data(report) == address + bytes(12) + bytes.fromhex(NONCE)
    # the agent saw one GetQuote with the exact bytes, then one Info, over POST + JSON
    (m1, t1, h1, b1), (m2, t2, h2, b2) = agent.requests
    assert (m1, t1, m2, t2) == ("POST", "/GetQuote", "POST", "/Info")
    assert h1[b"content-type"] == h2[b"content-type"] == b"application/json"
    assert json.loads(b1) == {"report_data": quote_report_data(report).hex()}
    assert json.loads(b2) == {}
    assert report["event_log"] == QUOTE_REPLY["event_log"]
    assert report["vm_config"] == QUOTE_REPLY["vm_config"]
    info = report["info"]
    assert isinstance(info["tcb_info"], dict)
    assert "cloud_vendor" not in info
    assert "cloud_product" not in info
    assert (
        hashlib.sha256(info["tcb_info"]["app_compose"].encode()).hexdigest() == info["compose_hash"]
    )
    payload = json.loads(report["nvidia_payload"])
    assert list(payload) == ["nonce", "evidence_list", "arch"]
    assert payload["nonce"] == NONCE
    assert payload["arch"] == "HOPPER"
    (entry,) = payload["evidence_list"]
    assert entry["arch"] == "HOPPER"
    evidence = base64.b64decode(entry["evidence"], validate=True)
    assert len(evidence) == len(HOPPER_REPORT)
    assert evidence[4:36].hex() == NONCE
    chain = x509.load_pem_x509_certificates(base64.b64decode(entry["certificate"]))
    assert len(chain) == 5
    assert chain[-1] == x509.load_pem_x509_certificate(DEVICE_CA)
    assert nvml.calls[0] == "init"
    assert nvml.calls[-1] == "shutdown"


async def test_v1_ed25519_layout(agent: FakeAgent) -> None:
    status, report = await get(
        make_handler(agent, FakeNvml()), f"signing_algo=ED25519&nonce={NONCE}"
    )
    assert status == 200, report
    assert report["signing_algo"] == "ed25519"
    assert report["signing_address"] == report["signing_public_key"]
    key = bytes.fromhex(report["signing_public_key"])
    assert quote_report_data(report) == key + bytes.fromhex(NONCE)


@pytest.mark.parametrize("algo", ["ecdsa", "ed25519"])
async def test_v2_binds_the_tls_key_and_rereads_it(
    agent: FakeAgent, tmp_path: Path, algo: str
) -> None:
    cert = tmp_path / "cert.pem"
    spki = self_signed(cert)
    handler = make_handler(agent, FakeNvml(), TLS_CERT_PATH=str(cert))
    status, report = await get(handler, f"version=2&signing_algo={algo}&nonce={NONCE}")
    assert status == 200, report
    assert report["version"] == 2
    assert report["tls_cert_fingerprint"] == spki.hex()
    identity = bytes.fromhex(report["signing_address"].removeprefix("0x"))
    expected = hashlib.sha256(identity + spki).digest() + bytes.fromhex(NONCE)
    assert quote_report_data(report) == expected
    # the certificate is renewed: the next report binds the new key
    spki2 = self_signed(cert)
    status, report2 = await get(handler, f"version=2&signing_algo={algo}&nonce={NONCE}")
    assert status == 200
    assert report2["tls_cert_fingerprint"] == spki2.hex() != spki.hex()


async def test_random_nonce_when_absent(agent: FakeAgent) -> None:
    handler = make_handler(agent, FakeNvml())
    status, first = await get(handler, "")
    _, second = await get(handler, "nonce=%20")
    assert status == 200
    for report in (first, second):
        assert len(report["request_nonce"]) == 64
        assert quote_report_data(report)[32:].hex() == report["request_nonce"]
    assert first["request_nonce"] != second["request_nonce"]


async def test_identity_is_stable_across_requests(agent: FakeAgent) -> None:
    handler = make_handler(agent, FakeNvml())
    _, one = await get(handler)
    _, two = await get(handler)
    assert one["signing_address"] == two["signing_address"]
    assert make_handler(agent, FakeNvml()).identities["ecdsa"] != handler.identities["ecdsa"]


# -- refusals before any I/O


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ("version=3", "Unsupported attestation report version: 3"),
        ("version=abc", "Unsupported attestation report version: abc"),
        ("version=1.0", "Unsupported attestation report version: 1.0"),
        ("version=-1", "Unsupported attestation report version: -1"),
        ("version=3&signing_algo=rsa&nonce=zz", "Unsupported attestation report version: 3"),
        ("signing_algo=rsa", "Unsupported signing algorithm"),
        ("signing_algo=rsa&nonce=zz", "Unsupported signing algorithm"),
        ("nonce=zz", "nonce must be hex-encoded"),
        ("nonce=" + "a" * 63, "nonce must be hex-encoded"),
        ("nonce=0x" + "a" * 62, "nonce must be hex-encoded"),
        ("nonce=" + "aa%20" * 31 + "aa", "nonce must be hex-encoded"),
        ("nonce=%20" + "a" * 64, "nonce must be hex-encoded"),
        ("nonce=" + "a" * 62, "nonce must be 32 bytes"),
        ("nonce=" + "a" * 66, "nonce must be 32 bytes"),
        ("version=2", "attestation version 2 requires a TLS certificate (set TLS_CERT_PATH)"),
    ],
)
async def test_bad_parameters(agent: FakeAgent, query: str, detail: str) -> None:
    status, body = await get(make_handler(agent, FakeNvml()), query)
    assert (status, body) == (400, {"detail": detail})
    assert agent.requests == []


@pytest.mark.parametrize("content", [None, b"not a certificate", b""])
async def test_v2_without_a_usable_certificate(
    agent: FakeAgent, tmp_path: Path, content: bytes | None
) -> None:
    cert = tmp_path / "cert.pem"
    if content is not None:
        cert.write_bytes(content)
    handler = make_handler(agent, FakeNvml(), TLS_CERT_PATH=str(cert))
    status, body = await get(handler, "version=2")
    assert status == 400
    assert "requires a TLS certificate" in body["detail"]
    assert agent.requests == []  # never a silent v1 report


async def test_method_and_disabled(agent: FakeAgent) -> None:
    handler = make_handler(agent, FakeNvml())
    for method in (b"POST", b"PUT", b"HEAD"):
        status, _headers, body = await handler.report(method=method, query="")
        assert (status, body) == (405, b"method not allowed\n")
    off = make_handler(agent, FakeNvml(), ATTESTATION_ENABLED="false")
    status, _headers, _body = await off.report(method=b"GET", query="")
    assert status == 404
    assert agent.requests == []


# -- dstack failures


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("error400", "HTTP 400: Report data is too long"),
        ("error500", "HTTP 500"),
        ("garbage", "not JSON"),
        ("no_quote", "empty quote"),
        ("empty_quote", "empty quote"),
        ("wrong_report_data", "does not carry the requested report_data"),
        ("truncated", "without sending complete message body"),
        ("hang", "no reply from unix:"),
    ],
)
async def test_dstack_quote_failures(agent: FakeAgent, mode: str, reason: str) -> None:
    agent.mode = mode
    nvml = FakeNvml()
    status, body = await get(make_handler(agent, nvml))
    assert status == 500
    assert body["detail"].startswith("get dstack quote: ")
    assert reason in body["detail"]
    assert nvml.calls == []  # nothing after a failed quote


@pytest.mark.parametrize("mode", ["error400", "garbage", "hang"])
async def test_dstack_info_failures(agent: FakeAgent, mode: str) -> None:
    agent.info_mode = mode
    status, body = await get(make_handler(agent, FakeNvml()))
    assert status == 500
    assert body["detail"].startswith("get dstack info: ")


async def test_dstack_down(short_dir: Path) -> None:
    missing = make_handler(None, FakeNvml(), ATTESTATION_DSTACK_ENDPOINT=str(short_dir / "no.sock"))
    status, body = await get(missing)
    assert status == 500
    assert body["detail"].startswith("get dstack quote: connect to unix:")
    # a socket file with nobody listening behind it
    stale = short_dir / "stale.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale))
    sock.close()
    handler = make_handler(None, FakeNvml(), ATTESTATION_DSTACK_ENDPOINT=str(stale))
    status, body = await get(handler)
    assert status == 500
    assert "get dstack quote: connect to unix:" in body["detail"]


async def test_dstack_http_endpoint_down() -> None:
    with socket.socket() as placeholder:  # a port that was free a moment ago
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    handler = make_handler(None, FakeNvml(), ATTESTATION_DSTACK_ENDPOINT=f"http://127.0.0.1:{port}")
    status, body = await get(handler)
    assert status == 500
    assert body["detail"].startswith(f"get dstack quote: connect to 127.0.0.1:{port} failed")


# -- NVIDIA evidence


@pytest.mark.parametrize(
    ("nvml", "reason"),
    [
        (FakeNvml(errors={("init", None): 12}), "NVML library not found (no GPU driver)"),
        (FakeNvml(errors={("init", None): 9}), "the NVIDIA driver is not loaded"),
        (FakeNvml(cc=0), "confidential-computing mode is off"),
        (FakeNvml(gpus=0), "NVML returned zero GPUs"),
        (FakeNvml(arch=8), "GPU 0: architecture 8 is neither Hopper nor Blackwell"),
        (FakeNvml(errors={("cert", 0): 3}), "GPU 0: certificate: not supported"),
        (FakeNvml(report_size=0), "GPU 0: report size 0 outside"),
        (FakeNvml(report_size=0x2001), "GPU 0: report size 8193 outside"),
        (FakeNvml(gpus=2, errors={("report", 1): 3}), "GPU 1: attestation report: not supported"),
    ],
)
async def test_gpu_failures_fail_closed(agent: FakeAgent, nvml: FakeNvml, reason: str) -> None:
    status, body = await get(make_handler(agent, nvml))
    assert status == 500
    assert body["detail"].startswith("NVIDIA evidence unavailable: ")
    assert reason in body["detail"]
    if "init" not in {k[0] for k in nvml.errors}:
        assert nvml.calls[-1] == "shutdown"


async def test_two_gpus(agent: FakeAgent) -> None:
    status, report = await get(make_handler(agent, FakeNvml(gpus=2, arch=10)))
    assert status == 200
    payload = json.loads(report["nvidia_payload"])
    assert [e["arch"] for e in payload["evidence_list"]] == ["BLACKWELL", "BLACKWELL"]
    assert payload["arch"] == "BLACKWELL"


async def test_nvml_deadline_and_one_collection_at_a_time(agent: FakeAgent) -> None:
    hold = threading.Event()
    nvml = FakeNvml(hold=hold)
    handler = make_handler(agent, nvml)
    handler._nvml_timeout_s = 0.3
    status, body = await get(handler)
    assert status == 500
    assert "NVML did not answer within 0.3 s" in body["detail"]
    # the stuck thread still holds the single NVML slot: the next request waits, then fails
    status, body = await get(handler)
    assert status == 500
    assert nvml.calls.count("init") == 1
    hold.set()
    await trio.sleep(0.2)  # let the abandoned thread finish
    handler._nvml_timeout_s = 2.0
    async with trio.open_nursery() as nursery:
        results: list[int] = []

        async def one() -> None:
            results.append((await get(handler))[0])

        for _ in range(3):
            nursery.start_soon(one)
    assert results == [200, 200, 200]
    assert nvml.max_active == 1


async def test_evidence_optional_gives_empty_list(agent: FakeAgent) -> None:
    handler = make_handler(
        agent,
        FakeNvml(errors={("init", None): 12}),
        ATTESTATION_REQUIRE_NVIDIA_EVIDENCE="false",
        ATTESTATION_GPU_ARCH="blackwell",
    )
    status, report = await get(handler)
    assert status == 200
    assert json.loads(report["nvidia_payload"]) == {
        "nonce": NONCE,
        "evidence_list": [],
        "arch": "BLACKWELL",
    }


async def test_real_pynvml_without_a_driver(agent: FakeAgent) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - only on a GPU machine
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    handler = AttestationHandler(
        load_config({"ATTESTATION_DSTACK_ENDPOINT": agent.socket_path})  # type: ignore[attr-defined]
    )
    status, body = await get(handler)
    assert status == 500
    assert body["detail"] == (
        "NVIDIA evidence unavailable: NVML library not found (no GPU driver) (and neither "
        "ATTESTATION_NVIDIA_PAYLOAD_URL nor ATTESTATION_NVIDIA_COMMAND is set)"
    )
    optional = AttestationHandler(
        load_config(
            {
                "ATTESTATION_DSTACK_ENDPOINT": agent.socket_path,  # type: ignore[attr-defined]
                "ATTESTATION_REQUIRE_NVIDIA_EVIDENCE": "false",
            }
        )
    )
    status, report = await get(optional)
    assert status == 200
    assert json.loads(report["nvidia_payload"])["evidence_list"] == []


# -- payload sources


def _payload_text() -> str:
    return (FIXTURES / "nvidia_payload_derived.json").read_text()


async def test_inline_payload_with_nonce(agent: FakeAgent) -> None:
    payload = json.loads(_payload_text())
    payload["nonce"] = "${nonce}"
    nvml = FakeNvml()
    handler = make_handler(agent, nvml, ATTESTATION_NVIDIA_PAYLOAD=json.dumps(payload))
    status, report = await get(handler)
    assert status == 200
    assert json.loads(report["nvidia_payload"])["nonce"] == NONCE
    assert nvml.calls == []  # the inline payload comes first


async def test_payload_file(agent: FakeAgent, tmp_path: Path) -> None:
    path = tmp_path / "payload.json"
    path.write_text("\n" + json.dumps({"evidences": json.loads(_payload_text())["evidence_list"]}))
    handler = make_handler(agent, FakeNvml(), ATTESTATION_NVIDIA_PAYLOAD_FILE=str(path))
    status, report = await get(handler)
    assert status == 200
    payload = json.loads(report["nvidia_payload"])
    assert payload["nonce"] == NONCE
    assert len(payload["evidence_list"]) == 1
    path.write_text('{"evidence_list": []}')
    status, body = await get(handler)
    assert (status, body) == (500, {"detail": "NVIDIA payload has an empty evidence_list"})
    path.unlink()
    status, body = await get(handler)
    assert status == 500
    assert body["detail"].startswith("cannot read ATTESTATION_NVIDIA_PAYLOAD_FILE")


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "evidence.py"
    path.write_text("import sys, time, json\n" + body)
    return str(path)


async def test_command_fallback(agent: FakeAgent, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "args = sys.argv[1:]\n"
        "nonce = args[args.index('--nonce') + 1]\n"
        "arch = args[args.index('--arch') + 1]\n"
        "print(json.dumps({'evidence': 'ZXZpZGVuY2U=', 'certificate': 'Y2VydA==', 'arch': arch,"
        " 'seen': nonce}))\n",
    )
    handler = make_handler(
        agent,
        FakeNvml(errors={("init", None): 12}),
        ATTESTATION_NVIDIA_COMMAND=sys.executable,
        ATTESTATION_NVIDIA_COMMAND_ARGS=f"{script},--nonce,{{nonce}},--arch,HOPPER",
    )
    status, report = await get(handler)
    assert status == 200, report
    payload = json.loads(report["nvidia_payload"])
    assert payload["nonce"] == NONCE
    assert payload["evidence_list"][0]["seen"] == NONCE


async def test_command_failure_and_timeout(agent: FakeAgent, tmp_path: Path) -> None:
    failing = _script(tmp_path, "sys.stderr.write('no GPU here'); sys.exit(3)\n")
    handler = make_handler(
        agent,
        FakeNvml(errors={("init", None): 12}),
        ATTESTATION_NVIDIA_COMMAND=sys.executable,
        ATTESTATION_NVIDIA_COMMAND_ARGS=failing,
    )
    status, body = await get(handler)
    assert (status, body) == (
        500,
        {"detail": "NVIDIA evidence command exited with 3: no GPU here"},
    )
    slow = _script(tmp_path, "time.sleep(20)\n")
    handler = make_handler(
        agent,
        FakeNvml(errors={("init", None): 12}),
        ATTESTATION_NVIDIA_COMMAND=sys.executable,
        ATTESTATION_NVIDIA_COMMAND_ARGS=slow,
        ATTESTATION_NVIDIA_COMMAND_TIMEOUT_SECONDS="1",
    )
    status, body = await get(handler)
    assert (status, body) == (500, {"detail": "NVIDIA evidence command timed out after 1 s"})


class PayloadServer:
    """A loopback HTTP server for the URL fallback."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self.requests: list[tuple[str, dict[bytes, bytes]]] = []

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    self.requests.append((event.target.decode(), dict(event.headers)))
                elif isinstance(event, h11.EndOfMessage):
                    break
            headers = [("Content-Length", str(len(self.body)))]
            out = conn.send(h11.Response(status_code=self.status, headers=headers)) or b""
            out += (conn.send(h11.Data(data=self.body)) or b"") + (
                conn.send(h11.EndOfMessage()) or b""
            )
            await stream.send_all(out)


async def test_url_fallback(agent: FakeAgent, nursery: trio.Nursery, tmp_path: Path) -> None:
    wrapped = json.dumps({"nvidia_payload": _payload_text()}).encode()
    server = PayloadServer(200, wrapped)
    port = await nursery.start(server.serve)
    never = _script(tmp_path, "sys.exit(1)\n")
    handler = make_handler(
        agent,
        FakeNvml(errors={("init", None): 12}),
        ATTESTATION_NVIDIA_PAYLOAD_URL=f"http://127.0.0.1:{port}/evidence?gpu=all",
        ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION="Bearer gpu-token",
        ATTESTATION_NVIDIA_COMMAND=sys.executable,
        ATTESTATION_NVIDIA_COMMAND_ARGS=never,
    )
    status, report = await get(handler)
    assert status == 200, report
    assert json.loads(report["nvidia_payload"]) == json.loads(_payload_text())
    ((target, headers),) = server.requests
    assert target == f"/evidence?gpu=all&nonce={NONCE}"
    assert headers[b"authorization"] == b"Bearer gpu-token"
    # a failing URL is the answer: the command is not tried after it
    server.status, server.body = 503, b"busy"
    status, body = await get(handler)
    assert (status, body) == (500, {"detail": "NVIDIA payload URL answered HTTP 503"})


async def test_native_evidence_wins_over_url(agent: FakeAgent, nursery: trio.Nursery) -> None:
    server = PayloadServer(200, b"{}")
    port = await nursery.start(server.serve)
    handler = make_handler(
        agent, FakeNvml(), ATTESTATION_NVIDIA_PAYLOAD_URL=f"http://127.0.0.1:{port}/"
    )
    status, _report = await get(handler)
    assert status == 200
    assert server.requests == []


# -- through the proxy: auth comes before the handler


async def test_proxy_auth_before_attestation(start_guard: Any, start_sim: Any, http: Any) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard({"UPSTREAM": sim, "TOKEN": "s3cret"})
    path = f"/v1/attestation/report?nonce={NONCE}"
    for headers in ([], [("Authorization", "Bearer wrong")], [("Authorization", "s3cret")]):
        reply = await http.request(guard, "GET", path, headers)
        assert reply.status == 401
    reply = await http.request(guard, "POST", path, [("Authorization", "Bearer s3cret")])
    assert reply.status == 405
    reply = await http.request(guard, "POST", path, [])
    assert reply.status == 401  # auth first: an anonymous POST is refused as unauthenticated


# -- the example verifier accepts a real answer and catches a wrong nonce or certificate


def _verifier() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "verify_report.py"
    spec = importlib.util.spec_from_file_location("verify_report", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version", [1, 2])
async def test_example_verifier(agent: FakeAgent, tmp_path: Path, version: int) -> None:
    verifier = _verifier()
    cert = tmp_path / "cert.pem"
    self_signed(cert)
    handler = make_handler(agent, FakeNvml(), TLS_CERT_PATH=str(cert))
    status, report = await get(handler, f"version={version}&nonce={NONCE}")
    assert status == 200
    notes = verifier.verify(report, NONCE, cert.read_bytes())
    assert "compose hash matches info.compose_hash" in notes
    with pytest.raises(verifier.Failed, match="does not end with your nonce"):
        verifier.verify(report, "a2" * 32, None)
    if version == 2:
        other = tmp_path / "other.pem"
        self_signed(other)
        with pytest.raises(verifier.Failed, match="does not match the certificate"):
            verifier.verify(report, NONCE, other.read_bytes())
