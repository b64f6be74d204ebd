"""What the simulated backend can be told, and which server's figures it imitates.

Reads: nothing beyond its arguments; every value comes from ``inference-guard sim-backend``'s
flags or from the caller that builds a :class:`SimBackendConfig`.

Guarantees: a :class:`SimBackendConfig` that exists is valid (ranges, flavour, metric names, a
known profile whose overrides still make a valid :class:`EngineProfile`); anything else raises
:class:`SimBackendError` with the field's name. The histogram bounds of each flavour and era are
here and nowhere else (:func:`histogram_bounds`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

import attrs

from guard_adapters.engine_model import DEFAULT_PROFILE, ITL_BUCKETS, PROFILES, EngineProfile
from guard_core import GuardError

Flavour = Literal["vllm", "sglang"]
MetricsNames = Literal["current", "legacy"]

#: names' era; its top bound is 10 s) and SGLang 0.5.x, from the ``*-histogram-buckets-by-version``
#: tables in ``../shared/data/metrics``.
VLLM_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_LEGACY_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
SGLANG_TTFT_BUCKETS: Final = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
)  # fmt: skip
#: Inter-token latency bounds per flavour, from the same tables: vLLM 0.33.0's
#: ``inter_token_latency_seconds`` (the engine model's own :data:`ITL_BUCKETS`), vLLM 0.7.3's
#: ``time_per_output_token_seconds`` (the name of that era; top bound 2.5 s) and SGLang 0.5.x's
#: ``inter_token_latency_seconds`` (unchanged since 0.4.6.post5).
VLLM_ITL_BUCKETS: Final = ITL_BUCKETS
VLLM_LEGACY_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
SGLANG_ITL_BUCKETS: Final = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
    0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip


class SimBackendError(GuardError):
    """The simulated backend cannot start with this configuration."""


# -- configuration ---------------------------------------------------------------------------------


def _check_positive(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value > 0:
        raise SimBackendError(f"{attribute.name} must be > 0, got {value!r}")


def _check_non_negative(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value >= 0:
        raise SimBackendError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SimBackendConfig:
    """Everything ``inference-guard sim-backend`` can be told; the defaults are its flags'.

    ``slow_down`` holds ``(factor, at_s)`` pairs: from ``at_s`` seconds after start every engine
    step takes ``factor`` times as long. ``speed`` divides every step's duration (a benchmark
    knob; 1 is the profile's calibrated speed). ``mean_output_tokens`` ends requests early with
    a seeded geometric length of that mean (finish reason ``stop``); without it each request
    generates exactly its ``max_tokens`` (finish reason ``length``), as benchmarks do.
    ``max_queued`` refuses a generation request with the engine's queue-full 503 while that many
    requests already wait in the engine (vLLM's ``--max-num-queued-reqs``, SGLang's
    ``--max-queued-requests``).
    """

    host: str = "127.0.0.1"
    port: int = 8001
    flavour: Flavour = "vllm"
    metrics_names: MetricsNames = "current"
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int | None = attrs.field(default=None, validator=_check_positive)
    max_queued: int | None = attrs.field(default=None, validator=_check_positive)
    seed: int = 0
    model: str = "Qwen/Qwen2-7B-Instruct"
    max_output: int = attrs.field(default=4096, validator=_check_positive)
    default_max_tokens: int = attrs.field(default=256, validator=_check_positive)
    max_model_len: int = attrs.field(default=8192, validator=_check_positive)
    speed: float = attrs.field(default=1.0, validator=_check_positive)
    mean_output_tokens: float | None = attrs.field(default=None, validator=_check_positive)
    reasoning_field: str = "reasoning_content"
    slow_down: tuple[tuple[float, float], ...] = ()
    die_at_s: float | None = attrs.field(default=None, validator=_check_non_negative)
    metrics_delay_s: float = attrs.field(default=0.0, validator=_check_non_negative)
    metrics_fail_after_s: float | None = attrs.field(default=None, validator=_check_non_negative)
    replay_sse: Path | None = None
    replay_interval_s: float = attrs.field(default=0.02, validator=_check_non_negative)
    keep_alive_s: float = attrs.field(default=5.0, validator=_check_positive)

    def __attrs_post_init__(self) -> None:
        if self.flavour not in ("vllm", "sglang"):
            raise SimBackendError(f"flavour must be vllm or sglang, got {self.flavour!r}")
        if self.metrics_names not in ("current", "legacy"):
            raise SimBackendError(
                f"metrics names must be current or legacy, not {self.metrics_names!r}"
            )
        if self.profile not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise SimBackendError(f"unknown profile {self.profile!r} (known: {known})")
        for factor, at_s in self.slow_down:
            if not factor > 0 or not at_s >= 0:
                raise SimBackendError(
                    f"slow-down needs a factor > 0 and a time >= 0: {factor}@{at_s}"
                )
        self.engine_profile()  # the overrides must make a valid profile

    def engine_profile(self) -> EngineProfile:
        """The profile with this configuration's overrides applied."""
        profile = PROFILES[self.profile]
        seqs = profile.max_num_seqs if self.max_num_seqs is None else self.max_num_seqs
        try:
            return attrs.evolve(
                profile,
                max_model_len=self.max_model_len,
                max_num_seqs=seqs,
                max_num_batched_tokens=max(profile.max_num_batched_tokens, seqs + 1),
            )
        except ValueError as invalid:
            raise SimBackendError(str(invalid)) from None


def histogram_bounds(config: SimBackendConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The TTFT and inter-token latency bounds the configured server exposes, in that order."""
    if config.flavour == "sglang":
        return SGLANG_TTFT_BUCKETS, SGLANG_ITL_BUCKETS
    if config.metrics_names == "legacy":
        return VLLM_LEGACY_TTFT_BUCKETS, VLLM_LEGACY_TPOT_BUCKETS
    return VLLM_TTFT_BUCKETS, VLLM_ITL_BUCKETS
