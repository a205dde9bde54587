"""A later prompt chunk's attention (--prefill_chunk, model.Attention.forward_chunk): the chunk's queries over
the tokens the cache holds and over the chunk itself, causally, as a one-shot prefill's queries would see
them minus what was evicted.

Two ways, the same attention up to rounding. When every row and KV head holds a token in the same slots (a
cache past its first fill; the tokens themselves may differ per head) and no sliding window applies, the held
tokens all precede the chunk, so each query sees all of them and the chunk up to itself: causal attention
aligned to the bottom right, which SDPA runs without a mask tensor (on CUDA its flash kernel; on the CPU one
[T, L + T] mask shared by every head). Otherwise (empty slots that differ between heads or rows, a pool, a
window) an additive mask per KV head, in blocks of queries."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def chunk_attention(q: Tensor, held_k: Tensor, held_v: Tensor, k: Tensor, v: Tensor, held_valid: Tensor,
                    held_pos: Tensor, input_pos: Tensor, sliding_window: int | None) -> Tensor:
    """q [B, n_head, T, D] of the chunk at positions input_pos [T]; held_k, held_v [B, n_kv, L, D] the cache's
    slots, held_valid [B, n_kv, L] (bool) which hold a token, held_pos (broadcastable to [B, n_kv, L]) their
    positions; k, v [B, n_kv, T, D] the chunk's own. Returns [B, n_head, T, D]."""
    B, n_kv, T = k.shape[0], k.shape[1], q.shape[2]
    if not sliding_window:
        slots = shared_preceding_slots(held_valid, held_pos, input_pos)
        if slots is not None:
            if slots.numel() < held_k.shape[2]:
                held_k, held_v = held_k.index_select(2, slots), held_v.index_select(2, slots)
            keys, values = torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)
            # Imported here: the module imports torch._dynamo (~1 s), which a command refused at its flags
            # never needs.
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(T, keys.shape[2]),
                                                  enable_gqa=True)
    pos = torch.cat([held_pos.expand(B, n_kv, -1), input_pos.expand(B, n_kv, T)], -1)
    valid = torch.cat([held_valid, pos.new_ones(B, n_kv, T, dtype=torch.bool)], -1)
    query_pos = input_pos.view(1, 1, T, 1)
    visible = valid[:, :, None, :] & (pos[:, :, None, :] <= query_pos)  # [B, n_kv, T, L + T]
    if sliding_window:
        visible &= query_pos - pos[:, :, None, :] < sliding_window
    return masked_attention_in_blocks(q, torch.cat([held_k, k], 2), torch.cat([held_v, v], 2), visible)


def shared_preceding_slots(held_valid: Tensor, held_pos: Tensor, input_pos: Tensor) -> Tensor | None:
    """The indices of the slots that hold a token, when every row and KV head holds a token in the same slots
    and all of them precede the chunk; else None (one host synchronisation a layer and chunk)."""
    first = held_valid[:1, :1]
    precede = held_pos.expand_as(held_valid) < input_pos.min()
    if not bool(((held_valid == first) & (precede | ~held_valid)).all()):
        return None
    return first[0, 0].nonzero().squeeze(1)


def masked_attention_in_blocks(q: Tensor, k: Tensor, v: Tensor, visible: Tensor,
                               max_elements: int = 2**26) -> Tensor:
    """SDPA of q [B, n_head, T, D] over k, v [B, n_kv, L, D] where visible [B, n_kv, T, L] (bool). In blocks
    of queries whose masks hold at most about `max_elements` entries, each an additive mask made once per KV
    head and one SDPA call per query head of a group (the i-th query head of every group at once), so neither
    K/V nor the mask is repeated per query head. The grouped product's float32 probabilities of a 4096-token
    chunk over 12288 slots at the 8B shape held 6.4 GB a layer (the prefill peaked 23 GB above the weights on
    the H200). Given a boolean mask per query head, SDPA's own conversion took 57% of a chunked prefill's CPU
    time at 32 heads; a float mask repeated per head, its copy 53%."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    grouped = q.reshape(B, n_kv, rep, T, D)
    rows = max(1, max_elements // (B * n_kv * k.shape[2]))
    out = torch.empty_like(grouped)
    for s in range(0, T, rows):
        hidden = ~visible[:, :, s : s + rows]
        bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        for r in range(rep):
            out[:, :, r, s : s + rows] = F.scaled_dot_product_attention(grouped[:, :, r, s : s + rows], k, v,
                                                                         attn_mask=bias)
    return out.view(B, H, T, D)
