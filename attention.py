"""The attention a layer runs, apart from its weights: a prompt over itself (the fused kernel, a sliding window
where one binds), a decode step's queries over a cache's slots (grouped query heads, read from the stored form
where the storage can), and the soft-gated attention that trains the gates. model.Attention and the transformers
adapter's layers (transformers_cache.py) both call these, so the two run the same arithmetic."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import cpu_bf16_kernels
from cache import KVCache


def sliding_causal_mask(T: int, window: int, device: torch.device) -> Tensor:
    """[T, T] bool: query t sees keys t − window < j ≤ t (the window counts the query's own token)."""
    t = torch.arange(T, device=device)
    age = t[:, None] - t[None, :]
    return (age >= 0) & (age < window)


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Causal attention of a prompt over itself (q [B, n_head, T, D], k, v [B, n_kv, T, D]), within the last
    `window` tokens where the layer has a sliding window that binds (0: none): the fused kernel, no
    probabilities."""
    T = q.shape[2]
    if window and T > window:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_causal_mask(T, window, q.device),
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of T queries over a cache without repeating K/V per query head.

    q: [B, n_head, T, D]; k, v: [B, n_kv, L, D]; mask: bool, broadcastable to [B, n_kv, rep*T, L].
    The rep query heads that share a KV head are folded into rows, so each KV head is read once.
    Returns (output [B, n_head, T, D], probabilities [B, n_kv, rep*T, L] in float32).
    """
    out, probs = cpu_bf16_kernels.decode_attention(grouped_rows(q, k.shape[1]), k, v, mask)
    return out.reshape(q.shape), probs


def attend_slots(cache: KVCache, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """grouped_attention of a decode step's queries over a cache's slots (mask: which slots each group's rows
    see), read straight from the stored form where the storage can (quantized codes on the CPU: no full-size K
    and V rebuilt every step, kv_storage.Storage.attend), else over its keys() and values()."""
    stored = cache.storage.attend(grouped_rows(q, mask.shape[1]), mask)
    if stored is not None:
        return stored[0].reshape(q.shape), stored[1]
    return grouped_attention(q, cache.keys(), cache.values(), mask)


def grouped_rows(q: Tensor, n_kv: int) -> Tensor:
    """q [B, n_head, T, D] as [B, n_kv, rep * T, D]: the rep query heads that share a KV head, as its rows."""
    B, H, T, D = q.shape
    return q.reshape(B, n_kv, H // n_kv * T, D)


def soft_gated_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, global_tokens: int, recent_window: int
) -> tuple[Tensor, Tensor]:
    """Causal attention with soft eviction, for training the gates (train_gates.py).

    Key j, seen from query t ≥ j, gets (t − j)·log_gate_j added to its logit: its attention is scaled by
    its retention g_j^(t−j), per KV head and shared by that head's query heads. Keys the cache protects
    (the first `global_tokens`, and the `recent_window` newest for each query) are not decayed.
    q [B, H, T, D]; k, v [B, n_kv, T, D]; log_gate [B, n_kv, T] (≤ 0). Explicit attention: a float bias
    that needs gradients rules out the fused kernel, and training sequences are short.
    Returns (output [B, H, T, D], retained [B, n_kv, T]: Σ_j retention of the decayable keys each query
    sees, i.e. how many tokens beyond the protected ones a cache would have to hold).
    """
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    t = torch.arange(T, device=q.device)
    age = (t[:, None] - t[None, :]).float()  # [T(query), T(key)]
    decayable = (age >= recent_window) & (t[None, :] >= global_tokens)
    decay = torch.where(decayable, age * log_gate[:, :, None, :], 0.0)  # [B, n_kv, T, T]
    bias = decay.masked_fill(age < 0, float("-inf"))
    qg = q.reshape(B, n_kv, H // n_kv, T, D)
    scores = (qg @ k[:, :, None].transpose(-1, -2)).float() * (1.0 / math.sqrt(D)) + bias[:, :, None]
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v[:, :, None]
    retained = (decay.exp() * decayable).sum(dim=-1)
    return out.reshape(B, H, T, D), retained


def follows_window(cache: KVCache, window: int) -> bool:
    """Whether attending over everything `cache` holds is the sliding window's attention: the sequence
    fits the window, or the cache keeps only the newest ≤ window tokens (no sinks)."""
    if cache.capacity_needed <= window:
        return True
    keeps_newest = cache.name == "recent_global" and cache.global_tokens == 0
    return keeps_newest and cache.max_cache_length <= window
