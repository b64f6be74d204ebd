"""Time the priority / compat body rewriter: ``python bench/bench_body_rewrite.py``.

Bodies are built here, deterministically, in two shapes and several sizes:

``chat``
    A realistic chat-completions request: model, sampling fields, a ``tools`` list and a long
    ``messages`` array (system, user and assistant turns of mixed length, English, CJK and code
    with escaped quotes and newlines, assistant turns with empty and non-empty ``tool_calls``,
    tool results), plus an ``extra_body.priority`` the client tried to set; serialised by
    ``json.dumps`` with its default ``", "`` / ``": "`` separators and no ASCII escaping.
``compact``
    The same request without blanks between tokens, as httpx (0.28 and later, under the OpenAI
    Python client) and ``JSON.stringify`` write it.
``string``
    One user message whose content is a single giant string.

Each body goes through :func:`guard_adapters.openai_body.rewrite` (the buffered path) and
through :class:`~guard_adapters.openai_body.StreamingRewriter` fed 64 KiB chunks (the streaming
path), with the default policy for a premium request. Figures are MB/s (10^6 bytes of input per
second) from the best of a few runs. Prints a table and exits 0; it makes no claim about what the
numbers must be.
"""

from __future__ import annotations

import functools
import json
import platform
import random
import sys
import time
from collections.abc import Callable

from guard_adapters.openai_body import (
    MIB,
    InjectionPolicy,
    Plan,
    StreamingRewriter,
    plan,
    rewrite,
)
from guard_core.tier import Tier

KIB = 1024
CHUNK = 64 * KIB
SIZES = (("64 KiB", 64 * KIB), ("2 MiB", 2 * MIB), ("4 MiB", 4 * MIB), ("30 MiB", 30 * MIB))

_PROSE = (
    "the quick brown fox jumps over the lazy dog while the scheduler keeps every request in "
    "its lane and the backend reports its queue depth once per second"
)
_WORDS = tuple(_PROSE.split(" "))
_CJK = "推理服务在高负载下需要公平地分配容量。优先级请求应当先被处理。"
_CODE = 'def f(x):\n    return {"k": x, "path": "C:\\\\tmp\\\\a.txt"}  # "quoted"\n'


def _text(rng: random.Random, size: int) -> str:
    parts: list[str] = []
    length = 0
    while length < size:
        pick = rng.random()
        if pick < 0.7:
            piece = " ".join(rng.choice(_WORDS) for _ in range(12)) + ". "
        elif pick < 0.85:
            piece = _CJK
        else:
            piece = _CODE
        parts.append(piece)
        length += len(piece.encode())
    return "".join(parts)


def _message(rng: random.Random, index: int) -> dict[str, object]:
    if index == 0:
        return {"role": "system", "content": _text(rng, 600)}
    kind = index % 4
    if kind == 1:
        return {"role": "user", "content": _text(rng, rng.randint(80, 2000))}
    if kind == 2:
        message: dict[str, object] = {"role": "assistant", "content": _text(rng, 400)}
        if rng.random() < 0.5:
            message["tool_calls"] = []
        return message
    if kind == 3 and rng.random() < 0.5:
        call = {"name": "lookup", "arguments": json.dumps({"q": _text(rng, 60)})}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_{index}", "type": "function", "function": call}],
        }
    return {"role": "tool", "tool_call_id": f"call_{index}", "content": _text(rng, 300)}


def _envelope(messages: list[dict[str, object]]) -> dict[str, object]:
    return {
        "model": "Qwen/Qwen3-32B",
        "messages": messages,
        "max_tokens": 1024,
        "temperature": 0.7,
        "stream": True,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Search the knowledge base.",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
        ],
        "extra_body": {"priority": -1000, "top_k": 20},
    }


def _dump(document: dict[str, object]) -> bytes:
    return json.dumps(document, ensure_ascii=False).encode()


def compact_body(size: int) -> bytes:
    """:func:`chat_body` without blanks between tokens."""
    document = json.loads(chat_body(size))
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def chat_body(size: int) -> bytes:
    """A chat request of about ``size`` bytes with a long messages array."""
    rng = random.Random(size)
    messages: list[dict[str, object]] = []
    body = _dump(_envelope(messages))
    estimate = len(body)
    while estimate < size:
        message = _message(rng, len(messages))
        messages.append(message)
        estimate += len(_dump(message)) + 2
    return _dump(_envelope(messages))


def string_body(size: int) -> bytes:
    """A chat request of about ``size`` bytes that is mostly one string."""
    rng = random.Random(size)
    messages: list[dict[str, object]] = [{"role": "user", "content": ""}]
    overhead = len(_dump(_envelope(messages)))
    messages[0]["content"] = _text(rng, max(0, size - overhead))
    return _dump(_envelope(messages))


def _buffered(body: bytes, rewrite_plan: Plan) -> bytes:
    return rewrite(body, plan=rewrite_plan)


def _streaming(body: bytes, rewrite_plan: Plan) -> bytes:
    rewriter = StreamingRewriter(rewrite_plan)
    view = memoryview(body)
    out = [rewriter.feed(view[i : i + CHUNK]) for i in range(0, len(body), CHUNK)]
    out.append(rewriter.finish())
    return b"".join(out)


def best_seconds(run: Callable[[], object], total_bytes: int) -> float:
    """The fastest of several runs, with fewer runs for big bodies."""
    repeats = 3 if total_bytes > 8 * MIB else 7
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    print(f"Python {platform.python_implementation()} {sys.version.split()[0]}")
    print(f"  {platform.platform()}, {platform.machine()}")
    print(f"default policy, premium tier; streaming fed {CHUNK // KIB} KiB chunks; best of runs\n")
    header = (
        f"{'shape':<8} {'size':>7} {'bytes':>10} {'buffered MB/s':>14} {'streaming MB/s':>15}"
        f" {'out bytes':>10}"
    )
    print(header)
    print("-" * len(header))
    policy = InjectionPolicy()
    builders: tuple[tuple[str, Callable[[int], bytes]], ...] = (
        ("chat", chat_body),
        ("compact", compact_body),
        ("string", string_body),
    )
    for shape, build in builders:
        for label, size in SIZES:
            body = build(size)
            rewrite_plan = plan(
                policy,
                tier=Tier.PREMIUM,
                content_type=b"application/json",
                content_length=len(body),
            )
            buffered_out = _buffered(body, rewrite_plan)
            streaming_out = _streaming(body, rewrite_plan)
            same = "" if buffered_out == streaming_out else "  (outputs differ!)"
            buffered = best_seconds(functools.partial(_buffered, body, rewrite_plan), len(body))
            streaming = best_seconds(functools.partial(_streaming, body, rewrite_plan), len(body))
            print(
                f"{shape:<8} {label:>7} {len(body):>10} {len(body) / buffered / 1e6:>14.0f}"
                f" {len(body) / streaming / 1e6:>15.0f} {len(buffered_out):>10}{same}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
