"""guard_core: the pure admission and capacity policy of inference-guard.

No I/O, no clock, no randomness, no concurrency: every input is a value (time arrives as ``at`` on
events, or ``now`` arguments), every output is a value. Only ``attrs`` and pure standard-library
modules are imported, so any runtime can embed it.
"""

from guard_core._errors import GuardError, InvalidObservation, PolicyConfigError
from guard_core.bands import PIG_BANDS, Band, BandSpec
from guard_core.composition import COMPONENT_ORDER, CapComponents, ComposedCap, compose
from guard_core.decision import (
    Admission,
    Admitted,
    DecisionSource,
    LimitReason,
    LoadState,
    PublishedDecision,
    Queued,
    RejectCode,
    Rejected,
    StateReason,
)
from guard_core.evaluation import BackendPoll, LearnerState, Snapshot, evaluate
from guard_core.events import (
    Abandoned,
    Arrived,
    Finished,
    FirstToken,
    Forwarded,
    Refused,
    RequestEvent,
    Retried,
)
from guard_core.flow import FlowConfig, FlowState
from guard_core.gate import (
    DecisionPublished,
    GateConfig,
    GateState,
    GateStep,
    SlotReleased,
    SlotRequested,
    WaitAbandoned,
    WaitRetried,
    current_limit,
    next_check_at,
    short_wait_s,
)
from guard_core.gate import apply as apply_gate_event
from guard_core.guard import GuardConfig, GuardEvent, GuardState, GuardStep, MetricsPolled, fold
from guard_core.guard import apply as apply_guard_event
from guard_core.lanes import Lane, body_lane, combine_lanes, output_lane
from guard_core.observations import BackendSample, Flavour, Histogram
from guard_core.policy import PolicyConfig
from guard_core.predictive import Binding, Prediction, PredictiveConfig, PredictiveState
from guard_core.routing import DEFAULT_QOS_PATHS, PathPolicy
from guard_core.signal_state import SignalThresholds
from guard_core.tenants import TenantConfig
from guard_core.tier import Tier, basic_limit, premium_reserved, tier_from_header_values
from guard_core.upstream_errors import Reclassified, reclassify
from guard_core.upstream_status import UpstreamStatus, upstream_status_digit

__all__ = (
    "COMPONENT_ORDER",
    "DEFAULT_QOS_PATHS",
    "PIG_BANDS",
    "Abandoned",
    "Admission",
    "Admitted",
    "Arrived",
    "BackendPoll",
    "BackendSample",
    "Band",
    "BandSpec",
    "Binding",
    "CapComponents",
    "ComposedCap",
    "DecisionPublished",
    "DecisionSource",
    "Finished",
    "FirstToken",
    "Flavour",
    "FlowConfig",
    "FlowState",
    "Forwarded",
    "GateConfig",
    "GateState",
    "GateStep",
    "GuardConfig",
    "GuardError",
    "GuardEvent",
    "GuardState",
    "GuardStep",
    "Histogram",
    "InvalidObservation",
    "Lane",
    "LearnerState",
    "LimitReason",
    "LoadState",
    "MetricsPolled",
    "PathPolicy",
    "PolicyConfig",
    "PolicyConfigError",
    "Prediction",
    "PredictiveConfig",
    "PredictiveState",
    "PublishedDecision",
    "Queued",
    "Reclassified",
    "Refused",
    "RejectCode",
    "Rejected",
    "RequestEvent",
    "Retried",
    "SignalThresholds",
    "SlotReleased",
    "SlotRequested",
    "Snapshot",
    "StateReason",
    "TenantConfig",
    "Tier",
    "UpstreamStatus",
    "WaitAbandoned",
    "WaitRetried",
    "apply_gate_event",
    "apply_guard_event",
    "basic_limit",
    "body_lane",
    "combine_lanes",
    "compose",
    "current_limit",
    "evaluate",
    "fold",
    "next_check_at",
    "output_lane",
    "premium_reserved",
    "reclassify",
    "short_wait_s",
    "tier_from_header_values",
    "upstream_status_digit",
)
