"""The pure parts of the attestation report: parameters, identities, report_data, dstack request
and reply handling, GPU evidence encoding and payload normalisation."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.attestation import (
    Failure,
    ReportParams,
    ecdsa_identity,
    ed25519_identity,
    encode_json,
    generate_identities,
    keccak256,
    parse_query,
    report_data,
    report_document,
    spki_fingerprint,
)
from guard_adapters.dstack import (
    DstackError,
    Endpoint,
    info_request,
    parse_info,
    parse_quote,
    quote_request,
)
from guard_adapters.nvml import (
    DEVICE_IDENTITY_CA_PEM,
    NvidiaEvidenceError,
    command_argv,
    normalise_chain,
    normalise_payload,
    url_reply_payload,
    url_with_nonce,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "attestation"
FIXED = b"\x5a" * 32
A = b"\xaa" * 32
B = b"\xab" * 32


def fixed() -> bytes:
    return FIXED


# -- Keccak and identities


def test_keccak_is_not_sha3() -> None:
    assert keccak256(b"").hex() == (
        "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
    )
    assert keccak256(b"") != hashlib.sha3_256(b"").digest()


def test_ethereum_address_vector() -> None:
    key = ec.derive_private_key(
        int("4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318", 16),
        ec.SECP256K1(),
    )
    identity = ecdsa_identity(key)
    assert identity.address == "0x2c7536e3605d9c16a7a3d7b1898e529396a65c23"
    assert identity.identity.hex() == "2c7536e3605d9c16a7a3d7b1898e529396a65c23"
    assert len(identity.public_key) == 128


def test_ecdsa_needs_secp256k1() -> None:
    with pytest.raises(ValueError, match="secp256k1"):
        ecdsa_identity(ec.generate_private_key(ec.SECP256R1()))


def test_ed25519_identity_rfc8032() -> None:
    key = ed25519.Ed25519PrivateKey.from_private_bytes(
        bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    )
    identity = ed25519_identity(key)
    expected = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    assert identity.address == identity.public_key == expected
    assert identity.identity == bytes.fromhex(expected)


def test_generated_identities_have_the_right_shapes() -> None:
    ids = generate_identities()
    assert re.fullmatch(r"0x[0-9a-f]{40}", ids["ecdsa"].address)
    assert re.fullmatch(r"[0-9a-f]{64}", ids["ed25519"].address)


# -- report_data


ADDRESS = bytes.fromhex("2c7536e3605d9c16a7a3d7b1898e529396a65c23")
ED_KEY = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")


def test_report_data_vectors() -> None:
    assert report_data(1, ADDRESS, A) == ADDRESS + bytes(12) + A
    assert (
        report_data(2, ADDRESS, A, B)
        == bytes.fromhex("f67906c33c961b67277662767b16885f6652f9c3d7edcbd0061a7fd561c55d63") + A
    )
    assert report_data(1, ED_KEY, A) == ED_KEY + A
    assert (
        report_data(2, ED_KEY, A, B)
        == bytes.fromhex("b622ae7091cefbf7c03d388035b09a4cffa5dd1aba949ab237ed151a129614b2") + A
    )


def test_v2_never_falls_back() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        report_data(2, ADDRESS, A)
    with pytest.raises(ValueError, match="version 3"):
        report_data(3, ADDRESS, A)
    with pytest.raises(ValueError, match="identity"):
        report_data(1, bytes(33), A)


@given(
    identity=st.binary(min_size=1, max_size=32),
    nonce=st.binary(min_size=32, max_size=32),
    spki=st.binary(min_size=32, max_size=32),
)
def test_report_data_layout(identity: bytes, nonce: bytes, spki: bytes) -> None:
    v1 = report_data(1, identity, nonce)
    v2 = report_data(2, identity, nonce, spki)
    assert len(v1) == len(v2) == 64
    assert v1[32:] == v2[32:] == nonce
    assert v1[:32] == identity + bytes(32 - len(identity))
    assert v2[:32] == hashlib.sha256(identity + spki).digest()


def test_spki_fingerprint_takes_the_first_certificate() -> None:
    chain = (FIXTURES / "hopper_cert_chain.pem").read_bytes()
    first = x509.load_pem_x509_certificates(chain)[0]
    der = first.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert spki_fingerprint(chain) == hashlib.sha256(der).digest()
    with pytest.raises(ValueError, match=r"."):
        spki_fingerprint(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


# -- parameters


def test_defaults() -> None:
    assert parse_query("", fixed) == ReportParams(1, "ecdsa", FIXED)
    assert parse_query("version=0&signing_algo=&nonce=", fixed) == ReportParams(1, "ecdsa", FIXED)
    assert parse_query("version=%2B2&signing_algo=+Ed25519+", fixed) == ReportParams(
        2, "ed25519", FIXED
    )


def test_first_value_wins_and_unknown_keys_are_ignored() -> None:
    params = parse_query(f"model=x&nonce={'ab' * 32}&nonce=zz&version=2&version=9", fixed)
    assert params == ReportParams(2, "ecdsa", b"\xab" * 32)


def test_huge_version_reports_the_raw_text() -> None:
    raw = "9" * 30
    assert parse_query(f"version={raw}", fixed) == Failure(
        400, f"Unsupported attestation report version: {raw}"
    )


@given(st.binary(min_size=32, max_size=32), st.booleans())
def test_any_hex_nonce_round_trips(nonce: bytes, upper: bool) -> None:
    text = nonce.hex().upper() if upper else nonce.hex()
    params = parse_query(f"nonce={text}", fixed)
    assert isinstance(params, ReportParams)
    assert params.nonce == nonce


@given(st.text(max_size=80))
def test_nonce_is_strict(raw: str) -> None:
    params = parse_query("nonce=" + quote(raw, safe=""), fixed)
    if raw.strip() == "":
        assert params == ReportParams(1, "ecdsa", FIXED)
    elif re.fullmatch(r"[0-9A-Fa-f]{64}", raw):
        assert params == ReportParams(1, "ecdsa", bytes.fromhex(raw))
    elif re.fullmatch(r"(?:[0-9A-Fa-f]{2})*", raw):
        assert params == Failure(400, "nonce must be 32 bytes")
    else:
        assert params == Failure(400, "nonce must be hex-encoded")


@given(st.text(max_size=12))
def test_version_parsing(raw: str) -> None:
    params = parse_query("version=" + quote(raw, safe=""), fixed)
    if raw == "" or (re.fullmatch(r"[+-]?0*[012]", raw) and int(raw) >= 0):
        assert isinstance(params, ReportParams)
        assert params.version == max(1, int(raw or "1"))
    else:
        assert isinstance(params, Failure)
        assert params.status == 400
        assert params.detail.startswith("Unsupported attestation report version: ")


@given(st.text(max_size=12))
def test_algo_parsing(raw: str) -> None:
    params = parse_query("signing_algo=" + quote(raw, safe=""), fixed)
    if raw.strip().lower() in ("", "ecdsa", "ed25519"):
        assert isinstance(params, ReportParams)
        assert params.signing_algo == (raw.strip().lower() or "ecdsa")
    else:
        assert params == Failure(400, "Unsupported signing algorithm")


@given(st.text(max_size=6), st.text(max_size=8), st.text(max_size=70))
def test_check_order(version: str, algo: str, nonce: str) -> None:
    query = "&".join(
        f"{k}={quote(v, safe='')}"
        for k, v in (("nonce", nonce), ("signing_algo", algo), ("version", version))
    )
    result = parse_query(query, fixed)
    version_ok = isinstance(parse_query(f"version={quote(version, safe='')}", fixed), ReportParams)
    algo_ok = isinstance(parse_query(f"signing_algo={quote(algo, safe='')}", fixed), ReportParams)
    if not version_ok:
        assert isinstance(result, Failure)
        assert "version" in result.detail
    elif not algo_ok:
        assert result == Failure(400, "Unsupported signing algorithm")
    elif isinstance(result, Failure):
        assert result.detail.startswith("nonce")


# -- the document


def test_report_document_shape() -> None:
    identity = generate_identities()["ed25519"]
    doc = report_document(
        identity=identity,
        nonce=A,
        version=2,
        quote="04",
        event_log="[]",
        vm_config="{}",
        info={"app_id": "x"},
        nvidia_payload="{}",
        fingerprint=B,
    )
    inner = {k: v for k, v in doc.items() if k != "all_attestations"}
    assert doc["all_attestations"] == [inner]
    assert doc["tls_cert_fingerprint"] == B.hex()
    assert doc["intel_quote"] == doc["quote"] == "04"
    body = encode_json(doc)
    assert body.endswith(b"}\n")
    assert list(json.loads(body)) == sorted(doc)


# -- dstack


REAL_QUOTE = json.loads((FIXTURES / "getquote_response.json").read_text())
REAL_INFO = (FIXTURES / "info_wire_derived.json").read_bytes()


def test_quote_request() -> None:
    endpoint = Endpoint.from_settings(None, "/var/run/dstack.sock")
    request = quote_request(endpoint, A + B)
    assert request.method == b"POST"
    assert request.target == "/GetQuote"
    assert json.loads(request.body) == {"report_data": (A + B).hex()}
    headers = dict(request.headers)
    assert headers[b"Content-Type"] == b"application/json"
    assert headers[b"Content-Length"] == str(len(request.body)).encode()
    assert headers[b"Connection"] == b"close"
    http = Endpoint.from_settings("http://127.0.0.1:8090/agent/", None)
    assert (http.host, http.port, http.prefix) == ("127.0.0.1", 8090, "/agent")
    assert info_request(http).target == "/agent/Info"
    assert info_request(http).body == b"{}"


def test_real_quote_reply() -> None:
    sent = bytes.fromhex("1234")
    quote = parse_quote(200, json.dumps(REAL_QUOTE).encode(), sent)
    assert quote.quote == REAL_QUOTE["quote"]
    assert quote.event_log == REAL_QUOTE["event_log"]
    assert quote.vm_config == REAL_QUOTE["vm_config"]
    with pytest.raises(DstackError, match="does not carry"):
        parse_quote(200, json.dumps(REAL_QUOTE).encode(), A + B)


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (400, b'{"error": "Report data is too long"}', "HTTP 400: Report data is too long"),
        (502, b"", "HTTP 502"),
        (200, b"[1]", "not a JSON object"),
        (200, b"{", "not JSON"),
        (200, b'{"quote": ""}', "empty quote"),
        (200, b'{"quote": 5}', "quote is not a string"),
        (200, b'{"quote": "zz"}', "quote is not hex"),
        (200, b'{"quote": "0400"}', "too short"),
    ],
)
def test_bad_quote_replies(status: int, body: bytes, reason: str) -> None:
    with pytest.raises(DstackError, match=re.escape(reason)):
        parse_quote(status, body, A + B)


def test_info_reply() -> None:
    wire = json.loads(REAL_INFO)
    wire["cloud_vendor"] = "gcp"
    info = parse_info(200, json.dumps(wire).encode())
    assert isinstance(info["tcb_info"], dict)
    assert "cloud_vendor" not in info
    assert (
        hashlib.sha256(info["tcb_info"]["app_compose"].encode()).hexdigest() == info["compose_hash"]
    )
    assert parse_info(200, b'{"tcb_info": "not json"}') == {"tcb_info": "not json"}
    with pytest.raises(DstackError):
        parse_info(500, b"{}")


# -- NVIDIA


def test_chain_normalisation_matches_nvidia_serialisation() -> None:
    chain = (FIXTURES / "hopper_cert_chain.pem").read_bytes()
    text = normalise_chain(chain)
    certs = x509.load_pem_x509_certificates(text.encode())
    assert len(certs) == 5
    assert certs[-1] == x509.load_pem_x509_certificate(DEVICE_IDENTITY_CA_PEM)
    ca_file = (FIXTURES / "nvidia_device_identity_ca.pem").read_bytes()
    assert DEVICE_IDENTITY_CA_PEM.strip() == ca_file.strip()
    fingerprint = certs[-1].fingerprint(hashes.SHA256())
    assert fingerprint.hex().startswith("102bf659")
    assert fingerprint.hex().endswith("0b167b48")
    # NVIDIA's own serialised evidence uses the same text for the same chain shape
    reference = json.loads((FIXTURES / "nvidia_payload_derived.json").read_text())
    reference_text = base64.b64decode(reference["evidence_list"][0]["certificate"]).decode()
    assert reference_text.endswith(DEVICE_IDENTITY_CA_PEM.decode())
    with pytest.raises(NvidiaEvidenceError):
        normalise_chain(b"junk")


NONCE_HEX = "cd" * 32


def test_payload_shapes() -> None:
    entry = {"certificate": "Yw==", "evidence": "ZQ==", "arch": "HOPPER"}
    assert json.loads(
        normalise_payload(json.dumps({"evidence_list": [entry]}), NONCE_HEX, "HOPPER", require=True)
    ) == {
        "evidence_list": [entry],
        "nonce": NONCE_HEX,
        "arch": "HOPPER",
    }
    kept = json.loads(
        normalise_payload(
            json.dumps({"nonce": "00", "evidence_list": [entry]}), NONCE_HEX, "X", require=True
        )
    )
    assert kept["nonce"] == "00"  # an existing nonce is not overwritten
    assert json.loads(
        normalise_payload(
            json.dumps({"evidences": [entry], "arch": "BLACKWELL"}),
            NONCE_HEX,
            "HOPPER",
            require=True,
        )
    ) == {
        "nonce": NONCE_HEX,
        "evidence_list": [entry],
        "arch": "BLACKWELL",
    }
    single = json.loads(normalise_payload(json.dumps(entry), NONCE_HEX, "HOPPER", require=True))
    assert single["evidence_list"] == [entry]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("[]", "not a JSON object"),
        ("{", "not JSON"),
        ('{"foo": 1}', "no evidence_list"),
        ('{"evidence": ""}', "no evidence_list"),
        ('{"evidence_list": {}}', "not a list"),
        ('{"evidence_list": []}', "empty evidence_list"),
        ('{"evidence_list": [{"evidence": "x"}, null]}', "empty evidence entry"),
        ('{"evidence_list": [{}]}', "empty evidence entry"),
    ],
)
def test_bad_payloads(text: str, reason: str) -> None:
    with pytest.raises(NvidiaEvidenceError, match=reason):
        normalise_payload(text, NONCE_HEX, "HOPPER", require=True)


def test_empty_list_allowed_when_not_required() -> None:
    out = normalise_payload('{"evidence_list": []}', NONCE_HEX, "HOPPER", require=False)
    assert json.loads(out) == {"evidence_list": [], "nonce": NONCE_HEX, "arch": "HOPPER"}


def test_url_and_command_helpers() -> None:
    assert url_with_nonce("http://h/p", "ab") == "http://h/p?nonce=ab"
    assert url_with_nonce("http://h/p?x=1", "ab") == "http://h/p?x=1&nonce=ab"
    assert url_with_nonce("http://h/p?nonce=zz", "ab") == "http://h/p?nonce=zz"
    assert command_argv("cmd", ("--nonce", "{nonce}", "x${nonce}y"), "ab") == [
        "cmd",
        "--nonce",
        "ab",
        "xaby",
    ]
    assert url_reply_payload(b'{"nvidia_payload": "{\\"a\\": 1}"}') == '{"a": 1}'
    assert url_reply_payload(b'{"evidence_list": []}') == '{"evidence_list": []}'
    with pytest.raises(NvidiaEvidenceError):
        url_reply_payload(b"nope")
