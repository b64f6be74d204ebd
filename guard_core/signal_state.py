"""The load state computed from one poll's raw backend signals (spec 3, settings of spec 2.6).

Reads: the thresholds (``DYNAMIC_KV_*``, ``DYNAMIC_RUNNING_*``, ``DYNAMIC_WAITING_*``,
``DYNAMIC_PREEMPTION_DELTA_RED`` and the three ``DYNAMIC_GLOBAL_*_LIMIT`` state caps), the
aggregated ``running``, ``waiting``, KV-cache usage and preemption increase of one poll, and the
readiness flags the user-TPS and TTFT assessments already worked out.
Guarantees:
- reasons are listed in the fixed order kv_cache, running, waiting, preemptions,
  single_user_tps, ttft_latency, with reasons added later by the cap stages after them;
- a reason is never both yellow and red: it is red when its red threshold is met, otherwise
  yellow when its yellow threshold is met, otherwise absent;
- a threshold of 0 switches its trigger off (for the waiting thresholds too, see below);
- the state is red exactly when some reason is red, yellow when only yellow reasons exist, green
  otherwise, and raising any one signal never lowers it;
- a state cap is never above ``GLOBAL_LIMIT``.

Decision where the spec is silent: spec 2.6 names 0 as "off" for the KV, running and preemption
triggers but not for the waiting pair. A waiting threshold of 0 read literally would make every
poll yellow or red (``waiting >= 0`` always holds), so here 0 turns the waiting triggers off as
well, just as the gate's short-wait rule already treats ``DYNAMIC_WAITING_RED=0``. The check
"yellow <= red" is applied as written, so red set to 0 (off) needs yellow at 0 too.
"""

from __future__ import annotations

from typing import Any

import attrs

from guard_core._errors import InvalidObservation, PolicyConfigError
from guard_core.decision import LoadState, StateReason
from guard_core.settings import AtLeast, NotAbove, require_valid, setting

__all__ = ("SignalReasons", "SignalThresholds", "raw_signal_reasons", "state_limit")

_GLOBAL_LIMIT = 512
_KV_YELLOW = 0.70
_KV_RED = 0.80
_WAITING_YELLOW = 1
_WAITING_RED = 2
_PREEMPTION_DELTA_RED = 1


_NON_NEGATIVE = (AtLeast(0),)


def _yellow(default: float, env: str, red: str) -> Any:
    """A yellow threshold: >= 0 and not above its red partner ``red``."""
    return setting(default, env=env, rules=(AtLeast(0), NotAbove(red)))


def _following(default: float, env: str, follows: str) -> Any:
    """A value >= 0 that PIG defaults to ``follows`` (whose own check reports it while equal)."""
    return setting(default, env=env, rules=_NON_NEGATIVE, unless_same_as=follows)


@attrs.frozen(kw_only=True)
class SignalThresholds:
    """The raw-signal thresholds and the per-state caps, with PIG's defaults.

    Each yellow threshold must not be above its red partner, and every value is >= 0; anything
    else raises :class:`~guard_core.PolicyConfigError`. Use :meth:`from_global_limit` to apply
    PIG's "same as the level before" defaulting of the state caps and the running red threshold.
    """

    #: ``GLOBAL_LIMIT``; every state cap is read as at most this.
    global_limit: int = setting(_GLOBAL_LIMIT, env="GLOBAL_LIMIT", rules=_NON_NEGATIVE)
    #: ``DYNAMIC_GLOBAL_GREEN_LIMIT`` / ``_YELLOW_LIMIT`` / ``_RED_LIMIT``.
    green_limit: int = _following(_GLOBAL_LIMIT, "DYNAMIC_GLOBAL_GREEN_LIMIT", "global_limit")
    yellow_limit: int = _following(_GLOBAL_LIMIT, "DYNAMIC_GLOBAL_YELLOW_LIMIT", "green_limit")
    red_limit: int = _following(_GLOBAL_LIMIT, "DYNAMIC_GLOBAL_RED_LIMIT", "yellow_limit")
    #: ``DYNAMIC_KV_YELLOW`` / ``DYNAMIC_KV_RED`` (a fraction of the KV cache; 0 is off).
    kv_yellow: float = _yellow(_KV_YELLOW, "DYNAMIC_KV_YELLOW", "kv_red")
    kv_red: float = _following(_KV_RED, "DYNAMIC_KV_RED", "kv_yellow")
    #: ``DYNAMIC_RUNNING_YELLOW`` / ``_RED`` (0 is off, the default).
    running_yellow: int = _yellow(0, "DYNAMIC_RUNNING_YELLOW", "running_red")
    running_red: int = _following(0, "DYNAMIC_RUNNING_RED", "running_yellow")
    #: ``DYNAMIC_WAITING_YELLOW`` / ``_RED`` (0 is off; see the module notes).
    waiting_yellow: int = _yellow(_WAITING_YELLOW, "DYNAMIC_WAITING_YELLOW", "waiting_red")
    waiting_red: int = _following(_WAITING_RED, "DYNAMIC_WAITING_RED", "waiting_yellow")
    #: ``DYNAMIC_PREEMPTION_DELTA_RED``: a per-poll preemption increase this large is red.
    preemption_delta_red: int = setting(
        _PREEMPTION_DELTA_RED, env="DYNAMIC_PREEMPTION_DELTA_RED", rules=_NON_NEGATIVE
    )

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    @classmethod
    def from_global_limit(
        cls,
        global_limit: int,
        *,
        green: int | None = None,
        yellow: int | None = None,
        red: int | None = None,
        kv_yellow: float = _KV_YELLOW,
        kv_red: float = _KV_RED,
        running_yellow: int = 0,
        running_red: int | None = None,
        waiting_yellow: int = _WAITING_YELLOW,
        waiting_red: int = _WAITING_RED,
        preemption_delta_red: int = _PREEMPTION_DELTA_RED,
    ) -> SignalThresholds:
        """Thresholds as PIG derives them from its settings; ``None`` means "not set".

        An unset green cap is ``global_limit``, an unset yellow cap equals green, an unset red
        cap equals yellow, and an unset running red threshold equals running yellow. Each cap is
        then lowered to ``global_limit`` if above it. A negative value given for a cap is
        rejected before any capping.
        """
        if not global_limit >= 0:
            raise PolicyConfigError(f"global_limit must be >= 0, got {global_limit}")
        for name, given in (("green", green), ("yellow", yellow), ("red", red)):
            if given is not None and not given >= 0:
                raise PolicyConfigError(f"{name} state limit must be >= 0, got {given}")
        green_value = global_limit if green is None else green
        yellow_value = green_value if yellow is None else yellow
        red_value = yellow_value if red is None else red
        return cls(
            global_limit=global_limit,
            green_limit=min(green_value, global_limit),
            yellow_limit=min(yellow_value, global_limit),
            red_limit=min(red_value, global_limit),
            kv_yellow=kv_yellow,
            kv_red=kv_red,
            running_yellow=running_yellow,
            running_red=running_yellow if running_red is None else running_red,
            waiting_yellow=waiting_yellow,
            waiting_red=waiting_red,
            preemption_delta_red=preemption_delta_red,
        )


def _check_reasons(instance: SignalReasons, _attribute: object, _value: object) -> None:
    for colour in (instance.yellow, instance.red):
        if len(set(colour)) != len(colour):
            raise InvalidObservation(f"a reason is listed twice: {colour}")
    both = set(instance.yellow) & set(instance.red)
    if both:
        raise InvalidObservation(f"reasons cannot be both yellow and red: {sorted(both)}")


@attrs.frozen
class SignalReasons:
    """The yellow and red reasons of one evaluation, in the order they were found.

    A reason is in at most one list and at most once; building a value that breaks this raises
    :class:`~guard_core.InvalidObservation`.
    """

    yellow: tuple[StateReason, ...] = ()
    red: tuple[StateReason, ...] = attrs.field(default=(), validator=_check_reasons)

    @property
    def state(self) -> LoadState:
        """Red with any red reason, yellow with only yellow ones, green with none."""
        return LoadState.from_reasons(self.yellow, self.red)

    def with_reason(self, reason: StateReason, red: bool) -> SignalReasons:
        """The same reasons with ``reason`` added as red (``red=True``) or yellow.

        Adding a reason already present at the same or a stronger colour changes nothing;
        adding as red a reason that is yellow moves it from the yellow list to the end of the
        red list.
        """
        if reason in self.red:
            return self
        if not red:
            if reason in self.yellow:
                return self
            return SignalReasons((*self.yellow, reason), self.red)
        yellow = tuple(r for r in self.yellow if r is not reason)
        return SignalReasons(yellow, (*self.red, reason))


def _colour(value: float, yellow: float, red: float) -> bool | None:
    """True for red, False for yellow, None for neither; a 0 threshold never fires."""
    if red > 0 and value >= red:
        return True
    if yellow > 0 and value >= yellow:
        return False
    return None


def raw_signal_reasons(
    thresholds: SignalThresholds,
    *,
    running: int,
    waiting: int,
    kv_usage: float,
    preemption_delta: int,
    user_tps_yellow_ready: bool = False,
    user_tps_red_ready: bool = False,
    ttft_yellow_ready: bool = False,
    ttft_red_ready: bool = False,
) -> SignalReasons:
    """The reasons one poll's raw signals give, before any cap stage adds its own.

    ``running``, ``waiting`` and ``kv_usage`` are the aggregated values of the poll (KV is the
    highest usage across backends), ``preemption_delta`` the preemption increase since the
    previous poll. The readiness flags come from the user-TPS and TTFT assessments; a red-ready
    assessment is red whatever its yellow flag says.
    """
    t = thresholds
    found: tuple[tuple[StateReason, bool | None], ...] = (
        (StateReason.KV_CACHE, _colour(kv_usage, t.kv_yellow, t.kv_red)),
        (StateReason.RUNNING, _colour(running, t.running_yellow, t.running_red)),
        (StateReason.WAITING, _colour(waiting, t.waiting_yellow, t.waiting_red)),
        (StateReason.PREEMPTIONS, _colour(preemption_delta, 0, t.preemption_delta_red)),
        (
            StateReason.SINGLE_USER_TPS,
            True if user_tps_red_ready else (False if user_tps_yellow_ready else None),
        ),
        (
            StateReason.TTFT_LATENCY,
            True if ttft_red_ready else (False if ttft_yellow_ready else None),
        ),
    )
    yellow = tuple(reason for reason, is_red in found if is_red is False)
    red = tuple(reason for reason, is_red in found if is_red is True)
    return SignalReasons(yellow, red)


def state_limit(thresholds: SignalThresholds, state: LoadState) -> int:
    """The state cap for ``state``, never above ``GLOBAL_LIMIT``; ``disabled`` reads green."""
    if state is LoadState.RED:
        level = thresholds.red_limit
    elif state is LoadState.YELLOW:
        level = thresholds.yellow_limit
    else:
        level = thresholds.green_limit
    return min(level, thresholds.global_limit)
