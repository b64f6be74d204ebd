"""An LRU cache of prompt blocks, the way vLLM's automatic prefix caching reuses a shared prefix.

Reads: nothing; a simulation asks it about each request's block ids (Mooncake's ``hash_ids``:
one id per ``block_tokens``-token block of the prompt, two prompts with equal leading ids
sharing those blocks' tokens).

The model:

- A request's *cached* tokens are its leading run of blocks already held, ``block_tokens`` each,
  stopping at the first block not held (a prefix cache can only reuse a prefix: a block after a
  miss was computed over different earlier tokens). The count is capped at ``prompt_tokens - 1``:
  the engine computes at least the last prompt token to produce the first output token's logits,
  as vLLM does when a whole prompt hits.
- Then every block of the request is held and becomes the most recently used, its first block
  most of all; least recently used blocks are evicted beyond ``capacity_blocks``. Touching the
  blocks last to first means that under pressure a prompt's tail goes before its head (vLLM frees
  a finished request's blocks in reverse order for the same reason), so a shared system prompt
  outlives the conversations that extend it.

Not modelled: the cache here is only the bookkeeping of which blocks exist. It does not take KV
space from running sequences (vLLM's cached blocks are exactly the free ones, reclaimed when
running sequences need room), and a block counts as held from the moment its request is looked
up rather than once its prefill has computed it. Both make reuse somewhat more likely than on a
real engine whose KV cache is busy.

Guarantees: pure (no I/O, clock or randomness); deterministic for a sequence of calls; at most
``capacity_blocks`` blocks held after every call; each call costs O(blocks of the request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

__all__ = ("MOONCAKE_BLOCK_TOKENS", "PrefixCache")

#: Tokens per ``hash_ids`` block in the Mooncake traces: stated in ``../shared/data/README.md``
#: and ``tests/fixtures/traces/README.md``, and borne out by every row of the committed trace
#: (``len(hash_ids) == ceil(input_length / 512)``; ``tests/property/adapters/test_traces.py``).
MOONCAKE_BLOCK_TOKENS: Final = 512


class PrefixCache:
    """Which prompt blocks are cached, least recently used first; see the module docstring."""

    __slots__ = ("_block_tokens", "_blocks", "_capacity")

    def __init__(self, capacity_blocks: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int):
            raise TypeError("capacity_blocks must be an int")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int):
            raise TypeError("block_tokens must be an int")
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._capacity = capacity_blocks
        self._block_tokens = block_tokens
        #: block id -> None, least recently used first.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    def __len__(self) -> int:
        """Blocks held now."""
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def lookup_and_insert(self, hash_ids: Sequence[int], prompt_tokens: int) -> int:
        """Cached tokens of a request whose prompt has these blocks; then hold its blocks.

        ``prompt_tokens`` bounds the answer (at most ``prompt_tokens - 1``, never below 0).
        """
        blocks = self._blocks
        hits = 0
        for block in hash_ids:
            if block not in blocks:
                break
            hits += 1
        cached = max(0, min(hits * self._block_tokens, prompt_tokens - 1))
        for block in reversed(hash_ids):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)
        return cached
