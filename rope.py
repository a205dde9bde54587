"""Rotary position embeddings (RoPE) in the Hugging Face "rotate-half" layout every loader produces: the
tables (with Llama 3.1's and linear frequency scaling, a GGUF's per-frequency factors, and Gemma 3's local
base), the rotation (partial rotary dimensions pass through), and the rotation by rank that re-rotated caches
use (rerotation.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from rerotation import query_ranks, slot_ranks

if TYPE_CHECKING:
    from model import ModelArgs


def rope_inverse_frequencies(args: ModelArgs, local: bool = False) -> Tensor:
    """Inverse frequencies of the rotated dimensions; `local`: those of the sliding layers' own base."""
    dim = args.rope_dim
    base = args.local_rope_base if local else args.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if local:
        return inv_freq
    if args.rope_freq_factors:  # llama.cpp divides each frequency by its factor, after any linear scaling
        inv_freq = inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float64)
    kind = args.rope_scaling.get("rope_type", args.rope_scaling.get("type")) if args.rope_scaling else None
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / args.rope_scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
        s = args.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_tables(args: ModelArgs, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [context_length, rope_dim] in the rotate-half layout, float32."""
    inv_freq = rope_inverse_frequencies(args, local)
    angles = torch.outer(torch.arange(args.context_length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, D]; cos/sin: [T, R], R ≤ D. Rotation in float32, result in x's dtype.

    With R < D (partial rotary embeddings) only the first R dimensions rotate; the rest pass through.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rotate_by_rank(q: Tensor, keys: Tensor, pos: Tensor, input_pos: Tensor, cos: Tensor,
                   sin: Tensor) -> tuple[Tensor, Tensor]:
    """Re-rotation (rerotation.py): pre-RoPE queries q [B, n_head, T, D] and cached keys [B, n_kv, L, D]
    rotated by rank, the held keys of each head at 0..n−1 in order of position and each query (position
    input_pos [T]) at its own rank. pos [B, 1 or n_kv, L] is the cache's; cos/sin are the whole tables.

    Ranks stay below the cache's slots; the clamp only guards the tables' end (FastGen's `hybrid` can
    reject a token when all of a head's slots are held, which puts the query one past the last slot).
    """
    B, H, T, _ = q.shape
    n_kv = keys.shape[1]
    last = cos.shape[0] - 1
    k_rank = slot_ranks(pos).clamp(max=last)  # [B, P, L]
    per_row = T == 1 and input_pos.numel() > 1  # a decode step of rows at their own positions
    q_rank = query_ranks(pos, input_pos, per_row).clamp(max=last).expand(B, n_kv, T).repeat_interleave(H // n_kv, dim=1)
    # F.embedding: a row gather ~8x faster than advanced indexing on the CPU (measured at L = 1024).
    return (apply_rope(q, F.embedding(q_rank, cos), F.embedding(q_rank, sin)),
            apply_rope(keys, F.embedding(k_rank, cos), F.embedding(k_rank, sin)))
