"""The ``inference-guard`` command line.

Reads: the command line. ``serve``, ``replay`` and ``record`` come from ``guard_trio``;
``sim-backend``, ``simulate`` and ``demo`` from :mod:`guard_trio.tools`, which the serving path
never imports. Running with no subcommand prints the ones available and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from guard_trio import __version__, _record, _replay_cli, _serve_cli
from guard_trio.tools import _demo_cli, _sim_backend_cli, _simulate_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-guard",
        description="QoS proxy for vLLM and SGLang backends.",
    )
    parser.add_argument("--version", action="version", version=f"inference-guard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_cli.add_parser(subparsers)
    _replay_cli.add_parser(subparsers)
    _record.add_parser(subparsers)
    _sim_backend_cli.add_parser(subparsers)
    _simulate_cli.add_parser(subparsers)
    _demo_cli.add_parser(subparsers)
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
