"""The ``inference-guard`` command line.

Subcommands are added as they are built; running with no subcommand prints the ones available.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from guard_trio import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-guard",
        description="QoS proxy for vLLM and SGLang backends.",
    )
    parser.add_argument("--version", action="version", version=f"inference-guard {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m guard_trio``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return 0  # pragma: no cover - no subcommand is registered yet


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
