"""Time the metrics-page parsers on real pages: ``python bench/bench_metrics_parse.py``.

Compares guard_adapters.metrics.parse_metrics (the focused scanner the poller uses) with the
prometheus_client-based reader in bench/metrics_parsers.py, on the 46 KB vLLM 0.10 capture and the
SGLang documentation page from tests/fixtures/metrics. Each figure is the median over several
timeit repeats of the time per parse, in microseconds. Both parsers get the page as bytes, as the
poller receives it. Prints a table and exits 0; it makes no claim about what the numbers must be.
"""

from __future__ import annotations

import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metrics_parsers import parse_metrics_with_prometheus_client

from guard_adapters.metrics import parse_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics"
PAGES = (
    "vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom",
    "sglang-0.4-docs-llama3.1-8b-under-load.prom",
)
REPEATS = 7
#: Rough wall time per timeit repeat; the loop count is sized to it from a trial run.
TARGET_SECONDS = 0.2


def per_parse_us(parse: Callable[[bytes], object], page: bytes) -> tuple[float, int]:
    """Median microseconds per call over ``REPEATS`` runs, and the calls per run."""
    timer = timeit.Timer(lambda: parse(page))
    number, elapsed = timer.autorange()
    number = max(1, int(number * TARGET_SECONDS / max(elapsed, 1e-9)))
    runs = timer.repeat(repeat=REPEATS, number=number)
    return statistics.median(runs) / number * 1e6, number


def main() -> int:
    print(f"Python {platform.python_implementation()} {sys.version.split()[0]}")
    print(f"  {sys.version}")
    print(f"  {platform.platform()}, {platform.machine()}")
    print(f"median of {REPEATS} timeit repeats, microseconds per parse\n")
    header = f"{'page':<58} {'bytes':>6} {'parser':<18} {'us/parse':>10} {'loops':>7}"
    print(header)
    print("-" * len(header))
    parsers: tuple[tuple[str, Callable[[bytes], object]], ...] = (
        ("parse_metrics", parse_metrics),
        ("prometheus_client", parse_metrics_with_prometheus_client),
    )
    for file_name in PAGES:
        page = (FIXTURES / file_name).read_bytes()
        results = {}
        for label, parse in parsers:
            results[label] = parse(page)
            micros, loops = per_parse_us(parse, page)
            print(f"{file_name:<58} {len(page):>6} {label:<18} {micros:>10.1f} {loops:>7}")
        same = results["parse_metrics"] == results["prometheus_client"]
        print(f"{'':<58} {'':>6} {'same sample:':<18} {'yes' if same else 'NO':>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
