"""Coverage-guided fuzzing of the request-side parsers with atheris (``nox -s fuzz``, row T34).

Usage::

    python tests/property/fuzz/atheris_targets.py                  # every target, 60 s each
    python tests/property/fuzz/atheris_targets.py --seconds 5 --target sse --target metrics

Each target runs in its own process (libFuzzer owns the process it runs in), seeded with the
files of tests/fixtures (SSE transcripts, metrics pages, vLLM error bodies) and a few request
bodies, copied to a scratch corpus folder so the fixtures are never written to. A target fails
on any exception outside the documented ones (``BodyRewriteError``, ``MetricsParseError``) and
on any broken property (an ``AssertionError``), the same properties as test_fuzz_parsers.py
checks with Hypothesis. The table at the end gives each target's executions; the command exits
non-zero when a target crashed, and libFuzzer leaves the crashing input as ``crash-*`` in the
scratch folder it names.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures"
MAX_LEN = 16384

REQUEST_BODIES = [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,'
    b' "max_tokens": 64}',
    b'{"model":"m","priority":7,"messages":[{"role":"assistant","content":null,'
    b'"tool_calls":[]}],"extra_body":{"priority":3},"max_completion_tokens":"128"}',
    b'{"text":"sglang","sampling_params":{"max_new_tokens":8},"\\u0070riority":1}',
]
AUTH_SEEDS = [b"Bearer fuzz-token\nx-user-tier: premium", b"bearer x\n\n Premium ", b"\xff\x80"]


def _seeds(target: str) -> list[bytes]:
    def files(folder: str, pattern: str) -> list[bytes]:
        return [p.read_bytes()[:MAX_LEN] for p in sorted((FIXTURES / folder).glob(pattern))]

    errors = files("errors", "*.json")
    return {
        "body_rewrite": [*REQUEST_BODIES, *errors],
        "output_tokens": [*REQUEST_BODIES, *errors],
        "sse": [*files("sse", "*.txt"), *REQUEST_BODIES],
        "metrics": files("metrics", "*.prom"),
        "headers": AUTH_SEEDS,
    }[target]


TARGETS = ("body_rewrite", "output_tokens", "sse", "metrics", "headers")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    pieces, previous = [], 0
    for cut in sorted(set(cuts)):
        pieces.append(data[previous:cut])
        previous = cut
    pieces.append(data[previous:])
    return pieces


def _cuts(selector: bytes, size: int) -> list[int]:
    return [b * (size + 1) // 256 for b in selector]


def _load(target: str) -> Callable[[bytes], None]:
    """The instrumented TestOneInput of ``target`` (imports happen under instrumentation)."""
    import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]
    import trio

    with atheris.instrument_imports(include=["guard_adapters", "guard_core"]):
        from guard_adapters._errors import BodyRewriteError, MetricsParseError
        from guard_adapters.config import load_config
        from guard_adapters.metrics import parse_metrics
        from guard_adapters.openai_body import (
            InjectionPolicy,
            StreamingRewriter,
            output_token_intent,
            plan,
            rewrite,
        )
        from guard_adapters.sse import (
            FirstUsefulEventScanner,
            is_streaming_request,
        )
        from guard_core.tier import Tier, tier_from_header_values
        from guard_trio._server import GuardServer

    plans = [
        plan(
            policy,
            tier=tier,
            content_type=b"application/json",
            content_length=length,
        )
        for policy, tier, length in (
            (InjectionPolicy(), Tier.PREMIUM, 100),
            (InjectionPolicy(), Tier.BASIC, 100),
            (InjectionPolicy(strategy="append_last"), Tier.PREMIUM, 100),
            (InjectionPolicy(strategy="append_last", strip_empty_tool_calls=False), Tier.BASIC, 9),
            (InjectionPolicy(enabled=False), Tier.BASIC, 100),
            (InjectionPolicy(stream_buffer_bytes=64, field="p"), Tier.PREMIUM, 10),
        )
    ]

    def body_rewrite(data: bytes) -> None:
        if len(data) < 3:
            return
        chosen = plans[data[0] % len(plans)]
        body = data[3:]

        def streamed() -> bytes:
            rewriter = StreamingRewriter(chosen)
            out = [rewriter.feed(p) for p in _split(body, _cuts(data[1:3], len(body)))]
            return b"".join([*out, rewriter.finish()])

        def buffered() -> bytes:
            return rewrite(body, plan=chosen)

        results: list[tuple[str, object]] = []
        for run in (buffered, streamed):
            try:
                results.append(("ok", run()))
            except BodyRewriteError as error:
                results.append(("error", (error.reason, error.offset)))
        assert results[0] == results[1], results
        if results[0][0] == "ok" and chosen.inject:
            try:
                source = json.loads(body)
            except (ValueError, RecursionError):
                return
            if isinstance(source, dict):
                written = results[0][1]
                assert isinstance(written, bytes)
                out = json.loads(written)  # valid JSON in, valid JSON out
                assert out[chosen.field] == chosen.priority_value

    def output_tokens(data: bytes) -> None:
        tokens = output_token_intent(data)
        assert tokens is None or 0 <= tokens <= 2**63 - 1

    def sse(data: bytes) -> None:
        if len(data) < 3:
            return
        stream = data[3:]
        limit = (65536, 1, 100, 4096)[data[0] % 4]
        outcomes = []
        for pieces in ([stream], _split(stream, _cuts(data[1:3], len(stream)))):
            scanner = FirstUsefulEventScanner(limit)
            for piece in pieces:
                scanner.feed(piece)
            outcomes.append((scanner.done, scanner.limit_reached, scanner.bytes_scanned))
        assert outcomes[0] == outcomes[1], outcomes
        is_streaming_request(stream[:64], stream)

    def metrics(data: bytes) -> None:
        try:
            sample = parse_metrics(data)
        except MetricsParseError:
            return
        for figure in (sample.running, sample.waiting, sample.kv_usage, sample.preemptions):
            assert figure is None or figure >= 0, figure

    async def build() -> GuardServer:
        return GuardServer(load_config({"UPSTREAM": "http://127.0.0.1:9", "TOKEN": "fuzz-token"}))

    authorized = trio.run(build).app.authorized
    expected = b"Bearer fuzz-token"

    def headers(data: bytes) -> None:
        lines = data.split(b"\n")[:8]
        premium = len(lines) == 1 and lines[0].strip(b" \t").lower() == b"premium"
        assert (tier_from_header_values(lines) is Tier.PREMIUM) == premium
        pairs = [(b"authorization", line) for line in lines[:3]]
        assert authorized(pairs) == (len(pairs) == 1 and pairs[0][1] == expected)

    return {
        "body_rewrite": body_rewrite,
        "output_tokens": output_tokens,
        "sse": sse,
        "metrics": metrics,
        "headers": headers,
    }[target]


def _child(target: str, seconds: int, corpus: Path) -> None:
    import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]

    one_input = _load(target)
    for i, seed in enumerate(_seeds(target)):
        (corpus / f"seed-{i}").write_bytes(seed)
    argv = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        f"-max_len={MAX_LEN}",
        "-rss_limit_mb=2048",
        "-timeout=10",
        f"-artifact_prefix={corpus}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


_DONE = re.compile(rb"Done (\d+) runs in (\d+) second")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="(repeatable)")
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.seconds, args.corpus)
        return 0
    failed = False
    rows = []
    for target in args.target or TARGETS:
        corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
        command = [sys.executable, __file__, "--child", target]
        command += ["--seconds", str(args.seconds), "--corpus", str(corpus)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            command, capture_output=True, timeout=args.seconds * 3 + 120, env=env, check=False
        )
        found = _DONE.search(run.stderr)
        runs = found.group(1).decode() if found else "?"
        ok = run.returncode == 0 and found is not None
        failed |= not ok
        rows.append((target, runs, args.seconds, "ok" if ok else f"FAILED ({corpus})"))
        if not ok:
            sys.stderr.write(run.stderr.decode("utf-8", "replace")[-4000:])
    print(f"{'target':<14} {'execs':>10} {'seconds':>8}  result")
    for target, runs, seconds, result in rows:
        print(f"{target:<14} {runs:>10} {seconds:>8}  {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
