"""``inference-guard sim-backend``: serve the simulated vLLM or SGLang engine over HTTP.

Reads: its flags (one per field of :class:`SimBackendConfig`); SIGINT and SIGTERM.

Guarantees: one line on stdout once the server listens (its URL, flavour and profile); it serves
until the first signal and exits 0, exits 2 on a configuration the server refuses and 1 when the
server cannot start (e.g. the port is taken), with the reason on stderr. The server itself is
:mod:`guard_trio.tools.sim_backend`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Final

import attrs
import trio

from guard_adapters.engine_model import DEFAULT_PROFILE, PROFILES
from guard_trio.tools.sim_backend import SimBackendConfig, SimBackendError, serve_sim_backend


def _slow_down(text: str) -> tuple[float, float]:
    factor, sep, at = text.partition("@")
    try:
        result = (float(factor), float(at) if sep else 0.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FACTOR@SECONDS, got {text!r}") from None
    if not result[0] > 0 or not result[1] >= 0:
        raise argparse.ArgumentTypeError(f"expected a factor > 0 and seconds >= 0, got {text!r}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``sim-backend``."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8001, help="port (default 8001; 0 picks a free one)")
    add("--flavour", choices=("vllm", "sglang"), default="vllm", help="which server to imitate")
    add(
        "--metrics-names",
        choices=("current", "legacy"),
        default="current",
        help="vLLM metric names: current (0.33) or legacy (0.7: no engine label, old KV gauge)",
    )
    add("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE, help="engine profile")
    add("--max-num-seqs", type=int, metavar="N", help="override the profile's max_num_seqs")
    add(
        "--max-num-queued-reqs",
        dest="max_queued",
        type=int,
        metavar="N",
        help="answer the engine's queue-full 503 while N requests wait (default: never)",
    )
    add("--seed", type=int, default=0, help="seed for ids, filler text and output lengths")
    add("--model", default="Qwen/Qwen2-7B-Instruct", help="served model name")
    add("--max-output", type=int, default=4096, metavar="N", help="cap on output tokens")
    add("--max-model-len", type=int, default=8192, metavar="N", help="context length (8192)")
    add(
        "--mean-output",
        dest="mean_output_tokens",
        type=float,
        metavar="N",
        help="end requests early with a seeded geometric length of this mean (default: never)",
    )
    add(
        "--speed",
        type=float,
        default=1.0,
        help="divide every engine step's duration by this (a benchmark knob; default 1)",
    )
    add(
        "--reasoning-field",
        choices=("reasoning_content", "reasoning"),
        default="reasoning_content",
        help="delta field of reasoning text (vLLM <= 0.14 wrote reasoning_content)",
    )
    add(
        "--slow-down",
        type=_slow_down,
        action="append",
        default=[],
        metavar="FACTOR@SECONDS",
        help="steps take FACTOR times longer from SECONDS after start (repeatable)",
    )
    add(
        "--die-at",
        dest="die_at_s",
        type=float,
        metavar="SECONDS",
        help="the engine dies at this time",
    )
    add(
        "--metrics-delay",
        dest="metrics_delay_s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="delay /metrics",
    )
    add(
        "--metrics-fail-after",
        dest="metrics_fail_after_s",
        type=float,
        metavar="SECONDS",
        help="/metrics answers 500 from this time on",
    )
    add(
        "--replay-sse",
        type=Path,
        metavar="FILE",
        help="answer every streaming request with this SSE transcript, byte for byte",
    )
    add(
        "--replay-interval-ms",
        type=float,
        default=20.0,
        metavar="MS",
        help="pause between replayed events (default 20)",
    )
    add(
        "--keep-alive",
        dest="keep_alive_s",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="idle keep-alive (5)",
    )


def config_from_args(args: argparse.Namespace) -> SimBackendConfig:
    """The configuration the options give: each option's ``dest`` is the field it sets."""
    given = vars(args)
    return SimBackendConfig(
        **{field.name: given[field.name] for field in _FLAG_FIELDS},
        slow_down=tuple(args.slow_down),
        replay_interval_s=args.replay_interval_ms / 1000,
    )


#: The configuration fields set as given by an option of the same ``dest``.
_FLAG_FIELDS: Final = tuple(
    field
    for field in attrs.fields(SimBackendConfig)
    if field.name not in {"default_max_tokens", "slow_down", "replay_interval_s"}
)


async def _serve(config: SimBackendConfig) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_sim_backend, config)
            shown = f"[{host}]" if ":" in host else host
            where = f"http://{shown}:{port}"
            print(
                f"sim-backend listening on {where} ({config.flavour}, {config.profile})", flush=True
            )
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except SimBackendError as error:
        sys.stderr.write(f"inference-guard sim-backend: {error}\n")
        return 2
    failure: BaseException | None = None
    try:
        trio.run(_serve, config)
    except* SimBackendError as group:  # e.g. the port is taken
        failure = group
        while isinstance(failure, BaseExceptionGroup):
            failure = failure.exceptions[0]
    if failure is not None:
        sys.stderr.write(f"inference-guard sim-backend: {failure}\n")
        return 1
    return 0
