"""NVIDIA GPU evidence for a report: native collection through NVML and the configured sources.

Reads: an NVML module (``pynvml`` from nvidia-ml-py in production, a stand-in in tests) passed
as a parameter, the 32-byte request nonce, and the text the inline, file, URL or command
sources produced.
Guarantees:
- :func:`collect_evidence` is blocking and meant for a worker thread. It calls init, checks that
  confidential computing is on (unless told not to), then for every GPU the architecture
  (Hopper or Blackwell), the certificate chain and the attestation report for the nonce, and
  shuts NVML down again whenever init succeeded. It returns one entry per GPU or raises
  :class:`NvidiaEvidenceError` with a message that says what failed; there are no partial lists;
- an entry's ``evidence`` is the standard base64 of the report bytes (checked to echo the nonce
  at bytes 4..36); its ``certificate`` is the standard base64 of the GPU's PEM chain with the
  GPU-supplied root replaced by the NVIDIA Device Identity CA (:data:`DEVICE_IDENTITY_CA_PEM`);
- :func:`normalise_payload` turns a supplied payload (``evidence_list``, ``evidences`` or a
  single ``evidence`` object) into ``{"nonce","evidence_list","arch"}`` JSON text and, when
  evidence is required, refuses an empty list or a list with empty entries;
- :func:`load_pynvml` imports ``pynvml`` only when called.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import re
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from guard_adapters._errors import AdapterError
from guard_adapters._json import json_object

__all__ = (
    "DEVICE_IDENTITY_CA_PEM",
    "EvidenceEntry",
    "NvidiaEvidenceError",
    "collect_evidence",
    "command_argv",
    "empty_payload",
    "evidence_payload",
    "load_pynvml",
    "normalise_chain",
    "normalise_payload",
    "substitute_nonce",
    "url_reply_payload",
    "url_with_nonce",
)

#: NVIDIA's Device Identity CA (public; published in NVIDIA/nvtrust as verifier_device_root.pem,
#: SHA-256 fingerprint 10:2B:F6:59:...:0B:16:7B:48). Verifiers expect it as the chain's root.
DEVICE_IDENTITY_CA_PEM: Final = b"""-----BEGIN CERTIFICATE-----
MIICCzCCAZCgAwIBAgIQLTZwscoQBBHB/sDoKgZbVDAKBggqhkjOPQQDAzA1MSIw
IAYDVQQDDBlOVklESUEgRGV2aWNlIElkZW50aXR5IENBMQ8wDQYDVQQKDAZOVklE
SUEwIBcNMjExMTA1MDAwMDAwWhgPOTk5OTEyMzEyMzU5NTlaMDUxIjAgBgNVBAMM
GU5WSURJQSBEZXZpY2UgSWRlbnRpdHkgQ0ExDzANBgNVBAoMBk5WSURJQTB2MBAG
ByqGSM49AgEGBSuBBAAiA2IABA5MFKM7+KViZljbQSlgfky/RRnEQScW9NDZF8SX
gAW96r6u/Ve8ZggtcYpPi2BS4VFu6KfEIrhN6FcHG7WP05W+oM+hxj7nyA1r1jkB
2Ry70YfThX3Ba1zOryOP+MJ9vaNjMGEwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8B
Af8EBAMCAQYwHQYDVR0OBBYEFFeF/4PyY8xlfWi3Olv0jUrL+0lfMB8GA1UdIwQY
MBaAFFeF/4PyY8xlfWi3Olv0jUrL+0lfMAoGCCqGSM49BAMDA2kAMGYCMQCPeFM3
TASsKQVaT+8S0sO9u97PVGCpE9d/I42IT7k3UUOLSR/qvJynVOD1vQKVXf0CMQC+
EY55WYoDBvs2wPAH1Gw4LbcwUN8QCff8bFmV4ZxjCRr4WXTLFHBKjbfneGSBWwA=
-----END CERTIFICATE-----
"""

_ARCHITECTURES: Final = {9: "HOPPER", 10: "BLACKWELL"}
_REPORT_MAX: Final = 0x2000
_CHAIN_MAX: Final = 0x1400
_CC_FEATURE_ENABLED: Final = 1
_MULTI_GPU_PROTECTED_PCIE: Final = 1
_NONCE_AT: Final = slice(4, 36)
# Clearer words for the NVML return codes an operator is likely to meet.
_NVML_CODES: Final = {
    1: "NVML is not initialised",
    3: "not supported (is confidential-computing mode on?)",
    4: "no permission to query the GPU",
    9: "the NVIDIA driver is not loaded",
    12: "NVML library not found (no GPU driver)",
    13: "the driver lacks the confidential-computing functions (too old?)",
}


class NvidiaEvidenceError(AdapterError):
    """No usable GPU evidence; the message is fit for the 500 ``detail``."""


@attrs.frozen
class EvidenceEntry:
    certificate: str
    evidence: str
    arch: str

    def as_json(self) -> dict[str, str]:
        return {"certificate": self.certificate, "evidence": self.evidence, "arch": self.arch}


def load_pynvml() -> ModuleType:
    """The real NVML bindings (nvidia-ml-py), imported on first use."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvidiaEvidenceError(f"nvidia-ml-py (pynvml) cannot be imported: {exc}") from None


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    if isinstance(code, int) and code in _NVML_CODES:
        return _NVML_CODES[code]
    return str(exc) or type(exc).__name__


def normalise_chain(chain_pem: bytes) -> str:
    """The GPU's PEM chain with its last certificate replaced by the Device Identity CA."""
    try:
        certificates = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as exc:
        raise NvidiaEvidenceError(f"GPU certificate chain is not PEM: {exc}") from None
    if len(certificates) < 2:
        raise NvidiaEvidenceError("GPU certificate chain has fewer than two certificates")
    root = x509.load_pem_x509_certificate(DEVICE_IDENTITY_CA_PEM)
    return b"".join(
        c.public_bytes(serialization.Encoding.PEM) for c in [*certificates[:-1], root]
    ).decode("ascii")


def _sized(array: Any, size: int, limit: int, what: str) -> bytes:
    if not 0 < size <= limit:
        raise NvidiaEvidenceError(f"{what} size {size} outside 1..{limit}")
    return bytes(array)[:size]


def _check_cc(nvml: Any) -> None:
    state = nvml.nvmlSystemGetConfComputeState()
    if state.ccFeature == _CC_FEATURE_ENABLED:
        return
    # Protected-PCIe multi-GPU systems report CC through the settings, not the state.
    settings_type = getattr(nvml, "c_nvmlSystemConfComputeSettings_v1_t", None)
    getter = getattr(nvml, "nvmlSystemGetConfComputeSettings", None)
    if settings_type is not None and getter is not None:
        import ctypes  # noqa: PLC0415 - only this rare path needs it

        settings = settings_type()
        if getter(ctypes.byref(settings)) == 0 and (
            settings.multiGpuMode == _MULTI_GPU_PROTECTED_PCIE
        ):
            return
    raise NvidiaEvidenceError(
        "NVIDIA evidence unavailable: confidential-computing mode is off on this machine"
    )


def _one_gpu(nvml: Any, index: int, nonce: bytes) -> EvidenceEntry:
    step = "handle"
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        step = "architecture"
        code = nvml.nvmlDeviceGetArchitecture(handle)
        arch = _ARCHITECTURES.get(int(code))
        if arch is None:
            raise NvidiaEvidenceError(
                f"NVIDIA evidence unavailable: GPU {index}: architecture {code} is neither "
                "Hopper nor Blackwell"
            )
        step = "certificate"
        cert = nvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
        step = "attestation report"
        report = nvml.nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)
    except nvml.NVMLError as exc:
        raise NvidiaEvidenceError(
            f"NVIDIA evidence unavailable: GPU {index}: {step}: {_describe(exc)}"
        ) from None
    try:
        chain = _sized(
            cert.attestationCertChain, cert.attestationCertChainSize, _CHAIN_MAX, "chain"
        )
        raw = _sized(report.attestationReport, report.attestationReportSize, _REPORT_MAX, "report")
        if raw[_NONCE_AT] != nonce:
            raise NvidiaEvidenceError("report does not carry the request nonce")
        certificate = normalise_chain(chain)
    except NvidiaEvidenceError as exc:
        raise NvidiaEvidenceError(f"NVIDIA evidence unavailable: GPU {index}: {exc}") from None
    return EvidenceEntry(
        certificate=base64.b64encode(certificate.encode("ascii")).decode("ascii"),
        evidence=base64.b64encode(raw).decode("ascii"),
        arch=arch,
    )


def collect_evidence(nvml: Any, nonce: bytes, *, check_cc: bool = True) -> list[EvidenceEntry]:
    """One evidence entry per GPU for ``nonce`` (blocking; run it in a worker thread)."""
    if len(nonce) != 32:
        raise ValueError("the GPU nonce is 32 bytes")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvidiaEvidenceError(f"NVIDIA evidence unavailable: {_describe(exc)}") from None
    try:
        try:
            if check_cc:
                _check_cc(nvml)
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise NvidiaEvidenceError(f"NVIDIA evidence unavailable: {_describe(exc)}") from None
        if count <= 0:
            raise NvidiaEvidenceError("NVIDIA evidence unavailable: NVML returned zero GPUs")
        return [_one_gpu(nvml, index, nonce) for index in range(count)]
    finally:
        # The evidence (or the error being raised) is what matters, not a failed shutdown.
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


# -- payloads


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def evidence_payload(nonce_hex: str, entries: Sequence[EvidenceEntry]) -> str:
    """The ``nvidia_payload`` text for natively collected evidence."""
    if not entries:
        raise NvidiaEvidenceError("NVIDIA evidence unavailable: no GPU evidence")
    return _dump(
        {
            "nonce": nonce_hex,
            "evidence_list": [e.as_json() for e in entries],
            "arch": entries[0].arch,
        }
    )


def empty_payload(nonce_hex: str, arch: str) -> str:
    """The test-only payload served when evidence is not required and none is available."""
    return _dump({"nonce": nonce_hex, "evidence_list": [], "arch": arch})


def substitute_nonce(text: str, nonce_hex: str) -> str:
    return text.replace("${nonce}", nonce_hex)


def command_argv(command: str, args: Sequence[str], nonce_hex: str) -> list[str]:
    return [
        command,
        *(a.replace("${nonce}", nonce_hex).replace("{nonce}", nonce_hex) for a in args),
    ]


def url_with_nonce(url: str, nonce_hex: str) -> str:
    """``url`` with ``nonce=<hex>`` added to its query unless it already names a nonce."""
    parts = urlsplit(url)
    if any(name == "nonce" for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
        return url
    extra = urlencode({"nonce": nonce_hex})
    query = f"{parts.query}&{extra}" if parts.query else extra
    return urlunsplit(parts._replace(query=query))


def url_reply_payload(body: bytes) -> str:
    """The payload text in a URL reply: the reply itself, or its ``nvidia_payload`` string."""
    try:
        parsed = json.loads(body)
    except ValueError:
        raise NvidiaEvidenceError("NVIDIA payload URL returned something other than JSON") from None
    if isinstance(parsed, dict) and isinstance(parsed.get("nvidia_payload"), str):
        return str(parsed["nvidia_payload"])
    return body.decode("utf-8")


def _empty(item: Any) -> bool:
    return item is None or (isinstance(item, str | list | dict) and len(item) == 0)


_SPACE_ONLY: Final = re.compile(r"\s*")


def normalise_payload(text: str, nonce_hex: str, default_arch: str, *, require: bool) -> str:
    """A supplied payload in the ``{"nonce","evidence_list","arch"}`` shape, as JSON text."""
    if _SPACE_ONLY.fullmatch(text):
        raise NvidiaEvidenceError("NVIDIA payload is empty")
    parsed = json_object(text, "NVIDIA payload", NvidiaEvidenceError)
    payload: dict[str, Any]
    if "evidence_list" in parsed:
        payload = dict(parsed)
        payload.setdefault("nonce", nonce_hex)
        payload.setdefault("arch", default_arch)
    elif "evidences" in parsed:
        arch = parsed.get("arch")
        payload = {
            "nonce": nonce_hex,
            "evidence_list": parsed["evidences"],
            "arch": arch if isinstance(arch, str) and arch else default_arch,
        }
    elif isinstance(parsed.get("evidence"), str) and parsed["evidence"]:
        arch = parsed.get("arch")
        payload = {
            "nonce": nonce_hex,
            "evidence_list": [parsed],
            "arch": arch if isinstance(arch, str) and arch else default_arch,
        }
    else:
        raise NvidiaEvidenceError("NVIDIA payload has no evidence_list, evidences or evidence")
    evidence = payload["evidence_list"]
    if not isinstance(evidence, list):
        raise NvidiaEvidenceError("NVIDIA payload's evidence_list is not a list")
    if require:
        if not evidence:
            raise NvidiaEvidenceError("NVIDIA payload has an empty evidence_list")
        if any(_empty(item) for item in evidence):
            raise NvidiaEvidenceError("NVIDIA payload has an empty evidence entry")
    return _dump(payload)
