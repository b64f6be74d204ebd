"""``inference-guard replay FILE``: recompute the guard's decisions from a recording."""

from __future__ import annotations

import argparse
import enum
import json
import sys
from pathlib import Path
from typing import IO, Any

import attrs

from guard_adapters.recording import (
    Header,
    Record,
    RecordingError,
    open_for_reading,
    read_records,
)
from guard_adapters.replay import ReplayResult, replay, summarise
from guard_adapters.request_story import explain_request, render_story
from guard_core import GuardConfig
from guard_trio._cli_support import add_overrides, read_input, settings_with
from guard_trio._cli_support import write_table as _table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``replay``."""
    parser.add_argument("file", type=Path, help="recording (.jsonl or .jsonl.gz)")
    add_overrides(parser, help="override one setting (environment variable name), repeatable")
    parser.add_argument("--out", type=Path, help="write one JSON object per poll to this file")
    parser.add_argument(
        "--diff",
        action="store_true",
        help="list every poll whose decision differs from the recording",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first malformed line instead of skipping it",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--explain",
        metavar="ID",
        help="tell one request's story instead: its X-Request-Id (or engine number), each "
        "event, and the rule that admitted or refused it (with --json: as JSON)",
    )


def _load(path: Path, *, strict: bool) -> tuple[Header | None, list[Record], list[RecordingError]]:
    header: Header | None = None
    records: list[Record] = []
    errors: list[RecordingError] = []
    with open_for_reading(path) as stream:
        for item in read_records(stream, strict=strict, source=str(path)):
            if isinstance(item, RecordingError):
                errors.append(item)
            elif isinstance(item, Header):
                header = header or item
            else:
                records.append(item)
    return header, records, errors


def _print_summary(path: Path, summary: dict[str, Any], overrides: list[str], out: IO[str]) -> None:
    settings = ", ".join(overrides) if overrides else "as recorded"
    polls, seconds = summary["polls"], summary["seconds"]
    out.write(f"{path}: {polls} polls over {seconds:.1f} s (settings: {settings})\n\n")
    total = sum(summary["time_in_state_s"].values()) or 1.0
    _table(
        [("state", "seconds", "share")]
        + [
            (s, f"{t:.1f}", f"{100 * t / total:.0f}%")
            for s, t in summary["time_in_state_s"].items()
        ],
        out,
    )
    cap = summary["cap"]
    out.write(f"\ncap: min {cap['min']}  median {cap['median']}  max {cap['max']}\n\n")
    _table(
        [("final reason", "polls")] + [(r, str(n)) for r, n in summary["final_reasons"].items()],
        out,
    )
    out.write("\n")
    if summary["state_reasons"]:
        _table(
            [("state reason", "polls")]
            + [(r, str(n)) for r, n in summary["state_reasons"].items()],
            out,
        )
        out.write("\n")
    adm = summary["admissions"]
    _table(
        [
            ("requests", "replay", "recorded"),
            ("admitted", str(adm["admitted"]), str(adm["recorded_forwarded"])),
            ("rejected", str(adm["rejected"]), str(adm["recorded_rejected"])),
        ],
        out,
    )
    predictive = summary.get("predictive")
    if predictive is not None:
        _print_predictive(predictive, out)
    out.write(f"\npolls whose decision differs from the recording: {summary['differing_polls']}\n")
    if summary["differing_outcomes"]:
        out.write(
            f"requests whose outcome differs from the recording: {summary['differing_outcomes']}\n"
        )
    if summary["unparsable_scrapes"]:
        out.write(
            f"scrapes that no longer parse (counted as failed): {summary['unparsable_scrapes']}\n"
        )


def _print_predictive(predictive: dict[str, Any], out: IO[str]) -> None:
    """The predictive learner's explanation: what bound the cap, the speed it predicted there,
    the fit of its engine model, and the refusals by constraint."""
    speed = predictive["predicted_user_tps_at_cap"]
    fit = predictive["final_fit"]
    out.write(
        f"\npredictive learner: user tok/s predicted at the cap min {speed['min']:.1f}"
        f"  median {speed['median']:.1f}  max {speed['max']:.1f}\n"
        f"engine model at the end: step {1000 * fit['step_base_s']:.2f} ms"
        f" + {1000 * fit['per_decoder_s']:.3f} ms per decoder"
        f" + {1000 * fit['per_kv_s']:.2f} ms x KV usage,"
        f" prefill {1000 * fit['per_prompt_token_s']:.4f} ms per prompt token;"
        f" relative error {fit['relative_error']:.3f} (median"
        f" {predictive['fit_relative_error_median']:.3f}) over {fit['observations']} intervals\n\n"
    )
    _table(
        [("cap bound by", "polls")] + [(b, str(n)) for b, n in predictive["cap_binding"].items()],
        out,
    )
    if predictive["refusals_by_binding"]:
        out.write("\n")
        _table(
            [("refused by", "requests")]
            + [(b, str(n)) for b, n in predictive["refusals_by_binding"].items()],
            out,
        )
    if predictive["differing_explanations"]:
        out.write(
            "polls whose explanation differs from the recording:"
            f" {predictive['differing_explanations']}\n"
        )


def _print_diff(result: ReplayResult, out: IO[str]) -> None:
    for poll in result.polls:
        if not poll.differs or poll.recorded is None:
            continue
        rec, dec = poll.recorded, poll.decision
        line = (
            f"poll {poll.poll} at {dec.at:.3f}s: recorded cap {rec.cap} {rec.state} {rec.reason}"
            f" -> replayed cap {dec.cap} {dec.state} {dec.final_reason}"
        )
        if poll.explanation_differs and rec.predicted is not None:
            replayed = poll.prediction
            now = (
                "none" if replayed is None else f"{replayed.user_tps:.2f} tok/s {replayed.binding}"
            )
            line += (
                f" (explanation: recorded {rec.predicted.user_tps:.2f} tok/s"
                f" {rec.predicted.binding} -> replayed {now})"
            )
        out.write(line + "\n")


def _explain(records: list[Record], config: GuardConfig, wanted: str, *, json_out: bool) -> int:
    story = explain_request(records, config, wanted)
    if story is None:
        sys.stderr.write(f"inference-guard replay: no request {wanted!r} in the recording\n")
        return 1
    if json_out:
        document = attrs.asdict(story, value_serializer=_json_value)
        document["verdict"] = story.verdict
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(render_story(story) + "\n")
    return 0


def _json_value(_instance: object, _field: object, value: Any) -> Any:
    return str(value) if isinstance(value, enum.Enum) else value


def run(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    loaded = read_input("replay", args.file, lambda path: _load(path, strict=args.strict), err)
    if loaded is None:
        return 1
    header, records, errors = loaded
    for skipped in errors:
        err.write(f"skipped {skipped}\n")
    if header is None:
        err.write(f"inference-guard replay: {args.file}: no header line; using default settings\n")
    settings = settings_with("replay", header.config if header else {}, args.overrides, err)
    if settings is None:
        return 2
    if args.explain is not None:
        return _explain(records, settings.guard_config(), args.explain, json_out=args.json)
    result = replay(records, settings.guard_config())
    if args.out is not None:
        with args.out.open("w", encoding="utf-8") as stream:
            for poll in result.polls:
                stream.write(json.dumps(poll.as_json(), separators=(",", ":")) + "\n")
    summary = summarise(result)
    summary["skipped_lines"] = len(errors)
    if args.json:
        out.write(json.dumps(summary, indent=2) + "\n")
    else:
        _print_summary(args.file, summary, args.overrides, out)
        if errors:
            out.write(f"malformed lines skipped: {len(errors)}\n")
    if args.diff:
        _print_diff(result, out)
    return 0
