"""A simulated inference engine: vLLM-style continuous batching in virtual time.

Pure: no I/O, no clock, no global random state. The only randomness is a ``random.Random(seed)``
owned by each :class:`Engine` (used only for the optional early end of sequence), so a given seed
and call sequence always produce the same events.

The model (one scheduler step at a time, like vLLM's V1 engine)
---------------------------------------------------------------
* Requests wait in a FIFO queue. A step first gives every *decoding* sequence one token. The token
  budget left over (``max_num_batched_tokens`` minus the decodes) goes to prompt prefill, chunked:
  sequences already part-way through their prefill first, then new ones taken from the head of the
  queue while fewer than ``max_num_seqs`` are running and the KV cache can hold the whole prompt.
  Admission is strictly first come, first served: a head that does not fit blocks the rest.
* A sequence whose prefill ends in a step gets its first token at the end of that step and decodes
  from the next step on. Every decode step delivers one token to each decoding sequence; a
  sequence finishes after exactly ``max_output_tokens`` tokens (benchmark-style ``ignore_eos``),
  or earlier when the engine is built with ``ignore_eos=False`` (a seeded geometric length).
* KV usage counts, in tokens, the prompt reserved at admission plus one token per decode step of
  every running sequence. When the next step's decodes do not fit, the most recently admitted
  running sequence is preempted (vLLM's recompute mode): its KV is freed, it goes back to the head
  of the queue, and once readmitted it prefills its prompt *and* the tokens it had generated before
  producing the next one. No new sequence is admitted in a step that preempted.
* A step lasts ``step_base_s + decode_token_s * D + prefill_token_s * P + kv_token_s * K`` seconds
  (times the ``slow_down`` factor), where D is the number of decoding sequences, P the prompt
  tokens prefilled in the step and K the KV tokens the decoders attend over (their context). The
  first terms are the weight read and per-token matmul work; the last is attention's KV read.
* There is no prefix cache of its own: a request may say how many leading prompt tokens are
  already cached (``SimRequest.cached_prompt_tokens``); they take KV space but no prefill time.
  A preempted sequence recomputes everything.
* :meth:`Engine.metrics` counts what a vLLM page shows, including the inter-token latency
  histogram (bounds :data:`ITL_BUCKETS`): one observation per output token after a request's
  first, the time since that request's previous token. Steps run back to back while anything
  decodes, so a step that ends adds its own duration once per decoding sequence (a single
  bisect, whatever the batch), and a sequence readmitted after a preemption adds its whole pause
  with its next token. The count therefore always equals generation tokens minus first tokens.

Time and events: :meth:`Engine.advance` runs the steps that end by ``until`` and returns what
clients would have seen. ``"first_token"``, ``"preempted"``, ``"finished"`` and ``"failed"`` carry
the exact step end; the tokens decoded between two ``advance`` calls come as one ``"tokens"``
event per sequence, stamped with the last step's end. Advancing step by step
(``advance(next_event_at())``) therefore gives one event per token and sequence, and advancing in
large strides costs one event per sequence and stride. Internally a step costs O(1) plus
O(log n) per sequence that starts or ends; only that ``"tokens"`` bookkeeping is O(batch) per
``advance``, and ``token_events=False`` skips it.

Fitted constants and where they come from
-----------------------------------------
The data are ``benchmark_serving.py`` runs published in dennislee22/vLLM-benchmarking (copied to
``tests/fixtures/capacity/``; its README names the source): vLLM 0.10.1.1 (V1 engine, chunked
prefill with ``max_num_batched_tokens=2048``, prefix caching on, bfloat16, ``max_model_len=16384``,
at most 256 running requests), N requests with random prompts sent at once. The step constants
were fitted by replaying those runs in this engine; ``tests/property/adapters/
test_engine_calibration.py`` lists the rows each profile is held to (within 15 %) and why the
others are left out (mostly prefix-cache hits left by an earlier run on the same server).

``a100-qwen2-7b`` (the default) is "Test 5": Qwen2-7B-Instruct on one A100-80GB with 24.83 GiB
of KV cache, which vLLM's start-up log reports as 464,848 tokens.

* ``step_base_s`` 11.5 ms, ``decode_token_s`` 0.062 ms: one stream decodes at 11.75 ms per token,
  200 streams at about 35 ms and the 256-sequence cap at about 40 ms (median inter-token latency);
* ``kv_token_s`` 35 ns per context token: 57,344 bytes of KV per token (28 layers, 4 KV heads of
  128, K and V in bf16) read at about 1.6 TB/s;
* ``prefill_token_s`` 75 us per prompt token (about 13,300 prompt tokens/s): 10, 50 and 100
  uncached 1024-token prompts sent together have their last first token after 0.72, 4.1 and 7.7 s.

``a100-qwen2-7b-kv5g`` is "Test 4": the same GPU, model and constants with 5.01 GiB of KV cache
(93,872 tokens), which holds about 45 sequences of 2048 tokens; its rows are dominated by KV
exhaustion (preemption, queueing) and match without any change of constants.

``a100-qwen2.5-32b`` is "Test 7" (Qwen2.5-32B on one A100-80GB, 9.70 GiB of KV, 39,728 tokens
at 256 KiB per token): 46.6 ms per step, 0.193 ms per decoding sequence, 0.279 ms per prompt
token, 111 ns per context token.

``2xa100-tp2-qwen2.5-32b`` is "Test 6" (the same model, tensor-parallel over two A100-80GB of one
node, 8.22 GiB of KV on each, 67,328 tokens): 30.7 ms per step, 0.384 ms per decoding sequence
(the two-GPU logs of that source show all-reduces without GPU peer-to-peer, which grow with the
batch), 0.286 ms per prompt token, 64 ns per context token.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

import attrs

__all__ = (
    "DEFAULT_PROFILE",
    "ITL_BUCKETS",
    "PROFILES",
    "TTFT_BUCKETS",
    "Engine",
    "EngineDead",
    "EngineMetrics",
    "EngineProfile",
    "RequestTooLong",
    "SimRequest",
    "TokenEvent",
    "idle_prefill_s",
    "profile_from_json",
)

#: Bucket bounds (seconds) of ``vllm:time_to_first_token_seconds`` in vLLM 0.33.0, the newest
#: version in ``../shared/data/metrics/vllm-v1-histogram-buckets-by-version.tsv``.
TTFT_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip

#: Bucket bounds (seconds) of ``vllm:inter_token_latency_seconds`` in vLLM 0.33.0, the newest
#: version in ``../shared/data/metrics/vllm-v1-histogram-buckets-by-version.tsv`` (the same
#: bounds since the name appeared in 0.10.2; its predecessor ``time_per_output_token_seconds``
#: had them from 0.8.5).
ITL_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class EngineDead(Exception):
    """The engine was killed; it accepts no more work."""


class RequestTooLong(ValueError):
    """Prompt plus requested output exceed the profile's ``max_model_len`` (vLLM answers 400)."""


_count = attrs.validators.gt(0)
_count_or_zero = attrs.validators.ge(0)
_seconds = attrs.validators.gt(0.0)
_seconds_or_zero = attrs.validators.ge(0.0)


@attrs.frozen(kw_only=True)
class EngineProfile:
    """One GPU setup and model: scheduler limits and the step-time model's constants.

    ``name``: key in :data:`PROFILES`.
    ``max_num_seqs``: most sequences running (prefilling or decoding) at once.
    ``kv_capacity_tokens``: KV cache size in tokens (prompt plus generated tokens of the running
    sequences); at least ``max_model_len`` so that any accepted request fits alone.
    ``max_num_batched_tokens``: tokens one step may process (decodes plus prefill chunks).
    ``max_model_len``: largest prompt plus ``max_output_tokens`` accepted by :meth:`Engine.submit`.
    ``step_base_s``: fixed cost of a step (reading the weights once).
    ``decode_token_s``: added per decoding sequence in the step.
    ``prefill_token_s``: added per prompt token prefilled in the step.
    ``kv_token_s``: added per KV token attended to by the decoding sequences.
    ``source``: the measurements the numbers come from, in words.
    """

    name: str
    max_num_seqs: int = attrs.field(validator=_count)
    kv_capacity_tokens: int = attrs.field(validator=_count)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_count)
    max_model_len: int = attrs.field(default=16384, validator=_count)
    step_base_s: float = attrs.field(validator=_seconds)
    decode_token_s: float = attrs.field(validator=_seconds_or_zero)
    prefill_token_s: float = attrs.field(validator=_seconds_or_zero)
    kv_token_s: float = attrs.field(default=0.0, validator=_seconds_or_zero)
    source: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kv_capacity_tokens < self.max_model_len:
            raise ValueError("kv_capacity_tokens must be >= max_model_len")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must exceed max_num_seqs")

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Duration of a pure decode step of ``batch`` sequences holding ``context_tokens``."""
        return self.step_base_s + self.decode_token_s * batch + self.kv_token_s * context_tokens


#: The measured profiles (see "Fitted constants" above), each run with vLLM at 256 sequences and
#: the field defaults for the batched tokens and model length: the name, the KV cache in tokens,
#: ``step_base_s``, ``decode_token_s``, ``prefill_token_s``, ``kv_token_s``, and the run.
_MEASURED: Final = (
    ("a100-qwen2-7b", 464_848, 0.0115, 0.000062, 0.000075, 35e-9,
     "Qwen2-7B-Instruct, 1 x A100-80GB, 24.83 GiB KV (Test 5)"),
    ("a100-qwen2.5-32b", 39_728, 0.0466, 0.000193, 0.000279, 111e-9,
     "Qwen2.5-32B, 1 x A100-80GB, 9.70 GiB KV (Test 7)"),
    ("2xa100-tp2-qwen2.5-32b", 67_328, 0.0307, 0.000384, 0.000286, 64e-9,
     "Qwen2.5-32B, 2 x A100-80GB tensor-parallel, 8.22 GiB KV each (Test 6)"),
)  # fmt: skip


def _measured(row: tuple[str, int, float, float, float, float, str]) -> EngineProfile:
    name, kv, base, decode, prefill, per_kv, source = row
    return EngineProfile(
        name=name,
        max_num_seqs=256,
        kv_capacity_tokens=kv,
        step_base_s=base,
        decode_token_s=decode,
        prefill_token_s=prefill,
        kv_token_s=per_kv,
        source=source,
    )


_A100_QWEN2_7B, *_OTHERS = map(_measured, _MEASURED)

PROFILES: Final[Mapping[str, EngineProfile]] = MappingProxyType(
    {
        profile.name: profile
        for profile in (
            _A100_QWEN2_7B,
            # The same engine with a smaller KV cache: Test 5's step constants, Test 4's KV size.
            attrs.evolve(
                _A100_QWEN2_7B,
                name="a100-qwen2-7b-kv5g",
                kv_capacity_tokens=93_872,
                source="Qwen2-7B-Instruct, 1 x A100-80GB, 5.01 GiB KV (Test 4), Test 5 constants",
            ),
            *_OTHERS,
        )
    }
)

DEFAULT_PROFILE: Final = "a100-qwen2-7b"


def idle_prefill_s(profile: EngineProfile, prompt_tokens: int) -> float:
    """Seconds from submission to the first token of a prompt alone on an idle ``profile`` engine.

    ``prompt_tokens`` is what must be computed (pass the uncached part where a prefix cache
    holds the rest); at least one token always is. The prompt goes in chunks of
    ``max_num_batched_tokens``, one step each (``step_base_s + prefill_token_s * chunk``, with no
    decoders and no KV read), and the first token comes at the end of the last chunk's step:
    exactly what :class:`Engine` does with nothing else running, at speed factor 1.
    """
    tokens = max(1, prompt_tokens)
    steps = -(-tokens // profile.max_num_batched_tokens)
    return steps * profile.step_base_s + profile.prefill_token_s * tokens


#: ``profile_from_json`` keys: field -> (kind, required). Kinds: whole count, seconds, text.
_PROFILE_KEYS: Final[Mapping[str, tuple[str, bool]]] = MappingProxyType(
    {
        "name": ("text", True),
        "max_num_seqs": ("count", True),
        "kv_capacity_tokens": ("count", True),
        "max_num_batched_tokens": ("count", False),
        "max_model_len": ("count", False),
        "step_base_s": ("seconds", True),
        "decode_token_s": ("seconds", True),
        "prefill_token_s": ("seconds", True),
        "kv_token_s": ("seconds", False),
        "source": ("text", False),
    }
)


def profile_from_json(document: Mapping[str, object]) -> EngineProfile:
    """An :class:`EngineProfile` from a decoded JSON object (an operator's own hardware).

    Keys are the profile's fields. Required: ``name``, ``max_num_seqs``, ``kv_capacity_tokens``,
    ``step_base_s``, ``decode_token_s``, ``prefill_token_s``; optional, with the class defaults:
    ``max_num_batched_tokens`` (2048), ``max_model_len`` (16384), ``kv_token_s`` (0) and
    ``source`` (text). Counts must be JSON integers, times JSON numbers (seconds), both finite;
    the class's own checks then apply (positive counts, ``kv_capacity_tokens >= max_model_len``,
    ``max_num_batched_tokens > max_num_seqs``, ...).

    Raises:
        ValueError: naming the field at fault: an unknown or missing key, a value of the wrong
            type, or one the profile refuses.
    """
    if not isinstance(document, Mapping):
        raise ValueError("an engine profile must be a JSON object")
    unknown = sorted(str(key) for key in document if key not in _PROFILE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown engine profile field(s): {', '.join(unknown)}"
            f" (known: {', '.join(_PROFILE_KEYS)})"
        )
    missing = [key for key, (_, needed) in _PROFILE_KEYS.items() if needed and key not in document]
    if missing:
        raise ValueError(f"engine profile is missing {', '.join(missing)}")
    values: dict[str, object] = {}
    for key, value in document.items():
        kind = _PROFILE_KEYS[key][0]
        if kind == "text":
            if not isinstance(value, str) or (key == "name" and not value.strip()):
                wanted = "a non-empty string" if key == "name" else "a string"
                raise ValueError(f"engine profile field {key} must be {wanted}, got {value!r}")
        elif kind == "count":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"engine profile field {key} must be a whole number, got {value!r}"
                )
        elif (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(
                f"engine profile field {key} must be a finite number of seconds, got {value!r}"
            )
        values[key] = float(value) if kind == "seconds" else value
    try:
        return EngineProfile(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise ValueError(f"engine profile refused: {error}") from None


@attrs.frozen(kw_only=True)
class SimRequest:
    """A generation request: prompt length and the number of tokens to generate at most."""

    request_id: int
    prompt_tokens: int = attrs.field(validator=_count)
    max_output_tokens: int = attrs.field(validator=_count)
    #: Leading prompt tokens already in the prefix cache: held in KV but not prefilled. At least
    #: one prompt token is always computed (as in vLLM, which needs it for the logits).
    cached_prompt_tokens: int = attrs.field(default=0, validator=_count_or_zero)

    def __attrs_post_init__(self) -> None:
        if self.cached_prompt_tokens >= self.prompt_tokens:
            raise ValueError("cached_prompt_tokens must be < prompt_tokens")


@attrs.frozen
class TokenEvent:
    """Something a client would see, at virtual time ``at``.

    ``kind`` is one of:
    * ``"first_token"``: the prompt is done and the first output token exists (``tokens`` is 1);
    * ``"tokens"``: ``tokens`` more output tokens (at least 1). One event may sum several steps:
      the tokens a sequence produced in the steps covered by one :meth:`Engine.advance` call,
      ``at`` being the end of the last of those steps;
    * ``"preempted"``: the sequence lost its KV and went back to the queue (``tokens`` 0); its
      stream pauses and later continues with ``"tokens"`` (no second ``"first_token"``);
    * ``"finished"``: the last event of a completed request; ``tokens`` is whatever output was not
      yet delivered by earlier events (0 unless the engine was built with ``token_events=False``);
    * ``"failed"``: the engine died under this request (``tokens`` 0); also a last event.

    Summing ``tokens`` over a request's events always gives the tokens it was sent.
    """

    request_id: int
    at: float
    kind: str
    tokens: int


@attrs.frozen(kw_only=True)
class EngineMetrics:
    """Gauges and cumulative counters as a vLLM ``/metrics`` page would show them."""

    running: int
    waiting: int
    kv_usage: float
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    ttft_bucket_counts: tuple[int, ...]
    ttft_sum: float
    ttft_count: int
    #: Inter-token latency: one observation per output token after a request's first, the
    #: time since that request's previous token. Cumulative counts per bound of
    #: :attr:`Engine.itl_buckets` (:data:`ITL_BUCKETS` unless the engine was given others),
    #: then ``+Inf``.
    itl_bucket_counts: tuple[int, ...]
    itl_sum: float
    itl_count: int


_WAITING: Final = 0
_PREFILL: Final = 1
_DECODE: Final = 2
_GONE: Final = 3


class _Seq:
    """Mutable per-request state; internal.

    While decoding, the generated count and KV held are implicit: a sequence that joined the
    decoders after step ``p0`` has ``g0 + (steps completed - p0)`` tokens and holds
    ``kv0 + (steps planned - p0)`` KV tokens, so a step costs O(1) per sequence only when one
    joins or leaves.
    """

    __slots__ = (
        "delivered",
        "epoch",
        "g0",
        "gen",
        "kv0",
        "kv_need",
        "last_at",
        "p0",
        "prefill_left",
        "prompt",
        "rid",
        "started",
        "state",
        "submit_at",
        "target",
    )

    def __init__(self, rid: int, prompt: int, cached: int, target: int, submit_at: float) -> None:
        self.rid = rid
        self.prompt = prompt
        self.target = target
        self.submit_at = submit_at
        self.state = _WAITING
        self.gen = 0  # tokens generated, valid while not decoding
        self.delivered = 0  # tokens handed out in events
        self.kv_need = prompt  # KV tokens taken at admission: prompt plus tokens generated so far
        self.prefill_left = prompt - cached  # tokens to compute before the next output token
        self.p0 = 0
        self.g0 = 0
        self.kv0 = 0
        self.epoch = 0
        self.started = False
        self.last_at = 0.0  # when its latest token came; kept up to date only across preemption


class Engine:
    """One simulated engine; see the module docstring for the model.

    Time only moves forward: an ``at`` or ``until`` earlier than the latest time the engine was
    given is taken as that time. Calls that take ``at`` first run every step that ends by then;
    their events are kept and returned by the next :meth:`advance`. Requests submitted at the same
    instant share a step unless :meth:`advance` or :meth:`next_event_at` was called in between
    (either fixes the step that starts then).

    Keyword options: ``ignore_eos=False`` ends each request early with a seeded geometric length
    of mean ``mean_output_tokens`` (capped by ``max_output_tokens``); ``token_events=False``
    drops the ``"tokens"`` events (first token, preemption, end and failure are still reported,
    and ``"finished"`` then carries the undelivered tokens), which makes long simulations cheaper.
    ``itl_buckets`` sets the bounds of the inter-token latency histogram (default
    :data:`ITL_BUCKETS`; a server imitating SGLang passes SGLang's).
    """

    def __init__(
        self,
        profile: EngineProfile,
        *,
        seed: int = 0,
        start_at: float = 0.0,
        ignore_eos: bool = True,
        mean_output_tokens: float = 256.0,
        token_events: bool = True,
        itl_buckets: Sequence[float] = ITL_BUCKETS,
    ) -> None:
        if mean_output_tokens <= 0:
            raise ValueError("mean_output_tokens must be > 0")
        bounds = tuple(float(bound) for bound in itl_buckets)
        if not all(math.isfinite(bound) for bound in bounds) or any(
            low >= high for low, high in itertools.pairwise(bounds)
        ):
            raise ValueError("itl_buckets must be finite and strictly increasing")
        self._itl_bounds = bounds
        #: Read-only to callers, as are ``dead`` and ``kv_used_tokens`` below.
        self.profile = profile
        self._rng = random.Random(seed)
        self._ignore_eos = ignore_eos
        self._eos_p = 1.0 / mean_output_tokens
        self._token_events = token_events
        self._now = float(start_at)
        #: Killed (:meth:`kill`): every later command raises :class:`EngineDead`.
        self.dead = False
        self._factor = 1.0
        self._seqs: dict[int, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._n_waiting = 0
        self._reported_waiting = 0
        self._running: dict[int, _Seq] = {}  # admission order; the last one is preempted first
        self._prefilling: deque[tuple[int, _Seq]] = deque()  # (epoch, seq) in admission order
        self._n_decoding = 0
        #: KV tokens held by the requests in the batch.
        self.kv_used_tokens = 0
        self._kv_dec = 0
        self._finish_heap: list[tuple[int, int, int, _Seq]] = []
        self._tie = 0
        self._k_planned = 0
        self._k_done = 0
        self._step_start = self._now
        self._step_end: float | None = None
        self._step_done: list[tuple[int, _Seq]] = []
        self._ready_at: float | None = None
        self._last_end = self._now
        self._flush_due = False
        self._events: list[TokenEvent] = []
        # counters
        self._preemptions = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._finished_total = 0
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._itl_counts = [0] * (len(bounds) + 1)
        self._itl_sum = 0.0
        self._itl_count = 0

    # -- read-only views ------------------------------------------------------------------------

    @property
    def now(self) -> float:
        """The latest virtual time the engine was given."""
        return self._now

    @property
    def itl_buckets(self) -> tuple[float, ...]:
        """The finite bounds of the inter-token latency histogram."""
        return self._itl_bounds

    # -- commands -------------------------------------------------------------------------------

    def submit(self, request: SimRequest, *, at: float) -> None:
        """Queue ``request`` at time ``at``.

        Raises :class:`EngineDead` after :meth:`kill`, :class:`RequestTooLong` when prompt plus
        ``max_output_tokens`` exceed ``max_model_len``, and ``ValueError`` for an id still live.
        """
        if self.dead:
            raise EngineDead("engine is dead")
        if request.prompt_tokens + request.max_output_tokens > self.profile.max_model_len:
            raise RequestTooLong(
                f"prompt ({request.prompt_tokens} tokens) plus max_output_tokens "
                f"({request.max_output_tokens}) exceed max_model_len "
                f"{self.profile.max_model_len}"
            )
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id} is already in the engine")
        at = self._catch_up(at, inclusive=False)
        target = request.max_output_tokens
        if not self._ignore_eos and target > 1:
            u = 1.0 - self._rng.random()  # (0, 1]
            drawn = 1 + int(math.log(u) / math.log1p(-self._eos_p)) if self._eos_p < 1 else 1
            target = min(target, drawn)
        seq = _Seq(
            request.request_id, request.prompt_tokens, request.cached_prompt_tokens, target, at
        )
        self._seqs[seq.rid] = seq
        self._waiting.append(seq)
        self._n_waiting += 1
        if self._step_end is None and self._ready_at is None:
            self._ready_at = at

    def abort(self, request_id: int, *, at: float) -> None:
        """The client went away: drop the request and free its KV now. Unknown ids are ignored."""
        if self.dead:
            return
        self._catch_up(at, inclusive=False)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.state == _WAITING:
            self._n_waiting -= 1
        else:
            del self._running[request_id]
            if seq.state == _PREFILL:
                self.kv_used_tokens -= seq.kv_need
            else:
                held = seq.kv0 + (self._k_planned - seq.p0)
                self.kv_used_tokens -= held
                self._kv_dec -= held
                self._n_decoding -= 1
        seq.state = _GONE
        if not self._has_work():  # nothing left: a step under way is moot
            self._step_end = None
            self._step_done = []
            self._ready_at = None

    def slow_down(self, factor: float, *, at: float) -> None:
        """From ``at`` on, every step takes ``factor`` times its normal duration (1 restores)."""
        if not 0 < factor < math.inf:
            raise ValueError("factor must be > 0 and finite")
        if self.dead:
            return
        at = self._catch_up(at, inclusive=False)
        if self._step_end is not None and self._step_end > at:
            self._step_end = at + (self._step_end - at) * factor / self._factor
        self._factor = factor

    def kill(self, *, at: float) -> None:
        """Engine death at ``at``: every queued or running request gets a ``"failed"`` event."""
        if self.dead:
            return
        at = self._catch_up(at, inclusive=False)
        if self._token_events:
            self._flush_tokens()
        seqs = [*self._running.values(), *(s for s in self._waiting if s.state == _WAITING)]
        for seq in seqs:
            self._events.append(TokenEvent(seq.rid, at, "failed", 0))
            seq.state = _GONE
        self._seqs.clear()
        self._running.clear()
        self._waiting.clear()
        self._prefilling.clear()
        self._finish_heap.clear()
        self._step_done = []
        self._n_waiting = self._n_decoding = self.kv_used_tokens = self._kv_dec = 0
        self._step_end = None
        self._ready_at = None
        self._flush_due = False
        self.dead = True

    def advance(self, until: float) -> list[TokenEvent]:
        """Run the steps that end by ``until``; return the events since the last call, in order."""
        if not self.dead:
            self._catch_up(until, inclusive=True)
            if self._flush_due and self._token_events:
                self._flush_tokens()
        else:
            self._now = max(self._now, until)
        self._flush_due = False
        events, self._events = self._events, []
        return events

    def next_event_at(self) -> float | None:
        """When :meth:`advance` next has something to return; ``None`` when idle."""
        if self.dead:
            return self._events[0].at if self._events else None
        self._catch_up(self._now, inclusive=True)
        candidates = []
        if self._events:
            candidates.append(self._events[0].at)
        if self._flush_due and self._token_events:
            candidates.append(self._last_end)
        if self._step_end is not None:
            candidates.append(self._step_end)
        return min(candidates) if candidates else None

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            running=len(self._running),
            waiting=min(self._reported_waiting, self._n_waiting),
            kv_usage=min(1.0, max(0.0, self.kv_used_tokens / self.profile.kv_capacity_tokens)),
            preemptions_total=self._preemptions,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._gen_total,
            requests_finished_total=self._finished_total,
            ttft_bucket_counts=tuple(itertools.accumulate(self._ttft_counts)),
            ttft_sum=self._ttft_sum,
            ttft_count=self._ttft_count,
            itl_bucket_counts=tuple(itertools.accumulate(self._itl_counts)),
            itl_sum=self._itl_sum,
            itl_count=self._itl_count,
        )

    # -- the scheduler ----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._running) or self._n_waiting > 0

    def _catch_up(self, t: float, *, inclusive: bool) -> float:
        """Complete every step ending by ``t``; plan steps starting before ``t`` (or at it)."""
        t = max(t, self._now)
        self._now = t
        while True:
            end = self._step_end
            if end is None:
                start = self._ready_at
                if start is None or start > t or (start == t and not inclusive):
                    break
                self._plan(start)
            elif end <= t:
                self._complete(end)
            else:
                break
        return t

    def _plan(self, start: float) -> None:
        """Choose the next step's work (preempting if needed) and fix when it ends."""
        profile = self.profile
        preempted = self._make_room(start)
        decoding = self._n_decoding
        self.kv_used_tokens += decoding
        self._kv_dec += decoding
        budget = profile.max_num_batched_tokens - decoding
        done: list[tuple[int, _Seq]] = []
        # Continue the prefills already under way, oldest first.
        queue = self._prefilling
        while queue and (queue[0][1].state != _PREFILL or queue[0][0] != queue[0][1].epoch):
            queue.popleft()
        prefill = 0
        for epoch, seq in queue:
            if budget <= 0:
                break
            if seq.state == _PREFILL and seq.epoch == epoch and seq.prefill_left:
                chunk = min(seq.prefill_left, budget)
                seq.prefill_left -= chunk
                budget -= chunk
                prefill += chunk
                if seq.prefill_left == 0:
                    done.append((epoch, seq))
        # Admit from the head of the queue (not in a step that had to preempt, unless idle).
        if not preempted or not self._running:
            prefill += self._admit(budget, done)
        # Like vLLM's scheduler stats, the waiting gauge is what the scheduler could not take at
        # its latest step; a request that arrived since then is not counted until the next step.
        self._reported_waiting = self._n_waiting
        if decoding == 0 and prefill == 0:
            self._ready_at = None  # nothing can run until something changes
            return
        self._k_planned += 1
        self._step_start = start
        duration = (
            profile.step_base_s
            + profile.decode_token_s * decoding
            + profile.prefill_token_s * prefill
            + profile.kv_token_s * self._kv_dec
        ) * self._factor
        self._step_end = start + duration
        self._step_done = done
        self._ready_at = None

    def _make_room(self, at: float) -> bool:
        """Preempt the newest sequences until every decoder can store one more KV token."""
        cap = self.profile.kv_capacity_tokens
        preempted = False
        while self.kv_used_tokens + self._n_decoding > cap and self._running:
            _, victim = self._running.popitem()
            preempted = True
            if victim.state == _DECODE:
                held = victim.kv0 + (self._k_planned - victim.p0)
                victim.gen = victim.g0 + (self._k_done - victim.p0)
                victim.last_at = self._last_end  # it decoded in every step since joining
                self._kv_dec -= held
                self._n_decoding -= 1
                if self._token_events and victim.gen > victim.delivered:
                    self._events.append(
                        TokenEvent(victim.rid, at, "tokens", victim.gen - victim.delivered)
                    )
                    victim.delivered = victim.gen
            else:
                held = victim.kv_need
            self.kv_used_tokens -= held
            victim.state = _WAITING
            victim.epoch += 1
            victim.kv_need = victim.prompt + victim.gen
            victim.prefill_left = victim.kv_need  # recomputed in full
            self._waiting.appendleft(victim)
            self._n_waiting += 1
            self._preemptions += 1
            self._events.append(TokenEvent(victim.rid, at, "preempted", 0))
        return preempted

    def _admit(self, budget: int, done: list[tuple[int, _Seq]]) -> int:
        """Start prefilling queued requests, first come first served; return tokens scheduled."""
        profile = self.profile
        cap = profile.kv_capacity_tokens
        waiting = self._waiting
        running = self._running
        scheduled = 0
        while budget > 0 and self._n_waiting and len(running) < profile.max_num_seqs:
            seq = waiting[0]
            if seq.state != _WAITING:  # aborted while queued
                waiting.popleft()
                continue
            if self.kv_used_tokens + seq.kv_need > cap:
                break
            waiting.popleft()
            self._n_waiting -= 1
            seq.state = _PREFILL
            running[seq.rid] = seq
            self.kv_used_tokens += seq.kv_need
            self._prefilling.append((seq.epoch, seq))
            chunk = min(seq.prefill_left, budget)
            seq.prefill_left -= chunk
            budget -= chunk
            scheduled += chunk
            if seq.prefill_left == 0:
                done.append((seq.epoch, seq))
        return scheduled

    def _complete(self, end: float) -> None:
        k = self._k_done = self._k_planned
        self._step_end = None
        self._last_end = end
        self._flush_due = True
        decoders = self._n_decoding
        self._gen_total += decoders
        if decoders:
            # Steps follow each other without a gap while anything decodes, so every decoder
            # waited exactly this step for its token: one bisect, whatever the batch.
            self._observe_itl(end - self._step_start, decoders)
        heap = self._finish_heap
        events = self._events
        while heap and heap[0][0] <= k:
            _, _, epoch, seq = heapq.heappop(heap)
            if seq.state != _DECODE or seq.epoch != epoch:
                continue
            held = seq.kv0 + (k - seq.p0)
            self.kv_used_tokens -= held
            self._kv_dec -= held
            self._n_decoding -= 1
            self._finish(seq, end)
        for epoch, seq in self._step_done:
            if seq.state != _PREFILL or seq.epoch != epoch:
                continue
            self._gen_total += 1
            seq.gen += 1
            if not seq.started:
                seq.started = True
                seq.delivered = 1
                events.append(TokenEvent(seq.rid, end, "first_token", 1))
                self._prompt_total += seq.prompt
                ttft = end - seq.submit_at
                self._ttft_sum += ttft
                self._ttft_count += 1
                self._ttft_counts[bisect_left(TTFT_BUCKETS, ttft)] += 1
            else:  # readmitted after a preemption: this token ends a long gap
                self._observe_itl(end - seq.last_at, 1)
            if seq.gen >= seq.target:
                self.kv_used_tokens -= seq.kv_need
                self._finish(seq, end)
                continue
            seq.state = _DECODE
            seq.p0 = k
            seq.g0 = seq.gen
            seq.kv0 = seq.kv_need
            self._kv_dec += seq.kv_need
            self._n_decoding += 1
            self._tie += 1
            heapq.heappush(heap, (k + seq.target - seq.gen, self._tie, seq.epoch, seq))
        self._step_done = []
        if self._has_work():
            self._ready_at = end

    def _observe_itl(self, gap: float, tokens: int) -> None:
        """``tokens`` output tokens, each ``gap`` seconds after its request's previous one."""
        self._itl_counts[bisect_left(self._itl_bounds, gap)] += tokens
        self._itl_sum += gap * tokens
        self._itl_count += tokens

    def _finish(self, seq: _Seq, at: float) -> None:
        """End ``seq`` normally (its KV already released by the caller)."""
        seq.gen = seq.target
        left = seq.target - seq.delivered
        if self._token_events and left > 0:
            self._events.append(TokenEvent(seq.rid, at, "tokens", left))
            left = 0
        seq.delivered = seq.target
        self._events.append(TokenEvent(seq.rid, at, "finished", left))
        seq.state = _GONE
        del self._running[seq.rid]
        del self._seqs[seq.rid]
        self._finished_total += 1

    def _flush_tokens(self) -> None:
        """Hand out the tokens decoders made since their last event, stamped with the last step."""
        k = self._k_done
        at = self._last_end
        events = self._events
        for seq in self._running.values():
            if seq.state == _DECODE:
                gen = seq.g0 + (k - seq.p0)
                if gen > seq.delivered:
                    events.append(TokenEvent(seq.rid, at, "tokens", gen - seq.delivered))
                    seq.delivered = gen
