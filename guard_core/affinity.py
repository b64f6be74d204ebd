"""Affinity with bounded loads: which backend a request with an affinity key should go to.

Reads: the backend names of one pool (once, to build a :class:`Ring`), then per request an
integer key the caller computed (a session or prompt-prefix hash,
:mod:`guard_adapters.affinity_key`), each backend's load (requests in flight to it), the load
bound factor, and which backends are eligible (not ejected, not marked full).

The rule (consistent hashing with bounded loads): every backend owns ``vnodes`` points on a
ring of 64-bit positions, placed by hashing its name; a key starts at its own position and walks
the ring clockwise; the first eligible backend whose load *after* taking this request stays
within ``ceil(bound * (total + 1) / n)`` gets it, where ``total`` is the load of the eligible
backends and ``n`` how many they are. ``bound`` (> 1, :data:`DEFAULT_BOUND` 1.25) is how far
above the mean a backend may go for the sake of affinity: 1.25 lets the backend a hot prefix
maps to carry a quarter more than its share, then the prefix spills to the next backend on the
ring, and so on.

Guarantees:
- pure and deterministic: the ring depends only on the names and ``vnodes`` (a fixed 64-bit
  hash, never the process-salted ``hash``), the choice only on the ring, the key, the loads
  and the bound;
- while the first eligible backend on a key's walk is within the bound it is the one chosen, so
  a key keeps its backend as long as that backend has room;
- a backend is never chosen when taking the request would carry it past the bound; since the
  least loaded eligible backend is always within it, :func:`choose` returns ``None`` only when
  no backend is eligible;
- removing a backend from the ring moves only the keys whose walk met it first (plus the
  overflow the bound sends on); every other key keeps its backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Final

import attrs

from guard_core._errors import PolicyConfigError

__all__ = (
    "DEFAULT_BOUND",
    "DEFAULT_VNODES",
    "Ring",
    "build_ring",
    "choose",
    "load_bound",
    "ring_position",
)

#: How far above the mean load a backend may go to keep a key's affinity.
DEFAULT_BOUND: Final = 1.25
#: Points per backend on the ring: enough that four backends each own close to a quarter.
DEFAULT_VNODES: Final = 128
_MASK: Final = (1 << 64) - 1


_FNV_OFFSET: Final = 0xCBF29CE484222325
_FNV_PRIME: Final = 0x100000001B3


def ring_position(text: str) -> int:
    """A stable 64-bit position for ``text``: FNV-1a over its UTF-8 bytes, then the splitmix64
    finaliser so that names differing in one character land far apart."""
    value = _FNV_OFFSET
    for byte in text.encode("utf-8"):
        value = ((value ^ byte) * _FNV_PRIME) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def _first_at_or_after(positions: tuple[int, ...], key: int) -> int:
    """The index of the first position >= ``key`` (``len`` when none is)."""
    low, high = 0, len(positions)
    while low < high:
        middle = (low + high) // 2
        if positions[middle] < key:
            low = middle + 1
        else:
            high = middle
    return low


@attrs.frozen
class Ring:
    """The sorted ring: positions and, aligned with them, the backend owning each."""

    names: tuple[str, ...]
    positions: tuple[int, ...]
    owners: tuple[str, ...]

    def walk(self, key: int) -> tuple[str, ...]:
        """The distinct backends in the order a walk from ``key`` meets them."""
        if not self.positions:
            return ()
        start = _first_at_or_after(self.positions, key & _MASK)
        seen: dict[str, None] = {}
        count = len(self.positions)
        wanted = len(self.names)
        for step in range(count):
            owner = self.owners[(start + step) % count]
            if owner not in seen:
                seen[owner] = None
                if len(seen) == wanted:
                    break
        return tuple(seen)


def build_ring(names: Sequence[str], vnodes: int = DEFAULT_VNODES) -> Ring:
    """The ring of ``names`` (distinct), each with ``vnodes`` points."""
    if vnodes < 1:
        raise PolicyConfigError(f"vnodes must be >= 1, got {vnodes}")
    if len(set(names)) != len(names):
        raise PolicyConfigError("backend names on a ring must be distinct")
    points = sorted(
        (ring_position(f"{name}#{index}"), name) for name in names for index in range(vnodes)
    )
    return Ring(
        names=tuple(names),
        positions=tuple(position for position, _ in points),
        owners=tuple(owner for _, owner in points),
    )


def load_bound(total: int, backends: int, bound: float = DEFAULT_BOUND) -> int:
    """The most requests one of ``backends`` eligible backends may hold after taking one more,
    when they hold ``total`` between them: ``ceil(bound * (total + 1) / backends)``."""
    if not bound > 1 or not math.isfinite(bound):
        raise PolicyConfigError(f"the affinity load bound must be finite and > 1, got {bound}")
    if backends < 1:
        raise PolicyConfigError(f"backends must be >= 1, got {backends}")
    return math.ceil(bound * (max(0, total) + 1) / backends)


Eligible = Callable[[str], bool] | Collection[str] | None


def _eligible_test(eligible: Eligible) -> Callable[[str], bool]:
    if eligible is None:
        return lambda _name: True
    if callable(eligible):
        return eligible
    allowed = frozenset(eligible)
    return allowed.__contains__


def choose(
    ring: Ring,
    key: int,
    loads: Mapping[str, int],
    bound: float = DEFAULT_BOUND,
    *,
    eligible: Eligible = None,
) -> str | None:
    """The backend for ``key``: the first eligible one on its walk within the load bound.

    ``loads`` gives each backend's requests in flight (a name missing counts 0); ``eligible``
    is a predicate or a collection of the names that may take work (``None``: all on the ring).
    ``None`` only when no backend on the ring is eligible.
    """
    allowed = _eligible_test(eligible)
    candidates = [name for name in ring.walk(key) if allowed(name)]
    if not candidates:
        return None
    total = sum(max(0, loads.get(name, 0)) for name in candidates)
    limit = load_bound(total, len(candidates), bound)
    for name in candidates:
        if max(0, loads.get(name, 0)) + 1 <= limit:
            return name
    # Unreachable when the loads are counts: the least loaded candidate is always within.
    return min(candidates, key=lambda name: loads.get(name, 0))
