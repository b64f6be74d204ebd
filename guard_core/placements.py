"""Where the latest requests of each prefix key went: the router's estimate of a warm cache.

Reads: one placement per routed request: its prefix key (``None`` when it has none), the
backend it went to and its prompt size in tokens; and, for a new request, its key, its prompt
size and each backend's prefix-cache capacity in tokens when known.
Guarantees:
- :func:`placed` remembers the latest backend of at most ``memory`` keys (the least recently
  placed key is forgotten first) and counts every request's prompt tokens against its backend,
  key or not;
- :func:`cached_tokens` expects a request to find its prompt (up to the earlier request's, which
  had the same key) cached on the backend that earlier request went to, while the prompt tokens
  sent to that backend since then fit in its cache (a capacity not known: still cached); every
  other backend is expected to hold none of it;
- pure: the same placements and inputs give the same figures; a placement makes a new table
  (a :class:`~guard_core.table.Table`: it copies about the square root of ``memory`` entries)
  and changes nothing else.

The pool router (:mod:`guard_core.pool_routing`) weighs these expected cached tokens against
each backend's pending prefill; the live proxy keeps one table per pool in the core's traffic
state and the simulator one per run, so both route on the same estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from guard_core.table import filed, forgotten

__all__ = ("DEFAULT_MEMORY", "Placed", "Placements", "cached_tokens", "placed")

#: Prefix keys remembered per pool.
DEFAULT_MEMORY = 4096


@attrs.frozen
class Placed:
    """Where a prefix key last went: the backend, the prompt size, and the prompt tokens that
    backend had been sent in all just after it."""

    backend: str
    prompt_tokens: float
    sent_after: float


@attrs.frozen
class Placements:
    """The latest placement of each remembered key (oldest first) and the prompt tokens sent
    to each backend in all."""

    memory: int = DEFAULT_MEMORY
    keys: Mapping[int, Placed] = attrs.field(factory=dict)
    sent: Mapping[str, float] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.memory < 1:
            raise ValueError(f"the prefix memory must hold at least one key, got {self.memory}")


def placed(
    placements: Placements, key: int | None, backend: str, prompt_tokens: float
) -> Placements:
    """``placements`` after a request of ``prompt_tokens`` (with prefix ``key``) went to
    ``backend``."""
    tokens = max(0.0, prompt_tokens)
    sent = {**placements.sent, backend: placements.sent.get(backend, 0.0) + tokens}
    if key is None:
        return Placements(memory=placements.memory, keys=placements.keys, sent=sent)
    keys = filed(forgotten(placements.keys, key), key, Placed(backend, tokens, sent[backend]))
    while len(keys) > placements.memory:
        keys = forgotten(keys, next(iter(keys)))
    return Placements(memory=placements.memory, keys=keys, sent=sent)


def cached_tokens(
    placements: Placements,
    key: int | None,
    names: Sequence[str],
    prompt_tokens: float,
    *,
    capacity: float | None,
) -> tuple[float, ...]:
    """The prompt tokens of a new request each of ``names`` is expected to hold in its prefix
    cache (see the module rules); ``capacity``: a backend's cache size in tokens, if known."""
    earlier = placements.keys.get(key) if key is not None else None
    if earlier is None or earlier.backend not in names:
        return (0.0,) * len(names)
    since = placements.sent.get(earlier.backend, 0.0) - earlier.sent_after
    if capacity is not None and since > capacity:
        return (0.0,) * len(names)
    held = float(min(earlier.prompt_tokens, max(0.0, prompt_tokens)))
    return tuple(held if name == earlier.backend else 0.0 for name in names)
