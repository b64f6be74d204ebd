"""Real request traces as plain values: when each request arrived and how many tokens it had.

Reads: a trace file in one of two public formats, recognised from its first non-blank line:
- the Azure LLM inference trace (CSV with a ``TIMESTAMP,ContextTokens,GeneratedTokens`` header;
  wall-clock timestamps such as ``2023-11-16 18:15:46.6805900``);
- the Mooncake trace (JSON Lines with ``timestamp`` in milliseconds, ``input_length``,
  ``output_length`` and, optionally, ``hash_ids``: one id per 512-token block of the prompt,
  equal ids meaning an equal prefix up to that block; other keys are ignored).

Guarantees:
- :func:`parse_trace` is pure (lines in, values out); :func:`read_trace` and :func:`load_trace`
  only add reading the file;
- requests come back sorted by arrival (stable for equal times), with ``arrival_s`` in seconds
  since the earliest request, so the first is always at 0;
- a row that cannot be used (unparsable, negative or missing numbers, no output token, a
  ``hash_ids`` that is not a list of non-negative whole numbers) is reported as a
  :class:`TraceError` naming ``file:line`` and skipped, or raised when ``strict``;
- ``hash_ids`` is kept as read (order and repeats included); it is ``()`` for Azure rows and for
  Mooncake rows without the key;
- :func:`scale_rate` and :func:`head` keep the order, the token counts and the ``hash_ids``;
- :func:`premium_flags` is a pure function of ``(count, share, seed)`` and the flags of a prefix
  of a trace are the prefix of the flags of the whole trace; so is :func:`tenant_labels` of
  its arguments, for the tenants of a simulation, and :func:`thinned` of its own.
"""

from __future__ import annotations

import csv
import datetime
import enum
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from guard_adapters._errors import LineError

__all__ = (
    "TraceError",
    "TraceFile",
    "TraceFormat",
    "TraceRequest",
    "head",
    "load_trace",
    "parse_trace",
    "premium_flags",
    "read_trace",
    "scale_rate",
    "tenant_labels",
    "thinned",
)

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormat(enum.StrEnum):
    AZURE_CSV = "azure-csv"
    MOONCAKE_JSONL = "mooncake-jsonl"


class TraceError(LineError):
    """A trace row (or a whole trace) that cannot be used; ``line_no`` is 1-based."""


@attrs.frozen
class TraceRequest:
    """One request of a trace."""

    #: Seconds since the trace's first request.
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    #: The prompt's prefix blocks as Mooncake ids them (``()``: not known). Two requests whose
    #: lists begin alike share that much of their prompt, so a prefix cache can reuse it.
    hash_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class TraceFile:
    """What a trace file held: the usable requests and the rows skipped."""

    format: TraceFormat
    requests: tuple[TraceRequest, ...]
    skipped: tuple[TraceError, ...] = ()


# -- parsing -----------------------------------------------------------------------------------


def _count(value: object, what: str, *, minimum: int) -> int:
    """A whole, finite token count of at least ``minimum`` (JSON may write ``12.0``)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("+-").isdigit():
            raise ValueError(f"{what} must be a whole number, got {value!r}")
        number = int(text)
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    else:
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    if number < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {number}")
    return number


def _hash_ids(value: object) -> tuple[int, ...]:
    """Mooncake's ``hash_ids``: a JSON list of non-negative whole numbers."""
    if not isinstance(value, list):
        raise ValueError(f"hash_ids must be a list of block ids, got {type(value).__name__}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(
                f"hash_ids[{position}] must be a non-negative whole number, got {item!r}"
            )
    return tuple(value)


def _timestamp(text: str) -> datetime.datetime:
    try:
        moment = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"TIMESTAMP is not a date and time: {text!r}") from None
    if moment.tzinfo is not None:
        moment = moment.astimezone(datetime.UTC).replace(tzinfo=None)
    return moment


_Row = tuple[float, int, int, tuple[int, ...]]


def _azure_rows(lines: list[tuple[int, str]], source: str) -> Iterator[_Row | TraceError]:
    header_no, header_line = lines[0]
    header = next(csv.reader([header_line]))
    names = [name.strip() for name in header]
    try:
        columns = [names.index(name) for name in _AZURE_COLUMNS]
    except ValueError:
        raise TraceError(
            header_no, f"CSV header must name {', '.join(_AZURE_COLUMNS)}", source=source
        ) from None
    first: datetime.datetime | None = None
    for line_no, line in lines[1:]:
        try:
            cells = next(csv.reader([line]))
            if len(cells) != len(names):
                raise ValueError(f"expected {len(names)} fields, got {len(cells)}")
            stamp, prompt, output = (cells[i] for i in columns)
            moment = _timestamp(stamp)
            prompt_tokens = _count(prompt, "ContextTokens", minimum=0)
            output_tokens = _count(output, "GeneratedTokens", minimum=1)
        except ValueError as error:
            yield TraceError(line_no, str(error), source=source)
            continue
        first = first or moment
        yield (moment - first).total_seconds(), prompt_tokens, output_tokens, ()


def _mooncake_rows(lines: list[tuple[int, str]], source: str) -> Iterator[_Row | TraceError]:
    for line_no, line in lines:
        try:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"not JSON: {error.msg}") from None
            if not isinstance(row, dict):
                raise ValueError("a line must be a JSON object")
            missing = [k for k in ("timestamp", "input_length", "output_length") if k not in row]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            stamp = row["timestamp"]
            if (
                isinstance(stamp, bool)
                or not isinstance(stamp, int | float)
                or not math.isfinite(stamp)
                or stamp < 0
            ):
                raise ValueError(f"timestamp must be a number of milliseconds, got {stamp!r}")
            prompt_tokens = _count(row["input_length"], "input_length", minimum=0)
            output_tokens = _count(row["output_length"], "output_length", minimum=1)
            hash_ids = _hash_ids(row["hash_ids"]) if "hash_ids" in row else ()
        except ValueError as error:
            yield TraceError(line_no, str(error), source=source)
            continue
        yield stamp / 1000.0, prompt_tokens, output_tokens, hash_ids


def parse_trace(
    lines: Iterable[str | bytes], *, source: str = "", strict: bool = False
) -> TraceFile:
    """Recognise the format from the first non-blank line and read every row.

    A file in neither format (or an Azure CSV without its header) raises :class:`TraceError`
    whatever ``strict`` says; ``strict`` only concerns single rows.
    """
    numbered: list[tuple[int, str]] = []
    for line_no, raw in enumerate(lines, start=1):
        line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if line.strip():
            numbered.append((line_no, line.lstrip("\ufeff") if not numbered else line))
    if not numbered:
        raise TraceError(1, "the trace is empty", source=source)
    first_no, first_line = numbered[0]
    if first_line.lstrip().startswith("{"):
        trace_format = TraceFormat.MOONCAKE_JSONL
        rows = _mooncake_rows(numbered, source)
    elif "TIMESTAMP" in first_line:
        trace_format = TraceFormat.AZURE_CSV
        rows = _azure_rows(numbered, source)
    else:
        raise TraceError(
            first_no,
            "unknown trace format (expected an Azure CSV header or Mooncake JSON lines)",
            source=source,
        )
    parsed: list[_Row] = []
    skipped: list[TraceError] = []
    for row in rows:
        if isinstance(row, TraceError):
            if strict:
                raise row
            skipped.append(row)
        else:
            parsed.append(row)
    parsed.sort(key=lambda row: row[0])
    start = parsed[0][0] if parsed else 0.0
    requests = tuple(
        TraceRequest(
            arrival_s=at - start, prompt_tokens=prompt, output_tokens=output, hash_ids=hash_ids
        )
        for at, prompt, output, hash_ids in parsed
    )
    return TraceFile(format=trace_format, requests=requests, skipped=tuple(skipped))


def read_trace(path: str | Path, *, strict: bool = False) -> TraceFile:
    """Read a trace file; see :func:`parse_trace`. Errors name the file and line."""
    path = Path(path)
    with path.open("rb") as stream:
        return parse_trace(stream, source=str(path), strict=strict)


def load_trace(path: str | Path, *, strict: bool = False) -> tuple[TraceRequest, ...]:
    """The usable requests of a trace file (malformed rows skipped unless ``strict``)."""
    return read_trace(path, strict=strict).requests


# -- transformations ---------------------------------------------------------------------------


def scale_rate(trace: Iterable[TraceRequest], factor: float) -> tuple[TraceRequest, ...]:
    """The same requests arriving ``factor`` times as fast (arrival times divided by it)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"the rate factor must be a positive number, got {factor!r}")
    return tuple(attrs.evolve(r, arrival_s=r.arrival_s / factor) for r in trace)


def head(trace: Iterable[TraceRequest], seconds: float) -> tuple[TraceRequest, ...]:
    """The requests that arrive before ``seconds``."""
    return tuple(r for r in trace if r.arrival_s < seconds)


def premium_flags(count: int, share: float, *, seed: int) -> tuple[bool, ...]:
    """Which of ``count`` requests are premium: each one independently with chance ``share``."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the premium share must be in [0, 1], got {share!r}")
    rng = random.Random(seed)
    return tuple(rng.random() < share for _ in range(count))


def tenant_labels(count: int, tenants: int, heavy_share: float, *, seed: int) -> tuple[str, ...]:
    """The tenant of each of ``count`` requests: ``t0`` (the heavy one) with chance
    ``heavy_share``, else one of ``t1`` .. ``t{tenants - 1}`` uniformly; a pure function of its
    arguments, drawn from its own stream (the premium flags of the same seed do not change)."""
    if tenants < 2:
        raise ValueError(f"tenant labels need at least 2 tenants, got {tenants}")
    if not 0.0 <= heavy_share < 1.0:
        raise ValueError(f"the heavy share must be in [0, 1), got {heavy_share!r}")
    rng = random.Random(f"tenants/{seed}")
    return tuple(
        "t0" if rng.random() < heavy_share else f"t{rng.randrange(1, tenants)}"
        for _ in range(count)
    )


def thinned(labels: Sequence[str], tenant: str, keep: float, *, seed: int) -> tuple[bool, ...]:
    """Which requests stay when each one labelled ``tenant`` is kept with chance ``keep`` and
    every other is kept: the same other requests, ``tenant`` sending ``keep`` times as much. A
    pure function of its arguments, drawn from its own stream."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"the kept share must be in (0, 1], got {keep!r}")
    rng = random.Random(f"thinned/{seed}")
    return tuple(label != tenant or rng.random() < keep for label in labels)
