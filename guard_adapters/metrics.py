"""Pull the few engine figures the capacity learner uses out of a Prometheus text page.

What is read
    Only the series named below; every other line is passed over unexamined, so a malformed
    ``python_gc_*``, ``http_*`` or unrelated ``vllm:`` line can never fail a scrape.

    ``running``
        ``vllm:num_requests_running``, else ``sglang:num_running_reqs``.
    ``waiting``
        ``vllm:num_requests_waiting``, else ``sglang:num_queue_reqs``.
    ``kv_usage``
        ``vllm:kv_cache_usage_perc``, else the name it replaced (gone from 0.12),
        ``vllm:gpu_cache_usage_perc``, else ``sglang:token_usage``.
    ``preemptions``
        ``vllm:num_preemptions_total`` + ``sglang:num_retracted_reqs`` (else SGLang 0.4.10's
        ``sglang:total_retracted_reqs``) + ``sglang:num_paused_reqs``.
    ``generation_tokens``
        ``vllm:generation_tokens_total``, else ``sglang:generation_tokens_total``.
    ``generation_tps``
        ``sglang:gen_throughput``.
    ``prompt_tokens``
        ``vllm:prompt_tokens_total``, else ``sglang:prompt_tokens_total``.
    ``ttft`` (a histogram)
        ``vllm:time_to_first_token_seconds``, ``vllm:request_time_to_first_token_seconds``,
        ``sglang:time_to_first_token_seconds``.
    ``inter_token_latency`` (a histogram)
        ``vllm:inter_token_latency_seconds``, the name it replaced (deprecated in 0.10.2, gone
        from 0.17) ``vllm:time_per_output_token_seconds``, ``sglang:inter_token_latency_seconds``,
        and SGLang 0.4.3's ``sglang:time_per_output_token_seconds``. The per-request means
        ``*:request_time_per_output_token_seconds`` are not read.

    Several series of one name (label sets) are added up for ``vllm:`` names, except the KV-cache
    gauges, and combined with ``max`` for ``sglang:`` names (SGLang repeats a gauge per rank).
    A field takes its vLLM value when the page has one, else its SGLang value. Two exceptions:
    ``preemptions`` adds whichever of its three parts are present, and ``generation_tps`` is
    reported only while ``vllm:generation_tokens_total`` is absent. A bare ``vllm:num_preemptions``
    is not read: no vLLM release exposes it (the counter is only ever scraped as ``_total`` and
    ``_created``, per the metric catalogues).

    Histograms are built from ``<name>_bucket`` (bound taken from ``le``, ``+Inf`` allowed),
    ``<name>_count`` and ``<name>_sum`` lines, each label set added in bound by bound, for both
    engines. Without a ``_count`` line the ``+Inf`` bucket stands in (0 if there is none either).
    ``ttft`` and ``inter_token_latency`` are each the first histogram of their list, in the order
    above, whose count is above zero; failing that, the first one present with a zero count;
    ``None`` when none is present.

Guarantees
    * Pure and deterministic: no I/O, clock or mutable global state.
    * ``None`` in a field means no accepted series fed it. A series whose value is skipped (see
      below) is treated as absent, also when choosing between the vLLM and SGLang name.
    * Every number in the result is finite and non-negative, except an ``inf`` bucket bound (and a
      sum of huge values that overflows); bucket bounds are any non-NaN number.
    * ``flavour``: VLLM if any line starts with ``vllm:``, else SGLANG if any starts with
      ``sglang:``, else UNKNOWN.
    * :class:`MetricsParseError` is the only exception raised, and only for what is listed next.

Errors, skips, and what is not checked
    A page over :data:`MAX_PAGE_BYTES` (counted as UTF-8) is refused, with ``line_no`` None. Bytes
    that are not UTF-8 are replaced, not refused. Lines are split on ``\\n`` (so a ``\\r`` before
    it is trailing whitespace) and leading blanks are ignored. A line belongs to a family read when
    the text before its first ``{`` or whitespace is exactly one of the names above (``_created``
    lines and longer names such as ``vllm:num_requests_waiting_by_reason`` do not). For those lines:

    * ``MetricsParseError`` naming the 1-based line: a ``{`` with no ``}`` after it; nothing after
      the name or the label set; more than two fields after it (only a value and an optional
      timestamp may follow); a ``_bucket`` line in which no ``le`` label can be found (a label
      value left unquoted or unclosed before ``le`` hides it).
    * skipped, exactly as if the line were absent: a value that is not a number (anything with an
      ``_``, ``0x..``, words), ``NaN``, ``+Inf``/``-Inf`` or below zero; a bucket whose ``le`` is
      not a number or is ``NaN``.
    * not checked: the label set beyond locating its closing brace (the last ``}`` on the line)
      and, for buckets, its ``le``; the timestamp, which is ignored.

How it stays fast
    One compiled expression finds the wanted lines: it is anchored on ``\\n`` and its names form a
    prefix tree whose first split is ``vllm:`` versus ``sglang:``, so nearly every line is dropped
    after a character or two inside the regular-expression engine, and the label set and the usual
    ``le`` come out as groups. Python code then runs for a few dozen lines only (54 on the 46 KB
    vLLM 0.10 page, most of them histogram buckets, at about 1 us each). About 120 us for that page
    on CPython 3.11 where prometheus_client's parser takes about 7 ms (it was about 70 us before the
    inter-token latency and prompt-token families were read); see ``bench/bench_metrics_parse.py``.
"""

from __future__ import annotations

import math
import re
from types import MappingProxyType
from typing import Final

from guard_adapters._errors import MetricsParseError
from guard_core.observations import BackendSample, Flavour, Histogram

__all__ = ("LEARNER_FAMILIES", "MAX_PAGE_BYTES", "parse_metrics")

#: Largest page accepted, in bytes once encoded as UTF-8 (the poller reads no more than this).
MAX_PAGE_BYTES: Final = 4 * 1024 * 1024

_INF: Final = float("inf")

# Accumulator slots for plain series.
(
    _RUN_V,
    _WAIT_V,
    _KV_V,
    _KV_V_OLD,
    _PRE_V,
    _GEN_V,
    _RUN_S,
    _WAIT_S,
    _KV_S,
    _RETR_S,
    _RETR_S_OLD,
    _PAUSE_S,
    _GEN_S,
    _TPS_S,
    _PROMPT_V,
    _PROMPT_S,
) = range(16)
_N_SLOTS: Final = 16

# How a series is folded in: plain sum, plain max, or one of a histogram's three parts.
_SUM, _MAX, _BUCKET, _COUNT, _HSUM = range(5)

#: TTFT histograms in the order they are tried.
_TTFT_NAMES: Final = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
)
#: Inter-token latency histograms in the order they are tried.
_ITL_NAMES: Final = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)
#: Every histogram read; its position is its accumulator index.
_HIST_NAMES: Final = _TTFT_NAMES + _ITL_NAMES
_TTFT_SLOTS: Final = range(len(_TTFT_NAMES))
_ITL_SLOTS: Final = range(len(_TTFT_NAMES), len(_HIST_NAMES))

_PLAIN: Final = (
    ("vllm:num_requests_running", _SUM, _RUN_V),
    ("vllm:num_requests_waiting", _SUM, _WAIT_V),
    ("vllm:kv_cache_usage_perc", _MAX, _KV_V),
    ("vllm:gpu_cache_usage_perc", _MAX, _KV_V_OLD),
    ("vllm:num_preemptions_total", _SUM, _PRE_V),
    ("vllm:generation_tokens_total", _SUM, _GEN_V),
    ("sglang:num_running_reqs", _MAX, _RUN_S),
    ("sglang:num_queue_reqs", _MAX, _WAIT_S),
    ("sglang:token_usage", _MAX, _KV_S),
    ("sglang:num_retracted_reqs", _MAX, _RETR_S),
    ("sglang:total_retracted_reqs", _MAX, _RETR_S_OLD),
    ("sglang:num_paused_reqs", _MAX, _PAUSE_S),
    ("sglang:generation_tokens_total", _MAX, _GEN_S),
    ("sglang:gen_throughput", _MAX, _TPS_S),
    ("vllm:prompt_tokens_total", _SUM, _PROMPT_V),
    ("sglang:prompt_tokens_total", _MAX, _PROMPT_S),
)

#: The metric families read, histograms by their base name (for tools that keep only these lines,
#: such as a recording of scrapes for replay).
LEARNER_FAMILIES: Final[tuple[str, ...]] = tuple(name for name, _, _ in _PLAIN) + _HIST_NAMES

#: Exact series name -> (fold kind, slot).
_SERIES: Final = MappingProxyType(
    {name: (kind, slot) for name, kind, slot in _PLAIN}
    | {
        f"{base}{suffix}": (kind, index)
        for index, base in enumerate(_HIST_NAMES)
        for suffix, kind in (("_bucket", _BUCKET), ("_count", _COUNT), ("_sum", _HSUM))
    }
)


def _alternation(words: tuple[str, ...]) -> str:
    """A regular expression matching exactly ``words``, factored as a prefix tree.

    Sharing prefixes matters: the engine tries the alternatives one by one at every line start,
    and a tree rejects a ``python_gc_...`` or ``vllm:cache_config_info`` line after a character
    or a few, where a flat list would try every name.
    """
    groups: dict[str, list[str]] = {}
    for word in words:
        groups.setdefault(word[:1], []).append(word[1:])
    options: list[str] = []
    ends_here = False
    for head, tails in sorted(groups.items()):
        if not head:
            ends_here = True
            continue
        options.append(re.escape(head) + _alternation(tuple(tails)))
    if not options:
        return ""
    body = options[0] if len(options) == 1 else f"(?:{'|'.join(options)})"
    return f"(?:{body})?" if ends_here else body


#: The inside of a quoted label value: anything but a quote or a line break, backslash escapes.
_QUOTED_VALUE: Final = r'[^"\\\n]*+(?:\\.[^"\\\n]*+)*+'

#: A line of one of the families read, as four groups: the exact name (it must be followed by a
#: label set, whitespace or the end of the page); the label set with its braces, running to the
#: *last* ``}`` of the line ("" when there is none); the value of the ``le`` label when the label
#: set is written the plain way up to it (``name="value",`` pairs; "" otherwise, and the slower
#: :func:`_find_le` decides); and the rest of the line. The page is given a
#: leading ``\n`` so that its first line is found like the others. The name tree branches on
#: ``vllm:`` / ``sglang:`` first, so nearly every line of a page is dropped after a character or
#: two without leaving the regular-expression engine.
_RELEVANT_LINE: Final = re.compile(
    r"\n[ \t]*+("
    + _alternation(tuple(_SERIES))
    + r")(?![^\s{])(?:[ \t]*+(\{(?:(?=(?:[A-Za-z_]\w*+=\""
    + _QUOTED_VALUE
    + r"\",)*?le=\"([^\"\\\n]*+)\"))?[^\n]*\}))?([^\n]*+)"
)
#: One quoted label value, closed; its inside is group 1.
_QUOTED: Final = re.compile(r'"(' + _QUOTED_VALUE + r')"')
_INDENTED_VLLM: Final = re.compile(r"\n[ \t]+vllm:")
_INDENTED_SGLANG: Final = re.compile(r"\n[ \t]+sglang:")


def parse_metrics(page: bytes | str) -> BackendSample:  # noqa: PLR0915 - hot loop kept inline
    """Build a :class:`BackendSample` from one Prometheus text page of a vLLM or SGLang server.

    See the module documentation for exactly what is read, combined, skipped and refused.

    Raises:
        MetricsParseError: the page is over :data:`MAX_PAGE_BYTES`, or a line of one of the
            families read is structurally broken.
    """
    text = "\n" + _decode(page)
    matches: list[tuple[str, str, str, str]] = _RELEVANT_LINE.findall(text)

    acc: list[float | None] = [None] * _N_SLOTS
    n_hist = len(_HIST_NAMES)
    buckets: tuple[dict[float, float], ...] = tuple({} for _ in range(n_hist))
    counts: list[float | None] = [None] * n_hist
    sums: list[float | None] = [None] * n_hist
    present = [False] * n_hist
    inf = _INF
    series = _SERIES
    isnan = math.isnan

    for match in matches:
        name, braced, le_text, tail = match
        kind, slot = series[name]
        fields = tail.split()
        if len(fields) != 1 or (not braced and fields[0][0] == "{"):
            _check_fields(text, match, fields)
        if kind == _BUCKET and not le_text:
            le_text = _bucket_bound(text, match)
        value_text = fields[0]
        if "_" in value_text:
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not 0.0 <= value < inf:  # also false for NaN
            continue

        if kind == _SUM:
            current = acc[slot]
            acc[slot] = value if current is None else current + value
        elif kind == _MAX:
            current = acc[slot]
            if current is None or value > current:
                acc[slot] = value
        elif kind == _BUCKET:
            if "_" in le_text:
                continue
            try:
                bound = float(le_text)
            except ValueError:
                continue
            if isnan(bound):
                continue
            per_bound = buckets[slot]
            per_bound[bound] = per_bound.get(bound, 0.0) + value
            present[slot] = True
        elif kind == _COUNT:
            current = counts[slot]
            counts[slot] = value if current is None else current + value
            present[slot] = True
        else:
            current = sums[slot]
            sums[slot] = value if current is None else current + value
            present[slot] = True

    return _assemble(
        flavour=_flavour(text, matches),
        acc=acc,
        buckets=buckets,
        counts=counts,
        sums=sums,
        present=present,
    )


def _decode(page: bytes | str) -> str:
    if isinstance(page, str):
        size = len(page)
        if size > MAX_PAGE_BYTES // 4:  # only then can the UTF-8 form exceed the limit
            size = len(page.encode("utf-8", "surrogatepass"))
        if size > MAX_PAGE_BYTES:
            raise MetricsParseError(f"page is {size} bytes, over the {MAX_PAGE_BYTES} byte limit")
        return page
    if len(page) > MAX_PAGE_BYTES:
        raise MetricsParseError(f"page is {len(page)} bytes, over the {MAX_PAGE_BYTES} byte limit")
    return page.decode("utf-8", "replace")


def _find_le(labels: str) -> str | None:
    """The raw value of the ``le`` label in a label set written in an unusual way, or ``None``.

    Quoted values are honoured (with backslash escapes), so an ``le=`` inside another label's
    value is not taken. A quote left open at the end of the set does not start a value.
    """
    start = 0
    for quoted in _QUOTED.finditer(labels):
        outside = labels[start : quoted.start()].rstrip()
        if outside.endswith("=") and outside[:-1].rpartition(",")[2].strip() == "le":
            return quoted.group(1)
        start = quoted.end()
    return None


def _check_fields(text: str, match: tuple[str, str, str, str], fields: list[str]) -> None:
    """Raise for the structural faults that show in the fields after the name or label set."""
    if fields and not match[1] and fields[0].startswith("{"):
        raise _line_error(text, match, "label set opened with '{' is never closed")
    if not fields:
        raise _line_error(text, match, "no value after the metric name")
    if len(fields) > 2:
        raise _line_error(text, match, "more than a value and a timestamp after the name")


def _bucket_bound(text: str, match: tuple[str, str, str, str]) -> str:
    """The ``le`` text of a bucket whose label set the line expression could not read."""
    found = _find_le(match[1][1:-1])
    if found is None:
        raise _line_error(text, match, "histogram bucket without an le label")
    return found


def _line_error(text: str, match: tuple[str, str, str, str], reason: str) -> MetricsParseError:
    # Whether a line is an error depends on its own text alone, so the first line that reads the
    # same is the one at fault: any earlier copy would have raised already.
    line_no: int | None = None
    for found in _RELEVANT_LINE.finditer(text):
        if found.groups("") == match:
            line_no = text.count("\n", 0, found.start()) + 1
            break
    line = f"{match[0]}{match[1]}{match[3]}"
    excerpt = line if len(line) <= 120 else f"{line[:117]}..."
    return MetricsParseError(f"{reason}: {excerpt!r}", line_no)


def _flavour(text: str, matches: list[tuple[str, str, str, str]]) -> Flavour:
    if any(match[0].startswith("v") for match in matches):
        return Flavour.VLLM
    if "\nvllm:" in text or _INDENTED_VLLM.search(text):
        return Flavour.VLLM
    if matches or "\nsglang:" in text or _INDENTED_SGLANG.search(text):
        return Flavour.SGLANG
    return Flavour.UNKNOWN


def _assemble(
    *,
    flavour: Flavour,
    acc: list[float | None],
    buckets: tuple[dict[float, float], ...],
    counts: list[float | None],
    sums: list[float | None],
    present: list[bool],
) -> BackendSample:
    retracted = acc[_RETR_S] if acc[_RETR_S] is not None else acc[_RETR_S_OLD]
    preemptions: float | None = None
    for part in (acc[_PRE_V], retracted, acc[_PAUSE_S]):
        if part is not None:
            preemptions = part if preemptions is None else preemptions + part

    kv = acc[_KV_V] if acc[_KV_V] is not None else acc[_KV_V_OLD]
    return BackendSample(
        flavour=flavour,
        running=acc[_RUN_V] if acc[_RUN_V] is not None else acc[_RUN_S],
        waiting=acc[_WAIT_V] if acc[_WAIT_V] is not None else acc[_WAIT_S],
        kv_usage=kv if kv is not None else acc[_KV_S],
        preemptions=preemptions,
        generation_tokens=acc[_GEN_V] if acc[_GEN_V] is not None else acc[_GEN_S],
        generation_tps=acc[_TPS_S] if acc[_GEN_V] is None else None,
        ttft=_first_histogram(_TTFT_SLOTS, buckets, counts, sums, present),
        prompt_tokens=acc[_PROMPT_V] if acc[_PROMPT_V] is not None else acc[_PROMPT_S],
        inter_token_latency=_first_histogram(_ITL_SLOTS, buckets, counts, sums, present),
    )


def _first_histogram(
    slots: range,
    buckets: tuple[dict[float, float], ...],
    counts: list[float | None],
    sums: list[float | None],
    present: list[bool],
) -> Histogram | None:
    """The first histogram of ``slots`` with observations, else the first present, else None."""
    chosen: int | None = None
    chosen_count = 0.0
    for index in slots:
        if present[index]:
            count = counts[index]
            if count is None:
                count = buckets[index].get(_INF, 0.0)
            if chosen is None or count > 0:
                chosen, chosen_count = index, count
            if count > 0:
                break
    if chosen is None:
        return None
    return Histogram(
        buckets=tuple(buckets[chosen].items()),
        count=chosen_count,
        sum=sums[chosen] or 0.0,
    )
