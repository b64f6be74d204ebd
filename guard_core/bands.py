"""Priority bands: named, ordered admission classes with a reserve and a short wait of their own.

Reads: a :class:`BandSpec` (``PIG_PRIORITY_BANDS``, parsed by the config adapter), the trusted
tier header's values, the cap in force and the in-flight and waiting counts per band.
Guarantees:
- bands are ordered, highest priority first; the first band is PIG's premium tier for every
  reader that knows only two tiers (metrics, ``X-PIG-Tier``, backend priority), the others are
  basic;
- a band never takes a slot while a higher band has a request waiting (``tier_priority``);
- a band below the first leaves free the slots reserved for every band above it (the sum of
  their reserves, ``tier_basic_limit``); under a cap of 1 or less nothing is reserved and the
  bands share the single slot;
- :data:`PIG_BANDS` (``premium`` reserving one slot, then ``basic``, the default) refuses exactly
  when PIG's tier rule does (:func:`guard_core.tier.basic_limit`), with the same code;
- a band's ``priority`` only replaces the value backend priority injection writes for its
  tier; whether anything is written stays the injection settings' choice;
- a header value picks a band only when it is the single value the request carried and names a
  band after trimming and ASCII lower-casing; anything else gets the default band (the second
  band, or the one marked ``default``), as PIG gives basic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from guard_core._errors import PolicyConfigError
from guard_core.decision import RejectCode
from guard_core.short_wait import MAX_SHORT_WAIT_S
from guard_core.tier import Tier

__all__ = (
    "PIG_BANDS",
    "Band",
    "BandSpec",
    "band_capacity",
    "band_from_header_values",
    "band_refusal",
    "headroom",
    "reserve_slots",
)

_OWS = b" \t"


def _valid_reserve(_instance: object, _attribute: object, value: float | None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0:
        raise PolicyConfigError(f"a band's reserve must be > 0, got {value!r}")
    if value >= 1 and value != int(value):
        raise PolicyConfigError(
            f"a band's reserve is a share below 1 or a whole number of slots, got {value!r}"
        )


def _valid_wait(_instance: object, _attribute: object, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise PolicyConfigError(f"a band's wait must be >= 0 s, got {value!r}")


def _valid_name(_instance: object, _attribute: object, value: str) -> None:
    if not value or value != value.strip().lower() or not value.isascii():
        raise PolicyConfigError(f"a band's name must be non-empty lower-case ASCII, got {value!r}")
    if any(ch in value for ch in ",:= \t"):
        raise PolicyConfigError(f"a band's name may not contain , : = or blanks, got {value!r}")


@attrs.frozen
class Band:
    """One band: its name (the tier header value that picks it), reserve and wait."""

    name: str = attrs.field(validator=_valid_name)
    #: Slots kept free for this band by every band below it: a share of the cap when below 1
    #: (rounded up to whole slots), a number of slots otherwise; ``None``: none.
    reserve: float | None = attrs.field(default=None, validator=_valid_reserve)
    #: The band's longest short wait in seconds (never above ``PIG_QUEUE_WAIT_SECONDS`` nor
    #: 0.5 s); 0: refused at once; ``None``: the guard's wait.
    wait_s: float | None = attrs.field(default=None, validator=_valid_wait)
    #: The trusted priority written into the request body for this band when backend priority
    #: injection is on (``BACKEND_PRIORITY_*``); ``None``: the tier's value (premium or basic).
    priority: int | None = None

    @property
    def wait_cap_s(self) -> float | None:
        """The cap this band puts on the gate's short wait, or ``None``."""
        return None if self.wait_s is None else min(self.wait_s, MAX_SHORT_WAIT_S)


@attrs.frozen
class BandSpec:
    """The bands in priority order and which one a request without a known name gets."""

    bands: tuple[Band, ...]
    default: int

    def __attrs_post_init__(self) -> None:
        if not self.bands:
            raise PolicyConfigError("at least one band is needed")
        names = [band.name for band in self.bands]
        if len(set(names)) != len(names):
            raise PolicyConfigError(f"band names must differ, got {', '.join(names)}")
        if not 0 <= self.default < len(self.bands):
            raise PolicyConfigError(f"the default band {self.default} is not one of the bands")

    @classmethod
    def of(cls, bands: Sequence[Band], default: str | None = None) -> BandSpec:
        """Bands in order; ``default`` names the band for unknown values (else the second)."""
        bands = tuple(bands)
        if default is None:
            index = min(1, len(bands) - 1)
        else:
            found = [i for i, band in enumerate(bands) if band.name == default]
            if not found:
                raise PolicyConfigError(f"the default band {default!r} is not one of the bands")
            index = found[0]
        return cls(bands, index)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(band.name for band in self.bands)

    def index_of(self, name: str) -> int:
        """The band named ``name``, or the default band."""
        for i, band in enumerate(self.bands):
            if band.name == name:
                return i
        return self.default

    @staticmethod
    def tier_of(index: int) -> Tier:
        """The PIG tier a band stands for: the first band is premium, the rest basic."""
        return Tier.PREMIUM if index == 0 else Tier.BASIC


#: PIG's two tiers: premium (one slot reserved) and basic, the default.
PIG_BANDS = BandSpec((Band("premium", reserve=1), Band("basic")), 1)


def band_from_header_values(spec: BandSpec, values: Sequence[bytes]) -> int:
    """The band of a request from every tier header value it carried, in arrival order."""
    if len(values) != 1:
        return spec.default
    try:
        name = values[0].strip(_OWS).decode("ascii").lower()
    except UnicodeDecodeError:
        return spec.default
    return spec.index_of(name)


def reserve_slots(band: Band, limit: int) -> int:
    """The whole slots ``band`` reserves under cap ``limit``."""
    if band.reserve is None or limit <= 0:
        return 0
    if band.reserve < 1:
        return math.ceil(band.reserve * limit)
    return int(band.reserve)


def headroom(spec: BandSpec, index: int, limit: int) -> int:
    """Slots band ``index`` must leave free for the bands above it (0 under a cap of 1)."""
    if limit <= 1:
        return 0
    return sum(reserve_slots(band, limit) for band in spec.bands[:index])


def band_refusal(
    spec: BandSpec,
    index: int,
    *,
    limit: int,
    inflight: int,
    waiting: Sequence[int],
) -> RejectCode | None:
    """Why band ``index`` may not take a slot now (the band rules only), or ``None``.

    ``inflight`` counts every band's admitted requests; ``waiting`` is the waiting count per
    band. The cap and ``GLOBAL_LIMIT`` themselves are the gate's to enforce.
    """
    if any(count > 0 for count in waiting[:index]):
        return RejectCode.TIER_PRIORITY
    if index > 0 and inflight + 1 + headroom(spec, index, limit) > limit:
        return RejectCode.TIER_BASIC_LIMIT
    return None


def band_capacity(
    spec: BandSpec, index: int, *, limit: int, inflight: int, band_inflight: int
) -> int:
    """How many slots band ``index`` could hold now: what it holds plus what it may still take."""
    free = max(0, limit - headroom(spec, index, limit) - inflight)
    return band_inflight + free
