"""Checks a Grafana dashboard's PromQL against a real ``/pig/metrics`` page.

Reads: the dashboard JSON (``deploy/grafana/inference-guard.json``) and a Prometheus text page,
parsed with ``prometheus_client.parser``; each expression is parsed with ``promql_parser`` (a
compiled PromQL parser) after Grafana's variables are replaced by values of the right shape.

Guarantees: :func:`expression_problems` returns one message per thing an expression asks for
that the page does not offer: a series name that is not a sample name on the page (so the
``_total``/``_bucket``/``_sum``/``_count`` suffixes must be the ones the exposition format gives
that family), a label in a matcher that the series does not carry, a ``by``/``without``/``on``/
``ignoring``/``group_left`` label that the expression under it cannot carry (labels are followed
through aggregations, functions and binary operators), ``rate``-like functions over a gauge, and
``histogram_quantile`` over series without ``le``. What it cannot follow (``label_replace``,
``label_join``, ``count_values``, a regex on ``__name__``, an unknown Grafana variable) is
reported as a problem too, so an expression is never passed unchecked. ``job`` and ``instance``
are the labels Prometheus attaches to every scraped series and ``up`` the series it writes for
each scrape. :func:`structure_problems` checks panel ids, datasources, targets and grid
positions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import promql_parser as pq
from prometheus_client.parser import text_string_to_metric_families

#: Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"job", "instance"})
#: Series Prometheus writes itself for each scrape target, with their labels.
SCRAPE_SERIES: Mapping[str, frozenset[str]] = {"up": TARGET_LABELS}
#: Functions whose argument must be a counter (or a histogram's or summary's counters).
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})
#: Functions whose result carries labels this checker does not follow.
UNFOLLOWED_FUNCTIONS = frozenset({"label_replace", "label_join"})
#: What Grafana's interval variables become before parsing.
INTERVAL_VARIABLES = ("__rate_interval", "__interval", "__range")
GRID_COLUMNS = 24

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.*),)?\s*(?P<label>\w+)\s*\)\s*$")


@attrs.frozen
class Catalogue:
    """What a scraped page offers: each sample name, its labels, and whether it is a counter."""

    labels: Mapping[str, frozenset[str]]
    counters: frozenset[str]

    @classmethod
    def from_page(cls, page: str) -> Catalogue:
        labels: dict[str, set[str]] = {}
        counters: set[str] = set()
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
                if _counter_like(family.type, family.name, sample.name):
                    counters.add(sample.name)
        return cls({name: frozenset(names) for name, names in labels.items()}, frozenset(counters))

    def merged(self, other: Catalogue) -> Catalogue:
        names = set(self.labels) | set(other.labels)
        return Catalogue(
            {
                name: self.labels.get(name, frozenset()) | other.labels.get(name, frozenset())
                for name in names
            },
            self.counters | other.counters,
        )

    def series_labels(self, name: str) -> frozenset[str] | None:
        """The labels a stored series of that name carries, or None when there is no such."""
        if name in SCRAPE_SERIES:
            return SCRAPE_SERIES[name]
        if name not in self.labels:
            return None
        return self.labels[name] | TARGET_LABELS


def _counter_like(family_type: str, family: str, sample: str) -> bool:
    """Samples that only go up: a counter's ``_total``, a histogram's or summary's ``_bucket``,
    ``_sum`` and ``_count`` (the exposition format's suffixes)."""
    if family_type == "counter":
        return sample == f"{family}_total"
    if family_type in ("histogram", "gaugehistogram"):
        return sample in (f"{family}_bucket", f"{family}_sum", f"{family}_count")
    if family_type == "summary":
        return sample in (f"{family}_sum", f"{family}_count")
    return False


def substitute_variables(expr: str, variables: frozenset[str]) -> tuple[str, list[str]]:
    """``expr`` with Grafana's interval variables as ``5m`` and each dashboard variable as
    ``.*`` (they stand in label-value regexes), and the names of variables nobody declared."""
    unknown: list[str] = []

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name in INTERVAL_VARIABLES:
            return "5m"
        if name in variables:
            return ".*"
        unknown.append(name)
        return match.group(0)

    return _VARIABLE.sub(value, expr), unknown


class _Walk:
    """Follows the labels each sub-expression can carry and collects what does not hold."""

    def __init__(self, catalogue: Catalogue) -> None:
        self.catalogue = catalogue
        self.problems: list[str] = []

    def labels(self, node: Any) -> frozenset[str] | None:
        """The labels ``node``'s series can carry; None for a scalar or a string."""
        if isinstance(node, pq.VectorSelector):
            return self.selector(node)
        if isinstance(node, pq.MatrixSelector):
            return self.selector(node.vector_selector)
        if isinstance(node, pq.ParenExpr | pq.UnaryExpr | pq.SubqueryExpr):
            return self.labels(node.expr)
        if isinstance(node, pq.NumberLiteral | pq.StringLiteral):
            return None
        if isinstance(node, pq.Call):
            return self.call(node)
        if isinstance(node, pq.AggregateExpr):
            return self.aggregate(node)
        if isinstance(node, pq.BinaryExpr):
            return self.binary(node)
        self.problems.append(f"not checked: {type(node).__name__} {node}")
        return frozenset()

    def selector(self, node: pq.VectorSelector) -> frozenset[str]:
        name = node.name
        matchers = [*node.matchers.matchers, *(m for g in node.matchers.or_matchers for m in g)]
        if name is None:
            names = [m for m in matchers if m.name == "__name__"]
            if len(names) != 1 or names[0].op != pq.MatchOp.Equal:
                self.problems.append(f"not checked: a metric name that is not one literal: {node}")
                return frozenset()
            name = names[0].value
        available = self.catalogue.series_labels(name)
        if available is None:
            self.problems.append(f"series {name!r} is not on the page")
            return frozenset()
        for matcher in matchers:
            if matcher.name != "__name__" and matcher.name not in available:
                self.problems.append(f"label {matcher.name!r} is not on series {name!r}")
        return available

    def call(self, node: pq.Call) -> frozenset[str] | None:
        name = node.func.name
        if name in UNFOLLOWED_FUNCTIONS:
            self.problems.append(f"not checked: {name}() makes labels this checker cannot follow")
        args = [self.labels(arg) for arg in node.args]
        if name in COUNTER_FUNCTIONS:
            self.counter_argument(name, node.args[0])
        vectors = [labels for labels in args if labels is not None]
        if node.func.return_type != pq.ValueType.Vector:
            return None
        if name == "histogram_quantile":
            inner = args[1] or frozenset()
            if "le" not in inner:
                self.problems.append("histogram_quantile over series without an 'le' label")
            return inner - {"le"}
        if name in ("absent", "absent_over_time", "vector", "time"):
            return frozenset()
        return vectors[0] if vectors else frozenset()

    def counter_argument(self, function: str, arg: Any) -> None:
        while isinstance(arg, pq.ParenExpr):
            arg = arg.expr
        if isinstance(arg, pq.MatrixSelector):
            name = arg.vector_selector.name
            known = name is not None and name in self.catalogue.labels
            if known and name not in self.catalogue.counters:
                self.problems.append(f"{function}() over {name!r}, which is not a counter")
            return
        if not isinstance(arg, pq.SubqueryExpr):
            self.problems.append(f"not checked: {function}() over {arg}")

    def aggregate(self, node: pq.AggregateExpr) -> frozenset[str]:
        operator = str(node.op)
        if node.param is not None:
            self.labels(node.param)
        if operator == "count_values":
            self.problems.append("not checked: count_values() makes a label")
        inner = self.labels(node.expr) or frozenset()
        modifier = node.modifier
        grouping = frozenset(modifier.labels) if modifier is not None else frozenset()
        for label in sorted(grouping - inner):
            self.problems.append(f"{operator} groups on {label!r}, which {node.expr} cannot carry")
        if operator in ("topk", "bottomk", "limitk", "limit_ratio"):
            return inner
        if modifier is None:
            return frozenset()
        if modifier.type == pq.AggModifierType.Without:
            return inner - grouping
        return grouping

    def binary(self, node: pq.BinaryExpr) -> frozenset[str] | None:
        left = self.labels(node.lhs)
        right = self.labels(node.rhs)
        if left is None or right is None:
            return left if right is None else right
        operator = str(node.op)
        modifier = node.modifier
        matching = modifier.matching if modifier is not None else None
        card = modifier.card if modifier is not None else pq.VectorMatchCardinality.OneToOne
        matched = frozenset(matching.labels) if matching is not None else frozenset()
        keyword = "on"
        if matching is not None and matching.type == pq.LabelModifierType.Include:
            for label in sorted(matched - (left & right)):
                self.problems.append(f"on({label}) needs {label!r} on both sides of {operator}")
        elif matching is not None:
            keyword = "ignoring"
            for label in sorted(matched - (left | right)):
                self.problems.append(f"ignoring({label}): neither side of {operator} carries it")
        group = frozenset(modifier.group_labels or ()) if modifier is not None else frozenset()
        one_side = right if card == pq.VectorMatchCardinality.ManyToOne else left
        for label in sorted(group - one_side):
            self.problems.append(f"group label {label!r} is not on the one side of {operator}")
        if operator == "or":
            return left | right
        if operator in ("and", "unless"):
            return left
        if card == pq.VectorMatchCardinality.ManyToOne:
            return left | group
        if card == pq.VectorMatchCardinality.OneToMany:
            return right | group
        if matching is None:
            return left
        return matched if keyword == "on" else left - matched


def expression_problems(
    expr: str, catalogue: Catalogue, variables: frozenset[str] = frozenset()
) -> list[str]:
    """Everything in ``expr`` the page behind ``catalogue`` does not offer (empty: it holds)."""
    text, unknown = substitute_variables(expr, variables)
    problems = [f"unknown variable ${name}" for name in unknown]
    try:
        tree = pq.parse(text)
    except (ValueError, TypeError) as error:
        return [*problems, f"does not parse: {error}"]
    walk = _Walk(catalogue)
    walk.labels(tree)
    return problems + walk.problems


def variable_query_problems(
    query: str, catalogue: Catalogue, variables: frozenset[str]
) -> list[str]:
    """Grafana's ``label_values([selector,] label)``: the selector holds and carries the label."""
    found = _LABEL_VALUES.match(query)
    if found is None:
        return [f"not checked: a variable query other than label_values(): {query}"]
    label = found.group("label")
    selector = found.group("selector")
    if selector is None:
        if any(label in labels for labels in catalogue.labels.values()) or label in TARGET_LABELS:
            return []
        return [f"no series carries label {label!r}"]
    problems = expression_problems(selector, catalogue, variables)
    text, _ = substitute_variables(selector, variables)
    try:
        walk = _Walk(catalogue)
        carried = walk.labels(pq.parse(text)) or frozenset()
    except (ValueError, TypeError):
        return problems
    if label not in carried:
        problems.append(f"label {label!r} is not on {selector}")
    return problems


# -- the dashboard -----------------------------------------------------------------------------


def all_panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, rows included, and the panels kept inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def variable_names(dashboard: Mapping[str, Any]) -> frozenset[str]:
    return frozenset(v["name"] for v in dashboard.get("templating", {}).get("list", []))


def panel_expressions(panel: Mapping[str, Any]) -> list[str]:
    return [target["expr"] for target in panel.get("targets", []) if "expr" in target]


def dashboard_problems(
    dashboard: Mapping[str, Any],
    catalogue: Catalogue,
    catalogue_for: Callable[[Mapping[str, Any]], Catalogue] | None = None,
) -> list[str]:
    """Every expression problem of every panel and variable query, prefixed by where it is.
    Panels are checked against ``catalogue_for(panel)`` when given, else ``catalogue``; the
    variable queries against ``catalogue``."""
    variables = variable_names(dashboard)
    problems: list[str] = []
    for panel in all_panels(dashboard):
        page = catalogue_for(panel) if catalogue_for is not None else catalogue
        for expr in panel_expressions(panel):
            problems += [
                f"panel {panel.get('title')!r}: {p} in {expr}"
                for p in expression_problems(expr, page, variables)
            ]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, Mapping) else query
        problems += [
            f"variable {variable['name']!r}: {p}"
            for p in variable_query_problems(text, catalogue, variables)
        ]
    return problems


def structure_problems(dashboard: Mapping[str, Any]) -> list[str]:
    """Unique panel ids; each panel (rows aside) with a datasource and at least one target with
    an expression; grid positions inside the 24 columns and not overlapping."""
    problems: list[str] = []
    ids = [panel.get("id") for panel in all_panels(dashboard)]
    for duplicate in sorted({i for i in ids if ids.count(i) > 1}, key=str):
        problems.append(f"panel id {duplicate} is used more than once")
    if None in ids:
        problems.append("a panel has no id")
    boxes: list[tuple[str, int, int, int, int]] = []
    for panel in dashboard.get("panels", []):
        title = str(panel.get("title"))
        grid = panel.get("gridPos") or {}
        values = [grid.get(key) for key in ("x", "y", "w", "h")]
        numbers = [v for v in values if isinstance(v, int)]
        if len(numbers) != len(values):
            problems.append(f"panel {title!r} has no complete gridPos")
            continue
        x, y, w, h = numbers
        if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > GRID_COLUMNS:
            problems.append(f"panel {title!r} lies outside the grid: {grid}")
        for other, ox, oy, ow, oh in boxes:
            if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                problems.append(f"panels {other!r} and {title!r} overlap")
        boxes.append((title, x, y, w, h))
    for panel in all_panels(dashboard):
        if panel.get("type") == "row":
            continue
        name = str(panel.get("title"))
        source = panel.get("datasource")
        if not isinstance(source, Mapping) or not source.get("uid"):
            problems.append(f"panel {name!r} has no datasource")
        if not panel_expressions(panel):
            problems.append(f"panel {name!r} has no target with an expression")
    return problems


def datasource_uids(dashboard: Mapping[str, Any]) -> set[str]:
    """The datasource uids the panels and their targets name."""
    uids: set[str] = set()
    for panel in all_panels(dashboard):
        for holder in (panel, *panel.get("targets", [])):
            source = holder.get("datasource")
            if isinstance(source, Mapping) and source.get("uid"):
                uids.add(str(source["uid"]))
    return uids


def row_titles(dashboard: Mapping[str, Any]) -> dict[int, str]:
    """Each panel's id and the title of the row above it ("" above the first row)."""
    titles: dict[int, str] = {}
    current = ""
    ordered = sorted(
        dashboard.get("panels", []),
        key=lambda p: (p.get("gridPos", {}).get("y", 0), p.get("gridPos", {}).get("x", 0)),
    )
    for panel in ordered:
        if panel.get("type") == "row":
            current = str(panel.get("title", ""))
            for inner in panel.get("panels", []):
                titles[inner["id"]] = current
        else:
            titles[panel["id"]] = current
    return titles
