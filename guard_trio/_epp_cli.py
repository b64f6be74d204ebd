"""``inference-guard epp``: the guard as Envoy's endpoint picker (ext_proc), configured by the
same environment variables as ``serve``, with ``PIG_EPP_LISTEN`` for the gRPC server.

Reads: the environment. Guarantees: ``serve``'s process (the metrics poller, ``/pig/metrics``
and the guard's own routes on ``LISTEN``, the admin plane, the recorder, drain on a signal) and
the picker's gRPC server over the same engine (docs/envoy.md).
"""

from __future__ import annotations

import argparse

from guard_trio import _serve_cli

__all__ = ("add_arguments", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``epp``: those of ``serve``."""
    _serve_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return _serve_cli.run(args, command="epp")
