"""Model routing: which backends serve which model, from ``PIG_POOLS``.

Reads: the text of ``PIG_POOLS`` (``model=backend,backend;model=backend``: each model name, then
the names of the ``BACKENDS`` that serve it, or ``discover``), each backend's ``/v1/models``
answer when discovering, the configured backend names, and a request's body (its top-level
``model``).
Guarantees:
- :func:`parse_pools` accepts exactly the documented form: every entry names a model once, at
  least one backend, and only configured backends; anything else is a list of problems, each
  saying which entry and why, and nothing is half-built;
- :meth:`ModelPools.backends_for` gives the backends of a known model (in configuration order)
  and ``None`` for an unknown one; a request that names no model is not routed by model;
- a *pool* is one set of backends: models that name the same set share it, and two sets that
  overlap without being equal are refused (a backend carries one pool's cap, never two);
  :meth:`ModelPools.pools` lists each pool once, named after its first model, in order;
- :func:`discovered_pools` builds the same pools from what each backend lists: a model goes to
  every backend listing it; backends whose lists overlap must list the same models (else a
  problem names them); a backend that listed nothing serves no model;
- the answers the guard gives itself are OpenAI's shapes: :func:`models_document` is the
  ``/v1/models`` list (the configured models, in order) and :func:`model_not_found_body` the 404
  for a model no pool serves (the name is JSON-escaped, never echoed raw).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import attrs

from guard_adapters.affinity_key import leading_string

#: ``PIG_POOLS=discover``: the pools come from each backend's ``/v1/models``.
DISCOVER = "discover"

__all__ = (
    "DISCOVER",
    "ModelPools",
    "discovered_pools",
    "listed_models",
    "model_not_found_body",
    "models_document",
    "outside",
    "parse_pools",
    "request_model",
)


@attrs.frozen
class ModelPools:
    """The models the guard routes, each with the backends that serve it."""

    #: Model name to backend names, in the order configured.
    by_model: Mapping[str, tuple[str, ...]]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.by_model)

    def backends_for(self, model: str) -> tuple[str, ...] | None:
        return self.by_model.get(model)

    def pools(self) -> tuple[tuple[str, frozenset[str]], ...]:
        """Each pool once: (its name, its backends), in the order first named."""
        found: dict[frozenset[str], str] = {}
        for model, names in self.by_model.items():
            found.setdefault(frozenset(names), model)
        return tuple((name, backends) for backends, name in found.items())

    def layout(self) -> tuple[tuple[str, ...], dict[str, int], dict[str, int]]:
        """The pools' names in order, and the index among them of each backend's pool and of
        each model's: what a runtime needs to give each pool its own engine."""
        pools = self.pools()
        names = tuple(name for name, _ in pools)
        of_backend = {b: index for index, (_, backends) in enumerate(pools) for b in backends}
        of_model = {model: names.index(self.pool_of(model) or "") for model in self.models}
        return names, of_backend, of_model

    def pool_of(self, model: str) -> str | None:
        """The name of the pool serving ``model`` (None: no pool does)."""
        names = self.by_model.get(model)
        if names is None:
            return None
        wanted = frozenset(names)
        return next(name for name, backends in self.pools() if backends == wanted)


def outside(names: Sequence[str], allowed: Sequence[str] | None) -> frozenset[int]:
    """The positions in ``names`` of the backends outside ``allowed`` (a model's pool; None:
    every backend is allowed): a request counts them as tried, never picked nor retried on."""
    if allowed is None:
        return frozenset()
    return frozenset(index for index, name in enumerate(names) if name not in allowed)


def parse_pools(text: str, backend_names: Sequence[str]) -> tuple[ModelPools | None, list[str]]:
    """``PIG_POOLS`` as pools, or the problems found (see the module rules); empty: no pools."""
    if not text.strip() or text.strip().lower() == DISCOVER:
        return None, []  # none, or built at start-up from what the backends list
    known = set(backend_names)
    by_model: dict[str, tuple[str, ...]] = {}
    problems: list[str] = []
    for number, entry in enumerate(text.split(";"), start=1):
        if not entry.strip():
            continue
        model, equals, listed = entry.partition("=")
        model = model.strip()
        names = tuple(dict.fromkeys(n.strip() for n in listed.split(",") if n.strip()))
        if not equals or not model:
            problems.append(f"entry {number} ({entry.strip()!r}) is not model=backend,...")
            continue
        if model in by_model:
            problems.append(f"entry {number} names model {model!r} a second time")
            continue
        if not names:
            problems.append(f"entry {number} gives model {model!r} no backend")
            continue
        unknown = [n for n in names if n not in known]
        if unknown:
            problems.append(
                f"entry {number} names backends not in BACKENDS: {', '.join(unknown)}"
                f" (known: {', '.join(backend_names) or 'none'})"
            )
            continue
        by_model[model] = names
    sets = {frozenset(names) for names in by_model.values()}
    for one in sets:
        for other in sets:
            shared = one & other
            if one != other and shared:
                problems.append(
                    f"two pools share backends ({', '.join(sorted(shared))}): a backend serves"
                    " one set of models, given as the same list each time"
                )
    problems = list(dict.fromkeys(problems))
    if problems:
        return None, problems
    if not by_model:
        return None, ["no model=backend entry"]
    return ModelPools(by_model=by_model), []


def listed_models(page: bytes) -> list[str]:
    """The model ids of a ``/v1/models`` answer (OpenAI's list shape); [] for anything else."""
    try:
        document = json.loads(page)
    except ValueError:
        return []
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return []
    ids = (item.get("id") for item in data if isinstance(item, dict))
    return list(dict.fromkeys(i for i in ids if isinstance(i, str) and i))


def discovered_pools(
    listings: Mapping[str, Sequence[str]], backend_names: Sequence[str]
) -> tuple[ModelPools | None, list[str]]:
    """The pools of what each backend (by name, in ``backend_names`` order) listed."""
    served: dict[str, list[str]] = {}
    for backend in backend_names:
        for model in listings.get(backend, ()):
            served.setdefault(model, []).append(backend)
    if not served:
        return None, ["no backend listed a model on /v1/models"]
    text = ";".join(f"{model}={','.join(backends)}" for model, backends in served.items())
    if any(c in model for model in served for c in "=;,"):
        return None, ["a listed model id holds '=', ';' or ',', which pools cannot name"]
    return parse_pools(text, backend_names)


def request_model(body: bytes | bytearray | memoryview) -> str | None:
    """The ``model`` a JSON request body names at its top level (read from its first bytes)."""
    return leading_string(body, "model")


def models_document(pools: ModelPools) -> bytes:
    """``GET /v1/models`` answered by the guard: every routed model, as OpenAI lists them."""
    data = [
        {"id": model, "object": "model", "owned_by": "inference-guard"} for model in pools.models
    ]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode() + b"\n"


def model_not_found_body(model: str) -> bytes:
    """The 404 for a model no pool serves (OpenAI's ``model_not_found`` shape)."""
    error = {
        "message": f"The model {model!r} is not served here.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return json.dumps({"error": error}, separators=(",", ":")).encode() + b"\n"
