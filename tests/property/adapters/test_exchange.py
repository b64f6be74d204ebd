"""The exchange rules (guard_adapters.exchange): path safety, the route order, the headers the
backend gets, the token check and the refusal accounting, without a socket."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.exchange import (
    ATTESTATION_ROUTE,
    OWN_ROUTES,
    Route,
    Routes,
    content_length,
    hop_by_hop,
    refusal_counts,
    route_path,
    token_digest,
    token_matches,
    upstream_headers,
)
from guard_core import Binding, Lane, RejectCode, Tier
from guard_core.routing import DEFAULT_QOS_PATHS, PathPolicy

_SEGMENT = st.one_of(
    st.sampled_from(["v1", "chat", "completions", ".", "..", "", "a;b", "%2e", "%2F", "x%41"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=6),
)


@given(st.lists(_SEGMENT, max_size=6), st.sampled_from(["", "?a=1", "?x/../y", "#f"]))
def test_a_routed_path_is_one_no_backend_can_read_as_another(
    segments: list[str], query: str
) -> None:
    target = ("/" + "/".join(segments) + query).encode("utf-8", "surrogateescape")
    path = route_path(target)
    if path is None:
        return
    assert path.startswith("/")
    assert "//" not in path
    assert not any(c in path for c in "#\\;?%")
    assert all(0x21 <= ord(c) <= 0x7E for c in path)
    parts = path.split("/")
    assert "." not in parts
    assert ".." not in parts


@given(st.lists(st.from_regex(r"[a-z0-9_-]{1,8}", fullmatch=True), min_size=1, max_size=5))
def test_a_plain_path_routes_as_itself(segments: list[str]) -> None:
    target = "/" + "/".join(segments)
    assert route_path(target.encode()) == target
    assert route_path(target.encode() + b"?stream=1") == target


def _routes(*, api_auth: bool = True, forward: tuple[str, ...] = ()) -> Routes:
    return Routes.build(
        admitted=PathPolicy(DEFAULT_QOS_PATHS),
        auth=PathPolicy(DEFAULT_QOS_PATHS),
        api_auth=api_auth,
        forward=forward,
    )


_METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS"])


@given(
    _METHODS,
    st.sampled_from([*OWN_ROUTES, ATTESTATION_ROUTE, *DEFAULT_QOS_PATHS, "/v1/models", "/x"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_routes_follow_pigs_order(
    method: bytes, path: str, upgrade: bool, authorized: bool, api_auth: bool, restricted: bool
) -> None:
    routes = _routes(api_auth=api_auth, forward=("/v1/models",) if restricted else ())
    route = routes.route(method, path, upgrade=upgrade, authorized=authorized)
    own = {
        "/healthz": Route.HEALTH,
        "/pig/metrics": Route.METRICS,
        "/v1/metrics": Route.ALL_METRICS,
        "/v1/upstream-status": Route.UPSTREAM_STATUS,
        ATTESTATION_ROUTE: Route.ATTESTATION,
    }
    generation = method == b"POST" and path in DEFAULT_QOS_PATHS
    if path in own:
        expected = own[path]
    elif generation and api_auth and not authorized:
        expected = Route.UNAUTHORIZED
    elif generation and upgrade:
        expected = Route.UPGRADE_REFUSED
    elif generation:
        expected = Route.ADMITTED
    elif restricted and path != "/v1/models":
        expected = Route.NOT_FOUND
    else:
        expected = Route.FORWARD
    assert route is expected
    assert routes.needs_token(method, path) == (generation and api_auth)


@given(
    st.sampled_from([*OWN_ROUTES, ATTESTATION_ROUTE, *DEFAULT_QOS_PATHS]),
    st.sampled_from(["upper", "slash", "both"]),
    _METHODS,
)
def test_a_lookalike_of_a_known_route_is_not_found(path: str, variant: str, method: bytes) -> None:
    changed = path.upper() if variant in ("upper", "both") else path
    if variant in ("slash", "both"):
        changed += "/"
    assert _routes().route(method, changed, upgrade=False, authorized=True) is Route.NOT_FOUND
    assert _routes().route(method, None, upgrade=False, authorized=True) is Route.NOT_FOUND


_NAMES = st.sampled_from(
    [
        b"host",
        b"connection",
        b"keep-alive",
        b"te",
        b"x-forwarded-for",
        b"x-pig-tier",
        b"x-pig-backend",
        b"expect",
        b"content-length",
        b"transfer-encoding",
        b"authorization",
        b"accept",
        b"x-custom",
    ]
)
_VALUES = st.sampled_from([b"a", b"x-custom", b"close, x-custom", b"10.0.0.1", b"100-continue"])


@given(
    st.lists(st.tuples(_NAMES, _VALUES), max_size=10),
    st.sampled_from([None, Tier.PREMIUM, Tier.BASIC]),
    st.one_of(st.none(), st.integers(0, 10**6)),
    st.one_of(st.none(), st.integers(0, 4096)),
)
def test_the_backend_gets_only_what_it_should(
    headers: list[tuple[bytes, bytes]],
    tier: Tier | None,
    body_length: int | None,
    output_tokens: int | None,
) -> None:
    out = upstream_headers(
        headers,
        authority=b"backend:8000",
        backend=b"b0",
        peer=b"127.0.0.9",
        tier=tier,
        lane=Lane.DEFAULT,
        body_length=body_length,
        output_tokens=output_tokens,
    )
    names = [name for name, _ in out]
    hops = hop_by_hop(headers)
    assert out[0] == (b"host", b"backend:8000")
    assert names.count(b"host") == 1
    assert not any(name in hops for name in names if name != b"transfer-encoding")
    assert b"expect" not in names
    # The only X-PIG-* headers are the guard's own facts, never a client's copy.
    guard_facts = [(b"x-pig-backend", b"b0")]
    if tier is not None:
        guard_facts += [(b"x-pig-tier", str(tier).encode()), (b"x-pig-lane", b"default")]
        if output_tokens is not None:
            guard_facts.append((b"x-pig-output-tokens", str(output_tokens).encode()))
    assert [(n, v) for n, v in out if n.startswith(b"x-pig-")] == guard_facts
    forwarded = [v for n, v in out if n == b"x-forwarded-for"]
    assert len(forwarded) == 1
    assert forwarded[0].endswith(b"127.0.0.9")
    if body_length is None:
        assert (b"transfer-encoding", b"chunked") in out
        assert b"content-length" not in names
    else:
        assert content_length(out) == body_length
    # What the client sent that is not the guard's to control is passed on, in order.
    kept = [
        (n, v)
        for n, v in headers
        if n not in hops | {b"host", b"content-length", b"x-forwarded-for", b"expect"}
        and not n.startswith(b"x-pig-")
    ]
    assert [pair for pair in out if pair in kept] == kept


@given(st.text(min_size=0, max_size=20), st.lists(st.binary(max_size=30), max_size=3))
def test_the_token_matches_only_one_exact_header(token: str, sent: list[bytes]) -> None:
    expected = token_digest(token)
    headers = [(b"authorization", value) for value in sent]
    want = bool(token) and len(sent) == 1 and sent[0] == b"Bearer " + token.encode()
    assert token_matches(headers, expected) == want
    if token:
        assert expected == hashlib.sha256(b"Bearer " + token.encode()).digest()


@given(
    st.sampled_from(list(Tier)),
    st.sampled_from(list(Lane)),
    st.sampled_from(list(RejectCode)),
    st.booleans(),
    st.one_of(st.none(), st.sampled_from(list(Binding))),
)
def test_a_refusal_is_counted_as_pig_counts_it(
    tier: Tier, lane: Lane, code: RejectCode, waited: bool, binding: Binding | None
) -> None:
    counts = refusal_counts(tier, lane, code, waited=waited, binding=binding)
    assert counts.queue_timeout == waited
    assert counts.binding == binding
    if code is RejectCode.BACKEND_UNAVAILABLE:
        assert counts.backend_unavailable
        assert counts.tier is None
        assert counts.lane is None
    else:
        assert not counts.backend_unavailable
        assert counts.tier is tier
        assert counts.lane is (Lane.GLOBAL if code is RejectCode.GLOBAL_LIMIT else lane)
