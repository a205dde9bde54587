"""Position re-rotation (`--rerotate_positions`): RoPE positions inside the cache, not in the text.

StreamingLLM (Xiao et al., arXiv 2309.17453, §3.2) assigns positions within the cache: the tokens a head
holds, in order of original position, sit at positions 0..n−1, and the current query at its own rank.
kvpress calls the same idea KeyRerotation. RoPE then only ever sees positions below the budget, so a
cache whose budget fits the model's context streams past the context window (a `recent_global` cache
with attention sinks is StreamingLLM itself).

How it is done here (docs/DESIGN.md §4):
- the cache stores keys *before* RoPE; prompt scoring and the prompt's own causal attention still use
  keys and queries rotated at their positions 0..T−1 (the prompt must fit the context);
- after the prompt (each decode step, and a chunk appended by `KVCache.append`), the layer rotates every
  slot's stored key by that slot's rank among the held slots of its head, and each query by its rank:
  the number of held tokens before it (its own rank when it is held itself);
- ranks come from the cache's `pos` (per head for head-specific caches) with one sort per row: fixed
  shapes, no host synchronisation, so the compiled decode step and CUDA graphs work unchanged.
- a prompt fed in chunks (--prefill_chunk; `model.Attention.forward_chunk`, cache_chunking.py) is at
  ranks after its first chunk: each head's held tokens at 0..n−1, the chunk at n..n+T−1, for the chunk's
  attention and for the prompt rule's scoring of the virtual prompt, so the prompt itself may exceed the
  context (the budget plus a chunk must fit it); --feed_long_prompts does the same one token at a time.

Rotating the stored keys at every step, rather than storing rotated keys and correcting them when a
token leaves, keeps the cache contract as it is (a slot's K never changes after it is written, so
quantized and KIVI storages need nothing new) and makes the ranks a pure function of `pos`, whatever
the strategy evicted. The cost is one sort of L positions and one rotation of L keys per layer and
step, the same order as reading the cache for attention.
"""

from __future__ import annotations

import torch
from torch import Tensor


def slot_ranks(pos: Tensor) -> Tensor:
    """Rank of each held slot among the held slots of its row, in order of original position.

    pos [..., L] (−1: empty slot) -> [..., L] long: the held slots of a row get 0..n−1; empty slots get 0
    (attention masks them, and 0 is always a valid index into the RoPE tables).
    """
    held = pos >= 0
    # Held positions are distinct within a row, so the sort needs no stability; empty slots sort last.
    order = pos.masked_fill(~held, torch.iinfo(pos.dtype).max).argsort(dim=-1)
    slots = torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, slots)
    return ranks.masked_fill(~held, 0)


def query_ranks(pos: Tensor, input_pos: Tensor, per_row: bool = False) -> Tensor:
    """Rank of each query: the number of held tokens before its position (its own rank when it is held).

    pos [B, P, L], input_pos [T] (or, for one query per row, [B]) -> [B, P, T] long. A token a head did not
    keep (FastGen's `hybrid` can reject one) still sits just after the tokens before it.
    """
    query = input_pos.view(-1, 1, 1, 1) if per_row else input_pos.view(-1, 1)
    before = (pos[..., None, :] >= 0) & (pos[..., None, :] < query)  # [B, P, T, L]
    return before.sum(dim=-1)
