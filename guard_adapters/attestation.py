"""The pure parts of ``/v1/attestation/report`` (spec 9.2): parameters, identities, report_data
and the response document.

Reads: the raw query string of a GET, the signing keys made at start-up, the PEM text of the TLS
certificate (version 2), and the values the dstack agent and the NVIDIA sources returned.
Guarantees:
- :func:`parse_query` checks ``version``, then ``signing_algo``, then ``nonce`` and returns the
  first problem as a :class:`Failure` (status 400 and PIG's message), never raising; a blank or
  absent nonce is replaced by the bytes the caller's ``random_nonce`` returns;
- the nonce is accepted only as exactly 64 ASCII hex digits (either case, nothing around them):
  ``bytes.fromhex`` is not used to validate because it skips spaces;
- :func:`report_data` always returns 64 bytes: the 32-byte identity value then the nonce, where
  the identity value is the padded identity (version 1) or ``SHA-256(identity || SPKI hash)``
  (version 2); version 2 without a fingerprint raises, it never falls back to version 1;
- the ECDSA address is Keccak-256 (the original Keccak padding, as Ethereum uses, not SHA3-256)
  of the 64-byte public key, last 20 bytes;
- :func:`report_document` builds the exact key set of spec 9.2, ``all_attestations`` holding the
  same object without itself; :func:`encode_json` gives sorted keys and a trailing newline.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal
from urllib.parse import parse_qsl

import attrs
from Crypto.Hash import keccak
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

__all__ = (
    "CERT_REQUIRED",
    "NONCE_BYTES",
    "REPORT_DATA_BYTES",
    "Failure",
    "ReportParams",
    "SigningAlgo",
    "SigningIdentity",
    "ecdsa_identity",
    "ed25519_identity",
    "encode_json",
    "error_body",
    "ethereum_address",
    "generate_identities",
    "keccak256",
    "parse_query",
    "report_data",
    "report_document",
    "spki_fingerprint",
)

SigningAlgo = Literal["ecdsa", "ed25519"]

NONCE_BYTES: Final = 32
REPORT_DATA_BYTES: Final = 64
#: The 400 message for version 2 without a usable certificate.
CERT_REQUIRED: Final = "attestation version 2 requires a TLS certificate (set TLS_CERT_PATH)"

_NONCE_RE: Final = re.compile(r"[0-9A-Fa-f]*")
_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
# Go's strconv.Atoi refuses what does not fit an int64; the raw text is then reported.
_INT64_MAX: Final = 2**63 - 1


@attrs.frozen
class Failure:
    """A refusal: the HTTP status (400 or 500) and the ``detail`` text."""

    status: int
    detail: str


@attrs.frozen
class ReportParams:
    version: int
    signing_algo: SigningAlgo
    nonce: bytes


def _first_values(query: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        values.setdefault(name, value)
    return values


def _parse_version(raw: str | None) -> int | Failure:
    if raw is None or raw == "":
        return 1
    if _INT_RE.fullmatch(raw) is None or abs(int(raw)) > _INT64_MAX:
        return Failure(400, f"Unsupported attestation report version: {raw}")
    number = int(raw)
    if number == 0:
        return 1
    if number not in (1, 2):
        return Failure(400, f"Unsupported attestation report version: {number}")
    return number


def _parse_algo(raw: str | None) -> SigningAlgo | Failure:
    algo = (raw or "").strip().lower()
    if algo in ("", "ecdsa"):
        return "ecdsa"
    if algo == "ed25519":
        return "ed25519"
    return Failure(400, "Unsupported signing algorithm")


def _parse_nonce(raw: str | None, random_nonce: Callable[[], bytes]) -> bytes | Failure:
    if raw is None or raw.strip() == "":
        nonce = random_nonce()
        if len(nonce) != NONCE_BYTES:
            return Failure(500, "nonce generator returned the wrong length")
        return nonce
    if _NONCE_RE.fullmatch(raw) is None or len(raw) % 2:
        return Failure(400, "nonce must be hex-encoded")
    if len(raw) != 2 * NONCE_BYTES:
        return Failure(400, "nonce must be 32 bytes")
    return bytes.fromhex(raw)


def parse_query(query: str, random_nonce: Callable[[], bytes]) -> ReportParams | Failure:
    """The request's parameters, or the first refusal in the order version, algo, nonce."""
    values = _first_values(query)
    version = _parse_version(values.get("version"))
    if isinstance(version, Failure):
        return version
    algo = _parse_algo(values.get("signing_algo"))
    if isinstance(algo, Failure):
        return algo
    nonce = _parse_nonce(values.get("nonce"), random_nonce)
    if isinstance(nonce, Failure):
        return nonce
    return ReportParams(version, algo, nonce)


# -- identities


def keccak256(data: bytes) -> bytes:
    """Keccak-256 with the original padding (Ethereum's hash), not SHA3-256."""
    return keccak.new(digest_bits=256, data=data).digest()


def ethereum_address(public_xy: bytes) -> bytes:
    """The 20-byte address of a 64-byte uncompressed secp256k1 key (no ``04`` prefix)."""
    if len(public_xy) != 64:
        raise ValueError("an uncompressed secp256k1 key is 64 bytes without its prefix")
    return keccak256(public_xy)[-20:]


@attrs.frozen
class SigningIdentity:
    """What a report says about one key: the two hex fields and the report_data bytes."""

    algo: SigningAlgo
    address: str
    public_key: str
    identity: bytes


def ecdsa_identity(key: ec.EllipticCurvePrivateKey) -> SigningIdentity:
    if not isinstance(key.curve, ec.SECP256K1):
        raise ValueError("the ECDSA identity key must be on secp256k1")
    point = key.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    xy = point[1:]
    address = ethereum_address(xy)
    return SigningIdentity("ecdsa", "0x" + address.hex(), xy.hex(), address)


def ed25519_identity(key: ed25519.Ed25519PrivateKey) -> SigningIdentity:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SigningIdentity("ed25519", raw.hex(), raw.hex(), raw)


def generate_identities() -> dict[SigningAlgo, SigningIdentity]:
    """Fresh in-memory keys, one per algorithm (they only name the instance; nothing is signed)."""
    return {
        "ecdsa": ecdsa_identity(ec.generate_private_key(ec.SECP256K1())),
        "ed25519": ed25519_identity(ed25519.Ed25519PrivateKey.generate()),
    }


# -- report_data


def spki_fingerprint(pem: bytes) -> bytes:
    """SHA-256 of the DER SubjectPublicKeyInfo of the first certificate in ``pem``.

    Raises ValueError when the text holds no parsable certificate.
    """
    certificate = x509.load_pem_x509_certificate(pem)
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def report_data(
    version: int, identity: bytes, nonce: bytes, fingerprint: bytes | None = None
) -> bytes:
    """The 64 bytes handed to GetQuote (spec 9.2)."""
    if not 0 < len(identity) <= 32:
        raise ValueError("the identity must be 1 to 32 bytes")
    if len(nonce) != NONCE_BYTES:
        raise ValueError("the nonce must be 32 bytes")
    if version == 1:
        head = identity.ljust(32, b"\0")
    elif version == 2:
        if fingerprint is None or len(fingerprint) != 32:
            raise ValueError("version 2 needs the 32-byte SPKI fingerprint")
        head = hashlib.sha256(identity + fingerprint).digest()
    else:
        raise ValueError(f"no report_data layout for version {version}")
    return head + nonce


# -- response


def report_document(
    *,
    identity: SigningIdentity,
    nonce: bytes,
    version: int,
    quote: str,
    event_log: str,
    vm_config: str,
    info: Mapping[str, Any],
    nvidia_payload: str,
    fingerprint: bytes | None,
) -> dict[str, Any]:
    """The 200 body: one attestation object plus ``all_attestations`` holding a copy of it."""
    attestation: dict[str, Any] = {
        "signing_address": identity.address,
        "signing_algo": identity.algo,
        "signing_public_key": identity.public_key,
        "request_nonce": nonce.hex(),
        "intel_quote": quote,
        "quote": quote,
        "event_log": event_log,
        "vm_config": vm_config,
        "info": dict(info),
        "nvidia_payload": nvidia_payload,
        "version": version,
    }
    if version == 2:
        if fingerprint is None:
            raise ValueError("a version 2 report carries the TLS fingerprint")
        attestation["tls_cert_fingerprint"] = fingerprint.hex()
    return {**attestation, "all_attestations": [dict(attestation)]}


def encode_json(value: Any) -> bytes:
    """Compact JSON with sorted keys and a trailing newline (Go's map encoding order)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def error_body(detail: str) -> bytes:
    return encode_json({"detail": detail})
