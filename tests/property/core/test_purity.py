"""guard_core is pure: no I/O, clock, randomness, concurrency or logging, and no mutable globals."""

from __future__ import annotations
import __future__

import ast
import enum
import importlib
import json
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path

import attrs

import guard_core

FORBIDDEN = ("trio", "asyncio", "socket", "time", "random", "threading", "logging")
#: The only imports guard_core's own source may name.
ALLOWED_IMPORTS = frozenset(
    {
        "__future__",
        "attrs",
        "collections",
        "collections.abc",
        "enum",
        "json",
        "math",
        "re",
        "types",
        "typing",
    }
)
CORE_DIR = Path(guard_core.__file__).parent

PROBE = """
import json, sys
before = set(sys.modules)
import attrs
after_attrs = set(sys.modules)
import guard_core, guard_core.lanes, guard_core.upstream_errors
after_core = set(sys.modules)
print(json.dumps({"baseline": sorted(after_attrs), "core": sorted(after_core - after_attrs)}))
"""


def test_importing_guard_core_loads_no_forbidden_module() -> None:
    """A fresh interpreter: guard_core adds none of the forbidden modules to ``sys.modules``.

    ``time`` is loaded by the interpreter itself at start-up and ``threading`` by attrs, so the
    check is on what importing guard_core adds beyond attrs, plus the source scan below.
    """
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(result.stdout)
    added = set(loaded["core"])
    for name in FORBIDDEN:
        assert name not in added, f"importing guard_core loads {name}"
    assert not {m for m in added if m.split(".")[0] in {"trio", "h11", "cattrs", "socket"}}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_source_imports_only_attrs_and_pure_stdlib() -> None:
    for path in sorted(CORE_DIR.glob("*.py")):
        outside = {
            name
            for name in _imports(path)
            if name.split(".")[0] != "guard_core" and name not in ALLOWED_IMPORTS
        }
        assert not outside, f"{path.name} imports {sorted(outside)}"


_IMMUTABLE_SCALARS = (str, bytes, int, float, bool, type(None), frozenset, range)


def _is_immutable(value: object) -> bool:
    if isinstance(value, (*_IMMUTABLE_SCALARS, enum.Enum, re.Pattern)):
        return True
    if isinstance(value, __future__._Feature):
        return True
    if isinstance(value, types.ModuleType | types.FunctionType | types.BuiltinFunctionType | type):
        return True
    if isinstance(value, types.MappingProxyType):
        return all(_is_immutable(k) and _is_immutable(v) for k, v in value.items())
    if isinstance(value, tuple):
        return all(_is_immutable(item) for item in value)
    if attrs.has(type(value)):
        return type(value).__setattr__ is not object.__setattr__ and all(
            _is_immutable(getattr(value, field.name))
            for field in attrs.fields(type(value))  # type: ignore[arg-type]
        )
    # typing constructs such as ``Admitted | Queued | Rejected`` aliases
    return (
        isinstance(value, types.UnionType | types.GenericAlias)
        or type(value).__module__ == "typing"
    )


def test_no_module_level_mutable_state() -> None:
    modules = [guard_core] + [
        importlib.import_module(f"guard_core.{info.name}")
        for info in pkgutil.iter_modules(guard_core.__path__)
    ]
    for module in modules:
        for name, value in vars(module).items():
            if name in {"__builtins__", "__loader__", "__spec__", "__path__", "__file__"}:
                continue
            if name in {"__name__", "__doc__", "__package__", "__cached__", "__annotations__"}:
                continue
            assert _is_immutable(value), f"{module.__name__}.{name} is mutable: {type(value)}"
