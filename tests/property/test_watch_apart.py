"""The watch client stays out of the serving shell, and its renderer stays pure.

Reads the source of ``guard_trio`` and ``guard_adapters`` only (no import of the modules under
test): no module of the shell but the command-line dispatcher imports ``guard_trio._watch_cli``
(nor the live view, which only the client and the demo draw), and the live view's modules
import neither I/O, nor a clock, nor a concurrency library.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "guard_trio"
LIVE_VIEW = sorted((ROOT / "guard_adapters").glob("live_view*.py"))
CLIENT_ONLY = ("guard_trio._watch_cli", "guard_adapters.live_view")
IMPURE = ("trio", "trio_websocket", "socket", "time", "asyncio", "threading", "os", "sys")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


#: The command-line dispatcher, the client itself, and the tools: the demo draws its live line
#: with the live view's compact line, as the issue asks (it never imports the client).
SERVING = sorted(
    p
    for p in SHELL.rglob("*.py")
    if p.name not in ("cli.py", "_watch_cli.py") and "tools" not in p.relative_to(SHELL).parts
)
TOOLS = sorted((SHELL / "tools").rglob("*.py"))


def test_the_modules_are_found() -> None:
    assert any(p.name == "_proxy.py" for p in SERVING)
    assert [p.name for p in LIVE_VIEW] == ["live_view.py", "live_view_messages.py"]


@pytest.mark.parametrize("path", SERVING, ids=lambda p: str(p.relative_to(SHELL)))
def test_the_serving_shell_does_not_import_the_watch_client(path: Path) -> None:
    client = sorted(n for n in _imported(path) if n.startswith(CLIENT_ONLY))
    assert client == []


@pytest.mark.parametrize("path", LIVE_VIEW, ids=lambda p: p.name)
def test_the_live_view_is_pure(path: Path) -> None:
    impure = sorted(n for n in _imported(path) if n.split(".")[0] in IMPURE)
    assert impure == []


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: str(p.relative_to(SHELL)))
def test_the_tools_may_draw_with_the_live_view_but_never_import_the_client(path: Path) -> None:
    assert sorted(n for n in _imported(path) if n.startswith("guard_trio._watch_cli")) == []
