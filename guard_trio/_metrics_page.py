"""The metrics page as data: one :class:`MetricRow` per family, rendered in table order.

Reads: a table of rows (name, kind, help, label names, getter) and, at scrape time, one value
the getters read (the scrape's view of the published core value and the event instruments).
Guarantees:
- the page is exactly the rows, in order: each row is one family with its name, kind and
  help; a section whose condition is false adds nothing, and an info row whose getter gives no
  label set is left out (PIG prints those only when set);
- the text is written by ``prometheus_client`` from a private :class:`CollectorRegistry`;
  unlike PIG it carries ``# HELP``/``# TYPE`` lines, and counters carry no ``_created`` series
  because the families are built here;
- a counter row may hold an unlabelled sample beside labelled ones (``pig_rejected_total``),
  which ``prometheus_client``'s own ``Counter`` cannot register;
- histogram samples are written in PIG's order (``_count``, ``_sum``, then the buckets), with
  bounds in their shortest form (``le="1"``) and ``+Inf`` equal to the count;
- the documentation's table (:func:`reference_rows`) is read from the same rows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
from prometheus_client.metrics_core import Metric

__all__ = (
    "Kind",
    "MetricRow",
    "Section",
    "counter",
    "gauge",
    "gauge_table",
    "histogram",
    "info",
    "read_path",
    "reference_rows",
    "render",
    "summary",
)

View = TypeVar("View")
Labels = Mapping[str, str]
#: One histogram series: labels, bounds, cumulative counts, count, sum.
HistogramSeries = tuple[Labels, Sequence[float], Sequence[float], float, float]


class Kind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    #: A gauge at 1 per label set (``*_info``).
    INFO = "info"
    #: ``_count`` and ``_sum`` only.
    SUMMARY = "summary"
    HISTOGRAM = "histogram"


@attrs.frozen
class MetricRow(Generic[View]):
    """One family of the page.

    ``get`` returns, by kind: a number (gauge or counter without labels; booleans are 0/1),
    ``(labels, value)`` pairs (with ``labels`` set), label sets (info), ``(count, sum)``
    (summary), or :data:`HistogramSeries` values (histogram).
    """

    name: str
    kind: Kind
    help: str
    get: Callable[[View], Any]
    labels: tuple[str, ...] = ()


@attrs.frozen
class Section(Generic[View]):
    """Rows shown together, only when ``when`` holds for the scrape."""

    title: str
    rows: tuple[MetricRow[View], ...]
    when: Callable[[View], bool] = lambda _view: True


def _bound(value: float) -> str:
    """A bucket bound in its shortest form: ``1``, ``0.25``, ``1800``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _pairs(row: MetricRow[View], value: Any) -> Iterable[tuple[Labels, float]]:
    if row.labels:
        return value  # type: ignore[no-any-return]
    return (({}, value),)


def _family(row: MetricRow[View], view: View) -> Metric | None:
    value = row.get(view)
    name = row.name
    if row.kind is Kind.INFO:
        label_sets = tuple(value)
        if not label_sets:
            return None
        family = Metric(name, row.help, "gauge")
        for labels in label_sets:
            family.add_sample(name, dict(labels), 1.0)
        return family
    if row.kind is Kind.GAUGE:
        family = Metric(name, row.help, "gauge")
        for labels, number in _pairs(row, value):
            family.add_sample(name, dict(labels), float(number))
        return family
    if row.kind is Kind.COUNTER:
        family = Metric(name.removesuffix("_total"), row.help, "counter")
        for labels, number in _pairs(row, value):
            family.add_sample(name, dict(labels), float(number))
        return family
    if row.kind is Kind.SUMMARY:
        count, total = value
        family = Metric(name, row.help, "summary")
        family.add_sample(name + "_count", {}, float(count))
        family.add_sample(name + "_sum", {}, float(total))
        return family
    family = Metric(name, row.help, "histogram")
    series: Iterable[HistogramSeries] = value
    for labels, bounds, cumulative, count, total in series:
        base = dict(labels)
        family.add_sample(name + "_count", base, float(count))
        family.add_sample(name + "_sum", base, float(total))
        for bound, number in zip(bounds, cumulative, strict=True):
            family.add_sample(name + "_bucket", {**base, "le": _bound(bound)}, float(number))
        family.add_sample(name + "_bucket", {**base, "le": "+Inf"}, float(count))
    return family


def render(sections: Iterable[Section[View]], view: View) -> Iterator[Metric]:
    """The families of one scrape, in table order."""
    for section in sections:
        if not section.when(view):
            continue
        for row in section.rows:
            family = _family(row, view)
            if family is not None:
                yield family


def reference_rows(rows: Iterable[MetricRow[Any]]) -> Iterator[str]:
    """One Markdown table row per metric: name, kind, label names, help."""
    for row in rows:
        labels = ", ".join(sorted(row.labels)) or "-"
        help_text = " ".join(row.help.split()).replace("|", "\\|")
        yield f"| `{row.name}` | {row.kind} | {labels} | {help_text} |"


# -- row constructors (what the tables are written with) --------------------------------------


def _labels(labels: str) -> tuple[str, ...]:
    return tuple(labels.split(",")) if labels else ()


def gauge(name: str, help: str, get: Callable[[View], Any], labels: str = "") -> MetricRow[View]:
    """A gauge; with ``labels`` (comma-separated) ``get`` gives ``(labels, value)`` pairs."""
    return MetricRow(name, Kind.GAUGE, help, get, _labels(labels))


def counter(name: str, help: str, get: Callable[[View], Any], labels: str = "") -> MetricRow[View]:
    """A counter; with ``labels`` (comma-separated) ``get`` gives ``(labels, value)`` pairs."""
    return MetricRow(name, Kind.COUNTER, help, get, _labels(labels))


def info(name: str, help: str, labels: str, get: Callable[[View], Any]) -> MetricRow[View]:
    """An info metric: ``get`` gives its label sets (none: the family is left out)."""
    return MetricRow(name, Kind.INFO, help, get, _labels(labels))


def summary(name: str, help: str, get: Callable[[View], Any]) -> MetricRow[View]:
    return MetricRow(name, Kind.SUMMARY, help, get)


def histogram(
    name: str, help: str, get: Callable[[View], Any], labels: str = ""
) -> MetricRow[View]:
    return MetricRow(name, Kind.HISTOGRAM, help, get, _labels(labels))


def read_path(view: object, path: str) -> Any:
    """The value at a dotted ``path`` of attributes (digits index a tuple); a trailing ``?``
    reads a ``None`` anywhere on the way as 0."""
    optional = path.endswith("?")
    value: Any = view
    for part in path.rstrip("?").split("."):
        if value is None and optional:
            return 0
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return 0 if value is None and optional else value


def _reader(path: str) -> Callable[[Any], Any]:
    return lambda view: read_path(view, path)


def gauge_table(text: str, special: Iterable[MetricRow[View]]) -> tuple[MetricRow[View], ...]:
    """Rows written as a text table, one per line, in page order.

    A line ``name path help`` is an unlabelled gauge reading :func:`read_path` at ``path``; a
    line ``@name`` places the row of that name from ``special`` (each used exactly once).
    """
    named = {row.name: row for row in special}
    rows: list[MetricRow[View]] = []
    for line in text.strip().splitlines():
        if line.startswith("@"):
            rows.append(named.pop(line[1:].strip()))
            continue
        name, path, help_text = line.split(maxsplit=2)
        rows.append(gauge(name, help_text, _reader(path)))
    if named:
        raise ValueError(f"rows never placed: {sorted(named)}")
    return tuple(rows)
