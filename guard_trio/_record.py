"""``inference-guard record``: poll backends' metrics into a recording, without the guard."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import IO

import attrs
import trio

from guard_adapters.metrics import LEARNER_FAMILIES, parse_metrics
from guard_adapters.recording import (
    Header,
    Scrape,
    ScrapeFailed,
    encode,
    learner_text,
    open_for_writing,
)
from guard_core import GuardError
from guard_trio import __version__
from guard_trio._http import fetch

POLL_TIMEOUT_S = 2.0
MAX_PAGE_BYTES = 4 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``record``."""
    parser.add_argument(
        "--metrics-url", dest="urls", action="append", required=True, metavar="URL",
        help="a backend's metrics URL; repeat for several backends",
    )  # fmt: skip
    parser.add_argument(
        "--interval-ms", type=int, default=1000, help="poll interval (default 1000)"
    )
    parser.add_argument(
        "--duration", type=float, required=True, metavar="S", help="seconds to record"
    )
    parser.add_argument("--out", type=Path, required=True, help="output file (.jsonl or .jsonl.gz)")


async def _poll_one(
    name: str, url: str, at: float, poll: int, results: dict[str, Scrape | ScrapeFailed]
) -> None:
    try:
        response = await fetch(url, timeout_s=POLL_TIMEOUT_S, max_bytes=MAX_PAGE_BYTES)
        if response.status != 200:
            raise GuardError(f"status {response.status}")
        text = response.body.decode("utf-8", errors="replace")
        sample = parse_metrics(text)
    except (GuardError, trio.TooSlowError) as exc:
        error = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
        results[name] = ScrapeFailed(at=at, poll=poll, backend=name, error=error[:200])
        return
    results[name] = Scrape(
        at=at,
        poll=poll,
        backend=name,
        flavour=str(sample.flavour),
        text=learner_text(text, LEARNER_FAMILIES),
    )


async def record(
    urls: list[str], *, interval_s: float, duration_s: float, out: IO[bytes], log: IO[str]
) -> int:
    """Poll every ``interval_s`` for ``duration_s``; returns the number of polls written."""
    names = [f"backend{i}" for i in range(1, len(urls) + 1)]
    header = Header(
        started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        producer=f"inference-guard {__version__} record",
        config={
            "DYNAMIC_METRICS_URLS": ",".join(urls),
            "DYNAMIC_POLL_INTERVAL_MS": str(round(interval_s * 1000)),
        },
    )
    out.write(encode(header))
    start = trio.current_time()
    count = int(duration_s / interval_s + 1e-9) + 1  # a poll at 0 and every interval up to the end
    for poll in range(count):
        await trio.sleep_until(start + poll * interval_s)
        results: dict[str, Scrape | ScrapeFailed] = {}
        async with trio.open_nursery() as nursery:
            for name, url in zip(names, urls, strict=True):
                nursery.start_soon(_poll_one, name, url, 0.0, poll, results)
        at = round(trio.current_time() - start, 6)
        for name in names:
            out.write(encode(_at(results[name], at)))
        failed = sum(isinstance(r, ScrapeFailed) for r in results.values())
        log.write(f"poll {poll} at {at:.1f}s: {len(urls) - failed} ok, {failed} failed\n")
    out.flush()
    return count


def _at(record: Scrape | ScrapeFailed, at: float) -> Scrape | ScrapeFailed:
    """Every scrape of one poll carries the poll's completion time, as the guard evaluates it."""
    return attrs.evolve(record, at=at)


def run(args: argparse.Namespace) -> int:
    if args.interval_ms <= 0 or args.duration < 0:
        sys.stderr.write("inference-guard record: --interval-ms must be > 0 and --duration >= 0\n")
        return 2
    try:
        stream = open_for_writing(args.out)
    except OSError as exc:
        sys.stderr.write(
            f"inference-guard record: cannot write {args.out}: {exc.strerror or exc}\n"
        )
        return 1
    with stream:
        polls = trio.run(
            lambda: record(
                args.urls,
                interval_s=args.interval_ms / 1000,
                duration_s=args.duration,
                out=stream,
                log=sys.stderr,
            )
        )
    sys.stderr.write(f"wrote {polls} polls to {args.out}\n")
    return 0
