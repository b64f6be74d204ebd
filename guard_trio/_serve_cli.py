"""``inference-guard serve``: the proxy, configured by PIG's environment variables only."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path

import trio

from guard_adapters.config import ConfigError, Settings, load_config
from guard_trio import __version__
from guard_trio._discovery import DiscoveryError, discover_pools
from guard_trio._picker import serve_picker
from guard_trio._recorder import Recorder
from guard_trio._server import GuardServer
from guard_trio.admin import serve_admin

log = logging.getLogger("inference_guard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``serve``."""
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (secrets redacted) and exit",
    )


def _describe(settings: Settings) -> str:
    describe = settings.describe
    if callable(describe):
        text: str = describe()
        return text
    return "\n".join(f"{k}={v}" for k, v in sorted(settings.redacted().items()))


async def serve(
    settings: Settings,
    *,
    picker: bool = False,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the guard until SIGTERM/SIGINT; drain on the first signal, exit at once on a second.
    ``picker``: also serve the endpoint picker (``inference-guard epp``) on ``PIG_EPP_LISTEN``,
    over the same engine."""
    if settings.discover_pools:
        settings = await discover_pools(settings)  # before listening: pools it could build
    recorder = None
    record_path = settings.env.pig_record_path
    if record_path:
        recorder = Recorder(
            Path(record_path),
            config=settings.redacted(),
            producer=f"inference-guard {__version__} serve",
        )
    server = GuardServer(
        settings,
        on_event=recorder.event if recorder is not None else None,
        on_poll=recorder.poll if recorder is not None else None,
    )
    drain_s = float(settings.env.pig_drain_seconds)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            if recorder is not None:
                nursery.start_soon(recorder.run)
            bound = await nursery.start(server.serve)
            if picker:
                host, port = await nursery.start(serve_picker, server, *settings.epp_listen)
                log.info("endpoint picker (ext_proc) on %s:%s", host, port)
            if settings.admin_listen is not None:
                # The admin plane: same process and nursery; it listens to the engine's events
                # after the recorder (guard_trio._listeners) and to every poll round.
                plane = await nursery.start(serve_admin, server, *settings.admin_listen)
                log.info("admin plane on %s/admin/", plane.url)
            log.info(
                "inference-guard %s listening on %s:%s backends=%d dynamic=%s/%s",
                __version__,
                bound[0],
                bound[1],
                len(settings.backends),
                settings.dynamic_enabled,
                settings.dynamic_enforced,
            )
            task_status.started(bound)
            async for signum in signals:
                log.info("signal %s: draining for up to %.0f s", signum, drain_s)
                with trio.move_on_after(drain_s):
                    async with trio.open_nursery() as drainer:

                        async def second_signal() -> None:
                            async for _ in signals:
                                log.info("second signal: exiting now")
                                drainer.cancel_scope.cancel()
                                return

                        drainer.start_soon(second_signal)
                        await server.drain(drain_s)
                        drainer.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
                break
    await server.aclose()


def run(args: argparse.Namespace, *, command: str = "serve") -> int:
    try:
        settings = load_config(os.environ)
    except ConfigError as error:
        sys.stderr.write(f"inference-guard {command}: invalid configuration:\n{error}\n")
        return 2
    if args.print_config:
        sys.stdout.write(_describe(settings) + "\n")
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%Y/%m/%d %H:%M:%S",
        stream=sys.stderr,
    )
    _tune_garbage_collector()
    try:
        trio.run(partial(serve, settings, picker=command == "epp"))
    except (OSError, DiscoveryError) as error:
        sys.stderr.write(f"inference-guard {command}: {error}\n")
        return 1
    return 0


def _tune_garbage_collector() -> None:
    """Fewer, cheaper collections on the hot path.

    Everything loaded at start-up (modules, settings, compiled patterns) is moved out of the
    collector's sight, and the young generation is collected every 20,000 allocations instead of
    700: a relayed event allocates a few objects and creates no cycles, so the default threshold
    made the collector run every few hundred events and scan every live stream's objects.
    Cycles (cancelled tasks, exception tracebacks) are still collected, just in larger batches.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
