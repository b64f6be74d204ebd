"""Load a script of ``tools/`` as a module, for the tests that run or check it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[1]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a fresh module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
