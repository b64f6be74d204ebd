"""The recording format: what the guard observed, one JSON object per line (docs/recording.md).

Reads: lines of a recording (plain or gzip-compressed JSON Lines) and record values to write.
Guarantees:
- the first line is a :class:`Header` naming the format and its version; every later line is
  one record with ``at`` (seconds since the start of the run, monotonic) and ``kind``;
- a request line is a :mod:`guard_core.events` value (the very event the engine applied),
  serialised by cattrs with its class's name in snake case as ``kind``; reading gives back an
  equal value;
- a line that is not valid JSON, not an object, has an unknown ``kind`` or a field of the wrong
  type is reported as a :class:`RecordingError` with its line number (1-based) and the reason;
  nothing else is raised while reading;
- writing never includes secrets: the header's config is whatever the caller passes, and
  :func:`redact` removes the variables that hold tokens or credentials;
- a recording of version 1 or 2 (whose request lines were records of their own, see
  :mod:`guard_adapters.recording_v1`) reads as the same request events, so it replays exactly
  as before; its ``scrape``, ``scrape_failed`` and ``decision`` lines are today's.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, ClassVar, get_args

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union

from guard_adapters import recording_v1
from guard_adapters._errors import LineError
from guard_core import Arrived, Finished, Refused, RequestEvent

__all__ = (
    "FORMAT",
    "VERSION",
    "Decision",
    "Explanation",
    "Header",
    "Record",
    "RecordingError",
    "Scrape",
    "ScrapeFailed",
    "decode_line",
    "encode",
    "learner_text",
    "open_for_reading",
    "open_for_writing",
    "read_records",
    "redact",
)

FORMAT = "inference-guard-recording"
VERSION = 3

#: Environment variables whose values never go into a recording.
SECRET_VARIABLES = frozenset(
    {"TOKEN", "ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION", "ATTESTATION_NVIDIA_PAYLOAD"}
)


class RecordingError(LineError):
    """A line of a recording that cannot be used."""


@attrs.frozen(kw_only=True)
class Header:
    """The first line: what produced the recording and with which settings."""

    KIND: ClassVar[str] = "header"
    format: str = FORMAT
    version: int = VERSION
    #: Wall-clock start of the run (ISO 8601, UTC), for people; ``at`` values are relative.
    started_at: str = ""
    #: The producer, e.g. ``inference-guard 0.1.0 serve``.
    producer: str = ""
    #: Effective non-secret settings as environment variables.
    config: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class _BackendAtPoll:
    """What one backend's metrics gave at poll ``poll`` (the fields both records begin with)."""

    at: float
    poll: int
    backend: str


@attrs.frozen(kw_only=True)
class Scrape(_BackendAtPoll):
    """One backend's metrics page at poll ``poll``: the families the learner reads, verbatim."""

    KIND: ClassVar[str] = "scrape"
    flavour: str
    text: str


@attrs.frozen(kw_only=True)
class ScrapeFailed(_BackendAtPoll):
    """One backend's metrics could not be fetched or parsed at poll ``poll``."""

    KIND: ClassVar[str] = "scrape_failed"
    error: str


@attrs.frozen(kw_only=True)
class Explanation:
    """The predictive learner's reasons for a cap: its predictions and the fit behind them.

    ``user_tps`` and ``ttft_s`` are predicted at the cap, ``binding`` names the constraint that
    set it, and the ``fit_*`` fields are the engine model's coefficients (seconds per step, per
    decoding sequence, per unit of KV usage and per prompt token taken in per second) with its
    smoothed relative error and the number of intervals it learned from.
    """

    cap: int
    user_tps: float
    ttft_s: float
    kv_usage: float
    binding: str
    fit_step_base_s: float
    fit_per_decoder_s: float
    fit_per_kv_s: float
    fit_per_prompt_token_s: float
    fit_relative_error: float
    fit_observations: int


@attrs.frozen(kw_only=True)
class Decision:
    """What the guard published after poll ``poll``; with the predictive learner, why (from
    version 2)."""

    KIND: ClassVar[str] = "decision"
    at: float
    poll: int
    cap: int
    state: str
    reason: str
    yellow: list[str] = attrs.field(factory=list)
    red: list[str] = attrs.field(factory=list)
    source: str = "metrics"
    predicted: Explanation | None = None


Record = Scrape | ScrapeFailed | Decision | RequestEvent


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


#: A poll record's kind is its ``KIND``; a request event's, its class's name in snake case.
_KIND_OF: dict[type, str] = {
    **{cls: cls.KIND for cls in (Scrape, ScrapeFailed, Decision)},
    **{cls: _snake_case(cls.__name__) for cls in get_args(RequestEvent)},
}
_KINDS = frozenset(_KIND_OF.values())
#: The kinds the recordings of versions 1 and 2 share with the current one.
_POLL_KINDS = frozenset({Scrape.KIND, ScrapeFailed.KIND, Decision.KIND})
_converter = cattrs.Converter(forbid_extra_keys=True)


def _omit_unset(cls: type, *names: str) -> None:
    """Unstructure ``cls`` without the fields ``names`` while they hold their defaults."""
    # Any: the per-field overrides travel as keyword arguments beside cattrs' own options.
    overrides: dict[str, Any] = {name: override(omit_if_default=True) for name in names}
    _converter.register_unstructure_hook(
        cls, make_dict_unstructure_fn(cls, _converter, **overrides)
    )


# Optional fields are written only when set: a refusal under PIG's learner has no predicted
# Retry-After, a decision no explanation, an arrival replayed from an old recording no id, and
# an arrival without flow control no band or tenant, an end no output token count (so such a
# line reads as it always did).
_omit_unset(Refused, "retry_after_s", "binding")
_omit_unset(Arrived, "trace_id", "band", "tenant")
_omit_unset(Finished, "output_tokens")
_omit_unset(Decision, "predicted")
configure_tagged_union(Record, _converter, tag_generator=_KIND_OF.__getitem__, tag_name="kind")


def encode(record: Record | Header) -> bytes:
    """One line of the recording, newline included."""
    if isinstance(record, Header):
        payload: dict[str, Any] = {"kind": Header.KIND, **_converter.unstructure(record)}
    else:
        payload = _converter.unstructure(record, Record)
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode_line(
    line: bytes | str, *, line_no: int, source: str = "", version: int = VERSION
) -> Record | Header:
    """Parse one line of a recording of ``version``; raise :class:`RecordingError` naming the
    line when it is unusable."""
    try:
        payload = json.loads(line)
    except ValueError as exc:
        raise RecordingError(line_no, f"not JSON ({exc})", source=source) from None
    if not isinstance(payload, dict):
        raise RecordingError(line_no, "not a JSON object", source=source)
    kind = payload.get("kind")
    if kind == Header.KIND:
        body = {k: v for k, v in payload.items() if k != "kind"}
        try:
            return _converter.structure(body, Header)
        except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
            raise RecordingError(line_no, f"bad header: {_describe(exc)}", source=source) from None
    legacy = version < VERSION and kind not in _POLL_KINDS
    if kind not in (recording_v1.KINDS if legacy else _KINDS):
        raise RecordingError(line_no, f"unknown kind {kind!r}", source=source)
    at = payload.get("at")
    if not isinstance(at, int | float) or isinstance(at, bool) or math.isnan(at):
        raise RecordingError(line_no, "missing or non-numeric 'at'", source=source)
    try:
        if legacy:
            payload = recording_v1.translate(payload)
        return _converter.structure(payload, Record)  # type: ignore[arg-type]
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        raise RecordingError(
            line_no, f"bad {kind!r} record: {_describe(exc)}", source=source
        ) from None


def _describe(exc: Exception) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc))
    return str(exc) or type(exc).__name__


def read_records(
    lines: Iterable[bytes | str], *, strict: bool = False, source: str = ""
) -> Iterator[Record | Header | RecordingError]:
    """Decode every line, as the version its header names (the current one until a header
    says otherwise). Errors are yielded (or raised when ``strict``) and reading goes on."""
    version = VERSION
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = decode_line(line, line_no=line_no, source=source, version=version)
            if isinstance(item, Header):
                version = item.version
            yield item
        except RecordingError as error:
            if strict:
                raise
            yield error


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as raw:
        return raw.read(2) == b"\x1f\x8b"


def open_for_reading(path: str | Path) -> IO[bytes]:
    """A binary stream of the recording's lines, decompressing gzip transparently."""
    path = Path(path)
    if _is_gzip(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb")


def open_for_writing(path: str | Path) -> IO[bytes]:
    """A binary stream to write lines to; gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    if path.suffix == ".gz":
        # mtime 0 keeps the output byte-for-byte reproducible for the same records.
        return gzip.GzipFile(filename=path, mode="wb", mtime=0)  # type: ignore[return-value]
    return io.BufferedWriter(io.FileIO(path, "w"))


def learner_text(page: str, families: Iterable[str]) -> str:
    """The lines of ``page`` that belong to ``families`` (with their HELP and TYPE comments).

    A recording keeps only what the learner reads, verbatim, so a replay parses exactly what the
    live guard parsed while the file stays small. Histogram families keep their ``_bucket``,
    ``_count`` and ``_sum`` lines; ``_created`` lines are dropped.
    """
    wanted = frozenset(families)
    kept = []
    for line in page.split("\n"):
        stripped = line.lstrip()
        if stripped.startswith("#"):
            fields = stripped.split(None, 3)
            name = fields[2] if len(fields) > 2 and fields[1] in ("HELP", "TYPE") else ""
        else:
            end = len(stripped)
            for stop in ("{", " ", "\t"):
                found = stripped.find(stop)
                if found != -1:
                    end = min(end, found)
            name = stripped[:end]
            for suffix in ("_bucket", "_count", "_sum"):
                if name.endswith(suffix) and name.removesuffix(suffix) in wanted:
                    name = name.removesuffix(suffix)
                    break
        if name in wanted:
            kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


def redact(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings safe to record: secrets and unrelated variables removed."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name not in SECRET_VARIABLES and not name.endswith("_AUTHORIZATION")
    }
