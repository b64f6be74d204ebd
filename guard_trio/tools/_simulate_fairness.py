"""``simulate``'s tenants and priority bands: the flags, the settings they make, the table.

Reads: ``--tenants N``, ``--heavy-share F``, ``--heavy-keep P``, ``--bands SPEC`` (as
``PIG_PRIORITY_BANDS``) and ``--unfair``, and a run's per-tenant figures.
Guarantees: without these flags the guard's settings are left exactly as the environment made
them; ``--tenants`` turns tenant fairness on (default weights) unless ``--unfair`` asks for the
baseline with the same labels; a bad band list is an argument error naming every problem.
"""

from __future__ import annotations

import argparse
from typing import IO

import attrs

from guard_adapters.flow_config import parse_bands
from guard_adapters.simulation import SimulationResult
from guard_core.bands import BandSpec
from guard_core.flow import FlowConfig
from guard_core.guard import GuardConfig
from guard_core.tenants import TenantConfig
from guard_trio._cli_support import figure, number, whole_number, write_table

__all__ = ("add_flow_arguments", "flow_flags_ok", "flow_notes", "print_fairness", "with_flow")

_heavy_share = number(lambda value: 0.0 <= value < 1.0, "in [0, 1)")
_heavy_keep = number(lambda value: 0.0 < value <= 1.0, "in (0, 1]")


_tenant_count = whole_number(2, 1000, "tenants")


def _bands(text: str) -> BandSpec:
    spec, problems = parse_bands(text)
    if spec is None:
        raise argparse.ArgumentTypeError("; ".join(problems) or "no band given")
    return spec


def with_flow(
    config: GuardConfig, args: argparse.Namespace, tenants: TenantConfig | None = None
) -> GuardConfig:
    """The guard's settings with ``--bands``, ``--tenants`` and ``--unfair`` applied."""
    flow = config.flow or FlowConfig()
    if args.bands is not None:
        flow = attrs.evolve(flow, bands=args.bands)
    if args.tenants is not None and flow.tenants is None:
        flow = attrs.evolve(flow, tenants=tenants or TenantConfig())
    if args.unfair:
        flow = attrs.evolve(flow, tenants=None)
    if flow == FlowConfig() and config.flow is None:
        return config  # nothing asked for: the gate alone, as before
    return attrs.evolve(config, flow=flow)


def flow_flags_ok(args: argparse.Namespace, err: IO[str]) -> bool:
    """False (the reason written to ``err``) when a flag is given without one it needs."""
    if args.tenants is None and (args.heavy_share > 0 or args.heavy_keep < 1):
        err.write("inference-guard simulate: --heavy-share and --heavy-keep need --tenants N\n")
        return False
    return True


def add_flow_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of this module."""
    fair = parser.add_argument_group("tenants and priority bands")
    fair.add_argument(
        "--tenants",
        type=_tenant_count,
        metavar="N",
        help="label requests with N tenants (t0 the heavy one) and turn tenant fairness on",
    )
    fair.add_argument(
        "--heavy-share",
        type=_heavy_share,
        default=0.0,
        metavar="F",
        help="the share of requests t0 sends (default 0: every tenant alike)",
    )
    fair.add_argument(
        "--heavy-keep",
        type=_heavy_keep,
        default=1.0,
        metavar="P",
        help="keep each of t0's requests with chance P only, the others as they are (default 1):"
        " the same light traffic with the heavy tenant sending less, a reference for fairness",
    )
    fair.add_argument(
        "--bands",
        type=_bands,
        metavar="SPEC",
        help="priority bands, as PIG_PRIORITY_BANDS (premium requests go to the first band)",
    )
    fair.add_argument(
        "--unfair",
        action="store_true",
        help="keep the tenant labels but turn tenant fairness off (the baseline)",
    )


def flow_notes(args: argparse.Namespace, config: GuardConfig) -> list[str]:
    """What the run's header line says about tenants and bands."""
    notes = []
    if args.tenants is not None:
        fairness = "off" if args.unfair else "on"
        kept = f", {args.heavy_keep:g} of it kept" if args.heavy_keep < 1 else ""
        notes.append(
            f"{args.tenants} tenants, t0 sends {args.heavy_share:g}{kept},"
            f" tenant fairness {fairness}"
        )
    if config.flow is not None:
        notes.append("bands " + ",".join(config.flow.bands.names))
    return notes


def print_fairness(result: SimulationResult, out: IO[str]) -> None:
    fair = result.fairness
    assert fair is not None
    out.write(
        f"tenants: Jain index (light, served share) {figure(fair.jain_index_light, 3)},"
        f" reject rate light {fair.light_reject_rate:.3f} heavy {fair.heavy_reject_rate:.3f},"
        f" goodput/s light {fair.light_goodput_per_s:.2f} heavy {fair.heavy_goodput_per_s:.2f}\n"
    )
    rows: list[tuple[str, ...]] = [("tenant", "requests", "rejected", "reject rate", "goodput/s")]
    shown = fair.tenants if len(fair.tenants) <= 8 else fair.tenants[:8]
    for row in shown:
        rows.append(
            (
                row.tenant,
                str(row.requests),
                str(row.rejected),
                f"{row.reject_rate:.3f}",
                f"{row.goodput_per_s:.2f}",
            )
        )
    write_table(rows, out)
