"""PIG's environment variables turned into validated settings and guard_core configs (spec 2).

Covers every variable of spec 2 (2.1 core and routing, 2.2 OpenAI compatibility, auth and
upstream errors, 2.3 attestation, 2.4 output-token classification, 2.5 backend priority
injection, 2.6 dynamic QoS, 2.7 SSE) plus the guard's own ``PIG_RETRY_AFTER_SECONDS``,
``PIG_DRAIN_SECONDS``, ``PIG_RECORD_PATH``, ``PIG_ADMIN_LISTEN``, the hardening limits, and the
learner choice ``DYNAMIC_POLICY`` with the predictive learner's ``DYNAMIC_PREDICTIVE_*``
settings and ``PIG_RETRY_AFTER_MODE``.

Reads: a mapping of environment variables, always passed in (``os.environ`` is never touched
here). Only the variables listed in :data:`VARIABLES` are looked at; everything else in the
environment is ignored. ``--set VAR=VALUE`` overrides are merged with :func:`apply_overrides`.

Guarantees:
- :func:`load_config` either returns a :class:`Settings` or raises one
  :class:`~guard_adapters._errors.ConfigError` that lists every problem at once, unparsable
  values and out-of-range or inconsistent values alike, each message starting with the name of
  the variable it concerns. Nothing else is raised for any mapping of strings.
- Values follow PIG's reading rules: an empty value means the default; integers are plain ASCII
  integers with an optional sign and nothing around them; floats are finite numbers in decimal
  notation (sign, fraction and exponent optional, nothing around them); booleans are trimmed
  and case-blind (1, true, yes, y, on and 0, false, no, n, off); lists are split on ``,`` with
  each part trimmed and empty parts dropped. A boolean, list or state made only of spaces is
  also treated as empty.
- Defaults are PIG's, including the ones that follow another variable (the state caps, the
  running red threshold, the enable flags of the dynamic stages, ``API_AUTH_ENABLED`` (on when
  ``TOKEN`` is set), ``API_AUTH_PATHS`` (``PIG_PATHS``), ``ATTESTATION_DSTACK_ENDPOINT``
  (``DSTACK_SIMULATOR_ENDPOINT``, else ``/var/run/dstack.sock``), the command arguments (they
  name ``ATTESTATION_GPU_ARCH``) and the two slot counts ``JSON_CLASSIFY_LIMIT`` and
  ``BACKEND_PRIORITY_REWRITE_LIMIT`` (64, or ``GLOBAL_LIMIT`` when that is between 1 and 63)),
  and a non-positive TTFT threshold falls back to its default. ``ATTESTATION_GPU_ARCH`` is
  trimmed and upper-cased, ``BACKEND_PRIORITY_MODE`` and ``BACKEND_PRIORITY_REWRITE_STRATEGY``
  trimmed and lower-cased; blank, they take their defaults; so are ``DYNAMIC_POLICY`` and
  ``PIG_RETRY_AFTER_MODE`` (whose default, ``predicted`` under ``DYNAMIC_POLICY=predictive`` and
  ``fixed`` otherwise, follows the learner).
- A feature's own ranges are checked only while it is on, as PIG does: the compat body limit
  with ``OPENAI_COMPAT_STRIP_EMPTY_TOOL_CALLS``, the command timeout with
  ``ATTESTATION_ENABLED``, the classifier and output-token thresholds with
  ``CLASSIFY_OUTPUT_TOKENS``, the ``ADAPTIVE_OUTPUT_*`` ranges with
  ``ADAPTIVE_OUTPUT_CLASSIFICATION``, every ``BACKEND_PRIORITY_*`` rule with
  ``BACKEND_PRIORITY_INJECTION_ENABLED``, the dynamic stages with their flags, and the
  ``DYNAMIC_PREDICTIVE_*`` ranges with ``DYNAMIC_POLICY=predictive`` (which also needs dynamic
  mode on). The body-size lane thresholds and ``OUTPUT_TOKEN_FIELD_NAMES`` are always checked.
  ``API_AUTH_PATHS`` is checked like ``PIG_PATHS`` but may be an empty list (``,``) while auth is
  off, and auth on needs a ``TOKEN``.
- Backends are resolved by spec 2.1 rules 1-5; every upstream is an http(s) URL with a host and
  no query or fragment, and so is every metrics URL whenever dynamic mode is on.
- One source of truth: a variable read by a core config (``PolicyConfig``, ``SignalThresholds``,
  ``GateConfig``, ``AdaptiveOutputConfig``, ``PredictiveConfig``) or by the body rewrite
  (``InjectionPolicy``) takes its default from that config's field (:data:`FROM_CONFIG`), and
  its ranges are checked by running the rules those fields carry (:mod:`guard_core.settings`)
  on the values the configs will be built from, in the same pass as the adapter's own rules,
  so every problem is still reported at once with the variable's name.
- :meth:`Settings.guard_config` and the other helpers (:attr:`Settings.auth_paths`,
  :attr:`Settings.lane_thresholds`, :attr:`Settings.adaptive_output`) never raise for a loaded
  :class:`Settings`: they build the configs whose rules were checked.
  :meth:`Settings.injection_policy` raises :class:`ConfigError` only where ``InjectionPolicy``
  is stricter than PIG while injection is off (see there).
- :meth:`Settings.redacted` and :meth:`Settings.describe` never contain a secret: ``TOKEN``,
  ``ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION`` and ``ATTESTATION_NVIDIA_PAYLOAD`` (an inline
  payload may carry evidence) are replaced, and passwords inside URLs are masked.

Adding a variable: add one field to :class:`Environment` (named after the variable in lower
case). When a core config reads it, declare it there with :func:`guard_core.settings.setting`
(default, ``env=`` name, rules) and give the :class:`Environment` field the default
:data:`FROM_CONFIG`; otherwise write PIG's default on the :class:`Environment` field and, when
it has a range, one line in :func:`_problems` or the section helper it calls.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, cast
from urllib.parse import urlsplit

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, override

from guard_adapters._errors import ConfigError
from guard_adapters._rules import Identifier, OneOf
from guard_adapters._rules import shown as _shown
from guard_adapters.flow_config import parse_bands, parse_weights
from guard_adapters.model_pools import DISCOVER, ModelPools, parse_pools
from guard_adapters.openai_body import (
    DEFAULT_OUTPUT_TOKEN_FIELDS,
    PRIORITY_MODES,
    REWRITE_STRATEGIES,
    InjectionPolicy,
)
from guard_core.decision import LoadState
from guard_core.flow import FlowConfig
from guard_core.gate import GateConfig
from guard_core.guard import GuardConfig
from guard_core.health import HealthConfig
from guard_core.lanes import AdaptiveOutputConfig, Thresholds
from guard_core.policy import PolicyConfig
from guard_core.predictive import PredictiveConfig
from guard_core.routing import DEFAULT_QOS_PATHS, PathPolicy
from guard_core.settings import (
    ENV,
    AtLeast,
    Below,
    Greater,
    Problem,
    Rule,
    default_of,
    problems,
)
from guard_core.signal_state import SignalThresholds
from guard_core.tenants import TenantConfig

__all__ = (
    "FAILURE_MODES",
    "POLICIES",
    "PRIORITY_MODES",
    "REDACTED",
    "RETRY_AFTER_MODES",
    "REWRITE_STRATEGIES",
    "ROUTINGS",
    "VARIABLES",
    "Backend",
    "ConfigError",
    "Environment",
    "LaneThresholds",
    "Settings",
    "apply_overrides",
    "load_config",
)

#: What :meth:`Settings.redacted` shows in place of a secret.
REDACTED: Final = "<redacted>"

#: Metadata key marking a field whose value must never be shown.
_SECRET: Final = "secret"
#: Metadata key marking a text field where a value of spaces only means the default.
_WORD: Final = "word"

_DEFAULT_UPSTREAM: Final = "http://backend:8000"
#: ``PIG_QUEUE_POLL_MS`` handed to the gate when the configured one is not positive (which is
#: only allowed while the wait is 0): ten times it is PIG's 250 ms fallback re-check.
_FALLBACK_POLL_MS: Final = 25
#: Where the dstack agent listens when neither endpoint variable is set.
_DSTACK_SOCKET: Final = "/var/run/dstack.sock"
_GPU_ARCH: Final = "HOPPER"
#: PIG's cap on the classifier and rewrite slot counts.
_SLOT_CAP: Final = 64
#: ``DYNAMIC_POLICY`` values, the default first: PIG's learner or the predictive one.
POLICIES: Final = ("pig", "predictive")
#: ``PIG_RETRY_AFTER_MODE`` values: ``PIG_RETRY_AFTER_SECONDS`` always, or the learner's
#: predicted seconds where it has them.
RETRY_AFTER_MODES: Final = ("fixed", "predicted")
#: ``PIG_FAILURE_MODE`` values, the default first: no intake without metrics (PIG's), or
#: forward within ``GLOBAL_LIMIT``.
FAILURE_MODES: Final = ("close", "open")
#: ``PIG_ROUTING`` values, the default first: PIG's backend choice (a load score), or the
#: guard's pool router (bounded-load affinity, then the best predicted outcome).
ROUTINGS: Final = ("pig", "guard")


#: The core configs whose fields name the variables they are read from, in the order their
#: rules are checked. Each carries its defaults and ranges; nothing here restates them.
_CORE_CONFIGS: Final = (
    SignalThresholds,
    PolicyConfig,
    GateConfig,
    AdaptiveOutputConfig,
    PredictiveConfig,
    HealthConfig,
    TenantConfig,
)


def _config_fields() -> dict[str, attrs.Attribute[Any]]:
    """Variable -> the first config field read from it (configs that share one agree on its
    default; a test checks that)."""
    found: dict[str, attrs.Attribute[Any]] = {}
    for cls in (*_CORE_CONFIGS, InjectionPolicy):
        for field in attrs.fields(cls):
            name = field.metadata.get(ENV)
            if isinstance(name, str):
                found.setdefault(name, field)
    return found


#: Every variable a core config or the body rewrite reads, with the field that holds its
#: default (and, for the core, its range rules).
CONFIG_FIELDS: Final = _config_fields()


class _FromConfig:
    def __repr__(self) -> str:
        return "FROM_CONFIG"


#: An :class:`Environment` default that stands for the default of the config field read from
#: the same variable (:data:`CONFIG_FIELDS`), so that it is written once, on that field.
FROM_CONFIG: Final[Any] = _FromConfig()


def _config_defaults(_cls: type, fields: list[attrs.Attribute[Any]]) -> list[attrs.Attribute[Any]]:
    """attrs field transformer of :class:`Environment`: resolves :data:`FROM_CONFIG`."""
    return [
        field.evolve(default=CONFIG_FIELDS[field.name.upper()].default)
        if field.default is FROM_CONFIG
        else field
        for field in fields
    ]


def _positive_or_default(name: str) -> Any:
    """The config's default, where PIG reads a value that is not positive as that default
    (the TTFT thresholds)."""
    default = cast("float", CONFIG_FIELDS[name].default)

    def convert(value: float) -> float:
        return value if value > 0 else default

    return attrs.field(default=default, converter=convert)


def _values(cls: type, env: Environment) -> dict[str, Any]:
    """Field name -> value of every field of the config ``cls`` that names a variable."""
    return {
        field.name: getattr(env, field.metadata[ENV].lower())
        for field in attrs.fields(cls)
        if isinstance(field.metadata.get(ENV), str)
    }


def _dynamic_default(env: Environment) -> bool:
    return bool(_resolve_routing(env).metrics_urls)


def _slot_default(env: Environment) -> int:
    """64, or ``GLOBAL_LIMIT`` when that is positive and smaller."""
    return env.global_limit if 0 < env.global_limit < _SLOT_CAP else _SLOT_CAP


def _dstack_default(env: Environment) -> str:
    return env.dstack_simulator_endpoint or _DSTACK_SOCKET


def _command_args_default(env: Environment) -> tuple[str, ...]:
    return ("--nonce", "{nonce}", "--arch", env.attestation_gpu_arch)


def _gpu_arch(value: str) -> str:
    return value.strip().upper() or _GPU_ARCH


def _priority_mode(value: str) -> str:
    return value.strip().lower() or PRIORITY_MODES[0]


def _rewrite_strategy(value: str) -> str:
    return value.strip().lower() or REWRITE_STRATEGIES[0]


def _word(value: str) -> str:
    return value.strip().lower()


def _retry_after_mode_default(env: Environment) -> str:
    return RETRY_AFTER_MODES[1] if env.dynamic_policy == POLICIES[1] else RETRY_AFTER_MODES[0]


def _follows(name: str) -> Any:
    """A default equal to the (already set) field ``name`` of the same instance."""
    return attrs.Factory(lambda env: getattr(env, name), takes_self=True)


@attrs.frozen(kw_only=True, field_transformer=_config_defaults)
class Environment:
    """The effective value of every variable read, after parsing and defaulting.

    Each field is named after its variable in lower case and holds PIG's default when the
    variable is unset or empty; a field declared with :data:`FROM_CONFIG` holds the default of
    the config field read from its variable. Building one validates nothing beyond the types;
    ranges and cross-variable rules are checked by :meth:`Settings.from_environment`. Field
    order matters: a default that follows another variable comes after it.
    """

    # -- spec 2.1: core and routing
    listen: str = ":8000"
    upstream: str = _DEFAULT_UPSTREAM
    upstreams: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    token: str = attrs.field(default="", repr=False, metadata={_SECRET: True})
    global_limit: int = FROM_CONFIG
    pig_paths: tuple[str, ...] = DEFAULT_QOS_PATHS
    pig_path_suffix_match: bool = False
    proxy_timeout_seconds: int = 1800
    pig_status_log_interval_seconds: int = 5
    pig_queue_wait_seconds: float = FROM_CONFIG
    pig_queue_poll_ms: int = default_of(GateConfig, "queue_poll_ms")
    # -- inference-guard's own (PRODUCT.md)
    pig_retry_after_seconds: int = 1
    pig_drain_seconds: float = 30.0
    pig_record_path: str = ""
    #: The admin plane's ``host:port`` (docs/admin.md); empty: no admin plane.
    pig_admin_listen: str = ""
    #: ``inference-guard epp``: where the endpoint picker's gRPC server listens (docs/envoy.md).
    pig_epp_listen: str = "127.0.0.1:9002"
    # -- inference-guard's hardening limits (docs/hardening.md)
    pig_header_timeout_seconds: float = 10.0
    pig_max_body_bytes: int = 8 * 1024 * 1024
    pig_body_idle_timeout_seconds: float = 10.0
    pig_body_timeout_seconds: float = 60.0
    pig_upstream_head_timeout_seconds: float = 600.0
    pig_upstream_idle_timeout_seconds: float = 300.0
    #: Paths forwarded without QoS (exact, decoded); empty forwards every path, as PIG does.
    pig_forward_paths: tuple[str, ...] = ()
    # -- spec 2.2: OpenAI compatibility, auth, upstream errors
    api_auth_enabled: bool = attrs.field(
        default=attrs.Factory(lambda env: bool(env.token), takes_self=True)
    )
    api_auth_paths: tuple[str, ...] = _follows("pig_paths")
    upstream_error_classification_enabled: bool = True
    openai_compat_strip_empty_tool_calls: bool = FROM_CONFIG
    openai_compat_body_bytes: int = FROM_CONFIG
    openai_compat_fail_open: bool = FROM_CONFIG
    # -- spec 2.3: attestation
    attestation_enabled: bool = True
    dstack_simulator_endpoint: str = ""
    attestation_dstack_endpoint: str = attrs.field(
        default=attrs.Factory(_dstack_default, takes_self=True)
    )
    tls_cert_path: str = ""
    attestation_gpu_arch: str = attrs.field(default=_GPU_ARCH, converter=_gpu_arch)
    attestation_require_nvidia_evidence: bool = True
    attestation_nvidia_payload: str = attrs.field(default="", repr=False, metadata={_SECRET: True})
    attestation_nvidia_payload_file: str = ""
    attestation_nvidia_payload_url: str = ""
    attestation_nvidia_payload_authorization: str = attrs.field(
        default="", repr=False, metadata={_SECRET: True}
    )
    attestation_nvidia_command: str = ""
    attestation_nvidia_command_args: tuple[str, ...] = attrs.field(
        default=attrs.Factory(_command_args_default, takes_self=True)
    )
    attestation_nvidia_command_timeout_seconds: int = 30
    # -- spec 2.4: output-token classification (lane labels only)
    classify_output_tokens: bool = False
    json_classify_body_bytes: int = 2_097_152
    json_classify_limit: int = attrs.field(default=attrs.Factory(_slot_default, takes_self=True))
    output_token_field_names: tuple[str, ...] = DEFAULT_OUTPUT_TOKEN_FIELDS
    medium_body_bytes: int = 60_000
    long_body_bytes: int = 100_000
    very_long_body_bytes: int = 524_288
    medium_output_tokens: int = 1024
    long_output_tokens: int = 4096
    very_long_output_tokens: int = 8192
    adaptive_output_classification: bool = False
    adaptive_output_window: int = FROM_CONFIG
    adaptive_output_min_samples: int = FROM_CONFIG
    adaptive_output_medium_quantile: float = FROM_CONFIG
    adaptive_output_long_quantile: float = FROM_CONFIG
    adaptive_output_very_quantile: float = FROM_CONFIG
    adaptive_output_green_relax: float = FROM_CONFIG
    adaptive_output_yellow_relax: float = FROM_CONFIG
    adaptive_output_red_relax: float = FROM_CONFIG
    # -- spec 2.5: backend priority injection
    backend_priority_injection_enabled: bool = FROM_CONFIG
    backend_priority_mode: str = attrs.field(default=PRIORITY_MODES[0], converter=_priority_mode)
    backend_priority_rewrite_strategy: str = attrs.field(
        default=REWRITE_STRATEGIES[0], converter=_rewrite_strategy
    )
    backend_priority_field: str = FROM_CONFIG
    backend_priority_premium_value: int = FROM_CONFIG
    backend_priority_basic_value: int = FROM_CONFIG
    backend_priority_body_bytes: int = FROM_CONFIG
    backend_priority_buffer_bytes: int = FROM_CONFIG
    backend_priority_stream_buffer_bytes: int = FROM_CONFIG
    backend_priority_rewrite_limit: int = attrs.field(
        default=attrs.Factory(_slot_default, takes_self=True)
    )
    backend_priority_fail_open: bool = FROM_CONFIG
    # -- spec 2.6: dynamic QoS
    dynamic_metrics_url: str = ""
    dynamic_metrics_urls: tuple[str, ...] = ()
    dynamic_pig_enabled: bool = attrs.field(
        default=attrs.Factory(_dynamic_default, takes_self=True)
    )
    dynamic_pig_enforce: bool = _follows("dynamic_pig_enabled")
    dynamic_poll_interval_ms: int = 1000
    dynamic_failsafe_state: LoadState = LoadState.YELLOW
    dynamic_global_green_limit: int = _follows("global_limit")
    dynamic_global_yellow_limit: int = _follows("dynamic_global_green_limit")
    dynamic_global_red_limit: int = _follows("dynamic_global_yellow_limit")
    dynamic_kv_yellow: float = FROM_CONFIG
    dynamic_kv_red: float = FROM_CONFIG
    dynamic_running_yellow: int = FROM_CONFIG
    dynamic_running_red: int = _follows("dynamic_running_yellow")
    dynamic_waiting_yellow: int = FROM_CONFIG
    dynamic_waiting_red: int = FROM_CONFIG
    dynamic_preemption_delta_red: int = FROM_CONFIG
    dynamic_pressure_limit_enabled: bool = _follows("dynamic_pig_enabled")
    dynamic_pressure_headroom: int = FROM_CONFIG
    dynamic_pressure_min_limit: int = FROM_CONFIG
    dynamic_pressure_learn_ratio: float = FROM_CONFIG
    dynamic_pressure_learn_min_running: int = FROM_CONFIG
    dynamic_single_user_tps_enabled: bool = _follows("dynamic_pig_enabled")
    dynamic_single_user_tps_yellow: float = FROM_CONFIG
    dynamic_single_user_tps_red: float = FROM_CONFIG
    dynamic_single_user_tps_min_running: int = FROM_CONFIG
    dynamic_single_user_tps_yellow_consecutive: int = FROM_CONFIG
    dynamic_single_user_tps_red_consecutive: int = FROM_CONFIG
    dynamic_single_user_tps_prefill_grace_min_seconds: float = FROM_CONFIG
    dynamic_single_user_tps_prefill_grace_max_seconds: float = FROM_CONFIG
    dynamic_single_user_tps_prefill_grace_body_bytes_per_second: float = FROM_CONFIG
    dynamic_single_user_tps_prefill_grace_multiplier: float = FROM_CONFIG
    dynamic_single_user_tps_capacity_ratio: float = FROM_CONFIG
    dynamic_single_user_tps_capacity_ratio_max: float = FROM_CONFIG
    dynamic_single_user_tps_capacity_smoothing: float = FROM_CONFIG
    dynamic_single_user_tps_capacity_learn_enabled: bool = _follows("dynamic_pig_enabled")
    dynamic_single_user_tps_capacity_ratio_step_up: float = FROM_CONFIG
    dynamic_single_user_tps_capacity_healthy_consecutive: int = FROM_CONFIG
    dynamic_single_user_tps_capacity_healthy_multiplier: float = FROM_CONFIG
    dynamic_ttft_enabled: bool = _follows("dynamic_single_user_tps_enabled")
    dynamic_ttft_target_seconds: float = _positive_or_default("DYNAMIC_TTFT_TARGET_SECONDS")
    dynamic_ttft_red_seconds: float = _positive_or_default("DYNAMIC_TTFT_RED_SECONDS")
    dynamic_ttft_p99_target_seconds: float = _positive_or_default("DYNAMIC_TTFT_P99_TARGET_SECONDS")
    dynamic_ttft_p99_red_seconds: float = _positive_or_default("DYNAMIC_TTFT_P99_RED_SECONDS")
    # -- inference-guard's predictive learner (DYNAMIC_POLICY=predictive)
    dynamic_policy: str = attrs.field(default=POLICIES[0], converter=_word, metadata={_WORD: True})
    dynamic_predictive_batch_tokens: int = FROM_CONFIG
    dynamic_predictive_forgetting: float = FROM_CONFIG
    dynamic_predictive_kv_limit: float = FROM_CONFIG
    dynamic_predictive_bytes_per_token: float = FROM_CONFIG
    dynamic_predictive_horizon_seconds: float = FROM_CONFIG
    pig_retry_after_mode: str = attrs.field(
        default=attrs.Factory(_retry_after_mode_default, takes_self=True),
        converter=_word,
        metadata={_WORD: True},
    )
    # -- inference-guard's backend health and failure mode (docs/serve.md)
    pig_failure_mode: str = attrs.field(
        default=FAILURE_MODES[0], converter=_word, metadata={_WORD: True}
    )
    pig_backend_eject_failures: int = FROM_CONFIG
    pig_backend_eject_seconds: float = FROM_CONFIG
    pig_backend_eject_max_seconds: float = FROM_CONFIG
    pig_backend_full_hold_seconds: float = FROM_CONFIG
    # -- inference-guard's routing among several backends (docs/serve.md)
    pig_routing: str = attrs.field(default=ROUTINGS[0], converter=_word, metadata={_WORD: True})
    pig_affinity_header: str = ""
    pig_affinity_bound: float = 1.25
    pig_affinity_prefix_bytes: int = 4096
    pig_pools: str = ""
    # -- inference-guard's flow control (docs/flow-control.md)
    pig_priority_bands: str = ""
    pig_tenant_header: str = ""
    pig_tenant_weights: str = ""
    pig_tenant_max: int = FROM_CONFIG
    pig_tenant_token_unit: float = FROM_CONFIG
    pig_tenant_max_lag: float = FROM_CONFIG
    pig_tenant_output_weight: float = FROM_CONFIG
    pig_tenant_recent_seconds: float = FROM_CONFIG
    pig_tenant_ahead_margin: float = FROM_CONFIG
    pig_tenant_spare: float = FROM_CONFIG
    pig_tenant_lend: bool = FROM_CONFIG
    # -- spec 2.7: SSE
    sse_keepalive_enabled: bool = False
    sse_early_bridge_enabled: bool = False


def _variable(attribute: attrs.Attribute[Any]) -> str:
    return attribute.name.upper()


attrs.resolve_types(Environment)
_FIELDS: Final[dict[str, attrs.Attribute[Any]]] = {
    _variable(a): a for a in attrs.fields(Environment)
}
#: Every environment variable read, in a stable order.
VARIABLES: Final[tuple[str, ...]] = tuple(_FIELDS)
_F = attrs.fields(Environment)
_BY_NAME: Final = attrs.fields_dict(Environment)


@attrs.frozen
class Backend:
    """One upstream the guard forwards to, with the metrics URL polled for it, if any."""

    name: str
    upstream: str
    metrics_url: str | None = None


@attrs.frozen
class LaneThresholds:
    """The lane thresholds in force (spec 6.4): lower bounds of the medium, long and very long
    lanes, for body sizes in bytes and for requested output tokens."""

    body: Thresholds
    #: None while ``CLASSIFY_OUTPUT_TOKENS`` is off: no output lane is ever computed then, and
    #: the ``*_OUTPUT_TOKENS`` variables are not checked.
    output: Thresholds | None


@attrs.frozen(kw_only=True)
class Settings:
    """Validated settings: every variable's value plus what is derived from several of them.

    Build with :func:`load_config` or :meth:`from_environment`; both check everything.
    """

    #: The effective value of every variable.
    env: Environment
    #: The backends in configuration order (spec 2.1 rules 1-3).
    backends: tuple[Backend, ...]
    #: Per-backend polling and scoring (rule 4): ``BACKENDS``/``UPSTREAMS`` gave more than one.
    backend_routing: bool
    #: The metrics URLs polled; outside backend routing they are summed as one signal.
    metrics_urls: tuple[str, ...]
    #: ``PIG_PATHS`` with ``PIG_PATH_SUFFIX_MATCH``.
    paths: PathPolicy
    #: ``API_AUTH_PATHS`` with ``PIG_PATH_SUFFIX_MATCH``: the generation paths whose POSTs need
    #: the bearer token while :attr:`api_auth_enabled`. With auth off the list may be empty;
    #: this then holds ``PIG_PATHS``, which nothing consults.
    auth_paths: PathPolicy
    #: ``LISTEN`` split into host ("" means every interface) and port.
    listen_host: str
    listen_port: int
    #: ``PIG_ADMIN_LISTEN`` split into host and port; None: the admin plane is off.
    admin_listen: tuple[str, int] | None = None
    #: ``PIG_EPP_LISTEN`` as (host, port): used only by ``inference-guard epp``.
    epp_listen: tuple[str, int] = ("127.0.0.1", 9002)
    #: ``PIG_POOLS``: the backends of each routed model; None: no model routing (PIG's form).
    model_pools: ModelPools | None = None

    @classmethod
    def from_environment(cls, env: Environment) -> Settings:
        """Check every range and cross-variable rule; raise one ConfigError listing them all."""
        problems = _problems(env)
        if problems:
            raise ConfigError(str(p) for p in problems)
        routing = _resolve_routing(env)
        listen = _split_listen(env.listen)
        assert listen is not None  # checked by _problems
        return cls(
            env=env,
            backends=routing.backends,
            backend_routing=routing.backend_routing,
            metrics_urls=routing.metrics_urls,
            paths=PathPolicy(env.pig_paths, env.pig_path_suffix_match),
            auth_paths=PathPolicy(env.api_auth_paths or env.pig_paths, env.pig_path_suffix_match),
            listen_host=listen[0],
            listen_port=listen[1],
            admin_listen=_split_listen(env.pig_admin_listen) if env.pig_admin_listen else None,
            epp_listen=_split_listen(env.pig_epp_listen) or ("127.0.0.1", 9002),
            model_pools=parse_pools(env.pig_pools, [b.name for b in routing.backends])[0],
        )

    @property
    def dynamic_enabled(self) -> bool:
        """``DYNAMIC_PIG_ENABLED``: the metrics poller and the learner run."""
        return self.env.dynamic_pig_enabled

    @property
    def dynamic_enforced(self) -> bool:
        """The gate uses the learned cap: dynamic mode is both enabled and enforced."""
        return self.env.dynamic_pig_enabled and self.env.dynamic_pig_enforce

    @property
    def predictive_enabled(self) -> bool:
        """``DYNAMIC_POLICY=predictive``: the predictive learner decides admission."""
        return self.env.dynamic_policy == POLICIES[1]

    @property
    def discover_pools(self) -> bool:
        """``PIG_POOLS=discover``: the pools come from each backend's ``/v1/models`` at start."""
        return self.env.pig_pools.strip().lower() == DISCOVER

    @property
    def guard_routing(self) -> bool:
        """``PIG_ROUTING=guard`` with several backends: the pool router picks each request's
        backend (with one backend there is nothing to pick)."""
        return self.env.pig_routing == ROUTINGS[1] and len(self.backends) > 1

    @property
    def fail_open(self) -> bool:
        """``PIG_FAILURE_MODE=open``: with no usable metrics the guard forwards within
        ``GLOBAL_LIMIT`` instead of refusing every request (PIG's ``close``)."""
        return self.env.pig_failure_mode == FAILURE_MODES[1]

    @property
    def retry_after_predicted(self) -> bool:
        """``PIG_RETRY_AFTER_MODE=predicted``: a 429 from admission says the learner's predicted
        seconds when it has them (``PIG_RETRY_AFTER_SECONDS`` otherwise; 0 still means none)."""
        return self.env.pig_retry_after_mode == RETRY_AFTER_MODES[1]

    # -- spec 2.3

    @property
    def dstack_base_url(self) -> str | None:
        """The dstack agent's base URL when the effective endpoint is http(s), else None."""
        endpoint = self.env.attestation_dstack_endpoint
        if endpoint[:8].lower().startswith(("http://", "https://")):
            return endpoint
        return None

    @property
    def dstack_socket_path(self) -> str | None:
        """The dstack agent's Unix socket when the effective endpoint is not a URL, else None."""
        if self.dstack_base_url is not None:
            return None
        return self.env.attestation_dstack_endpoint

    # -- spec 2.4

    @property
    def lane_thresholds(self) -> LaneThresholds:
        """The ``*_BODY_BYTES`` thresholds, and the ``*_OUTPUT_TOKENS`` ones when classifying."""
        env = self.env
        body = Thresholds((env.medium_body_bytes, env.long_body_bytes, env.very_long_body_bytes))
        if not env.classify_output_tokens:
            return LaneThresholds(body, None)
        output = Thresholds(
            (env.medium_output_tokens, env.long_output_tokens, env.very_long_output_tokens)
        )
        return LaneThresholds(body, output)

    @property
    def adaptive_output(self) -> AdaptiveOutputConfig | None:
        """The adaptive output thresholds' settings while both ``CLASSIFY_OUTPUT_TOKENS`` and
        ``ADAPTIVE_OUTPUT_CLASSIFICATION`` are on, else None."""
        env = self.env
        output = self.lane_thresholds.output
        if output is None or not env.adaptive_output_classification:
            return None
        return AdaptiveOutputConfig(static=output, **_values(AdaptiveOutputConfig, env))

    # -- spec 2.2 and 2.5: the body rewrite (values are checked only while their feature is on)

    def injection_policy(self) -> InjectionPolicy:
        """The body rewrite's settings (spec 2.2 compat cleanup, 2.5 priority injection), each
        field read from the variable it names.

        :class:`~guard_adapters.openai_body.InjectionPolicy` checks ``BACKEND_PRIORITY_MODE``,
        ``BACKEND_PRIORITY_REWRITE_STRATEGY`` and ``BACKEND_PRIORITY_STREAM_BUFFER_BYTES`` even
        while injection is off (they shape the compat cleanup too), so this raises its
        :class:`ConfigError` for those, where :func:`load_config`, as PIG, checks them only
        while injecting.
        """
        return InjectionPolicy(**_values(InjectionPolicy, self.env))

    def guard_config(self) -> GuardConfig:
        """The pure core's settings, each field read from the variable it names."""
        env = self.env
        values = _values(SignalThresholds, env)
        signals = SignalThresholds.from_global_limit(
            values.pop("global_limit"),
            green=values.pop("green_limit"),
            yellow=values.pop("yellow_limit"),
            red=values.pop("red_limit"),
            **values,
        )
        gate = GateConfig(
            **_values(GateConfig, env),
            global_limit=signals.global_limit,
            dynamic=self.dynamic_enforced,
            queue_poll_ms=env.pig_queue_poll_ms if env.pig_queue_poll_ms > 0 else _FALLBACK_POLL_MS,
            kv_red=signals.kv_red,
            waiting_red=signals.waiting_red,
            fail_open=self.fail_open,
        )
        policy = PolicyConfig(signals=signals, **_values(PolicyConfig, env))
        predictive = None
        if self.predictive_enabled:
            predictive = PredictiveConfig(
                user_tps_floor=min(policy.user_tps_red, policy.user_tps_yellow),
                **_values(PredictiveConfig, env),
            )
        return GuardConfig(
            gate=gate,
            policy=policy,
            learning=env.dynamic_pig_enabled,
            failsafe=env.dynamic_failsafe_state,
            predictive=predictive,
            health=HealthConfig(**_values(HealthConfig, env)),
            flow=self.flow_config,
        )

    @property
    def flow_config(self) -> FlowConfig | None:
        """Bands and tenants (``PIG_PRIORITY_BANDS``, ``PIG_TENANT_*``); ``None`` while neither
        bands nor a tenant header is configured: PIG's two tiers by the gate alone."""
        env = self.env
        bands = parse_bands(env.pig_priority_bands)[0]
        header = self.tenant_header
        if bands is None and header is None:
            return None
        tenants = self.tenant_config if header is not None else None
        if bands is None:
            return FlowConfig(tenants=tenants)
        return FlowConfig(bands=bands, tenants=tenants)

    @property
    def tenant_config(self) -> TenantConfig:
        """The tenant settings (``PIG_TENANT_WEIGHTS``, ``PIG_TENANT_*``), whether or not a
        tenant header turns them on."""
        weights = parse_weights(self.env.pig_tenant_weights)[0] or ()
        return TenantConfig(weights=weights, **_values(TenantConfig, self.env))

    @property
    def tenant_header(self) -> bytes | None:
        """``PIG_TENANT_HEADER`` as a lower-case header name; ``None``: no tenants."""
        name = self.env.pig_tenant_header.strip().lower()
        return name.encode("ascii") if name else None

    def redacted(self) -> dict[str, str]:
        """Every variable's effective value, written as the environment would hold it.

        Loading the result again gives the same settings, except that a set secret reads
        :data:`REDACTED` (an unset one stays empty) and URL passwords are masked.
        """
        shown: dict[str, str] = {}
        for name, attribute in _FIELDS.items():
            value = getattr(self.env, attribute.name)
            text = _as_text(value)
            if value == () and attribute.default != ():
                # An empty list where the default is not: "," reads back as an empty list,
                # whereas "" would mean the default.
                text = ","
            if attribute.metadata.get(_SECRET):
                shown[name] = REDACTED if text else ""
            else:
                shown[name] = _mask_passwords(text)
        return shown

    def describe(self) -> str:
        """The effective configuration, one ``VAR=value`` line per variable, sorted by name.

        The values are those of :meth:`redacted` (so no secret appears). A value holding a
        character that is not printable (a line break, say) is written as a JSON string, so
        each variable stays on one line. No trailing line break.
        """
        return "\n".join(
            f"{name}={_one_line(value)}" for name, value in sorted(self.redacted().items())
        )


def load_config(environ: Mapping[str, str]) -> Settings:
    """Read, check and resolve the settings in ``environ``; see the module notes."""
    raw = {
        name: value
        for name, value in environ.items()
        if name in _FIELDS and not _is_empty(name, value)
    }
    messages: list[str] = []
    unreadable: set[str] = set()
    env: Environment | None = None
    while env is None:
        try:
            env = _converter.structure(raw, Environment)
        except cattrs.BaseValidationError as error:
            found = _parse_messages(error)
            messages.extend(message for _, message in found)
            failed = {name for name, _ in found if name in raw}
            if not failed:
                raise ConfigError(messages) from None
            unreadable |= failed
            # Check the rest with the unreadable variables at their defaults.
            raw = {name: value for name, value in raw.items() if name not in failed}
    if not messages:
        return Settings.from_environment(env)
    messages.extend(
        str(problem) for problem in _problems(env) if unreadable.isdisjoint(problem.variables)
    )
    raise ConfigError(messages)


def apply_overrides(environ: Mapping[str, str], overrides: Sequence[str]) -> dict[str, str]:
    """``environ`` with each ``VAR=VALUE`` applied in order (a later one wins).

    The value may be empty (meaning "the default") and may itself contain ``=``. An override
    without ``=``, or whose name is empty or contains spaces, is malformed; all malformed ones
    are reported in one :class:`ConfigError` and nothing is applied.
    """
    merged = dict(environ)
    malformed: list[str] = []
    for item in overrides:
        name, equals, value = item.partition("=")
        if not equals or not name or any(ch.isspace() for ch in name):
            malformed.append(f"--set {_shown(item)}: expected VAR=VALUE with a variable name")
            continue
        merged[name] = value
    if malformed:
        raise ConfigError(malformed)
    return merged


# -- reading single values ---------------------------------------------------------------------

_PLAIN_INT = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NON_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
_INT64 = 2**63
_TRUE = frozenset({"1", "true", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "no", "n", "off"})
_STATES = {state.value: state for state in (LoadState.GREEN, LoadState.YELLOW, LoadState.RED)}


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _read_int(value: object, _type: object) -> int:
    text = _text(value)
    if not _PLAIN_INT.fullmatch(text):
        raise ValueError(f"expected a plain integer, got {_shown(text)}")
    # Checking the length first keeps int() away from its limit on very long digit strings.
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > 19 or not -_INT64 <= int(text) < _INT64:
        raise ValueError(f"integer out of range, got {_shown(text)}")
    return int(text)


def _read_float(value: object, _type: object) -> float:
    text = _text(value)
    if _NON_FINITE.fullmatch(text):
        raise ValueError(f"expected a finite number, got {_shown(text)}")
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"expected a number, got {_shown(text)}")
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number out of range, got {_shown(text)}")
    return number


def _read_bool(value: object, _type: object) -> bool:
    word = _text(value).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(
        f"expected a boolean (1/true/yes/y/on or 0/false/no/n/off), got {_shown(value)}"
    )


def _read_csv(value: object, _type: object) -> tuple[str, ...]:
    return tuple(part for part in (p.strip() for p in _text(value).split(",")) if part)


def _read_state(value: object, _type: object) -> LoadState:
    word = _text(value).strip().lower()
    if word not in _STATES:
        raise ValueError(f"expected green, yellow or red, got {_shown(value)}")
    return _STATES[word]


def _read_str(value: object, _type: object) -> str:
    return _text(value)


def _build_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _read_int)
    converter.register_structure_hook(float, _read_float)
    converter.register_structure_hook(bool, _read_bool)
    converter.register_structure_hook(str, _read_str)
    converter.register_structure_hook(LoadState, _read_state)
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _read_csv)
    renames: dict[str, Any] = {
        a.name: override(rename=_variable(a)) for a in attrs.fields(Environment)
    }
    converter.register_structure_hook(
        Environment, make_dict_structure_fn(Environment, converter, **renames)
    )
    return converter


_converter: Final = _build_converter()


def _is_empty(name: str, value: object) -> bool:
    if not isinstance(value, str):
        return False
    field = _FIELDS[name]
    field_type = field.type
    if (
        field_type in (bool, LoadState)
        or field_type == tuple[str, ...]
        or field.metadata.get(_WORD)
    ):
        return not value.strip()
    return value == ""


def _describe(error: BaseException, _type: object) -> str:
    if isinstance(error, ValueError | TypeError):
        return str(error)
    return f"cannot be read ({type(error).__name__})"


def _parse_messages(error: cattrs.BaseValidationError) -> list[tuple[str, str]]:
    """(variable, message) for each value cattrs could not structure."""
    found: list[tuple[str, str]] = []
    for line in cattrs.transform_error(error, path="$", format_exception=_describe):
        text, _, path = line.rpartition(" @ ")
        name = path.removeprefix("$.").upper()
        if name in _FIELDS:
            if _FIELDS[name].metadata.get(_SECRET):
                text = "cannot be read"
            found.append((name, f"{name}: {text}"))
        else:
            found.append(("", f"configuration: {line}"))
    return found


def _as_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, LoadState):
        return value.value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _one_line(text: str) -> str:
    return text if text.isprintable() else json.dumps(text)


_USERINFO_PASSWORD = re.compile(r"(://[^/?#@:\s,|]*:)[^/?#@\s,|]*@")


def _mask_passwords(text: str) -> str:
    return _USERINFO_PASSWORD.sub(rf"\1{REDACTED}@", text)


# -- backend resolution (spec 2.1 rules 1-4) ---------------------------------------------------


@attrs.frozen
class _Routing:
    backends: tuple[Backend, ...]
    backend_routing: bool
    metrics_urls: tuple[str, ...]
    #: The variable the backend list came from, and the one the metrics URLs came from.
    backend_source: str
    metrics_source: str


def _clean_url(text: str) -> str:
    return text.strip().rstrip("/")


def _url_list(texts: Iterable[str]) -> tuple[str, ...]:
    """Trimmed, without trailing slashes, without empties and repeats, in first-seen order."""
    return tuple(dict.fromkeys(url for url in map(_clean_url, texts) if url))


def _parse_backend_entries(entries: tuple[str, ...]) -> tuple[Backend, ...]:
    backends = []
    for number, entry in enumerate(entries, start=1):
        name, equals, body = entry.partition("=")
        if not equals:
            name, body = f"backend{number}", entry
        upstream, bar, rest = body.partition("|")
        # Parts after a second '|' are ignored, as PIG does.
        metrics = _clean_url(rest.partition("|")[0]) if bar else ""
        backends.append(Backend(name.strip(), _clean_url(upstream), metrics or None))
    return tuple(backends)


def _resolve_routing(env: Environment) -> _Routing:
    if env.dynamic_metrics_urls:
        metrics_source = "DYNAMIC_METRICS_URLS"
        metrics = _url_list(env.dynamic_metrics_urls)
    else:
        metrics_source = "DYNAMIC_METRICS_URL"
        metrics = _url_list((env.dynamic_metrics_url,))
    listed = bool(env.backends or env.upstreams)
    if env.backends:
        source = "BACKENDS"
        backends = _parse_backend_entries(env.backends)
    else:
        source = "UPSTREAMS"
        upstreams = _url_list(env.upstreams)
        if not upstreams:
            source = "UPSTREAM"
            single = _clean_url(env.upstream)
            upstreams = (single,) if single else ()
        backends = tuple(
            Backend(f"backend{i + 1}", url, metrics[i] if i < len(metrics) else None)
            for i, url in enumerate(upstreams)
        )
    if listed:
        own = _url_list(b.metrics_url for b in backends if b.metrics_url)
        if own:
            metrics = own
            if env.backends:
                metrics_source = "BACKENDS"
    return _Routing(
        backends=backends,
        backend_routing=listed and len(backends) > 1,
        metrics_urls=metrics,
        backend_source=source,
        metrics_source=metrics_source,
    )


def _url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an upstream or metrics URL, or None when it can."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return "must include a host"
    if "?" in url or "#" in url:
        return "must not include a query string or fragment"
    return None


def _split_listen(text: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for IPv6; the host may be empty), or None."""
    host, colon, port = text.rpartition(":")
    if not colon or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or "[" in host or "]" in host:
            return None
    elif ":" in host or "[" in host or "]" in host:
        return None
    if any(ch.isspace() or not ch.isprintable() for ch in host):
        return None
    return host, int(port)


# -- ranges and cross-variable rules -----------------------------------------------------------


class _Checks:
    """Collects problems instead of stopping at the first; one method per kind of rule.

    The ranges of the settings the core configs read are not here: those configs carry them
    (:func:`_core_problems`). These are the adapter's own variables and rules."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.found: list[Problem] = []

    def add(self, variables: Iterable[str], text: str) -> None:
        self.found.append(Problem(tuple(variables), text))

    def _value(self, field: attrs.Attribute[Any]) -> Any:
        return getattr(self.env, field.name)

    def rule(self, field: attrs.Attribute[Any], *rules: Rule) -> None:
        """``field`` keeps each rule; a rule's partner is another field of :class:`Environment`."""
        for rule in rules:
            partner = None if rule.partner is None else _BY_NAME[rule.partner]
            partner_value = None if partner is None else self._value(partner)
            partner_name = "" if partner is None else _variable(partner)
            text = rule.broken(self._value(field), partner_value, partner_name)
            if text is not None:
                self.add([_variable(field), partner_name] if partner else [_variable(field)], text)

    def at_least(self, field: attrs.Attribute[Any], bound: float) -> None:
        self.rule(field, AtLeast(bound))

    def above(self, field: attrs.Attribute[Any], bound: float) -> None:
        self.rule(field, Greater(bound))

    def identifiers(self, field: attrs.Attribute[Any]) -> None:
        """Each name of a list is an ASCII identifier; none is repeated."""
        seen: set[str] = set()
        for name in self._value(field):
            text = Identifier().broken(name, None, "")
            if text is not None:
                self.add([_variable(field)], text)
            if name in seen:
                self.add([_variable(field)], f"{_shown(name)} is listed twice")
            seen.add(name)

    def increasing(self, fields: Sequence[attrs.Attribute[Any]]) -> None:
        """Three lane thresholds: each > 0, each strictly below the next."""
        for field in fields:
            self.above(field, 0)
        for low, high in itertools.pairwise(fields):
            self.rule(low, Below(high.name))


def _path_problems(checks: _Checks, field: attrs.Attribute[Any], *, required: bool) -> None:
    name = _variable(field)
    paths: tuple[str, ...] = getattr(checks.env, field.name)
    if not paths and required:
        checks.add([name], "must name at least one path")
    seen: set[str] = set()
    for path in paths:
        try:
            PathPolicy((path,))
        except ValueError:
            checks.add(
                [name],
                f"{_shown(path)} must start with '/' and use only letters, digits, '_', '.',"
                " '-' and '/'",
            )
        if path in seen:
            checks.add([name], f"{_shown(path)} is listed twice")
        seen.add(path)


def _routing_problems(checks: _Checks, routing: _Routing) -> None:
    source = routing.backend_source
    if not routing.backends:
        checks.add([source], "no backend configured")
    names: set[str] = set()
    for number, backend in enumerate(routing.backends, start=1):
        label = f"backend {_shown(backend.name)}" if backend.name else f"entry {number}"
        if not backend.name:
            checks.add([source], f"entry {number} has an empty name")
        elif not backend.name.isprintable():
            checks.add([source], f"{label} has control characters in its name")
        elif backend.name in names:
            checks.add([source], f"{label} is named twice")
        names.add(backend.name)
        reason = _url_problem(backend.upstream)
        if reason is not None:
            where = "" if source == "UPSTREAM" else f"{label}: "
            checks.add(
                [source], f"{where}upstream {_shown(_mask_passwords(backend.upstream))} {reason}"
            )
    if not checks.env.dynamic_pig_enabled:
        return
    if not routing.metrics_urls:
        checks.add(
            ["DYNAMIC_PIG_ENABLED", "DYNAMIC_METRICS_URL", "DYNAMIC_METRICS_URLS"],
            "dynamic mode needs at least one metrics URL"
            " (DYNAMIC_METRICS_URL, DYNAMIC_METRICS_URLS or BACKENDS)",
        )
    for url in routing.metrics_urls:
        reason = _url_problem(url)
        if reason is not None:
            checks.add(
                [routing.metrics_source, "DYNAMIC_PIG_ENABLED"],
                f"metrics URL {_shown(_mask_passwords(url))} {reason}",
            )


def _problems(env: Environment) -> list[Problem]:
    """Every range and cross-variable rule of spec 2 that ``env`` breaks."""
    c = _Checks(env)
    f = _F
    # spec 2.1 and the guard's own variables
    if _split_listen(env.listen) is None:
        c.add(["LISTEN"], f"expected [host]:port with a numeric port, got {_shown(env.listen)}")
    _routing_problems(c, _resolve_routing(env))
    _admin_problems(c)
    _epp_problems(c)
    _pool_problems(c)
    _flow_problems(c)
    _path_problems(c, f.pig_paths, required=True)
    c.above(f.proxy_timeout_seconds, 0)
    c.at_least(f.pig_status_log_interval_seconds, 0)
    if env.pig_queue_wait_seconds > 0:
        c.above(f.pig_queue_poll_ms, 0)
    c.at_least(f.pig_retry_after_seconds, 0)
    c.at_least(f.pig_drain_seconds, 0)
    c.above(f.pig_header_timeout_seconds, 0)
    c.above(f.pig_max_body_bytes, 0)
    c.above(f.pig_body_idle_timeout_seconds, 0)
    c.above(f.pig_body_timeout_seconds, 0)
    c.at_least(f.pig_upstream_head_timeout_seconds, 0)
    c.at_least(f.pig_upstream_idle_timeout_seconds, 0)
    _path_problems(c, f.pig_forward_paths, required=False)
    c.rule(f.pig_failure_mode, OneOf(FAILURE_MODES))
    c.rule(f.pig_routing, OneOf(ROUTINGS))
    c.above(f.pig_affinity_bound, 1)
    c.above(f.pig_affinity_prefix_bytes, 0)
    _feature_problems(c)
    c.above(f.dynamic_poll_interval_ms, 0)
    _core_problems(c)
    _predictive_problems(c)
    return c.found


def _core_problems(c: _Checks) -> None:
    """The rules the core configs and the body rewrite carry, checked on the values they would
    be built from: the adaptive thresholds' while ``ADAPTIVE_OUTPUT_CLASSIFICATION`` is on, the
    predictive learner's while it is chosen, the others always (each stage's own rules apply
    while its flag is on, the priority rules while injecting). A rule shared by two configs is
    reported once."""
    env = c.env
    found: list[Problem] = []
    for cls in (*_CORE_CONFIGS, InjectionPolicy):
        if cls is AdaptiveOutputConfig and not env.adaptive_output_classification:
            continue
        if cls is PredictiveConfig and env.dynamic_policy != POLICIES[1]:
            continue
        for problem in problems(cls, _values(cls, env)):
            if problem not in found:
                found.append(problem)
    c.found.extend(found)


def _pool_problems(c: _Checks) -> None:
    """``PIG_POOLS``: each entry a model and configured backends (guard_adapters.model_pools)."""
    names = [b.name for b in _resolve_routing(c.env).backends]
    for problem in parse_pools(c.env.pig_pools, names)[1]:
        c.add(["PIG_POOLS"], problem)


def _flow_problems(c: _Checks) -> None:
    """``PIG_PRIORITY_BANDS``, ``PIG_TENANT_HEADER`` and ``PIG_TENANT_WEIGHTS``
    (guard_adapters.flow_config)."""
    env = c.env
    for problem in parse_bands(env.pig_priority_bands)[1]:
        c.add(["PIG_PRIORITY_BANDS"], problem)
    header = env.pig_tenant_header.strip()
    if header and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", header):
        c.add(["PIG_TENANT_HEADER"], f"{_shown(header)} is not a header name")
    for problem in parse_weights(env.pig_tenant_weights)[1]:
        c.add(["PIG_TENANT_WEIGHTS"], problem)
    if env.pig_tenant_weights.strip() and not header:
        c.add(["PIG_TENANT_WEIGHTS", "PIG_TENANT_HEADER"], "weights need a tenant header")


def _admin_problems(c: _Checks) -> None:
    """``PIG_ADMIN_LISTEN``: empty, or ``host:port`` with a host (the admin plane is never
    opened on every interface by accident), and only with a ``TOKEN`` to guard it."""
    listen = c.env.pig_admin_listen
    if not listen:
        return
    split = _split_listen(listen)
    if split is None or not split[0]:
        c.add(["PIG_ADMIN_LISTEN"], f"expected host:port with a numeric port, got {_shown(listen)}")
    if not c.env.token:
        c.add(["PIG_ADMIN_LISTEN", "TOKEN"], "the admin plane needs TOKEN, which is empty")


def _epp_problems(c: _Checks) -> None:
    """``PIG_EPP_LISTEN``: ``host:port`` with a numeric port."""
    if _split_listen(c.env.pig_epp_listen) is None:
        c.add(
            ["PIG_EPP_LISTEN"],
            f"expected host:port with a numeric port, got {_shown(c.env.pig_epp_listen)}",
        )


def _feature_problems(c: _Checks) -> None:
    """Spec 2.2 to 2.5: auth, compat cleanup, attestation, lanes and the priority rewrite."""
    env, f = c.env, _F
    # spec 2.2
    if env.api_auth_enabled and not env.token:
        c.add(["API_AUTH_ENABLED", "TOKEN"], "is on but TOKEN is empty")
    if env.api_auth_paths != env.pig_paths:
        _path_problems(c, f.api_auth_paths, required=env.api_auth_enabled)
    # spec 2.3
    if env.attestation_enabled:
        c.above(f.attestation_nvidia_command_timeout_seconds, 0)
    # spec 2.4
    c.identifiers(f.output_token_field_names)
    c.increasing((f.medium_body_bytes, f.long_body_bytes, f.very_long_body_bytes))
    if env.classify_output_tokens:
        c.above(f.json_classify_body_bytes, 0)
        c.above(f.json_classify_limit, 0)
        c.increasing((f.medium_output_tokens, f.long_output_tokens, f.very_long_output_tokens))


def _predictive_problems(c: _Checks) -> None:
    """The learner choice and, while the predictive learner is chosen, its settings."""
    env, f = c.env, _F
    c.rule(f.dynamic_policy, OneOf(POLICIES))
    c.rule(f.pig_retry_after_mode, OneOf(RETRY_AFTER_MODES))
    if env.dynamic_policy != POLICIES[1]:
        return
    if not env.dynamic_pig_enabled:
        c.add(
            ["DYNAMIC_POLICY", "DYNAMIC_PIG_ENABLED"],
            "predictive needs dynamic mode (DYNAMIC_PIG_ENABLED on, with a metrics URL):"
            " it learns from the backends' metrics",
        )
