"""The tools (simulated backend, simulate, demo) stay out of the serving shell.

Reads the source of ``guard_trio`` only (no import of the modules under test): every module
outside ``guard_trio/tools`` but the command-line dispatcher is checked not to import from the
tools, and every tool module to open with its header docstring and to stay under 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SHELL = Path(__file__).resolve().parents[2] / "guard_trio"
TOOLS = SHELL / "tools"
MAX_LINES = 600


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


SERVING = sorted(p for p in SHELL.rglob("*.py") if TOOLS not in p.parents and p.name != "cli.py")
TOOL_MODULES = sorted(TOOLS.rglob("*.py"))


def test_the_modules_are_found() -> None:
    assert any(p.name == "_proxy.py" for p in SERVING)
    assert any(p.name == "_driver.py" for p in TOOL_MODULES)


@pytest.mark.parametrize("path", SERVING, ids=lambda p: str(p.relative_to(SHELL)))
def test_the_serving_shell_does_not_import_the_tools(path: Path) -> None:
    tools = sorted(n for n in _imported(path) if n.startswith("guard_trio.tools"))
    assert tools == []


@pytest.mark.parametrize("path", TOOL_MODULES, ids=lambda p: str(p.relative_to(SHELL)))
def test_each_tool_module_is_short_and_says_what_it_guarantees(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring
    assert "Guarantees" in docstring or path.name == "__init__.py"
