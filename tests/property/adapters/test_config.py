"""guard_adapters.config: PIG's environment variables to settings and core configs (spec 2).

Sections 2.1 and 2.6 first, then 2.2-2.5 and 2.7: each variable's default, its reading, its
ranges and whether they are checked only while its feature is on; then redaction of the three
secrets, ``describe()`` and properties over arbitrary environments.
"""

from __future__ import annotations

import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_adapters._errors import AdapterError
from guard_adapters.config import (
    REDACTED,
    VARIABLES,
    Backend,
    ConfigError,
    Environment,
    LaneThresholds,
    Settings,
    apply_overrides,
    load_config,
)
from guard_core.decision import LoadState
from guard_core.gate import GateConfig
from guard_core.guard import GuardConfig
from guard_core.lanes import (
    DEFAULT_BODY_THRESHOLDS,
    DEFAULT_OUTPUT_THRESHOLDS,
    AdaptiveOutputConfig,
    Thresholds,
)
from guard_core.policy import PolicyConfig
from guard_core.predictive import PredictiveConfig
from guard_core.routing import DEFAULT_QOS_PATHS, PathPolicy
from guard_core.signal_state import SignalThresholds

METRICS = "http://engine:8000/metrics"


def errors_of(environ: dict[str, str]) -> tuple[str, ...]:
    """The messages of the ConfigError that loading ``environ`` must raise."""
    with pytest.raises(ConfigError) as caught:
        load_config(environ)
    return caught.value.messages


def assert_reported(environ: dict[str, str], variable: str) -> str:
    """Loading fails, and exactly one message concerns ``variable``; that message."""
    messages = [m for m in errors_of(environ) if m.startswith(f"{variable}: ")]
    assert len(messages) == 1, messages
    return messages[0]


def dynamic(**extra: str) -> dict[str, str]:
    """An environment with dynamic mode on (one metrics URL) plus ``extra``."""
    return {"DYNAMIC_METRICS_URL": METRICS, **extra}


# -- defaults ----------------------------------------------------------------------------------


def test_defaults_build_the_core_defaults_once_dynamic_mode_is_on() -> None:
    settings = load_config({"UPSTREAM": "http://engine:8000", "DYNAMIC_METRICS_URL": METRICS})
    config = settings.guard_config()
    assert config == GuardConfig()
    assert config.learning
    assert config.gate.dynamic
    assert settings.dynamic_enabled
    assert settings.dynamic_enforced


def test_empty_environment_is_pig_static_mode() -> None:
    settings = load_config({})
    config = settings.guard_config()
    off = PolicyConfig(
        pressure_enabled=False,
        user_tps_enabled=False,
        capacity_learn_enabled=False,
        ttft_enabled=False,
    )
    assert config == GuardConfig(gate=GateConfig(dynamic=False), policy=off, learning=False)
    assert config.policy.signals == SignalThresholds.from_global_limit(512)
    assert not settings.dynamic_enabled
    assert settings.backends == (Backend("backend1", "http://backend:8000"),)
    assert not settings.backend_routing
    assert settings.metrics_urls == ()
    assert settings.paths == PathPolicy()
    assert (settings.listen_host, settings.listen_port) == ("", 8000)
    assert settings.env == Environment()


def test_scalar_defaults_are_pigs() -> None:
    env = load_config({}).env
    assert env.listen == ":8000"
    assert env.token == ""
    assert env.global_limit == 512
    assert env.pig_paths == DEFAULT_QOS_PATHS
    assert env.proxy_timeout_seconds == 1800
    assert env.pig_status_log_interval_seconds == 5
    assert env.pig_queue_wait_seconds == 0.5
    assert env.pig_queue_poll_ms == 100
    assert env.pig_retry_after_seconds == 1
    assert env.pig_drain_seconds == 30.0
    assert env.pig_record_path == ""
    assert env.dynamic_poll_interval_ms == 1000
    assert env.dynamic_failsafe_state is LoadState.YELLOW
    assert (env.dynamic_kv_yellow, env.dynamic_kv_red) == (0.70, 0.80)
    assert (env.dynamic_waiting_yellow, env.dynamic_waiting_red) == (1, 2)
    assert env.dynamic_preemption_delta_red == 1


def test_defaults_that_follow_other_variables() -> None:
    env = load_config(dynamic(GLOBAL_LIMIT="100", DYNAMIC_RUNNING_YELLOW="7")).env
    assert env.dynamic_global_green_limit == 100
    assert env.dynamic_global_yellow_limit == 100
    assert env.dynamic_global_red_limit == 100
    assert env.dynamic_running_red == 7

    env = load_config(dynamic(DYNAMIC_GLOBAL_YELLOW_LIMIT="40")).env
    assert (env.dynamic_global_green_limit, env.dynamic_global_red_limit) == (512, 40)

    env = load_config(dynamic(DYNAMIC_PIG_ENABLED="false")).env
    assert not env.dynamic_pig_enforce
    assert not env.dynamic_pressure_limit_enabled
    assert not env.dynamic_single_user_tps_capacity_learn_enabled
    assert not env.dynamic_ttft_enabled

    env = load_config(dynamic(DYNAMIC_SINGLE_USER_TPS_ENABLED="off")).env
    assert env.dynamic_pressure_limit_enabled
    assert not env.dynamic_ttft_enabled


def test_enforce_off_keeps_learning_but_not_the_gate() -> None:
    config = load_config(dynamic(DYNAMIC_PIG_ENFORCE="false")).guard_config()
    assert config.learning
    assert not config.gate.dynamic


def test_state_caps_above_the_global_limit_are_lowered_in_the_core() -> None:
    config = load_config(dynamic(GLOBAL_LIMIT="10", DYNAMIC_GLOBAL_GREEN_LIMIT="50")).guard_config()
    signals = config.policy.signals
    assert (signals.green_limit, signals.yellow_limit, signals.red_limit) == (10, 10, 10)


def test_non_positive_ttft_thresholds_fall_back_to_their_defaults() -> None:
    env = load_config(
        dynamic(
            DYNAMIC_TTFT_TARGET_SECONDS="0",
            DYNAMIC_TTFT_RED_SECONDS="-2",
            DYNAMIC_TTFT_P99_TARGET_SECONDS="-0.5",
            DYNAMIC_TTFT_P99_RED_SECONDS="0.0",
        )
    ).env
    assert env.dynamic_ttft_target_seconds == 1.0
    assert env.dynamic_ttft_red_seconds == 3.0
    assert env.dynamic_ttft_p99_target_seconds == 3.0
    assert env.dynamic_ttft_p99_red_seconds == 8.0


def test_queue_poll_may_be_zero_when_the_wait_is_zero() -> None:
    settings = load_config({"PIG_QUEUE_WAIT_SECONDS": "0", "PIG_QUEUE_POLL_MS": "0"})
    gate = settings.guard_config().gate
    assert gate.queue_wait_s == 0
    assert gate.fallback_check_s == 0.25
    message = assert_reported({"PIG_QUEUE_POLL_MS": "0"}, "PIG_QUEUE_POLL_MS")
    assert "> 0" in message


# -- reading single values ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [("5", 5), ("+5", 5), ("-3", -3), ("0", 0)])
def test_plain_integers_are_read(text: str, value: int) -> None:
    assert load_config({"DYNAMIC_PRESSURE_HEADROOM": text}).env.dynamic_pressure_headroom == value


@pytest.mark.parametrize(
    "text",
    [" 5", "5 ", "\t5", "5.0", "1e3", "0x10", "1_000", "\uff15", "five", "+", "--1", "5\n", " "],
)
def test_integers_must_be_plain(text: str) -> None:
    message = assert_reported({"GLOBAL_LIMIT": text}, "GLOBAL_LIMIT")
    assert message == f"GLOBAL_LIMIT: expected a plain integer, got {text!r}"


def test_integers_beyond_64_bits_are_rejected() -> None:
    assert_reported({"GLOBAL_LIMIT": "9" * 20}, "GLOBAL_LIMIT")
    assert "out of range" in assert_reported({"GLOBAL_LIMIT": "1" * 5000}, "GLOBAL_LIMIT")
    assert load_config({"GLOBAL_LIMIT": "0" * 30 + "7"}).env.global_limit == 7
    assert load_config({"GLOBAL_LIMIT": str(2**63 - 1)}).env.global_limit == 2**63 - 1


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-1", 0.1), (".5", 0.5), ("5", 5.0), ("5.", 5.0), ("+2.5E+1", 25.0), ("-0", 0.0)],
)
def test_floats_take_any_decimal_form(text: str, value: float) -> None:
    # Pressure is off in static mode, so its ratio is read but not range-checked.
    env = load_config({"DYNAMIC_PRESSURE_LEARN_RATIO": text}).env
    assert env.dynamic_pressure_learn_ratio == value


@pytest.mark.parametrize(
    "text", ["abc", " 1", "1 ", "1_0", "0x1p-2", "1e", "..5", "inf", "-Infinity", "NaN", "1e999"]
)
def test_floats_that_are_rejected(text: str) -> None:
    message = assert_reported({"PIG_QUEUE_WAIT_SECONDS": text}, "PIG_QUEUE_WAIT_SECONDS")
    assert repr(text) in message


@pytest.mark.parametrize(
    "text", ["1", "true", "TRUE", "True", "yes", "Y", "y", "on", " On ", "\ttrue\n"]
)
def test_true_spellings(text: str) -> None:
    assert load_config({"PIG_PATH_SUFFIX_MATCH": text}).env.pig_path_suffix_match is True


@pytest.mark.parametrize("text", ["0", "false", "FALSE", "no", "N", "n", "off", " OFF "])
def test_false_spellings(text: str) -> None:
    env = load_config(dynamic(DYNAMIC_PIG_ENFORCE=text)).env
    assert env.dynamic_pig_enforce is False


@pytest.mark.parametrize("text", ["2", "tru", "enable", "yes please", "t", "-1", "oui"])
def test_other_booleans_are_rejected(text: str) -> None:
    message = assert_reported({"PIG_PATH_SUFFIX_MATCH": text}, "PIG_PATH_SUFFIX_MATCH")
    assert "expected a boolean" in message


@pytest.mark.parametrize(
    "variable", ["GLOBAL_LIMIT", "PIG_QUEUE_WAIT_SECONDS", "PIG_PATH_SUFFIX_MATCH", "LISTEN"]
)
def test_empty_means_default(variable: str) -> None:
    assert load_config({variable: ""}) == load_config({})


def test_blank_booleans_lists_and_states_mean_default() -> None:
    environ = {"PIG_PATH_SUFFIX_MATCH": "  ", "PIG_PATHS": " ", "DYNAMIC_FAILSAFE_STATE": " "}
    assert load_config(environ) == load_config({})


def test_csv_parts_are_trimmed_and_empty_parts_dropped() -> None:
    settings = load_config({"PIG_PATHS": " /a , ,/b/c,, "})
    assert settings.paths == PathPolicy(("/a", "/b/c"))


def test_failsafe_state_is_trimmed_and_lower_cased() -> None:
    assert load_config({"DYNAMIC_FAILSAFE_STATE": " RED "}).guard_config().failsafe is LoadState.RED
    for text in ("disabled", "orange", "redd"):
        assert_reported({"DYNAMIC_FAILSAFE_STATE": text}, "DYNAMIC_FAILSAFE_STATE")


def test_unknown_variables_are_ignored() -> None:
    assert load_config({"PATH": "/usr/bin", "GLOBAL_LIMITS": "x", "global_limit": "x"}) == (
        load_config({})
    )


# -- backends (spec 2.1 rules 1-5) -------------------------------------------------------------


def test_single_upstream_takes_the_first_metrics_url_and_all_urls_are_summed() -> None:
    settings = load_config(
        {
            "UPSTREAM": " http://engine:8000// ",
            "DYNAMIC_METRICS_URLS": "http://m1/metrics/, http://m2/metrics, http://m1/metrics",
        }
    )
    assert settings.backends == (Backend("backend1", "http://engine:8000", "http://m1/metrics"),)
    assert settings.metrics_urls == ("http://m1/metrics", "http://m2/metrics")
    assert not settings.backend_routing
    assert settings.dynamic_enabled


def test_metrics_urls_override_the_single_metrics_url() -> None:
    settings = load_config(
        {"DYNAMIC_METRICS_URL": "http://single/metrics", "DYNAMIC_METRICS_URLS": "http://list/m"}
    )
    assert settings.metrics_urls == ("http://list/m",)
    settings = load_config({"DYNAMIC_METRICS_URL": " http://single/metrics/ "})
    assert settings.metrics_urls == ("http://single/metrics",)


def test_upstreams_are_deduplicated_and_paired_with_metrics_urls_by_index() -> None:
    settings = load_config(
        {
            "UPSTREAM": "http://ignored:1",
            "UPSTREAMS": "http://a:1/, http://a:1, ,http://b:2//,http://c:3",
            "DYNAMIC_METRICS_URLS": "http://a:1/metrics,http://b:2/metrics/",
        }
    )
    assert settings.backends == (
        Backend("backend1", "http://a:1", "http://a:1/metrics"),
        Backend("backend2", "http://b:2", "http://b:2/metrics"),
        Backend("backend3", "http://c:3", None),
    )
    assert settings.backend_routing
    assert settings.metrics_urls == ("http://a:1/metrics", "http://b:2/metrics")


def test_extra_metrics_urls_beyond_the_upstreams_are_not_polled_with_upstreams() -> None:
    settings = load_config(
        {"UPSTREAMS": "http://a:1", "DYNAMIC_METRICS_URLS": "http://m1/x,http://m2/x"}
    )
    assert settings.backends == (Backend("backend1", "http://a:1", "http://m1/x"),)
    assert settings.metrics_urls == ("http://m1/x",)
    assert not settings.backend_routing


def test_backends_with_names_and_metrics_urls() -> None:
    settings = load_config(
        {
            "UPSTREAMS": "http://ignored:1,http://ignored:2",
            "DYNAMIC_METRICS_URL": "http://ignored/metrics",
            "BACKENDS": " big = http://a:1/ | http://a:1/metrics/ , http://b:2 ,small=http://c:3|",
        }
    )
    assert settings.backends == (
        Backend("big", "http://a:1", "http://a:1/metrics"),
        Backend("backend2", "http://b:2", None),
        Backend("small", "http://c:3", None),
    )
    assert settings.backend_routing
    assert settings.metrics_urls == ("http://a:1/metrics",)
    assert settings.dynamic_enabled


def test_backend_name_is_the_text_before_the_first_equals_sign() -> None:
    settings = load_config({"BACKENDS": "x=http://h:1/p=q"})
    assert settings.backends == (Backend("x", "http://h:1/p=q"),)
    # Without a name, an '=' inside the URL splits it, as in PIG.
    message = assert_reported({"BACKENDS": "http://h:1/p=q"}, "BACKENDS")
    assert "'http://h:1/p'" in message


def test_backends_without_metrics_keep_the_dynamic_metrics_urls() -> None:
    settings = load_config(
        {"BACKENDS": "http://a:1,http://b:2", "DYNAMIC_METRICS_URLS": "http://m/1,http://m/2"}
    )
    assert settings.backends == (
        Backend("backend1", "http://a:1"),
        Backend("backend2", "http://b:2"),
    )
    assert settings.metrics_urls == ("http://m/1", "http://m/2")
    assert settings.backend_routing


def test_a_single_listed_backend_is_not_routing() -> None:
    settings = load_config({"BACKENDS": "only=http://a:1|http://a:1/metrics"})
    assert not settings.backend_routing
    assert settings.metrics_urls == ("http://a:1/metrics",)


@pytest.mark.parametrize(
    ("upstream", "reason"),
    [
        ("ftp://h", "http:// or https://"),
        ("h:8000", "http:// or https://"),
        ("engine", "http:// or https://"),
        ("http://", "host"),
        ("http://:8000", "host"),
        ("http://h?x=1", "query"),
        ("http://h/#frag", "query"),
        ("http://h:99999", "not a valid URL"),
        ("http://[::1", "not a valid URL"),
        ("http://h/a b", "spaces"),
    ],
)
def test_invalid_upstreams_are_rejected(upstream: str, reason: str) -> None:
    message = assert_reported({"UPSTREAM": upstream}, "UPSTREAM")
    assert reason in message
    message = assert_reported({"UPSTREAMS": f"http://ok:1,{upstream}"}, "UPSTREAMS")
    assert "backend2" in message
    message = assert_reported({"BACKENDS": f"x=http://ok:1,bad={upstream}"}, "BACKENDS")
    assert "'bad'" in message


def test_valid_upstream_shapes() -> None:
    for url in ("https://h", "http://10.0.0.1:8000/prefix", "http://[::1]:8000", "http://u:p@h"):
        assert load_config({"UPSTREAM": url}).backends[0].upstream == url


def test_no_backend_at_all() -> None:
    assert "no backend" in assert_reported({"UPSTREAM": "/"}, "UPSTREAM")


def test_backend_names_must_be_present_and_distinct() -> None:
    assert "empty name" in assert_reported({"BACKENDS": "=http://a:1,b=http://b:1"}, "BACKENDS")
    message = assert_reported({"BACKENDS": "a=http://a:1,a=http://b:1"}, "BACKENDS")
    assert "named twice" in message


def test_metrics_urls_are_checked_only_in_dynamic_mode() -> None:
    message = assert_reported({"DYNAMIC_METRICS_URL": "ftp://m/metrics"}, "DYNAMIC_METRICS_URL")
    assert "http:// or https://" in message
    assert_reported({"DYNAMIC_METRICS_URLS": "http://m/x,http://m/y?z"}, "DYNAMIC_METRICS_URLS")
    assert_reported({"BACKENDS": "a=http://a:1|nope,b=http://b:1"}, "BACKENDS")
    settings = load_config({"DYNAMIC_METRICS_URL": "ftp://m", "DYNAMIC_PIG_ENABLED": "false"})
    assert not settings.dynamic_enabled


def test_dynamic_mode_on_needs_a_metrics_url() -> None:
    message = assert_reported({"DYNAMIC_PIG_ENABLED": "true"}, "DYNAMIC_PIG_ENABLED")
    assert "metrics URL" in message


# -- ranges and cross-variable rules -----------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GLOBAL_LIMIT", "-1"),
        ("PROXY_TIMEOUT_SECONDS", "0"),
        ("PIG_STATUS_LOG_INTERVAL_SECONDS", "-1"),
        ("PIG_QUEUE_WAIT_SECONDS", "-0.1"),
        ("PIG_RETRY_AFTER_SECONDS", "-1"),
        ("PIG_DRAIN_SECONDS", "-1"),
        ("DYNAMIC_POLL_INTERVAL_MS", "0"),
        ("DYNAMIC_GLOBAL_GREEN_LIMIT", "-1"),
        ("DYNAMIC_GLOBAL_YELLOW_LIMIT", "-1"),
        ("DYNAMIC_GLOBAL_RED_LIMIT", "-1"),
        ("DYNAMIC_PREEMPTION_DELTA_RED", "-1"),
    ],
)
def test_ranges_checked_even_in_static_mode(variable: str, value: str) -> None:
    assert_reported({variable: value}, variable)


def test_zero_values_that_pig_allows() -> None:
    settings = load_config(
        {
            "GLOBAL_LIMIT": "0",
            "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
            "PIG_RETRY_AFTER_SECONDS": "0",
            "PIG_DRAIN_SECONDS": "0",
            "LISTEN": "127.0.0.1:0",
        }
    )
    assert settings.guard_config().gate.global_limit == 0
    assert (settings.listen_host, settings.listen_port) == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    ("yellow", "red", "yellow_value"),
    [
        ("DYNAMIC_KV_YELLOW", "DYNAMIC_KV_RED", "0.9"),
        ("DYNAMIC_RUNNING_YELLOW", "DYNAMIC_RUNNING_RED", "9"),
        ("DYNAMIC_WAITING_YELLOW", "DYNAMIC_WAITING_RED", "9"),
    ],
)
def test_signal_thresholds_must_be_ordered_in_every_mode(
    yellow: str, red: str, yellow_value: str
) -> None:
    environ = {yellow: yellow_value, red: "5" if "KV" not in red else "0.8"}
    message = assert_reported(environ, yellow)
    assert red in message
    assert_reported(dynamic(**environ), yellow)


def test_running_red_follows_yellow_so_raising_yellow_alone_is_fine() -> None:
    env = load_config({"DYNAMIC_RUNNING_YELLOW": "12"}).env
    assert env.dynamic_running_red == 12


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DYNAMIC_PRESSURE_HEADROOM", "-1"),
        ("DYNAMIC_PRESSURE_MIN_LIMIT", "-1"),
        ("DYNAMIC_PRESSURE_LEARN_RATIO", "0"),
        ("DYNAMIC_PRESSURE_LEARN_RATIO", "1.5"),
        ("DYNAMIC_PRESSURE_LEARN_MIN_RUNNING", "-1"),
    ],
)
def test_pressure_ranges_only_when_pressure_is_on(variable: str, value: str) -> None:
    assert_reported(dynamic(**{variable: value}), variable)
    load_config(dynamic(**{variable: value, "DYNAMIC_PRESSURE_LIMIT_ENABLED": "false"}))
    load_config({variable: value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DYNAMIC_SINGLE_USER_TPS_YELLOW", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_RED", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_RED", "30"),
        ("DYNAMIC_SINGLE_USER_TPS_MIN_RUNNING", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_YELLOW_CONSECUTIVE", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_RED_CONSECUTIVE", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MIN_SECONDS", "-1"),
        ("DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MIN_SECONDS", "31"),
        ("DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_BODY_BYTES_PER_SECOND", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MULTIPLIER", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO", "0.9"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_MAX", "1.01"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_SMOOTHING", "1"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_SMOOTHING", "-0.1"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_STEP_UP", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_STEP_UP", "1.1"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_CONSECUTIVE", "0"),
        ("DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_MULTIPLIER", "0.99"),
    ],
)
def test_user_tps_ranges_only_when_user_tps_is_on(variable: str, value: str) -> None:
    assert any(variable in message for message in errors_of(dynamic(**{variable: value})))
    off = {variable: value, "DYNAMIC_SINGLE_USER_TPS_ENABLED": "0", "DYNAMIC_TTFT_ENABLED": "0"}
    load_config(dynamic(**off)).guard_config()


@pytest.mark.parametrize(
    ("target", "red", "environ"),
    [
        (
            "DYNAMIC_TTFT_TARGET_SECONDS",
            "DYNAMIC_TTFT_RED_SECONDS",
            {"DYNAMIC_TTFT_RED_SECONDS": "0.5"},
        ),
        (
            "DYNAMIC_TTFT_P99_TARGET_SECONDS",
            "DYNAMIC_TTFT_P99_RED_SECONDS",
            {"DYNAMIC_TTFT_P99_TARGET_SECONDS": "9"},
        ),
    ],
)
def test_ttft_red_must_not_be_below_target_when_ttft_is_on(
    target: str, red: str, environ: dict[str, str]
) -> None:
    message = assert_reported(dynamic(**environ), target)
    assert red in message
    load_config(dynamic(**environ, DYNAMIC_TTFT_ENABLED="false")).guard_config()


@pytest.mark.parametrize(
    "listen", ["", ":8000", "0.0.0.0:80", "localhost:8000", "[::]:8000", "[::1]:65535"]
)
def test_listen_addresses_accepted(listen: str) -> None:
    load_config({"LISTEN": listen})


@pytest.mark.parametrize("listen", [" ", "8000", ":http", "h:65536", "::1:80", "[]:80", "a b:80"])
def test_listen_addresses_rejected(listen: str) -> None:
    assert_reported({"LISTEN": listen}, "LISTEN")


@pytest.mark.parametrize(
    ("paths", "fragment"),
    [(",", "at least one"), ("/a,/a", "twice"), ("v1/chat", "must start"), ("/a b", "must start")],
)
def test_pig_paths_rules(paths: str, fragment: str) -> None:
    assert fragment in assert_reported({"PIG_PATHS": paths}, "PIG_PATHS")


def test_every_bad_variable_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            {
                "GLOBAL_LIMIT": " 5",
                "PIG_PATH_SUFFIX_MATCH": "maybe",
                "PROXY_TIMEOUT_SECONDS": "0",
                "DYNAMIC_KV_YELLOW": "0.9",
                "UPSTREAM": "ftp://engine",
                "PIG_PATHS": "/a,/a,b",
            }
        )
    error = caught.value
    assert isinstance(error, AdapterError)
    leads = sorted(message.split(":")[0] for message in error.messages)
    assert leads == sorted(
        [
            "GLOBAL_LIMIT",
            "PIG_PATH_SUFFIX_MATCH",
            "PROXY_TIMEOUT_SECONDS",
            "DYNAMIC_KV_YELLOW",
            "UPSTREAM",
            "PIG_PATHS",
            "PIG_PATHS",
        ]
    )
    assert "GLOBAL_LIMIT: expected a plain integer, got ' 5'" in error.messages
    assert str(error).splitlines() == list(error.messages)
    assert pickle.loads(pickle.dumps(error)).messages == error.messages


def test_rules_that_name_an_unreadable_variable_are_not_reported_twice() -> None:
    messages = errors_of({"DYNAMIC_KV_RED": "high", "DYNAMIC_KV_YELLOW": "0.9"})
    assert messages == ("DYNAMIC_KV_RED: expected a number, got 'high'",)


def test_an_unreadable_variable_does_not_hide_other_range_problems() -> None:
    messages = errors_of({"DYNAMIC_KV_RED": "high", "GLOBAL_LIMIT": "-4"})
    assert messages == (
        "DYNAMIC_KV_RED: expected a number, got 'high'",
        "GLOBAL_LIMIT: must be >= 0, got -4",
    )


def test_a_bad_value_is_reported_once_not_again_for_the_variables_that_follow_it() -> None:
    assert errors_of({"DYNAMIC_RUNNING_YELLOW": "-1"}) == (
        "DYNAMIC_RUNNING_YELLOW: must be >= 0, got -1",
    )
    messages = errors_of({"DYNAMIC_GLOBAL_GREEN_LIMIT": "-1", "DYNAMIC_GLOBAL_RED_LIMIT": "-2"})
    assert messages == (
        "DYNAMIC_GLOBAL_GREEN_LIMIT: must be >= 0, got -1",
        "DYNAMIC_GLOBAL_RED_LIMIT: must be >= 0, got -2",
    )


def test_from_environment_checks_directly_built_values() -> None:
    with pytest.raises(ConfigError):
        Settings.from_environment(Environment(global_limit=-1))
    settings = Settings.from_environment(Environment(dynamic_metrics_url=METRICS))
    assert settings.dynamic_enabled


# -- spec 2.2: auth, compat cleanup, upstream errors -------------------------------------------


def test_section_2_2_defaults() -> None:
    settings = load_config({})
    env = settings.env
    assert env.api_auth_enabled is False
    assert settings.env.api_auth_enabled is False
    assert env.api_auth_paths == DEFAULT_QOS_PATHS
    assert settings.auth_paths == PathPolicy()
    assert env.upstream_error_classification_enabled is True
    assert env.openai_compat_strip_empty_tool_calls is True
    assert env.openai_compat_body_bytes == 33_554_432
    assert env.openai_compat_fail_open is True
    assert settings.injection_policy().strip_empty_tool_calls is True
    assert settings.injection_policy().compat_body_bytes == 33_554_432
    assert settings.injection_policy().compat_fail_open is True


def test_api_auth_is_on_by_default_exactly_when_a_token_is_set() -> None:
    assert load_config({"TOKEN": "t"}).env.api_auth_enabled
    assert not load_config({"TOKEN": "t", "API_AUTH_ENABLED": "false"}).env.api_auth_enabled
    assert load_config({"TOKEN": "t", "API_AUTH_ENABLED": " yes "}).env.api_auth_enabled
    # An empty TOKEN is the same as none.
    assert not load_config({"TOKEN": ""}).env.api_auth_enabled


def test_api_auth_on_needs_a_token() -> None:
    message = assert_reported({"API_AUTH_ENABLED": "true"}, "API_AUTH_ENABLED")
    assert "TOKEN" in message
    assert_reported({"API_AUTH_ENABLED": "1", "TOKEN": ""}, "API_AUTH_ENABLED")


def test_api_auth_paths_follow_pig_paths_and_share_suffix_matching() -> None:
    settings = load_config({"PIG_PATHS": "/a,/b", "PIG_PATH_SUFFIX_MATCH": "true"})
    assert settings.env.api_auth_paths == ("/a", "/b")
    assert settings.auth_paths == PathPolicy(("/a", "/b"), suffix_match=True)
    settings = load_config({"PIG_PATHS": "/a", "API_AUTH_PATHS": " /v1/models , /a ", "TOKEN": "t"})
    assert settings.paths == PathPolicy(("/a",))
    assert settings.auth_paths == PathPolicy(("/v1/models", "/a"))
    assert settings.auth_paths.matches("/v1/models")


@pytest.mark.parametrize(("paths", "fragment"), [("/a,/a", "twice"), ("v1/x", "must start")])
def test_api_auth_paths_are_checked_like_pig_paths_whether_or_not_auth_is_on(
    paths: str, fragment: str
) -> None:
    assert fragment in assert_reported({"API_AUTH_PATHS": paths}, "API_AUTH_PATHS")
    environ = {"API_AUTH_PATHS": paths, "TOKEN": "t"}
    assert fragment in assert_reported(environ, "API_AUTH_PATHS")


def test_an_empty_api_auth_path_list_is_refused_only_while_auth_is_on() -> None:
    message = assert_reported({"API_AUTH_PATHS": " , ", "TOKEN": "t"}, "API_AUTH_PATHS")
    assert "at least one" in message
    settings = load_config({"API_AUTH_PATHS": ",", "TOKEN": "t", "API_AUTH_ENABLED": "off"})
    assert settings.env.api_auth_paths == ()
    # Nothing consults it while auth is off; it holds the admitted paths rather than failing.
    assert settings.auth_paths == settings.paths
    assert settings.redacted()["API_AUTH_PATHS"] == ","


def test_a_bad_pig_paths_is_not_reported_again_for_the_auth_paths_that_follow_it() -> None:
    messages = errors_of({"PIG_PATHS": "/a,/a", "TOKEN": "t"})
    assert messages == ("PIG_PATHS: '/a' is listed twice",)


def test_compat_body_limit_is_checked_only_while_stripping() -> None:
    for value in ("0", "-1"):
        assert_reported({"OPENAI_COMPAT_BODY_BYTES": value}, "OPENAI_COMPAT_BODY_BYTES")
        settings = load_config(
            {"OPENAI_COMPAT_BODY_BYTES": value, "OPENAI_COMPAT_STRIP_EMPTY_TOOL_CALLS": "no"}
        )
        assert settings.injection_policy().compat_body_bytes == int(value)
        assert not settings.injection_policy().strip_empty_tool_calls


def test_section_2_2_switches_are_read() -> None:
    env = load_config(
        {
            "UPSTREAM_ERROR_CLASSIFICATION_ENABLED": "off",
            "OPENAI_COMPAT_FAIL_OPEN": "0",
            "OPENAI_COMPAT_BODY_BYTES": "1",
        }
    ).env
    assert env.upstream_error_classification_enabled is False
    assert env.openai_compat_fail_open is False
    assert env.openai_compat_body_bytes == 1
    assert_reported({"OPENAI_COMPAT_FAIL_OPEN": "maybe"}, "OPENAI_COMPAT_FAIL_OPEN")


# -- spec 2.3: attestation ---------------------------------------------------------------------


def test_section_2_3_defaults() -> None:
    settings = load_config({})
    env = settings.env
    assert env.attestation_enabled is True
    assert env.dstack_simulator_endpoint == ""
    assert env.attestation_dstack_endpoint == "/var/run/dstack.sock"
    assert settings.dstack_socket_path == "/var/run/dstack.sock"
    assert settings.dstack_base_url is None
    assert env.tls_cert_path == ""
    assert env.attestation_gpu_arch == "HOPPER"
    assert env.attestation_require_nvidia_evidence is True
    assert env.attestation_nvidia_payload == ""
    assert env.attestation_nvidia_payload_file == ""
    assert env.attestation_nvidia_payload_url == ""
    assert env.attestation_nvidia_payload_authorization == ""
    assert env.attestation_nvidia_command == ""
    assert env.attestation_nvidia_command_args == ("--nonce", "{nonce}", "--arch", "HOPPER")
    assert env.attestation_nvidia_command_timeout_seconds == 30


@pytest.mark.parametrize(
    ("environ", "endpoint", "url"),
    [
        ({"DSTACK_SIMULATOR_ENDPOINT": "/tmp/sim.sock"}, "/tmp/sim.sock", None),
        (
            {"DSTACK_SIMULATOR_ENDPOINT": "http://127.0.0.1:8090"},
            "http://127.0.0.1:8090",
            "http://127.0.0.1:8090",
        ),
        (
            {
                "DSTACK_SIMULATOR_ENDPOINT": "/tmp/sim.sock",
                "ATTESTATION_DSTACK_ENDPOINT": "/a.sock",
            },
            "/a.sock",
            None,
        ),
        (
            {"DSTACK_SIMULATOR_ENDPOINT": "", "ATTESTATION_DSTACK_ENDPOINT": "https://d:1/x"},
            "https://d:1/x",
            "https://d:1/x",
        ),
        ({"ATTESTATION_DSTACK_ENDPOINT": "HTTPS://d"}, "HTTPS://d", "HTTPS://d"),
        ({"ATTESTATION_DSTACK_ENDPOINT": "", "DSTACK_SIMULATOR_ENDPOINT": ""}, None, None),
        ({"ATTESTATION_DSTACK_ENDPOINT": "httpx://d"}, "httpx://d", None),
    ],
)
def test_dstack_endpoint_fallbacks(
    environ: dict[str, str], endpoint: str | None, url: str | None
) -> None:
    settings = load_config(environ)
    effective = endpoint or "/var/run/dstack.sock"
    assert settings.env.attestation_dstack_endpoint == effective
    assert settings.dstack_base_url == url
    assert settings.dstack_socket_path == (None if url else effective)


def test_gpu_arch_is_trimmed_and_upper_cased_and_names_itself_in_the_command_args() -> None:
    env = load_config({"ATTESTATION_GPU_ARCH": " blackwell "}).env
    assert env.attestation_gpu_arch == "BLACKWELL"
    assert env.attestation_nvidia_command_args == ("--nonce", "{nonce}", "--arch", "BLACKWELL")
    assert load_config({"ATTESTATION_GPU_ARCH": "   "}).env.attestation_gpu_arch == "HOPPER"


def test_command_args_are_a_csv_and_may_be_empty() -> None:
    env = load_config(
        {
            "ATTESTATION_NVIDIA_COMMAND_ARGS": " attest , --nonce={nonce},, -q ",
            "ATTESTATION_GPU_ARCH": "x",
        }
    ).env
    assert env.attestation_nvidia_command_args == ("attest", "--nonce={nonce}", "-q")
    settings = load_config({"ATTESTATION_NVIDIA_COMMAND_ARGS": ","})
    assert settings.env.attestation_nvidia_command_args == ()
    shown = settings.redacted()
    assert shown["ATTESTATION_NVIDIA_COMMAND_ARGS"] == ","
    assert load_config(shown) == settings


def test_command_timeout_is_checked_only_while_attestation_is_on() -> None:
    variable = "ATTESTATION_NVIDIA_COMMAND_TIMEOUT_SECONDS"
    for value in ("0", "-5"):
        assert "> 0" in assert_reported({variable: value}, variable)
        env = load_config({variable: value, "ATTESTATION_ENABLED": "false"}).env
        assert env.attestation_nvidia_command_timeout_seconds == int(value)
    assert "plain integer" in assert_reported({variable: "1.5"}, variable)
    assert "plain integer" in assert_reported(
        {variable: "1.5", "ATTESTATION_ENABLED": "false"}, variable
    )


def test_attestation_strings_are_kept_as_given() -> None:
    environ = {
        "TLS_CERT_PATH": "/evidences/cert-x.pem",
        "ATTESTATION_NVIDIA_PAYLOAD_FILE": "/run/payload.json",
        "ATTESTATION_NVIDIA_PAYLOAD_URL": "http://collector:9000/evidence?gpu=0",
        "ATTESTATION_NVIDIA_COMMAND": "/usr/bin/nvattest",
        "ATTESTATION_REQUIRE_NVIDIA_EVIDENCE": "false",
    }
    env = load_config(environ).env
    assert env.tls_cert_path == "/evidences/cert-x.pem"
    assert env.attestation_nvidia_payload_file == "/run/payload.json"
    assert env.attestation_nvidia_payload_url == "http://collector:9000/evidence?gpu=0"
    assert env.attestation_nvidia_command == "/usr/bin/nvattest"
    assert env.attestation_require_nvidia_evidence is False


# -- spec 2.4: output-token classification -----------------------------------------------------


def test_section_2_4_defaults() -> None:
    settings = load_config({})
    env = settings.env
    assert env.classify_output_tokens is False
    assert env.json_classify_body_bytes == 2_097_152
    assert env.json_classify_limit == 64
    assert env.output_token_field_names == (
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
    )
    body = (env.medium_body_bytes, env.long_body_bytes, env.very_long_body_bytes)
    assert body == (60_000, 100_000, 524_288)
    output = (env.medium_output_tokens, env.long_output_tokens, env.very_long_output_tokens)
    assert output == (1024, 4096, 8192)
    assert env.adaptive_output_classification is False
    assert (env.adaptive_output_window, env.adaptive_output_min_samples) == (512, 32)
    quantiles = (
        env.adaptive_output_medium_quantile,
        env.adaptive_output_long_quantile,
        env.adaptive_output_very_quantile,
    )
    assert quantiles == (0.50, 0.90, 0.99)
    relax = (
        env.adaptive_output_green_relax,
        env.adaptive_output_yellow_relax,
        env.adaptive_output_red_relax,
    )
    assert relax == (1.0, 0.5, 0.0)
    assert settings.lane_thresholds == LaneThresholds(DEFAULT_BODY_THRESHOLDS, None)
    assert settings.adaptive_output is None


@pytest.mark.parametrize(
    ("global_limit", "slots"),
    [("512", 64), ("64", 64), ("63", 63), ("10", 10), ("1", 1), ("0", 64), ("1000", 64)],
)
def test_slot_counts_follow_a_small_global_limit(global_limit: str, slots: int) -> None:
    env = load_config({"GLOBAL_LIMIT": global_limit}).env
    assert env.json_classify_limit == slots
    assert env.backend_priority_rewrite_limit == slots
    env = load_config({"GLOBAL_LIMIT": global_limit, "JSON_CLASSIFY_LIMIT": "100"}).env
    assert env.json_classify_limit == 100


def test_output_lanes_when_classifying() -> None:
    settings = load_config({"CLASSIFY_OUTPUT_TOKENS": "true"})
    assert settings.lane_thresholds == LaneThresholds(
        DEFAULT_BODY_THRESHOLDS, DEFAULT_OUTPUT_THRESHOLDS
    )
    settings = load_config(
        {
            "CLASSIFY_OUTPUT_TOKENS": "on",
            "MEDIUM_BODY_BYTES": "1",
            "LONG_BODY_BYTES": "2",
            "VERY_LONG_BODY_BYTES": "3",
            "MEDIUM_OUTPUT_TOKENS": "10",
            "LONG_OUTPUT_TOKENS": "20",
            "VERY_LONG_OUTPUT_TOKENS": "30",
        }
    )
    assert settings.lane_thresholds == LaneThresholds(
        Thresholds((1, 2, 3)), Thresholds((10, 20, 30))
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"MEDIUM_BODY_BYTES": "0"},
        {"LONG_BODY_BYTES": "60000"},
        {"LONG_BODY_BYTES": "50000"},
        {"VERY_LONG_BODY_BYTES": "100000"},
        {"VERY_LONG_BODY_BYTES": "-1"},
        {"MEDIUM_BODY_BYTES": "-5", "LONG_BODY_BYTES": "-3", "VERY_LONG_BODY_BYTES": "-1"},
    ],
)
def test_body_lane_thresholds_are_always_checked(environ: dict[str, str]) -> None:
    messages = errors_of(environ)
    assert all("BODY_BYTES" in message.split(":")[0] for message in messages)
    errors_of({**environ, "CLASSIFY_OUTPUT_TOKENS": "true"})


def test_body_threshold_order_names_both_variables() -> None:
    message = assert_reported({"LONG_BODY_BYTES": "50000"}, "MEDIUM_BODY_BYTES")
    assert message == "MEDIUM_BODY_BYTES: must be below LONG_BODY_BYTES (50000), got 60000"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("JSON_CLASSIFY_BODY_BYTES", "0"),
        ("JSON_CLASSIFY_LIMIT", "0"),
        ("JSON_CLASSIFY_LIMIT", "-1"),
        ("MEDIUM_OUTPUT_TOKENS", "0"),
        ("MEDIUM_OUTPUT_TOKENS", "4096"),
        ("LONG_OUTPUT_TOKENS", "8192"),
        ("VERY_LONG_OUTPUT_TOKENS", "-8192"),
    ],
)
def test_classifier_ranges_only_when_classifying(variable: str, value: str) -> None:
    assert any(variable in m for m in errors_of({variable: value, "CLASSIFY_OUTPUT_TOKENS": "1"}))
    settings = load_config({variable: value})
    assert settings.lane_thresholds.output is None
    assert settings.adaptive_output is None


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        ("max-tokens", "must be a letter"),
        ("1st", "must be a letter"),
        ("max tokens", "must be a letter"),
        ("ma\u00dfe", "must be a letter"),
        ("max_tokens,max_tokens", "twice"),
    ],
)
def test_output_token_field_names_are_always_checked(names: str, fragment: str) -> None:
    assert fragment in assert_reported(
        {"OUTPUT_TOKEN_FIELD_NAMES": names}, "OUTPUT_TOKEN_FIELD_NAMES"
    )
    environ = {"OUTPUT_TOKEN_FIELD_NAMES": names, "CLASSIFY_OUTPUT_TOKENS": "true"}
    assert_reported(environ, "OUTPUT_TOKEN_FIELD_NAMES")


def test_output_token_field_names_are_a_trimmed_csv() -> None:
    env = load_config({"OUTPUT_TOKEN_FIELD_NAMES": " n_predict ,, _x9 ,"}).env
    assert env.output_token_field_names == ("n_predict", "_x9")
    settings = load_config({"OUTPUT_TOKEN_FIELD_NAMES": ",", "CLASSIFY_OUTPUT_TOKENS": "1"})
    assert settings.env.output_token_field_names == ()
    assert load_config(settings.redacted()) == settings


def test_adaptive_output_settings_need_both_switches() -> None:
    assert load_config({"ADAPTIVE_OUTPUT_CLASSIFICATION": "true"}).adaptive_output is None
    settings = load_config(
        {"ADAPTIVE_OUTPUT_CLASSIFICATION": "true", "CLASSIFY_OUTPUT_TOKENS": "true"}
    )
    assert settings.adaptive_output == AdaptiveOutputConfig()
    settings = load_config(
        {
            "ADAPTIVE_OUTPUT_CLASSIFICATION": "true",
            "CLASSIFY_OUTPUT_TOKENS": "true",
            "MEDIUM_OUTPUT_TOKENS": "100",
            "ADAPTIVE_OUTPUT_WINDOW": "10",
            "ADAPTIVE_OUTPUT_MIN_SAMPLES": "10",
            "ADAPTIVE_OUTPUT_MEDIUM_QUANTILE": "0",
            "ADAPTIVE_OUTPUT_LONG_QUANTILE": "0",
            "ADAPTIVE_OUTPUT_VERY_QUANTILE": "1",
            "ADAPTIVE_OUTPUT_GREEN_RELAX": "0.3",
            "ADAPTIVE_OUTPUT_YELLOW_RELAX": "0.3",
            "ADAPTIVE_OUTPUT_RED_RELAX": "0.1",
        }
    )
    assert settings.adaptive_output == AdaptiveOutputConfig(
        static=Thresholds((100, 4096, 8192)),
        window=10,
        min_samples=10,
        medium_quantile=0.0,
        long_quantile=0.0,
        very_quantile=1.0,
        green_relax=0.3,
        yellow_relax=0.3,
        red_relax=0.1,
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ADAPTIVE_OUTPUT_WINDOW", "0"),
        ("ADAPTIVE_OUTPUT_MIN_SAMPLES", "-1"),
        ("ADAPTIVE_OUTPUT_MIN_SAMPLES", "513"),
        ("ADAPTIVE_OUTPUT_MEDIUM_QUANTILE", "-0.1"),
        ("ADAPTIVE_OUTPUT_MEDIUM_QUANTILE", "0.95"),
        ("ADAPTIVE_OUTPUT_LONG_QUANTILE", "0.995"),
        ("ADAPTIVE_OUTPUT_VERY_QUANTILE", "1.01"),
        ("ADAPTIVE_OUTPUT_GREEN_RELAX", "1.5"),
        ("ADAPTIVE_OUTPUT_GREEN_RELAX", "0.4"),
        ("ADAPTIVE_OUTPUT_YELLOW_RELAX", "-0.5"),
        ("ADAPTIVE_OUTPUT_RED_RELAX", "0.6"),
    ],
)
def test_adaptive_ranges_only_when_adaptive_is_on(variable: str, value: str) -> None:
    on = {variable: value, "ADAPTIVE_OUTPUT_CLASSIFICATION": "yes"}
    assert any(variable in message for message in errors_of(on))
    assert any(variable in message for message in errors_of({**on, "CLASSIFY_OUTPUT_TOKENS": "1"}))
    load_config({variable: value, "CLASSIFY_OUTPUT_TOKENS": "1"})
    load_config({variable: value})


def test_min_samples_may_be_zero_or_equal_the_window() -> None:
    environ = {
        "ADAPTIVE_OUTPUT_CLASSIFICATION": "1",
        "CLASSIFY_OUTPUT_TOKENS": "1",
        "ADAPTIVE_OUTPUT_WINDOW": "32",
        "ADAPTIVE_OUTPUT_MIN_SAMPLES": "32",
    }
    adaptive = load_config(environ).adaptive_output
    assert adaptive is not None
    assert (adaptive.window, adaptive.min_samples) == (32, 32)
    adaptive = load_config({**environ, "ADAPTIVE_OUTPUT_MIN_SAMPLES": "0"}).adaptive_output
    assert adaptive is not None
    assert adaptive.min_samples == 0
    message = assert_reported(
        {**environ, "ADAPTIVE_OUTPUT_WINDOW": "31"}, "ADAPTIVE_OUTPUT_MIN_SAMPLES"
    )
    assert message == (
        "ADAPTIVE_OUTPUT_MIN_SAMPLES: must not be above ADAPTIVE_OUTPUT_WINDOW (31), got 32"
    )


# -- spec 2.5: backend priority injection ------------------------------------------------------


def test_section_2_5_defaults() -> None:
    settings = load_config({})
    policy = settings.injection_policy()
    assert policy.enabled is True
    assert policy.fail_open is True
    assert (policy.mode, policy.strategy, policy.field) == ("all", "field_scan", "priority")
    assert (policy.premium_value, policy.basic_value) == (-100, 0)
    sizes = (policy.body_bytes, policy.buffer_bytes, policy.stream_buffer_bytes)
    assert sizes == (33_554_432, 0, 2_097_152)
    assert policy.rewrite_limit == 64
    env = settings.env
    assert env.backend_priority_injection_enabled is True
    assert env.backend_priority_mode == "all"
    assert env.backend_priority_rewrite_strategy == "field_scan"


def test_priority_values_are_read() -> None:
    settings = load_config(
        {
            "BACKEND_PRIORITY_MODE": " Premium_Only ",
            "BACKEND_PRIORITY_REWRITE_STRATEGY": "APPEND_LAST",
            "BACKEND_PRIORITY_FIELD": "_prio9",
            "BACKEND_PRIORITY_PREMIUM_VALUE": "-9223372036854775808",
            "BACKEND_PRIORITY_BASIC_VALUE": "+7",
            "BACKEND_PRIORITY_BODY_BYTES": "1",
            "BACKEND_PRIORITY_BUFFER_BYTES": "4096",
            "BACKEND_PRIORITY_STREAM_BUFFER_BYTES": "1",
            "BACKEND_PRIORITY_REWRITE_LIMIT": "1",
            "BACKEND_PRIORITY_FAIL_OPEN": "no",
        }
    )
    policy = settings.injection_policy()
    assert policy.mode == "premium_only"
    assert policy.strategy == "append_last"
    assert policy.field == "_prio9"
    assert policy.premium_value == -(2**63)
    assert policy.basic_value == 7
    assert policy.body_bytes == 1
    assert policy.buffer_bytes == 4096
    assert policy.stream_buffer_bytes == 1
    assert policy.rewrite_limit == 1
    assert policy.fail_open is False
    assert load_config({"BACKEND_PRIORITY_MODE": "  "}).injection_policy().mode == "all"


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("BACKEND_PRIORITY_MODE", "premium", "all or premium_only"),
        ("BACKEND_PRIORITY_MODE", "premium-only", "all or premium_only"),
        ("BACKEND_PRIORITY_REWRITE_STRATEGY", "scan", "field_scan or append_last"),
        ("BACKEND_PRIORITY_FIELD", "x-priority", "must be a letter"),
        ("BACKEND_PRIORITY_FIELD", "9", "must be a letter"),
        ("BACKEND_PRIORITY_FIELD", " ", "must be a letter"),
        ("BACKEND_PRIORITY_BODY_BYTES", "0", "> 0"),
        ("BACKEND_PRIORITY_BUFFER_BYTES", "-1", ">= 0"),
        ("BACKEND_PRIORITY_STREAM_BUFFER_BYTES", "0", "> 0"),
        ("BACKEND_PRIORITY_REWRITE_LIMIT", "0", "> 0"),
    ],
)
def test_priority_rules_only_while_injecting(variable: str, value: str, fragment: str) -> None:
    assert fragment in assert_reported({variable: value}, variable)
    off = {variable: value, "BACKEND_PRIORITY_INJECTION_ENABLED": "false"}
    settings = load_config(off)
    assert not settings.env.backend_priority_injection_enabled


@pytest.mark.parametrize(
    "variable",
    [
        "BACKEND_PRIORITY_PREMIUM_VALUE",
        "BACKEND_PRIORITY_BASIC_VALUE",
        "BACKEND_PRIORITY_BODY_BYTES",
    ],
)
def test_priority_integers_must_be_plain_in_every_mode(variable: str) -> None:
    assert_reported({variable: "-1.0"}, variable)
    assert_reported({variable: " 1", "BACKEND_PRIORITY_INJECTION_ENABLED": "0"}, variable)


# -- spec 2.7: SSE -----------------------------------------------------------------------------


def test_sse_switches() -> None:
    env = load_config({}).env
    assert (env.sse_keepalive_enabled, env.sse_early_bridge_enabled) == (False, False)
    env = load_config({"SSE_KEEPALIVE_ENABLED": "on", "SSE_EARLY_BRIDGE_ENABLED": "Y"}).env
    assert (env.sse_keepalive_enabled, env.sse_early_bridge_enabled) == (True, True)
    assert_reported({"SSE_KEEPALIVE_ENABLED": "sometimes"}, "SSE_KEEPALIVE_ENABLED")


# -- the predictive learner (DYNAMIC_POLICY) ---------------------------------------------------


def predictive(**extra: str) -> dict[str, str]:
    return dynamic(DYNAMIC_POLICY="predictive", **extra)


def test_pig_is_the_default_learner_and_has_no_predictive_config() -> None:
    settings = load_config(dynamic())
    env = settings.env
    assert env.dynamic_policy == "pig"
    assert env.pig_retry_after_mode == "fixed"
    assert not settings.predictive_enabled
    assert not settings.retry_after_predicted
    assert settings.guard_config().predictive is None
    assert settings.guard_config() == GuardConfig()


def test_predictive_builds_its_config_from_its_settings_and_pigs_targets() -> None:
    settings = load_config(
        predictive(
            DYNAMIC_PREDICTIVE_BATCH_TOKENS="8192",
            DYNAMIC_PREDICTIVE_FORGETTING="0.75",
            DYNAMIC_PREDICTIVE_KV_LIMIT="1",
            DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN="3.5",
            DYNAMIC_PREDICTIVE_HORIZON_SECONDS="20",
            DYNAMIC_SINGLE_USER_TPS_YELLOW="30",
            DYNAMIC_TTFT_TARGET_SECONDS="0.5",
            GLOBAL_LIMIT="96",
        )
    )
    config = settings.guard_config()
    assert settings.predictive_enabled
    assert config.predictive == PredictiveConfig(
        user_tps_target=30.0,
        ttft_target_s=0.5,
        batch_tokens=8192,
        forgetting=0.75,
        kv_limit=1.0,
        bytes_per_token=3.5,
        horizon_s=20.0,
        global_limit=96,
    )
    # PIG's own pipeline keeps its settings: it still runs for the intake rules.
    assert config.policy.user_tps_yellow == 30.0
    assert config.policy.global_limit == 96


def test_predictive_defaults() -> None:
    config = load_config(predictive()).guard_config().predictive
    assert config == PredictiveConfig(
        batch_tokens=2048, forgetting=0.9, kv_limit=0.9, bytes_per_token=4.0, horizon_s=3.0
    )


@pytest.mark.parametrize(
    ("text", "value"), [("pig", "pig"), (" Predictive ", "predictive"), ("   ", "pig"), ("", "pig")]
)
def test_policy_is_trimmed_and_case_blind_and_blank_means_pig(text: str, value: str) -> None:
    assert load_config(dynamic(DYNAMIC_POLICY=text)).env.dynamic_policy == value


@pytest.mark.parametrize("text", ["pid", "predict", "both", "pig,predictive", "0"])
def test_an_unknown_policy_is_a_clear_error(text: str) -> None:
    message = assert_reported(dynamic(DYNAMIC_POLICY=text), "DYNAMIC_POLICY")
    assert "must be pig or predictive" in message
    assert repr(text) in message


def test_predictive_needs_dynamic_mode() -> None:
    message = assert_reported({"DYNAMIC_POLICY": "predictive"}, "DYNAMIC_POLICY")
    assert "dynamic mode" in message
    message = assert_reported(predictive(DYNAMIC_PIG_ENABLED="off"), "DYNAMIC_POLICY")
    assert "DYNAMIC_PIG_ENABLED" in message


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("DYNAMIC_PREDICTIVE_BATCH_TOKENS", "15", "must be >= 16"),
        ("DYNAMIC_PREDICTIVE_FORGETTING", "1", "must be in [0.5, 1)"),
        ("DYNAMIC_PREDICTIVE_FORGETTING", "0.49", "must be in [0.5, 1)"),
        ("DYNAMIC_PREDICTIVE_KV_LIMIT", "0", "must be in (0, 1]"),
        ("DYNAMIC_PREDICTIVE_KV_LIMIT", "1.01", "must be in (0, 1]"),
        ("DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN", "0", "must be > 0"),
        ("DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN", "-4", "must be > 0"),
        ("DYNAMIC_PREDICTIVE_HORIZON_SECONDS", "0.4", "must be in [0.5, 60]"),
        ("DYNAMIC_PREDICTIVE_HORIZON_SECONDS", "61", "must be in [0.5, 60]"),
    ],
)
def test_predictive_ranges_only_when_predictive_is_chosen(
    variable: str, value: str, fragment: str
) -> None:
    load_config(dynamic(**{variable: value}))
    assert fragment in assert_reported(predictive(**{variable: value}), variable)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DYNAMIC_PREDICTIVE_FORGETTING", "0.5"),
        ("DYNAMIC_PREDICTIVE_FORGETTING", "0.999"),
        ("DYNAMIC_PREDICTIVE_KV_LIMIT", "1"),
        ("DYNAMIC_PREDICTIVE_HORIZON_SECONDS", "0.5"),
        ("DYNAMIC_PREDICTIVE_HORIZON_SECONDS", "60"),
        ("DYNAMIC_PREDICTIVE_BATCH_TOKENS", "16"),
    ],
)
def test_predictive_range_ends_that_are_allowed(variable: str, value: str) -> None:
    load_config(predictive(**{variable: value})).guard_config()


def test_predictive_integers_and_floats_are_read_in_every_mode() -> None:
    assert_reported(
        dynamic(DYNAMIC_PREDICTIVE_BATCH_TOKENS="2k"), "DYNAMIC_PREDICTIVE_BATCH_TOKENS"
    )
    assert_reported(dynamic(DYNAMIC_PREDICTIVE_KV_LIMIT="nan"), "DYNAMIC_PREDICTIVE_KV_LIMIT")


def test_the_speed_target_is_checked_for_predictive_even_with_pigs_stage_off() -> None:
    off = {"DYNAMIC_SINGLE_USER_TPS_ENABLED": "off", "DYNAMIC_SINGLE_USER_TPS_YELLOW": "0"}
    load_config(dynamic(**off))
    message = assert_reported(predictive(**off), "DYNAMIC_SINGLE_USER_TPS_YELLOW")
    assert "must be > 0" in message
    # With PIG's stage on, its own check reports the value once.
    assert_reported(
        predictive(DYNAMIC_SINGLE_USER_TPS_YELLOW="0"), "DYNAMIC_SINGLE_USER_TPS_YELLOW"
    )


@pytest.mark.parametrize(
    ("environ", "mode"),
    [
        (dynamic(), "fixed"),
        (predictive(), "predicted"),
        (predictive(PIG_RETRY_AFTER_MODE="fixed"), "fixed"),
        (predictive(PIG_RETRY_AFTER_MODE=" "), "predicted"),
        (dynamic(PIG_RETRY_AFTER_MODE="Predicted"), "predicted"),
        ({"PIG_RETRY_AFTER_MODE": "PREDICTED"}, "predicted"),
    ],
)
def test_retry_after_mode_follows_the_learner(environ: dict[str, str], mode: str) -> None:
    settings = load_config(environ)
    assert settings.env.pig_retry_after_mode == mode
    assert settings.retry_after_predicted == (mode == "predicted")


def test_retry_after_mode_is_fixed_or_predicted_and_the_fixed_value_stays() -> None:
    message = assert_reported(dynamic(PIG_RETRY_AFTER_MODE="computed"), "PIG_RETRY_AFTER_MODE")
    assert "must be fixed or predicted, got 'computed'" in message
    env = load_config(predictive(PIG_RETRY_AFTER_SECONDS="0")).env
    assert (env.pig_retry_after_seconds, env.pig_retry_after_mode) == (0, "predicted")


def test_every_bad_predictive_variable_is_reported_at_once() -> None:
    messages = errors_of(
        predictive(
            DYNAMIC_PREDICTIVE_BATCH_TOKENS="0",
            DYNAMIC_PREDICTIVE_FORGETTING="2",
            DYNAMIC_PREDICTIVE_KV_LIMIT="-1",
            DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN="0",
            DYNAMIC_PREDICTIVE_HORIZON_SECONDS="0",
            PIG_RETRY_AFTER_MODE="sometimes",
        )
    )
    assert {message.split(":")[0] for message in messages} == {
        "DYNAMIC_PREDICTIVE_BATCH_TOKENS",
        "DYNAMIC_PREDICTIVE_FORGETTING",
        "DYNAMIC_PREDICTIVE_KV_LIMIT",
        "DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN",
        "DYNAMIC_PREDICTIVE_HORIZON_SECONDS",
        "PIG_RETRY_AFTER_MODE",
    }


def test_predictive_settings_show_in_describe_and_load_back() -> None:
    settings = load_config(predictive(DYNAMIC_PREDICTIVE_HORIZON_SECONDS="12.5"))
    lines = settings.describe().split("\n")
    assert "DYNAMIC_POLICY=predictive" in lines
    assert "DYNAMIC_PREDICTIVE_HORIZON_SECONDS=12.5" in lines
    assert "PIG_RETRY_AFTER_MODE=predicted" in lines
    assert load_config(settings.redacted()) == settings


# -- every section at once ---------------------------------------------------------------------


def test_every_new_section_is_covered_by_a_variable() -> None:
    for name in (
        "API_AUTH_ENABLED",
        "API_AUTH_PATHS",
        "UPSTREAM_ERROR_CLASSIFICATION_ENABLED",
        "OPENAI_COMPAT_STRIP_EMPTY_TOOL_CALLS",
        "OPENAI_COMPAT_BODY_BYTES",
        "OPENAI_COMPAT_FAIL_OPEN",
        "ATTESTATION_ENABLED",
        "ATTESTATION_DSTACK_ENDPOINT",
        "DSTACK_SIMULATOR_ENDPOINT",
        "TLS_CERT_PATH",
        "ATTESTATION_GPU_ARCH",
        "ATTESTATION_REQUIRE_NVIDIA_EVIDENCE",
        "ATTESTATION_NVIDIA_PAYLOAD",
        "ATTESTATION_NVIDIA_PAYLOAD_FILE",
        "ATTESTATION_NVIDIA_PAYLOAD_URL",
        "ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION",
        "ATTESTATION_NVIDIA_COMMAND",
        "ATTESTATION_NVIDIA_COMMAND_ARGS",
        "ATTESTATION_NVIDIA_COMMAND_TIMEOUT_SECONDS",
        "CLASSIFY_OUTPUT_TOKENS",
        "JSON_CLASSIFY_BODY_BYTES",
        "JSON_CLASSIFY_LIMIT",
        "OUTPUT_TOKEN_FIELD_NAMES",
        "MEDIUM_BODY_BYTES",
        "LONG_BODY_BYTES",
        "VERY_LONG_BODY_BYTES",
        "MEDIUM_OUTPUT_TOKENS",
        "LONG_OUTPUT_TOKENS",
        "VERY_LONG_OUTPUT_TOKENS",
        "ADAPTIVE_OUTPUT_CLASSIFICATION",
        "ADAPTIVE_OUTPUT_WINDOW",
        "ADAPTIVE_OUTPUT_MIN_SAMPLES",
        "ADAPTIVE_OUTPUT_MEDIUM_QUANTILE",
        "ADAPTIVE_OUTPUT_LONG_QUANTILE",
        "ADAPTIVE_OUTPUT_VERY_QUANTILE",
        "ADAPTIVE_OUTPUT_GREEN_RELAX",
        "ADAPTIVE_OUTPUT_YELLOW_RELAX",
        "ADAPTIVE_OUTPUT_RED_RELAX",
        "BACKEND_PRIORITY_INJECTION_ENABLED",
        "BACKEND_PRIORITY_MODE",
        "BACKEND_PRIORITY_REWRITE_STRATEGY",
        "BACKEND_PRIORITY_FIELD",
        "BACKEND_PRIORITY_PREMIUM_VALUE",
        "BACKEND_PRIORITY_BASIC_VALUE",
        "BACKEND_PRIORITY_BODY_BYTES",
        "BACKEND_PRIORITY_BUFFER_BYTES",
        "BACKEND_PRIORITY_STREAM_BUFFER_BYTES",
        "BACKEND_PRIORITY_REWRITE_LIMIT",
        "BACKEND_PRIORITY_FAIL_OPEN",
        "SSE_KEEPALIVE_ENABLED",
        "SSE_EARLY_BRIDGE_ENABLED",
        "DYNAMIC_POLICY",
        "DYNAMIC_PREDICTIVE_BATCH_TOKENS",
        "DYNAMIC_PREDICTIVE_FORGETTING",
        "DYNAMIC_PREDICTIVE_KV_LIMIT",
        "DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN",
        "DYNAMIC_PREDICTIVE_HORIZON_SECONDS",
        "PIG_RETRY_AFTER_MODE",
    ):
        assert name in VARIABLES, name


def test_every_bad_new_variable_is_reported_at_once() -> None:
    messages = errors_of(
        {
            "API_AUTH_ENABLED": "true",
            "API_AUTH_PATHS": "nope",
            "OPENAI_COMPAT_BODY_BYTES": "0",
            "ATTESTATION_NVIDIA_COMMAND_TIMEOUT_SECONDS": "0",
            "CLASSIFY_OUTPUT_TOKENS": "true",
            "JSON_CLASSIFY_LIMIT": "0",
            "OUTPUT_TOKEN_FIELD_NAMES": "a-b",
            "VERY_LONG_BODY_BYTES": "1",
            "LONG_OUTPUT_TOKENS": "1",
            "ADAPTIVE_OUTPUT_CLASSIFICATION": "on",
            "ADAPTIVE_OUTPUT_WINDOW": "-1",
            "BACKEND_PRIORITY_MODE": "some",
            "BACKEND_PRIORITY_FIELD": "a.b",
            "BACKEND_PRIORITY_REWRITE_LIMIT": "-1",
            "SSE_EARLY_BRIDGE_ENABLED": "2",
            "BACKEND_PRIORITY_BASIC_VALUE": "zero",
        }
    )
    leads = {message.split(":")[0] for message in messages}
    assert leads == {
        "API_AUTH_ENABLED",
        "API_AUTH_PATHS",
        "OPENAI_COMPAT_BODY_BYTES",
        "ATTESTATION_NVIDIA_COMMAND_TIMEOUT_SECONDS",
        "JSON_CLASSIFY_LIMIT",
        "OUTPUT_TOKEN_FIELD_NAMES",
        "LONG_BODY_BYTES",
        "MEDIUM_OUTPUT_TOKENS",
        "ADAPTIVE_OUTPUT_WINDOW",
        "ADAPTIVE_OUTPUT_MIN_SAMPLES",
        "BACKEND_PRIORITY_MODE",
        "BACKEND_PRIORITY_FIELD",
        "BACKEND_PRIORITY_REWRITE_LIMIT",
        "SSE_EARLY_BRIDGE_ENABLED",
        "BACKEND_PRIORITY_BASIC_VALUE",
    }


# -- overrides ---------------------------------------------------------------------------------


def test_set_overrides_apply_in_order_and_leave_the_input_alone() -> None:
    environ = {"GLOBAL_LIMIT": "5", "HOME": "/root"}
    merged = apply_overrides(
        environ, ["GLOBAL_LIMIT=7", "DYNAMIC_METRICS_URL=http://m/x?", "TOKEN=", "GLOBAL_LIMIT=9"]
    )
    assert merged == {
        "GLOBAL_LIMIT": "9",
        "HOME": "/root",
        "DYNAMIC_METRICS_URL": "http://m/x?",
        "TOKEN": "",
    }
    assert environ == {"GLOBAL_LIMIT": "5", "HOME": "/root"}
    assert apply_overrides(environ, ["PIG_PATHS=/a=b"])["PIG_PATHS"] == "/a=b"
    assert load_config(apply_overrides({}, ["GLOBAL_LIMIT=3"])).env.global_limit == 3


def test_malformed_overrides_are_all_reported() -> None:
    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, ["GLOBAL_LIMIT", "=5", "OK=1", " X=1"])
    messages = caught.value.messages
    assert len(messages) == 3
    assert all(message.startswith("--set ") for message in messages)
    assert "'GLOBAL_LIMIT'" in messages[0]
    assert "'=5'" in messages[1]


# -- redaction ---------------------------------------------------------------------------------


def test_redacted_never_shows_the_token() -> None:
    secret = "sk-very-secret-token"
    settings = load_config(dynamic(TOKEN=secret))
    shown = settings.redacted()
    assert shown["TOKEN"] == REDACTED
    assert all(secret not in value for value in shown.values())
    assert secret not in repr(settings)
    assert secret not in str(settings.env)
    assert settings.env.token == secret
    assert load_config({}).redacted()["TOKEN"] == ""


def test_redacted_masks_passwords_in_urls() -> None:
    settings = load_config(
        {"BACKENDS": "a=http://user:pw1@a:1|http://m:pw2@a:1/metrics,b=http://b:2"}
    )
    joined = " ".join(settings.redacted().values())
    assert "pw1" not in joined
    assert "pw2" not in joined
    assert f"http://user:{REDACTED}@a:1" in joined


def test_redacted_lists_every_variable_and_loads_back_to_the_same_settings() -> None:
    settings = load_config(
        dynamic(
            GLOBAL_LIMIT="64",
            DYNAMIC_KV_YELLOW="1e-1",
            DYNAMIC_TTFT_TARGET_SECONDS="-1",
            PIG_PATHS="/a, /b",
            DYNAMIC_FAILSAFE_STATE="Red",
        )
    )
    shown = settings.redacted()
    assert tuple(shown) == VARIABLES
    assert shown["DYNAMIC_KV_YELLOW"] == "0.1"
    assert shown["PIG_PATH_SUFFIX_MATCH"] == "false"
    assert shown["DYNAMIC_FAILSAFE_STATE"] == "red"
    assert load_config(shown) == settings


SECRETS = {
    "TOKEN": "sk-token-123",
    "ATTESTATION_NVIDIA_PAYLOAD_AUTHORIZATION": "Bearer nv-secret-456",
    "ATTESTATION_NVIDIA_PAYLOAD": (
        '{"nonce":"${nonce}","evidence_list":[{"evidence":"EVIDENCE789"}]}'
    ),
}


def test_redacted_never_shows_any_of_the_three_secrets() -> None:
    settings = load_config(dynamic(**SECRETS))
    shown = settings.redacted()
    described = settings.describe()
    for name, secret in SECRETS.items():
        assert shown[name] == REDACTED
        assert getattr(settings.env, name.lower()) == secret
        for text in (*shown.values(), described, repr(settings), str(settings.env)):
            assert secret not in text
    assert "EVIDENCE789" not in described
    unset = load_config({}).redacted()
    assert all(unset[name] == "" for name in SECRETS)


def test_redacted_secrets_load_back_as_the_placeholder() -> None:
    shown = load_config(dynamic(**SECRETS)).redacted()
    env = load_config(shown).env
    assert env.token == REDACTED
    assert env.attestation_nvidia_payload == REDACTED
    assert env.attestation_nvidia_payload_authorization == REDACTED


def test_a_password_in_the_payload_url_is_masked() -> None:
    settings = load_config({"ATTESTATION_NVIDIA_PAYLOAD_URL": "https://u:hunter2@collector/x"})
    assert "hunter2" not in settings.describe()
    assert settings.redacted()["ATTESTATION_NVIDIA_PAYLOAD_URL"] == (
        f"https://u:{REDACTED}@collector/x"
    )


def test_describe_lists_every_variable_sorted_one_per_line() -> None:
    settings = load_config(dynamic(GLOBAL_LIMIT="32", TOKEN="t", ATTESTATION_GPU_ARCH="blackwell"))
    text = settings.describe()
    assert not text.endswith("\n")
    lines = text.split("\n")
    names = [line.partition("=")[0] for line in lines]
    assert names == sorted(VARIABLES)
    shown = settings.redacted()
    assert lines == [f"{name}={shown[name]}" for name in sorted(VARIABLES)]
    assert "GLOBAL_LIMIT=32" in lines
    assert "JSON_CLASSIFY_LIMIT=32" in lines
    assert "BACKEND_PRIORITY_REWRITE_LIMIT=32" in lines
    assert "API_AUTH_ENABLED=true" in lines
    assert f"TOKEN={REDACTED}" in lines
    assert "ATTESTATION_NVIDIA_COMMAND_ARGS=--nonce,{nonce},--arch,BLACKWELL" in lines
    assert "ATTESTATION_DSTACK_ENDPOINT=/var/run/dstack.sock" in lines
    assert f"DYNAMIC_METRICS_URL={METRICS}" in lines
    assert "DYNAMIC_FAILSAFE_STATE=yellow" in lines
    assert "PIG_PATHS=/v1/chat/completions,/v1/completions,/v1/responses" in lines


def test_describe_keeps_odd_values_on_one_line() -> None:
    settings = load_config(
        {"TLS_CERT_PATH": "/certs/a\nb.pem", "PIG_RECORD_PATH": "/r/\u00e9t\u00e9"}
    )
    lines = settings.describe().split("\n")
    assert len(lines) == len(VARIABLES)
    assert 'TLS_CERT_PATH="/certs/a\\nb.pem"' in lines
    assert "PIG_RECORD_PATH=/r/\u00e9t\u00e9" in lines


def test_every_variable_is_a_field_named_after_it() -> None:
    assert tuple(a.name.upper() for a in attrs.fields(Environment)) == VARIABLES
    assert len(set(VARIABLES)) == len(VARIABLES)


# -- properties --------------------------------------------------------------------------------

_VALUES = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "1",
            "-1",
            "5",
            "0.5",
            "1e-1",
            "true",
            "off",
            "red",
            "/v1/x",
            "http://h:1",
            "http://h:1/metrics/",
            "a=http://a:1|http://a:1/m,http://b:2",
            ":9000",
            ",",
            "max_tokens,n",
            "premium_only",
            "append_last",
            "/var/run/x.sock",
            "http://dstack:8090",
            "0.99",
            "64",
            "predictive",
            "predicted",
            " Fixed ",
        ]
    ),
)
_KEYS = st.one_of(st.sampled_from(VARIABLES), st.text(max_size=12))


@given(st.dictionaries(_KEYS, _VALUES, max_size=12))
def test_loading_any_environment_returns_settings_or_raises_config_error(
    environ: dict[str, str],
) -> None:
    settings: Settings | None = None
    failure: ConfigError | None = None
    try:
        settings = load_config(environ)
    except ConfigError as error:
        failure = error
    if failure is not None:
        assert failure.messages
        known = (*VARIABLES, "configuration")
        assert all(message.split(":")[0] in known for message in failure.messages)
        assert str(failure) == "\n".join(failure.messages)
        return
    assert settings is not None
    settings.guard_config()
    settings.auth_paths.matches("/v1/x")
    assert settings.lane_thresholds.body.values[0] > 0
    adaptive = settings.adaptive_output
    assert (adaptive is not None) == (
        settings.env.classify_output_tokens and settings.env.adaptive_output_classification
    )
    shown = settings.redacted()
    lines = settings.describe().split("\n")
    assert len(lines) == len(VARIABLES)
    secrets = (has_secret(settings.env), "@" in "".join(shown.values()))
    # A comma inside the GPU arch cannot survive the CSV of the command arguments it names.
    if not any(secrets) and "," not in settings.env.attestation_gpu_arch:
        assert load_config(shown) == settings


def has_secret(env: Environment) -> bool:
    return bool(
        env.token or env.attestation_nvidia_payload or env.attestation_nvidia_payload_authorization
    )


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_integers_read_back_exactly(number: int) -> None:
    assert load_config(
        {"DYNAMIC_PRESSURE_HEADROOM": str(number)}
    ).env.dynamic_pressure_headroom == (number)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_read_back_exactly(number: float) -> None:
    env = load_config({"DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_MAX": repr(number)}).env
    assert env.dynamic_single_user_tps_capacity_ratio_max == number


@given(st.lists(st.text(alphabet=" ,/ab", max_size=6), max_size=5))
def test_csv_never_keeps_blank_or_untrimmed_parts(parts: list[str]) -> None:
    text = ",".join(parts)
    if not text.strip():
        return
    try:
        settings = load_config({"PIG_PATHS": text})
    except ConfigError:
        return
    for path in settings.paths.paths:
        assert path
        assert path == path.strip()
