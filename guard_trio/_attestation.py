"""The I/O side of ``/v1/attestation/report``: dstack over HTTP/1.1, NVML in a worker thread, and
the URL and command fallbacks for GPU evidence.

Reads: the loaded :class:`~guard_adapters.config.Settings` (``ATTESTATION_*``, ``TLS_CERT_PATH``,
the dstack endpoint); per request the method and the raw query string. Authentication and routing
stay with the proxy, which calls :meth:`AttestationHandler.report` after its own auth check.
Guarantees:
- the answer is 405 for any method but GET, 404 when attestation is off, 400 for a bad parameter
  or (version 2) a missing certificate, 500 for every later failure, and 200 only with a quote
  that carries the request's report_data, the agent's Info and GPU evidence (an empty evidence
  list only when ``ATTESTATION_REQUIRE_NVIDIA_EVIDENCE`` is false); error bodies are
  ``{"detail": ...}`` JSON;
- each dstack call opens its own connection and ends within ``dstack_timeout_s`` (3 s);
- NVML runs in a worker thread, one collection at a time (a capacity limiter of one that stays
  held until the thread really ends, even when a request gave up waiting), within
  ``nvml_timeout_s``; the command fallback is killed at its timeout;
- the TLS certificate is read again for every version-2 request; nothing is cached between
  requests except the signing keys made at construction.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import urlsplit

import trio

from guard_adapters.attestation import (
    CERT_REQUIRED,
    Failure,
    SigningAlgo,
    SigningIdentity,
    encode_json,
    error_body,
    generate_identities,
    parse_query,
    report_data,
    report_document,
    spki_fingerprint,
)
from guard_adapters.config import Settings
from guard_adapters.dstack import (
    DstackError,
    DstackRequest,
    Endpoint,
    Quote,
    info_request,
    parse_info,
    parse_quote,
    quote_request,
)
from guard_adapters.nvml import (
    EvidenceEntry,
    NvidiaEvidenceError,
    collect_evidence,
    command_argv,
    empty_payload,
    evidence_payload,
    load_pynvml,
    normalise_payload,
    substitute_nonce,
    url_reply_payload,
    url_with_nonce,
)
from guard_trio._http import FetchError, exchange, open_stream

__all__ = ("AttestationHandler",)

Headers = list[tuple[bytes, bytes]]

_JSON: Final = (b"content-type", b"application/json")
_TEXT: Final = (b"content-type", b"text/plain; charset=utf-8")
_DSTACK_MAX_BYTES: Final = 16 * 1024 * 1024
_URL_MAX_BYTES: Final = 32 * 1024 * 1024
_STDERR_SHOWN: Final = 400


class AttestationHandler:
    """Answers ``/v1/attestation/report``; built once per server from its Settings."""

    def __init__(
        self,
        settings: Settings,
        *,
        nvml_loader: Callable[[], Any] = load_pynvml,
        dstack_timeout_s: float = 3.0,
        nvml_timeout_s: float = 30.0,
        check_cc: bool = True,
        random_nonce: Callable[[], bytes] = lambda: os.urandom(32),
    ) -> None:
        env = settings.env
        self.enabled: bool = env.attestation_enabled
        self.identities: dict[SigningAlgo, SigningIdentity] = generate_identities()
        self._endpoint: Endpoint | None
        self._endpoint_problem = ""
        try:
            self._endpoint = Endpoint.from_settings(
                settings.dstack_base_url, settings.dstack_socket_path
            )
        except DstackError as exc:
            self._endpoint, self._endpoint_problem = None, str(exc)
        self._tls_cert_path = env.tls_cert_path
        self._require_gpu = env.attestation_require_nvidia_evidence
        self._gpu_arch = env.attestation_gpu_arch
        self._inline = env.attestation_nvidia_payload
        self._payload_file = env.attestation_nvidia_payload_file
        self._payload_url = env.attestation_nvidia_payload_url
        self._payload_authorization = env.attestation_nvidia_payload_authorization
        self._command = env.attestation_nvidia_command
        self._command_args = tuple(env.attestation_nvidia_command_args)
        self._fallback_timeout_s = float(env.attestation_nvidia_command_timeout_seconds)
        self._nvml_loader = nvml_loader
        self._dstack_timeout_s = dstack_timeout_s
        self._nvml_timeout_s = nvml_timeout_s
        self._check_cc = check_cc
        self._random_nonce = random_nonce
        # One NVML collection at a time. A limiter (unlike a lock) stays held by an abandoned
        # worker thread until it really returns, so a stuck driver call is never doubled up.
        self._nvml_limiter = trio.CapacityLimiter(1)

    async def report(self, *, method: bytes, query: str) -> tuple[int, Headers, bytes]:
        """Status, headers and body for one request that already passed the proxy's auth."""
        if method != b"GET":
            return 405, [_TEXT], b"method not allowed\n"
        if not self.enabled:
            return 404, [_TEXT], b"404 page not found\n"
        try:
            result = await self._report(query)
        except Exception as exc:  # fail closed on anything unforeseen, with a clear reason
            result = Failure(500, f"attestation failed: {type(exc).__name__}: {exc}")
        if isinstance(result, Failure):
            return result.status, [_JSON], error_body(result.detail)
        return 200, [_JSON], encode_json(result)

    async def _report(self, query: str) -> dict[str, Any] | Failure:
        params = parse_query(query, self._random_nonce)
        if isinstance(params, Failure):
            return params
        identity = self.identities[params.signing_algo]
        fingerprint: bytes | None = None
        if params.version == 2:
            fingerprint = await self._fingerprint()
            if fingerprint is None:
                return Failure(400, CERT_REQUIRED)
        data = report_data(params.version, identity.identity, params.nonce, fingerprint)
        quote = await self._quote(data)
        if isinstance(quote, Failure):
            return quote
        info = await self._info()
        if isinstance(info, Failure):
            return info
        payload = await self._nvidia_payload(params.nonce)
        if isinstance(payload, Failure):
            return payload
        return report_document(
            identity=identity,
            nonce=params.nonce,
            version=params.version,
            quote=quote.quote,
            event_log=quote.event_log,
            vm_config=quote.vm_config,
            info=info,
            nvidia_payload=payload,
            fingerprint=fingerprint,
        )

    async def _fingerprint(self) -> bytes | None:
        if not self._tls_cert_path:
            return None
        try:
            pem = await trio.Path(self._tls_cert_path).read_bytes()
            return spki_fingerprint(pem)
        except (OSError, ValueError):
            return None

    # -- dstack

    async def _dstack(self, request: DstackRequest) -> tuple[int, bytes]:
        endpoint = self._endpoint
        if endpoint is None:
            raise FetchError(self._endpoint_problem)
        with trio.move_on_after(self._dstack_timeout_s) as scope:
            if endpoint.socket_path is not None:
                try:
                    stream: trio.abc.Stream = await trio.open_unix_socket(endpoint.socket_path)
                except OSError as exc:
                    raise FetchError(
                        f"connect to {endpoint.describe()} failed: {exc.strerror or exc}"
                    ) from None
            else:
                stream = await open_stream(endpoint.host, endpoint.port, secure=endpoint.secure)
            async with stream:
                response = await exchange(
                    stream,
                    method=request.method,
                    target=request.target,
                    headers=request.headers,
                    body=request.body,
                    max_bytes=_DSTACK_MAX_BYTES,
                )
                return response.status, response.body
        assert scope.cancelled_caught
        raise FetchError(f"no reply from {endpoint.describe()} within {self._dstack_timeout_s:g} s")

    async def _quote(self, data: bytes) -> Quote | Failure:
        if self._endpoint is None:
            return Failure(500, f"get dstack quote: {self._endpoint_problem}")
        try:
            status, body = await self._dstack(quote_request(self._endpoint, data))
            return parse_quote(status, body, data)
        except (FetchError, DstackError) as exc:
            return Failure(500, f"get dstack quote: {exc}")

    async def _info(self) -> dict[str, Any] | Failure:
        if self._endpoint is None:
            return Failure(500, f"get dstack info: {self._endpoint_problem}")
        try:
            status, body = await self._dstack(info_request(self._endpoint))
            return parse_info(status, body)
        except (FetchError, DstackError) as exc:
            return Failure(500, f"get dstack info: {exc}")

    # -- NVIDIA evidence

    async def _nvidia_payload(self, nonce: bytes) -> str | Failure:
        """Sources in PIG's order: inline, file, native NVML, URL, command, then (only when not
        required) an empty list. A configured inline, file, URL or command source that fails
        is the answer; a native failure moves on to the URL and the command."""
        nonce_hex = nonce.hex()
        try:
            if self._inline:
                return self._normalise(substitute_nonce(self._inline, nonce_hex), nonce_hex)
            if self._payload_file:
                return self._normalise(
                    substitute_nonce(await self._read_payload_file(), nonce_hex), nonce_hex
                )
            try:
                return evidence_payload(nonce_hex, await self._native(nonce))
            except NvidiaEvidenceError as exc:
                native_problem = str(exc)
            if self._payload_url:
                return self._normalise(await self._from_url(nonce_hex), nonce_hex)
            if self._command:
                return self._normalise(await self._from_command(nonce_hex), nonce_hex)
        except NvidiaEvidenceError as exc:
            return Failure(500, str(exc))
        if not self._require_gpu:
            return empty_payload(nonce_hex, self._gpu_arch)
        return Failure(
            500,
            f"{native_problem} (and neither ATTESTATION_NVIDIA_PAYLOAD_URL nor "
            "ATTESTATION_NVIDIA_COMMAND is set)",
        )

    def _normalise(self, text: str, nonce_hex: str) -> str:
        return normalise_payload(text, nonce_hex, self._gpu_arch, require=self._require_gpu)

    async def _read_payload_file(self) -> str:
        try:
            return (await trio.Path(self._payload_file).read_text(encoding="utf-8")).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise NvidiaEvidenceError(
                f"cannot read ATTESTATION_NVIDIA_PAYLOAD_FILE: {exc}"
            ) from None

    def _collect(self, nonce: bytes) -> list[EvidenceEntry]:
        return collect_evidence(self._nvml_loader(), nonce, check_cc=self._check_cc)

    async def _native(self, nonce: bytes) -> list[EvidenceEntry]:
        with trio.move_on_after(self._nvml_timeout_s) as scope:
            try:
                return await trio.to_thread.run_sync(
                    self._collect, nonce, limiter=self._nvml_limiter, abandon_on_cancel=True
                )
            except NvidiaEvidenceError:
                raise
            except Exception as exc:
                raise NvidiaEvidenceError(
                    f"NVIDIA evidence unavailable: {type(exc).__name__}: {exc}"
                ) from None
        assert scope.cancelled_caught
        raise NvidiaEvidenceError(
            f"NVIDIA evidence unavailable: NVML did not answer within {self._nvml_timeout_s:g} s"
        )

    async def _from_url(self, nonce_hex: str) -> str:
        url = url_with_nonce(self._payload_url, nonce_hex)
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise NvidiaEvidenceError("ATTESTATION_NVIDIA_PAYLOAD_URL is not an http(s) URL")
        secure = parts.scheme.lower() == "https"
        port = parts.port or (443 if secure else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [
            (b"Host", parts.netloc.rpartition("@")[2].encode()),
            (b"Accept", b"application/json"),
            (b"User-Agent", b"inference-guard"),
            (b"Connection", b"close"),
        ]
        if self._payload_authorization:
            headers.append((b"Authorization", self._payload_authorization.encode()))
        with trio.move_on_after(self._fallback_timeout_s) as scope:
            try:
                stream = await open_stream(parts.hostname, port, secure=secure)
                async with stream:
                    response = await exchange(
                        stream,
                        method=b"GET",
                        target=target,
                        headers=headers,
                        max_bytes=_URL_MAX_BYTES,
                    )
                status, body = response.status, response.body
            except FetchError as exc:
                raise NvidiaEvidenceError(f"NVIDIA payload URL: {exc}") from None
        if scope.cancelled_caught:
            raise NvidiaEvidenceError(
                f"NVIDIA payload URL: no reply within {self._fallback_timeout_s:g} s"
            )
        if not 200 <= status < 300:
            raise NvidiaEvidenceError(f"NVIDIA payload URL answered HTTP {status}")
        try:
            return url_reply_payload(body)
        except UnicodeDecodeError:
            raise NvidiaEvidenceError("NVIDIA payload URL reply is not UTF-8") from None

    async def _from_command(self, nonce_hex: str) -> str:
        argv = command_argv(self._command, self._command_args, nonce_hex)
        with trio.move_on_after(self._fallback_timeout_s) as scope:
            try:
                done = await trio.run_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            except OSError as exc:
                raise NvidiaEvidenceError(
                    f"NVIDIA evidence command could not start: {exc}"
                ) from None
        if scope.cancelled_caught:
            raise NvidiaEvidenceError(
                f"NVIDIA evidence command timed out after {self._fallback_timeout_s:g} s"
            )
        if done.returncode != 0:
            stderr = done.stderr.decode("utf-8", "replace").strip()[:_STDERR_SHOWN]
            raise NvidiaEvidenceError(
                f"NVIDIA evidence command exited with {done.returncode}"
                + (f": {stderr}" if stderr else "")
            )
        try:
            return bytes(done.stdout).decode("utf-8")
        except UnicodeDecodeError:
            raise NvidiaEvidenceError("NVIDIA evidence command output is not UTF-8") from None
