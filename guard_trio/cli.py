"""The ``inference-guard`` command line.

Reads: the command line. ``serve``, ``epp``, ``replay``, ``record`` and ``watch`` come from
``guard_trio``; ``sim-backend``, ``simulate`` and ``demo`` from :mod:`guard_trio.tools`, which
the serving path never imports. Each subcommand's module adds its arguments (``add_arguments``)
and runs it (``run``, returning the exit status); the names, help lines and descriptions are one
table here.
Running with no subcommand prints the ones available and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Final, Protocol

from guard_trio import __version__, _epp_cli, _record, _replay_cli, _serve_cli, _watch_cli
from guard_trio.tools import _demo_cli, _sim_backend_cli, _simulate_cli


class _Command(Protocol):
    """What a subcommand's module provides: its arguments and what runs it (the exit status)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


#: The subcommands in ``--help`` order: name, module, one-line help, description.
_COMMANDS: Final[tuple[tuple[str, _Command, str, str], ...]] = (
    (
        "serve",
        _serve_cli,
        "run the proxy (configured by environment variables, as PIG)",
        "Run the QoS proxy. Every setting comes from PIG's environment variables.",
    ),
    (
        "epp",
        _epp_cli,
        "run the guard as Envoy's endpoint picker (ext_proc over gRPC)",
        "Run the guard's engine behind Envoy: an ext_proc gRPC server on PIG_EPP_LISTEN"
        " (default 127.0.0.1:9002) that admits, refuses (PIG's 429, as Envoy's immediate"
        " response) or names the backend of each request (x-gateway-destination-endpoint), with"
        " the metrics poller, /pig/metrics and the admin plane as in serve.",
    ),
    (
        "replay",
        _replay_cli,
        "recompute decisions from a recording, optionally with other settings",
        "Feed a recording's scrapes and request events through the policy core and print a"
        " summary. With the recorded settings every decision comes back as recorded;"
        " --set tries others.",
    ),
    (
        "record",
        _record,
        "record backends' metrics pages into a recording (no proxy)",
        "Poll one or more /metrics URLs and write what the learner reads to FILE.",
    ),
    (
        "watch",
        _watch_cli,
        "a live view of a guard's admin plane in the terminal",
        "Connect to the admin plane's event stream (URL/admin/events, with the TOKEN) and show"
        " the guard's decisions and admissions as they happen: a full screen redrawn in place"
        " on a terminal, one line a second otherwise, or each message as a JSON line (--json).",
    ),
    (
        "sim-backend",
        _sim_backend_cli,
        "serve a simulated vLLM or SGLang engine over HTTP",
        "A simulated inference engine (continuous batching, KV cache, preemption, calibrated"
        " on real vLLM measurements) behind OpenAI-compatible endpoints, /health and /metrics,"
        " with scripted faults. POST /sim/control (loopback only) changes faults at run time.",
    ),
    (
        "simulate",
        _simulate_cli,
        "run a request trace through the simulated engine under several policies",
        "Closed loop in virtual time, no sockets: each request of a real trace (Azure CSV or"
        " Mooncake JSONL) meets a policy (none, static:N, PIG's learner or the predictive"
        " one) in front of the simulated engine. Prints one table per policy with a row per"
        " tier; goodput PA/s is the prompt-aware goodput (TTFT within 1 s plus the prompt's"
        " own idle prefill time).",
    ),
    (
        "demo",
        _demo_cli,
        "a 90-second demonstration: simulated backend, guard and load, no GPU needed",
        "Starts a simulated vLLM and the guard on free loopback ports, drives a premium/basic"
        " load that ramps to about three times capacity straight to the backend, then through"
        " the guard with PIG's learner and with the predictive one, and compares them per"
        " tier. No config, no network.",
    ),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-guard",
        description="QoS proxy for vLLM and SGLang backends.",
    )
    parser.add_argument("--version", action="version", version=f"inference-guard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command, help_line, description in _COMMANDS:
        sub = subparsers.add_parser(name, help=help_line, description=description)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m guard_trio``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        result: int = args.handler(args)
    except BrokenPipeError:
        # The reader went away (e.g. piped into head): stop quietly, like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
