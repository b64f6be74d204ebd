"""Check that an attestation report from inference-guard is bound to your nonce (and TLS key).

Usage:
    curl -s -H "Authorization: Bearer $TOKEN" \
        "https://guard.example/v1/attestation/report?nonce=$NONCE&version=2" > report.json
    python examples/verify_report.py report.json --nonce $NONCE --cert server-cert.pem

What it checks (exit status 1 on the first hard failure):
- report_data is read from the quote bytes (offsets 568..632 of a TDX v4 quote), never from a
  JSON field; its second half must equal your nonce;
- its first half must equal the signing identity padded to 32 bytes (version 1), or
  SHA-256(identity || SHA-256(SubjectPublicKeyInfo of the TLS certificate)) (version 2);
- for ECDSA, the address must be the Keccak-256 address of ``signing_public_key``;
- ``nvidia_payload`` must name your nonce and hold at least one evidence entry;
- informational: the TD is not a debug TD, and ``sha256(app_compose) == compose_hash``.

What it does NOT check: the quote's signature and TCB status (send the quote to a dstack
verifier or Phala's verification API), or the GPU evidence itself (POST ``nvidia_payload`` to
NVIDIA's NRAS). A report that passes this script is only bound to your request; those two
services tell you whether the hardware behind it is genuine.

Needs ``cryptography`` and ``pycryptodome`` (both dependencies of inference-guard).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from Crypto.Hash import keccak
from cryptography import x509
from cryptography.hazmat.primitives import serialization

REPORT_DATA = slice(568, 632)
TD_ATTRIBUTES_DEBUG = 168
MR_CONFIG_ID = slice(232, 280)


class Failed(Exception):
    pass


def spki_sha256(pem: bytes) -> bytes:
    cert = x509.load_pem_x509_certificate(pem)  # the first certificate: the leaf
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).digest()


def identity_bytes(report: dict[str, Any]) -> bytes:
    algo = report.get("signing_algo")
    if algo == "ecdsa":
        address = bytes.fromhex(report["signing_address"].removeprefix("0x"))
        public = bytes.fromhex(report["signing_public_key"])
        derived = keccak.new(digest_bits=256, data=public).digest()[-20:]
        if len(address) != 20 or derived != address:
            raise Failed("signing_address is not the Keccak address of signing_public_key")
        return address
    if algo == "ed25519":
        key = bytes.fromhex(report["signing_public_key"])
        if len(key) != 32 or report["signing_address"].lower() != key.hex():
            raise Failed("an Ed25519 identity is its 32-byte public key")
        return key
    raise Failed(f"unknown signing_algo {algo!r}")


def verify(report: dict[str, Any], nonce_hex: str, cert_pem: bytes | None) -> list[str]:
    """Raise Failed on a binding problem; return informational notes."""
    notes: list[str] = []
    if report.get("all_attestations"):
        report = report["all_attestations"][0]
    if not re.fullmatch(r"[0-9a-fA-F]{64}", nonce_hex):
        raise Failed("your nonce must be 64 hex characters")
    nonce = bytes.fromhex(nonce_hex)
    quote = bytes.fromhex(report.get("intel_quote") or report["quote"])
    if len(quote) < REPORT_DATA.stop:
        raise Failed("the quote is too short to be a TDX quote")
    data = quote[REPORT_DATA]
    if data[32:] != nonce:
        raise Failed("the quote's report_data does not end with your nonce")
    if report.get("request_nonce", "").lower() != nonce_hex.lower():
        raise Failed("request_nonce differs from your nonce")
    identity = identity_bytes(report)
    version = report.get("version", 1)
    if version == 1:
        expected = identity.ljust(32, b"\0")
    elif version == 2:
        claimed = report.get("tls_cert_fingerprint")
        if not claimed:
            raise Failed("a version 2 report must carry tls_cert_fingerprint")
        fingerprint = bytes.fromhex(claimed)
        if cert_pem is not None and spki_sha256(cert_pem) != fingerprint:
            raise Failed("tls_cert_fingerprint does not match the certificate you gave")
        if cert_pem is None:
            notes.append("no --cert given: pin tls_cert_fingerprint on your TLS connection")
        expected = hashlib.sha256(identity + fingerprint).digest()
    else:
        raise Failed(f"unknown report version {version!r}")
    if data[:32] != expected:
        raise Failed("the quote's report_data does not bind the signing identity")
    payload = json.loads(report["nvidia_payload"])
    if str(payload.get("nonce", "")).lower() != nonce_hex.lower():
        raise Failed("nvidia_payload is for another nonce")
    if not payload.get("evidence_list"):
        raise Failed("nvidia_payload has no GPU evidence")
    if quote[TD_ATTRIBUTES_DEBUG] != 0:
        raise Failed("the quote comes from a debug TD")
    info = report.get("info") or {}
    tcb = info.get("tcb_info")
    if isinstance(tcb, str):
        tcb = json.loads(tcb)
    if isinstance(tcb, dict) and "app_compose" in tcb:
        compose = hashlib.sha256(tcb["app_compose"].encode()).hexdigest()
        notes.append(
            "compose hash "
            + ("matches" if compose == info.get("compose_hash") else "DOES NOT match")
            + " info.compose_hash"
        )
        if quote[MR_CONFIG_ID] != b"\x01" + bytes.fromhex(compose) + bytes(15):
            notes.append("mr_config_id does not carry 01||compose_hash (older dstack?)")
    notes.append("not checked here: the quote signature (dstack verifier) and NRAS for the GPUs")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="the JSON body of /v1/attestation/report")
    parser.add_argument("--nonce", required=True, help="the 64 hex characters you sent")
    parser.add_argument("--cert", type=Path, help="PEM of the server's TLS certificate (v2)")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    cert = args.cert.read_bytes() if args.cert else None
    try:
        notes = verify(report, args.nonce, cert)
    except (Failed, KeyError, ValueError) as exc:
        print(f"FAIL: {exc}")
        return 1
    print("OK: report_data binds your nonce and the signing identity")
    for note in notes:
        print(f"  - {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
