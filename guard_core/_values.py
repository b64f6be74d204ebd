"""A fast copy of a frozen attrs value with some fields changed.

Reads: nothing but its arguments.
Guarantees: :func:`replace` gives the value ``attrs.evolve`` would give, for classes with no
validators, converters or ``__attrs_post_init__`` (the states the reducers copy on every request);
it skips evolve's generic machinery, which is most of the cost of a small copy.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def replace(value: T, **changes: Any) -> T:
    """``attrs.evolve(value, **changes)`` for a plain frozen attrs class (see the module rules)."""
    cls = type(value)
    new = object.__new__(cls)
    for field in cls.__attrs_attrs__:  # type: ignore[attr-defined]
        name = field.name
        object.__setattr__(new, name, changes[name] if name in changes else getattr(value, name))
    return new
