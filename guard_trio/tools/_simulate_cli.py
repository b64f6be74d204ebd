"""``inference-guard simulate``: a request trace through the simulated engine under policies.

Reads: its flags, the trace file, and optionally an engine profile file; no environment, no
network (``--set`` gives the guard's settings).

Guarantees: the same trace, seed and settings give the same figures (virtual time, seeded
tiers; only the CPU time each policy took varies); one table per policy (per policy and routing
with ``--backends``), in the order asked, with a row per tier; ``--json`` writes the
same summaries and what the run was, ``--plot`` one chart per figure. Without ``--backends``
the output is the single-engine simulation's, unchanged. Exits 2 on bad settings or flags, 1 on
an unreadable trace.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    PROFILES,
    EngineProfile,
    profile_from_json,
)
from guard_adapters.sim_routing import ROUTINGS, parse_routing
from guard_adapters.simulation import (
    TIERS,
    SimulationResult,
    Slowdown,
    parse_policy,
    simulate,
    validate_slowdowns,
)
from guard_adapters.traces import head, premium_flags, read_trace, scale_rate
from guard_core.affinity import DEFAULT_BOUND
from guard_trio._cli_support import (
    add_overrides,
    figure,
    number,
    read_input,
    settings_with,
    whole_number,
    write_json,
    write_table,
)
from guard_trio.tools._simulate_fairness import (
    add_flow_arguments,
    flow_flags_ok,
    flow_notes,
    print_fairness,
    with_flow,
)

#: The guard policy learns from metrics; a metrics URL is what turns learning on.
#: ``DYNAMIC_POLICY=predictive`` makes the predictive learner's settings (``DYNAMIC_PREDICTIVE_*``)
#: part of the configuration; the ``guard`` policy is always PIG's learner whatever it says.
BASE_ENVIRONMENT = {"DYNAMIC_METRICS_URL": "http://sim/metrics", "DYNAMIC_POLICY": "predictive"}
DEFAULT_POLICIES = ("none", "static:32", "guard", "predictive")
_PLOTS = (
    ("cap", "cap", "admission cap"),
    ("running", "running", "engine running"),
    ("waiting", "waiting", "engine waiting"),
    ("user_tps", "user_tps", "mean per-user tok/s"),
)


def _policy_text(text: str) -> str:
    try:
        parse_policy(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip().lower()


_positive = number(lambda value: math.isfinite(value) and value > 0, "a positive number")
_above_one = number(lambda value: math.isfinite(value) and value > 1, "a number above 1")
_at_least_one = number(lambda value: math.isfinite(value) and value >= 1, "a number >= 1")


_backends = whole_number(1, 64, "backends")


def _routing(text: str) -> str:
    spec = text.strip().lower()
    if spec not in ROUTINGS:
        raise argparse.ArgumentTypeError(f"unknown routing {text!r}: use {', '.join(ROUTINGS)}")
    return spec


_share = number(lambda value: 0.0 <= value <= 1.0, "in [0, 1]")


def _profile_file(text: str) -> tuple[Path, EngineProfile]:
    """``--profile-file``: a JSON object of EngineProfile fields, checked in full."""
    path = Path(text)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise argparse.ArgumentTypeError(f"{path}: an engine profile must be a JSON object")
    try:
        return path, profile_from_json(document)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{path}: {error}") from None


def _slowdown(text: str) -> Slowdown:
    """``--slowdown AT_S:DURATION_S:FACTOR``."""
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected AT_S:DURATION_S:FACTOR, got {text!r}")
    try:
        at_s, duration_s, factor = (float(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected three numbers AT_S:DURATION_S:FACTOR, got {text!r}"
        ) from None
    try:
        return validate_slowdowns([(at_s, duration_s, factor)])[0]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``simulate``."""
    parser.add_argument("--trace", type=Path, required=True, help="trace file")
    parser.add_argument(
        "--policy",
        dest="policies",
        action="append",
        type=_policy_text,
        metavar="POLICY",
        help=(
            "none, static:N, guard (PIG's learner) or predictive; repeatable, in the order shown"
            f" (default: {' '.join(DEFAULT_POLICIES)})"
        ),
    )
    add_overrides(parser, help="a guard setting (environment variable name), repeatable")
    parser.add_argument(
        "--rate-scale",
        type=_positive,
        default=1.0,
        metavar="X",
        help="multiply the arrival rate by X (default 1)",
    )
    parser.add_argument(
        "--premium-share",
        type=_share,
        default=0.0,
        metavar="F",
        help="tag this share of requests premium (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="tiers and engine seed (default 0)")
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help=f"engine profile (default {DEFAULT_PROFILE})",
    )
    engine.add_argument(
        "--profile-file",
        type=_profile_file,
        metavar="FILE",
        help=(
            "your own engine profile: a JSON object with the fields name, max_num_seqs,"
            " kv_capacity_tokens, step_base_s, decode_token_s, prefill_token_s and optionally"
            " max_num_batched_tokens, max_model_len, kv_token_s, source"
        ),
    )
    parser.add_argument(
        "--slowdown",
        dest="slowdowns",
        action="append",
        default=[],
        type=_slowdown,
        metavar="AT_S:DURATION_S:FACTOR",
        help=(
            "make every engine step FACTOR times as long from AT_S for DURATION_S simulated"
            " seconds; repeatable (windows must not overlap)"
        ),
    )
    pool = parser.add_argument_group("backend pools")
    pool.add_argument(
        "--backends",
        type=_backends,
        metavar="N",
        help="simulate a pool of N engines of the profile, each with its own prefix cache; the"
        " policy's cap is the pool's (default: one engine, today's simulation)",
    )
    pool.add_argument(
        "--slow-backend",
        type=_at_least_one,
        default=1.0,
        metavar="FACTOR",
        help="make the last backend FACTOR times slower (every step), for the whole run",
    )
    pool.add_argument(
        "--routing",
        dest="routings",
        action="append",
        type=_routing,
        metavar="ROUTING",
        help=(
            f"{', '.join(ROUTINGS)}; repeatable (default: round-robin). guard: affinity with"
            " bounded load on the prompt prefix, else the best predicted outcome"
        ),
    )
    pool.add_argument(
        "--affinity-bound",
        type=_above_one,
        default=DEFAULT_BOUND,
        metavar="C",
        help=f"the guard routing's load bound factor (default {DEFAULT_BOUND})",
    )
    add_flow_arguments(parser)
    parser.add_argument(
        "--duration",
        type=_positive,
        metavar="S",
        help="keep only the requests arriving in the first S simulated seconds (after scaling)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="stop at a malformed trace row instead of skipping"
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the summaries as JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="write PNG charts over time (needs matplotlib)"
    )


def _print_result(
    result: SimulationResult, seconds: float, out: IO[str], *, pooled: bool = False
) -> None:
    label = result.policy if not pooled else f"{result.policy}/{result.routing}"
    out.write(
        f"policy {label}: {len(result.requests)} requests over"
        f" {result.duration_s:.0f} s of arrivals, drained at {result.end_s:.0f} s,"
        f" engine {result.profile}, {result.preemptions} preemptions"
        f" (simulated in {seconds:.1f} s)\n"
    )
    rows: list[tuple[str, ...]] = [
        (
            "tier",
            "requests",
            "admitted",
            "rejected",
            "tok/s p5",
            "tok/s p50",
            "TTFT p50",
            "TTFT p95",
            "TTFT p99",
            "goodput/s",
            "goodput PA/s",
        )
    ]
    for tier in TIERS:
        s = result.summary[tier]
        rows.append(
            (
                tier,
                str(s.requests),
                str(s.admitted),
                str(s.rejected),
                figure(s.user_tps_p5, 1),
                figure(s.user_tps_p50, 1),
                figure(s.ttft_p50_s, 2),
                figure(s.ttft_p95_s, 2),
                figure(s.ttft_p99_s, 2),
                figure(s.goodput_per_s, 2),
                figure(s.goodput_prompt_aware_per_s, 2),
            )
        )
    write_table(rows, out)
    if result.limit_reasons:
        reasons = ", ".join(f"{reason} {n}" for reason, n in result.limit_reasons.items())
        out.write(f"cap set by (polls): {reasons}\n")
    if result.engine_refused:
        out.write(f"admitted but refused by the engine (too long): {result.engine_refused}\n")
    if pooled:
        _print_backends(result, out)
    if result.fairness is not None:
        print_fairness(result, out)
    out.write("\n")


def _print_backends(result: SimulationResult, out: IO[str]) -> None:
    hit = figure(result.prefix_hit_rate, 3)
    routes = ", ".join(f"{reason} {n}" for reason, n in sorted(result.routes.items()))
    out.write(f"prefix hit rate {hit}" + (f"; routed by {routes}" if routes else "") + "\n")
    rows: list[tuple[str, ...]] = [("backend", "requests", "busy", "prefix hit", "goodput/s")]
    for backend in result.backends:
        rows.append(
            (
                backend.name,
                str(backend.requests),
                figure(backend.busy_share, 2),
                figure(backend.prefix_hit_rate, 3),
                figure(backend.goodput_per_s, 2),
            )
        )
    write_table(rows, out)


def _json_results(
    results: Sequence[SimulationResult], *, pooled: bool, several: bool
) -> dict[str, Any]:
    """The summaries by policy (by "<policy>/<routing>" when several routings ran); a pool's
    also carry its prefix hit rate, routing, how the router chose and each backend's load."""
    document: dict[str, Any] = {}
    for result in results:
        entry: dict[str, Any] = result.as_json()
        if pooled:
            entry["prefix_hit_rate"] = result.prefix_hit_rate
            entry["routing"] = result.routing
            entry["routes"] = dict(result.routes)
            entry["backends"] = [backend.as_json() for backend in result.backends]
        if result.fairness is not None:
            entry["fairness"] = result.fairness.as_json()
            entry["tenants"] = [row.as_json() for row in result.fairness.tenants]
        key = f"{result.policy}/{result.routing}" if several else result.policy
        document[key] = entry
    return document


def _load_pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def _label(result: SimulationResult) -> str:
    """A result's name in a chart: its policy, and its routing for a pool."""
    return result.policy if len(result.backends) <= 1 else f"{result.policy}/{result.routing}"


def _plot(results: Sequence[SimulationResult], directory: Path, pyplot: Any) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, field, title in _PLOTS:
        figure, axes = pyplot.subplots(figsize=(10, 4))
        for result in results:
            points = [(p.at, getattr(p, field)) for p in result.series]
            if all(value is None for _, value in points):
                continue  # e.g. the none policy has no cap
            axes.plot(
                [at for at, _ in points],
                [math.nan if value is None else value for _, value in points],
                label=result.policy
                if len(result.backends) <= 1
                else f"{result.policy}/{result.routing}",
                linewidth=0.8,
            )
        axes.set_title(title)
        axes.set_xlabel("simulated seconds")
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
        path = directory / f"{name}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        pyplot.close(figure)
        written.append(path)
    return written


def _engine_setup(
    args: argparse.Namespace, err: IO[str]
) -> tuple[EngineProfile, Path | None, tuple[Slowdown, ...]] | None:
    """The engine profile (and the file it came from) and the slowdowns; None after an error."""
    try:
        slowdowns = validate_slowdowns(args.slowdowns)
    except ValueError as error:  # each window is checked by argparse; this is an overlap
        err.write(f"inference-guard simulate: --slowdown: {error}\n")
        return None
    if args.profile_file is not None:
        path, profile = args.profile_file
        return profile, path, slowdowns
    return PROFILES[args.profile], None, slowdowns


def run(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    policies = list(dict.fromkeys(args.policies or DEFAULT_POLICIES))
    pyplot = None
    if args.plot is not None:
        pyplot = _load_pyplot()
        if pyplot is None:
            err.write(
                "inference-guard simulate: --plot needs matplotlib;"
                ' install it with: pip install "inference-guard[plot]"\n'
            )
            return 2
    settings = (
        settings_with("simulate", BASE_ENVIRONMENT, args.overrides, err)
        if flow_flags_ok(args, err)
        else None
    )
    if settings is None:
        return 2
    engine = _engine_setup(args, err)
    if engine is None:
        return 2
    profile, profile_path, slowdowns = engine
    trace_file = read_input(
        "simulate", args.trace, lambda path: read_trace(path, strict=args.strict), err
    )
    if trace_file is None:
        return 1
    for skipped in trace_file.skipped[:10]:
        err.write(f"skipped {skipped}\n")
    if len(trace_file.skipped) > 10:
        err.write(f"... and {len(trace_file.skipped) - 10} more malformed rows skipped\n")
    trace = scale_rate(trace_file.requests, args.rate_scale)
    if args.duration is not None:
        trace = head(trace, args.duration)
    guard_config = with_flow(settings.guard_config(), args, settings.tenant_config)
    poll_interval_s = settings.env.dynamic_poll_interval_ms / 1000
    premium = sum(premium_flags(len(trace), args.premium_share, seed=args.seed))
    notes = [f"rate x{args.rate_scale:g}", f"{premium} premium", f"seed {args.seed}"]
    if trace_file.skipped:
        notes.append(f"{len(trace_file.skipped)} malformed rows skipped")
    if args.overrides:
        notes.append("settings: " + ", ".join(args.overrides))
    if profile_path is not None:
        notes.append(f"engine from {profile_path}")
    for at_s, duration_s, factor in slowdowns:
        notes.append(f"engine x{factor:g} slower from {at_s:g} s for {duration_s:g} s")
    notes.extend(flow_notes(args, guard_config))
    pooled = args.backends is not None
    routings = list(dict.fromkeys(args.routings or ("round-robin",)))
    if pooled:
        notes.append(f"{args.backends} backends, routing {' '.join(routings)}")
        if args.slow_backend != 1:
            notes.append(f"the last backend x{args.slow_backend:g} slower")
    out.write(f"{args.trace}: {len(trace)} requests ({trace_file.format}), {', '.join(notes)}\n\n")
    results = []
    for text in policies:
        for routing in routings if pooled else ("round-robin",):
            started = time.process_time()
            result = simulate(
                trace,
                parse_policy(text, guard_config),
                profile=profile,
                seed=args.seed,
                premium_share=args.premium_share,
                poll_interval_s=poll_interval_s,
                slowdowns=slowdowns,
                backends=args.backends or 1,
                slow_backend=args.slow_backend,
                routing=parse_routing(routing, bound=args.affinity_bound),
                tenants=args.tenants or 0,
                heavy_share=args.heavy_share,
                heavy_keep=args.heavy_keep,
            )
            _print_result(result, time.process_time() - started, out, pooled=pooled)
            results.append(result)
    if args.json is not None:
        document = {
            "policies": _json_results(results, pooled=pooled, several=len(routings) > 1),
            "run": {
                "trace": str(args.trace),
                "format": str(trace_file.format),
                "requests": len(trace),
                "skipped_rows": len(trace_file.skipped),
                "rate_scale": args.rate_scale,
                "premium_share": args.premium_share,
                "seed": args.seed,
                "profile": profile.name,
                "profile_file": None if profile_path is None else str(profile_path),
                "slowdowns": [list(window) for window in slowdowns],
                "duration_s": args.duration,
                "settings": list(args.overrides),
                "tenants": args.tenants,
                "heavy_share": args.heavy_share,
                "heavy_keep": args.heavy_keep,
                "tenant_fairness": args.tenants is not None and not args.unfair,
                "bands": None if guard_config.flow is None else list(guard_config.flow.bands.names),
                **(
                    {
                        "backends": args.backends,
                        "slow_backend": args.slow_backend,
                        "routings": routings,
                        "affinity_bound": args.affinity_bound,
                    }
                    if pooled
                    else {}
                ),
            },
        }
        write_json(args.json, document)
    if pyplot is not None:
        for path in _plot(results, args.plot, pyplot):
            out.write(f"wrote {path}\n")
    return 0
