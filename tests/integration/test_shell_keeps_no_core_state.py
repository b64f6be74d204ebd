"""The trio shell reads what the core published; it recomputes none of it (in the spirit of the
core's purity test, for what can be checked mechanically).

Checks, on the source of every ``guard_trio`` module that serves traffic (the simulated backend
and the tools are not the serving shell):
* none imports the core's per-poll computations (normalisation, aggregation, histogram windows
  and summaries, the evaluation) or the adaptive output state: the published value and the
  traffic state carry their results;
* none reads the learner's per-backend statuses or its last snapshot: ``state.published``
  holds the figures and the snapshot behind the published decision.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import guard_trio

SHELL = Path(guard_trio.__file__).parent
NOT_SERVING = {"sim_backend.py"}
#: Core names whose results the published value or the traffic state already carry.
RECOMPUTING = {
    "guard_core.normalise": {"normalise", "aggregate", "BackendStatus"},
    "guard_core.histogram": {"window", "merge", "summarise"},
    "guard_core.evaluation": {"evaluate", "evaluate_round"},
    "guard_core": {"evaluate"},
    "guard_core.lanes": {"AdaptiveOutputState"},
}
#: ``learner.<name>`` reads that would go round the published value.
LEARNER_COPIES = {"backends", "last"}


def serving_modules() -> list[Path]:
    return sorted(
        path
        for path in SHELL.glob("*.py")
        if path.name not in NOT_SERVING and "tools" not in path.parts
    )


@pytest.mark.parametrize("path", serving_modules(), ids=lambda p: p.name)
def test_shell_module_recomputes_nothing_the_core_published(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in RECOMPUTING:
            names = {alias.name for alias in node.names} & RECOMPUTING[node.module]
            assert not names, f"{path.name}:{node.lineno} imports {sorted(names)}"
        if isinstance(node, ast.ImportFrom) and node.module == "guard_core":
            modules = {alias.name for alias in node.names} & {"histogram", "normalise"}
            assert not modules, f"{path.name}:{node.lineno} imports {sorted(modules)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name not in ("guard_core.histogram", "guard_core.normalise"), (
                    f"{path.name}:{node.lineno} imports {alias.name}"
                )
        if (
            isinstance(node, ast.Attribute)
            and node.attr in LEARNER_COPIES
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "learner"
        ):
            raise AssertionError(f"{path.name}:{node.lineno} reads learner.{node.attr}")


def test_the_check_sees_the_shell() -> None:
    names = {path.name for path in serving_modules()}
    assert {"_observability.py", "_proxy.py", "_server.py", "_metrics_rows.py"} <= names
