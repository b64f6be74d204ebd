"""The rules of one HTTP exchange through the guard, without I/O: which route a request takes,
what the backend and the client are told, and how a refusal is counted.

Reads: request targets and header lists (lower-case names, as h11 gives them), the routes the
settings declare, the gate's published state; nothing else (no clock, no sockets).
Guarantees:
- :func:`route_path` gives the path every check sees, the one the backend gets: the
  percent-decoded path, or None for a target some backend could read as another path (dot or
  empty segments, ``;``, ``#``, ``\\``, ``%`` left after decoding, an encoded slash, bytes
  outside printable ASCII);
- :class:`Routes` decides the route of a request in PIG's order (``/healthz``, the metrics and
  status routes, attestation, generation-route auth, QoS for a POST to an admitted path, plain
  forwarding, only to ``PIG_FORWARD_PATHS`` when set); a case or trailing-slash variant of a
  route the guard knows is refused (404) before any check;
- :func:`token_matches` compares SHA-256 digests in constant time: neither the token's length
  nor any byte of it changes how the comparison runs;
- :func:`upstream_headers` never passes on a client's ``X-PIG-*`` header, a hop-by-hop header
  (those the client names in ``Connection`` included), its ``Host``, ``Expect`` or framing;
  the backend gets its own ``Host``, the forwarded-for chain with the socket peer last, the
  guard's own ``X-PIG-*`` facts and, when given, the request's one ``X-Request-Id``;
- :func:`refusal_counts` is PIG's reject accounting: which counters one refusal moves.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import re
from collections.abc import Sequence
from urllib.parse import unquote

import attrs

from guard_adapters.sse import is_streaming_request
from guard_core import Binding, DecisionSource, GateState, Lane, LoadState, RejectCode, Tier
from guard_core.routing import PathPolicy

__all__ = (
    "BAD_ENCODING_BODY",
    "GATEWAY_TIMEOUT_BODY",
    "NOT_FOUND",
    "TOO_MANY_REQUESTS_BODY",
    "UNAUTHORIZED_JSON",
    "ClientHead",
    "RefusalCounts",
    "Route",
    "Routes",
    "chunked_passthrough",
    "client_head",
    "content_length",
    "first_header",
    "header_values",
    "hop_by_hop",
    "is_chunked",
    "low_load",
    "openai_error",
    "refusal_counts",
    "route_key",
    "route_path",
    "token_digest",
    "token_matches",
    "upstream_headers",
    "with_sse_defaults",
    "without_length",
)

Headers = Sequence[tuple[bytes, bytes]]


def openai_error(message: bytes, kind: bytes, code: int) -> bytes:
    """An OpenAI-style error body (PIG's shape): what every refusal of the guard answers."""
    return b'{"error":{"message":"%b","type":"%b","param":null,"code":%d}}\n' % (
        message,
        kind,
        code,
    )


TOO_MANY_REQUESTS_BODY = openai_error(b"Too many requests", b"TooManyRequestsError", 429)
GATEWAY_TIMEOUT_BODY = openai_error(
    b"The backend did not answer in time", b"GatewayTimeoutError", 504
)
UNAUTHORIZED_JSON = openai_error(
    b"Invalid or missing Authorization header", b"AuthenticationError", 401
)
BAD_ENCODING_BODY = openai_error(
    b"The request body must be JSON encoded as UTF-8", b"BadRequestError", 400
)
NOT_FOUND = b"404 page not found\n"

# -- paths -------------------------------------------------------------------------------------

#: The routes the guard answers itself (their case and trailing-slash variants are refused).
OWN_ROUTES = ("/healthz", "/pig/metrics", "/v1/metrics", "/v1/upstream-status")
ATTESTATION_ROUTE = "/v1/attestation/report"
#: In the raw path: anything but printable ASCII, a fragment, a backslash or an encoded slash.
_UNSAFE_RAW = re.compile(rb"[^\x21-\x7e]|[#\\]|%2[fF]")
#: In the decoded path: the same, plus what some backend would split, strip or decode again.
_UNSAFE_DECODED = re.compile(r"[^\x21-\x7e]|[#\\;?%]|//|/\.\.?(?:/|$)")


def route_path(target: bytes) -> str | None:
    """The decoded path the guard routes on, or None when a backend could read ``target`` as
    another path than the guard would. Only origin-form targets are served."""
    if not target.startswith(b"/"):
        return None
    raw_path = target.partition(b"?")[0]
    if _UNSAFE_RAW.search(raw_path):
        return None
    path = raw_path.decode("ascii")
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            return None
    if _UNSAFE_DECODED.search(path):
        return None
    return path


def route_key(path: str) -> str:
    """What a lenient backend might treat as the same route: case and trailing slashes."""
    return path.rstrip("/").lower() or "/"


class Route(enum.Enum):
    """Where a request goes, in the order PIG checks."""

    NOT_FOUND = "not_found"
    HEALTH = "health"
    METRICS = "metrics"
    ALL_METRICS = "all_metrics"
    UPSTREAM_STATUS = "upstream_status"
    ATTESTATION = "attestation"
    #: A POST to a generation route without the API token (JSON 401).
    UNAUTHORIZED = "unauthorized"
    #: An ``Upgrade`` on an admitted path (400).
    UPGRADE_REFUSED = "upgrade_refused"
    #: QoS: a slot, a short wait or a 429, then forwarding.
    ADMITTED = "admitted"
    FORWARD = "forward"
    #: ``GET /v1/models`` with ``PIG_POOLS``: the union of the pools' models, the guard's own.
    MODELS = "models"


_OWN = {
    "/healthz": Route.HEALTH,
    "/pig/metrics": Route.METRICS,
    "/v1/metrics": Route.ALL_METRICS,
    "/v1/upstream-status": Route.UPSTREAM_STATUS,
    ATTESTATION_ROUTE: Route.ATTESTATION,
}


@attrs.frozen(cache_hash=True)  # a key of :func:`admitted_post`'s cache, hashed once
class Routes:
    """The routes the settings declare, and the rule that picks one for a request."""

    #: ``PIG_ADMITTED_PATHS``: POSTs here go through admission.
    admitted: PathPolicy
    #: ``API_AUTH_PATHS``: with ``api_auth``, POSTs here need the token.
    auth: PathPolicy
    api_auth: bool
    #: ``PIG_FORWARD_PATHS``: None forwards every other path (PIG).
    forward: frozenset[str] | None
    known_routes: frozenset[str]
    known_keys: frozenset[str]
    suffix_keys: tuple[str, ...]
    #: ``PIG_POOLS`` is set: several models behind one guard, whose list is theirs together.
    models_union: bool = False

    @classmethod
    def build(
        cls,
        *,
        admitted: PathPolicy,
        auth: PathPolicy,
        api_auth: bool,
        forward: Sequence[str] = (),
        models_union: bool = False,
    ) -> Routes:
        known = (*OWN_ROUTES, ATTESTATION_ROUTE, *admitted.paths, *auth.paths, *forward)
        suffix_keys = (
            tuple(sorted({route_key(r) for r in (*admitted.paths, *auth.paths)}))
            if admitted.suffix_match
            else ()
        )
        return cls(
            admitted=admitted,
            auth=auth,
            api_auth=api_auth,
            forward=frozenset(forward) or None,
            known_routes=frozenset(known),
            known_keys=frozenset(route_key(route) for route in known),
            suffix_keys=suffix_keys,
            models_union=models_union,
        )

    def lookalike(self, path: str) -> bool:
        """A case or trailing-slash variant of a route the guard knows, which a lenient backend
        could serve as that route while the guard's checks would not apply."""
        if path in self.known_routes:
            return False
        key = route_key(path)
        if key in self.known_keys:
            return True
        if self.suffix_keys and any(key.endswith(k) for k in self.suffix_keys):
            return not (self.admitted.matches(path) or self.auth.matches(path))
        return False

    def route(self, method: bytes, path: str | None, *, upgrade: bool, authorized: bool) -> Route:
        """The route of a request to ``path`` (from :func:`route_path`); ``authorized``: it
        carries the token; ``upgrade``: it asks for a protocol upgrade."""
        if path is None or self.lookalike(path):
            return Route.NOT_FOUND
        own = _OWN.get(path)
        if own is not None:
            return own
        admitted = method == b"POST" and self.admitted.matches(path)
        if method == b"POST" and self.api_auth and self.auth.matches(path) and not authorized:
            return Route.UNAUTHORIZED
        if upgrade and admitted:
            return Route.UPGRADE_REFUSED
        if admitted:
            return Route.ADMITTED
        if self.forward is not None and path not in self.forward:
            return Route.NOT_FOUND
        if self.models_union and method == b"GET" and path == "/v1/models":
            return Route.MODELS
        return Route.FORWARD

    def needs_token(self, method: bytes, path: str) -> bool:
        """Whether :meth:`route` would ask for the token for this request."""
        return method == b"POST" and self.api_auth and self.auth.matches(path)

    def admitted_post(self, target: bytes) -> tuple[str, bool] | None:
        """For a POST to ``target``: (the path the engine records, whether the API token is
        checked) when :meth:`route` gives :attr:`Route.ADMITTED` to it with the token; None for
        every other route."""
        path = route_path(target)
        if path is None or self.route(b"POST", path, upgrade=False, authorized=True) is not (
            Route.ADMITTED
        ):
            return None
        return target.decode("latin-1").partition("?")[0], self.needs_token(b"POST", path)


@functools.lru_cache(maxsize=1024)
def admitted_post(routes: Routes, target: bytes) -> tuple[str, bool] | None:
    """:meth:`Routes.admitted_post`, remembered for the last 1,024 targets (routes are few; the
    fast reader asks it for every request)."""
    return routes.admitted_post(target)


def refusal_headers(
    retry_after: bytes | None, predicted_s: int | None
) -> tuple[tuple[bytes, bytes], ...]:
    """The 429's headers: ``Retry-After`` says ``predicted_s`` when given (the predicted mode),
    else ``retry_after`` (``PIG_RETRY_AFTER_SECONDS``), and is left out when neither is."""
    json = (b"content-type", b"application/json")
    if predicted_s is not None:
        return (json, (b"retry-after", str(predicted_s).encode()))
    if retry_after is not None:
        return (json, (b"retry-after", retry_after))
    return (json,)


# -- the token ---------------------------------------------------------------------------------


def token_digest(token: str) -> bytes | None:
    """The digest :func:`token_matches` compares with (None: no token configured)."""
    return hashlib.sha256(b"Bearer " + token.encode()).digest() if token else None


def token_matches(headers: Headers, expected: bytes | None) -> bool:
    """Exactly one Authorization header, equal in constant time to ``Bearer <TOKEN>``."""
    values = header_values(headers, b"authorization")
    if expected is None or len(values) != 1:
        return False
    return hmac.compare_digest(hashlib.sha256(values[0]).digest(), expected)


# -- headers -----------------------------------------------------------------------------------

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_SSE_DEFAULTS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


def header_values(headers: Headers, name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


def first_header(headers: Headers, name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def hop_by_hop(headers: Headers) -> frozenset[bytes]:
    """The standard hop-by-hop headers and those ``Connection`` names."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    }
    return _HOP_BY_HOP | named


def content_length(headers: Headers) -> int | None:
    """The one declared body length, or None (none, several, chunked, not a number)."""
    declared: bytes | None = None
    for key, value in headers:  # one pass, no call per header: it is read on every request
        if key == b"content-length":
            if declared is not None:
                return None
            declared = value
        elif key == b"transfer-encoding":
            return None
    if declared is None:
        return None
    try:
        length = int(declared)
    except ValueError:
        return None
    return length if length >= 0 else None


def is_chunked(headers: Headers) -> bool:
    """The body is chunked (h11 already refused any other transfer coding)."""
    return any(
        name == b"transfer-encoding" and value.strip().lower() == b"chunked"
        for name, value in headers
    )


def without_length(headers: Headers) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k != b"content-length"]


#: An unwanted body at most this long (declared) is read and dropped, keeping the connection;
#: a longer, chunked or ``100-continue`` one is left unread and the connection closes instead.
EARLY_DRAIN_BYTES = 64 * 1024


def framed(headers: Headers) -> list[tuple[bytes, bytes]]:
    """A request's headers, with ``Content-Length: 0`` added when it has no framing header at
    all: no framing means no body (RFC 9112 6.3), and the backend is told so rather than given
    an empty body re-framed as chunked."""
    kept = list(headers)
    for name, _ in kept:  # a loop, not any() over a generator: no call per header
        if name in (b"content-length", b"transfer-encoding"):
            return kept
    kept.append((b"content-length", b"0"))
    return kept


def peek_first(length: int | None, *, classify: bool, pooled: bool) -> bool:
    """Whether the gate is asked from the head alone before an admitted body is read: a short
    body costs nothing to read (a refusal drops it and keeps the connection), a long one or
    one the output classifier would parse is worth the peek; with ``PIG_POOLS`` the body's
    model says which pool's gate to ask, so it is read first."""
    if pooled:
        return False
    return length is None or length > EARLY_DRAIN_BYTES or classify


def with_sse_defaults(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An event stream tells caches and buffering proxies (nginx) to pass it on at once."""
    names = {name for name, _ in headers}
    extra = [pair for pair in _SSE_DEFAULTS if pair[0] not in names]
    return [*headers, *extra] if extra else headers


def upstream_headers(
    headers: Headers,
    *,
    authority: bytes,
    backend: bytes,
    peer: bytes,
    tier: Tier | None,
    lane: Lane,
    body_length: int | None,
    output_tokens: int | None = None,
    trace_id: bytes = b"",
) -> list[tuple[bytes, bytes]]:
    """The request head's headers as the backend gets them (see the module rules)."""
    hops = hop_by_hop(headers)
    drop = hops | {b"host", b"content-length", b"x-forwarded-for", b"expect"}
    if trace_id:  # the guard's id for the request replaces whatever the client sent
        drop = drop | {b"x-request-id"}
    out = [
        (name, value)
        for name, value in headers
        if name not in drop and not name.startswith(b"x-pig-")
    ]
    out.insert(0, (b"host", authority))
    # A client that names X-Forwarded-For in Connection asks for its value to be dropped at this
    # hop: only the socket peer remains (as Go's reverse proxy does).
    client_chain = [] if b"x-forwarded-for" in hops else header_values(headers, b"x-forwarded-for")
    out.append((b"x-forwarded-for", b", ".join([*client_chain, peer])))
    out.append((b"x-pig-backend", backend))
    if trace_id:
        out.append((b"x-request-id", trace_id))
    if tier is not None:
        out.append((b"x-pig-tier", str(tier).encode()))
        out.append((b"x-pig-lane", str(lane).encode()))
        if output_tokens is not None:
            out.append((b"x-pig-output-tokens", str(output_tokens).encode()))
    if body_length is not None:
        out.append((b"content-length", str(body_length).encode()))
    else:
        out.append((b"transfer-encoding", b"chunked"))
    return out


@attrs.frozen
class ClientHead:
    """What the client is told of a backend's response head, and how its body is relayed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content_type: bytes
    #: A 200 event stream: scanned for its first useful event, kept alive when quiet.
    event_stream: bool
    #: SSE comments go out while the backend is silent (then no Content-Length is passed on).
    keepalive: bool
    #: A 500 that may be the client's fault: read it whole and reclassify it (spec 7).
    reclassify: bool


def client_head(
    status: int,
    upstream: Headers,
    *,
    classify_errors: bool,
    keepalive_allowed: bool,
    reclassifiable: bool,
) -> ClientHead:
    """The client's head for a backend's ``status`` and headers: hop-by-hop headers dropped (and
    Content-Length when the body is chunked, whose framing wins, RFC 9112 6.3), an event stream
    marked for caches and buffering proxies; ``reclassifiable``: the error classifier's
    candidate test (:func:`guard_core.upstream_errors.is_candidate`) said yes."""
    drop = hop_by_hop(upstream)
    if header_values(upstream, b"transfer-encoding"):
        drop = drop | {b"content-length"}
    headers = [(name, value) for name, value in upstream if name not in drop]
    content_type = first_header(upstream, b"content-type") or b""
    reclassify = classify_errors and reclassifiable
    event_stream = not reclassify and status == 200 and b"text/event-stream" in content_type.lower()
    keepalive = event_stream and keepalive_allowed
    if event_stream:
        headers = with_sse_defaults(headers)
    if keepalive:
        headers = without_length(headers)
    return ClientHead(status, headers, content_type, event_stream, keepalive, reclassify)


def chunked_passthrough(
    upstream: Headers, *, status: int, method: bytes, client_version: bytes
) -> bool:
    """The response body can be copied chunk for chunk without h11 parsing it: chunked from the
    backend, a body the client expects, and an HTTP/1.1 client (whose response h11 frames as
    chunked too)."""
    return (
        is_chunked(upstream)
        and method != b"HEAD"
        and status not in (204, 304)
        and client_version == b"1.1"
    )


# -- load and refusals -------------------------------------------------------------------------


def low_load(gate: GateState, *, dynamic: bool) -> bool:
    """PIG's gate for SSE keep-alive and the early bridge: quiet backend, empty queue."""
    if not dynamic:
        return True
    decision = gate.decision
    return (
        decision.source is DecisionSource.METRICS
        and decision.state is LoadState.GREEN
        and decision.waiting == 0
        and decision.backend_failed == 0
        and decision.kv_usage < 0.70
        and gate.waiting == 0
    )


#: A held body larger than this never opens the early bridge (spec 8.4).
BRIDGE_SAFE_BODY = 524_288


def opens_bridge(headers: Headers, body: Sequence[bytes] | None, *, quiet: bool) -> bool:
    """Spec 8.4, for an admitted request with ``SSE_EARLY_BRIDGE_ENABLED``: whether its client
    gets a 200 event stream at once when the backend is slow to answer: its body is held and
    under :data:`BRIDGE_SAFE_BODY`, it asks to stream, and the pool is ``quiet``
    (:func:`low_load`)."""
    if body is None or sum(len(chunk) for chunk in body) >= BRIDGE_SAFE_BODY:
        return False
    return quiet and is_streaming_request(first_header(headers, b"accept"), b"".join(body))


@attrs.frozen
class RefusalCounts:
    """The counters one refusal moves (PIG's reject accounting, spec 4.4)."""

    #: ``pig_queue_timeout_total``: it waited first.
    queue_timeout: bool
    #: The predictive learner's count by the constraint that refused it.
    binding: Binding | None
    #: ``pig_backend_unavailable_total`` (and nothing else).
    backend_unavailable: bool
    #: ``pig_rejected_total`` and the tier's rejects (None: not counted there).
    tier: Tier | None
    #: The lane whose rejects count it (the global lane for the global limit).
    lane: Lane | None


@functools.lru_cache(maxsize=512)  # a few tiers x lanes x codes: one value each, reused
def refusal_counts(
    tier: Tier, lane: Lane, code: RejectCode, *, waited: bool, binding: Binding | None = None
) -> RefusalCounts:
    if code is RejectCode.BACKEND_UNAVAILABLE:
        return RefusalCounts(waited, binding, True, None, None)
    counted = Lane.GLOBAL if code is RejectCode.GLOBAL_LIMIT else lane
    return RefusalCounts(waited, binding, False, tier, counted)
