"""The KV cache contract (DESIGN.md §4) and the registry of eviction strategies.

One `KVCache` per attention layer. Every tensor is a registered buffer of fixed shape, so a compiled
decode step never recompiles:

- `k_cache`, `v_cache`: [B, n_kv_heads, L, head_dim], L = this layer's budget. Keys are stored after
  RoPE at their original absolute position; eviction leaves gaps and nothing is re-rotated.
- `pos`: original position held in each slot, -1 when empty: [B, n_kv_heads or 1, L] (per head only
  for head-specific strategies, which evict different tokens in different heads).
- `mask`: which slots hold a token, [B, n_kv_heads, 1, L] (the shape attention broadcasts against).
- `inserted`: tokens that went through this cache, per head [B, n_kv_heads].

A strategy is a small subclass: it scores tokens (`token_scores`, the lowest is evicted first) or
overrides how a slot is chosen, and lists the hyper-parameters it reads in `hyperparameters`
(their flags, defaults and help live in one place: cache_spec.py). Slots are chosen with tensor ops
only (fill the next empty slot, else evict the argmin score), so there are no host syncs or
data-dependent shapes in the decode step.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from errors import UserError


class KVCache(nn.Module):
    name: ClassVar[str] = ""
    # Names of cache_spec flags this strategy reads (global_tokens, recent_window, ...).
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    # Evicts different tokens in different KV heads (then `pos` is per head).
    head_specific: ClassVar[bool] = False
    # Wants the decode-time attention probabilities (per KV head) through `update_state`.
    needs_attention: ClassVar[bool] = False
    # Global (sink) tokens and the recent window are never evicted (when the strategy reads them).
    protects_global_and_recent: ClassVar[bool] = True

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_cache_length: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        **hyperparameters: object,
    ) -> None:
        super().__init__()
        unknown = set(hyperparameters) - set(self.hyperparameters)
        if unknown:
            raise TypeError(f"{self.name} does not read hyper-parameters {sorted(unknown)}")
        self.max_cache_length = max_cache_length
        self.n_kv_heads = n_kv_heads
        self.global_tokens = int(hyperparameters.get("global_tokens", 0))
        self.recent_window = int(hyperparameters.get("recent_window", 0))
        self.hparams = dict(hyperparameters)
        B, H, L, D = batch_size, n_kv_heads, max_cache_length, head_dim
        pos_heads = H if self.head_specific else 1
        self.register_buffer("k_cache", torch.zeros(B, H, L, D, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(B, H, L, D, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((B, pos_heads, L), -1, dtype=torch.long, device=device))
        self.register_buffer("mask", torch.zeros(B, H, 1, L, dtype=torch.bool, device=device))
        self.register_buffer("inserted", torch.zeros(B, H, dtype=torch.long, device=device))

    # ---- the contract used by model.Attention -------------------------------------------------------

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        """Store the prompt's keys/values (positions `input_pos`, starting at 0) into an empty cache.

        k, v: [B, n_kv, T, D] after RoPE; q: [B, n_head, T, D], for strategies whose prompt compression
        or initial scores need the prompt's attention.
        """
        B, H, T, D = k.shape
        if T > self.max_cache_length:
            keep = self.select_prompt_tokens(input_pos, k, v, q)  # [B, pos_heads, L]
        else:
            keep = torch.arange(T, device=k.device).view(1, 1, T).expand(B, self.pos.shape[1], T)
        n = keep.shape[-1]
        idx = keep.expand(B, H, n)
        self.k_cache[:, :, :n] = k.gather(2, idx[..., None].expand(B, H, n, D))
        self.v_cache[:, :, :n] = v.gather(2, idx[..., None].expand(B, H, n, D))
        self.pos[:, :, :n] = input_pos[keep]
        self.mask[:, :, 0, :n] = True
        self.inserted.fill_(T)
        self.after_prefill(keep, input_pos, k, q)

    def update_kv(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Insert one decoded token (input_pos: [1]; k, v: [B, n_kv, 1, D]); return (k, v, mask) to attend over."""
        slot = self.choose_slot(input_pos)  # [B, pos_heads]
        B, H, _, D = k.shape
        head_slot = slot.expand(B, H)
        self.k_cache.scatter_(2, head_slot[..., None, None].expand(B, H, 1, D), k)
        self.v_cache.scatter_(2, head_slot[..., None, None].expand(B, H, 1, D), v)
        self.pos.scatter_(2, slot[..., None], input_pos.view(1, 1, 1).expand(B, slot.shape[1], 1))
        self.mask.scatter_(3, head_slot[..., None, None], True)
        self.inserted += 1
        self.after_insert(slot, input_pos, k)
        return self.k_cache, self.v_cache, self.mask

    def update_state(self, attn: Tensor) -> None:
        """Attention probabilities of the current step, [B, n_kv, L] (averaged over each KV group)."""

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.pos.fill_(-1)
        self.mask.zero_()
        self.inserted.zero_()

    # ---- what a strategy overrides ------------------------------------------------------------------

    def token_scores(self, input_pos: Tensor) -> Tensor:
        """Importance of every slot, [B, pos_heads, L]; the lowest unprotected one is evicted."""
        raise NotImplementedError

    def select_prompt_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """Indices of the prompt tokens to keep when the prompt exceeds the budget: [B, pos_heads, L]."""
        raise UserError(
            f"the prompt ({k.shape[2]} tokens) exceeds this layer's {self.name} cache "
            f"({self.max_cache_length} tokens) and no prompt compression is configured"
        )

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        """Hook: initialise per-token state for the kept prompt tokens (slots 0..n-1)."""

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        """Hook: initialise per-token state of the slot that just received a token."""

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """The next empty slot while there is one, else the lowest-scoring unprotected token."""
        filled = self.inserted[:, : self.pos.shape[1]]
        if self.max_cache_length >= self.capacity_needed:
            return filled  # never full: skip scoring (the full cache, or a budget above the sequence)
        scores = self.token_scores(input_pos).masked_fill(self.protected(input_pos), float("inf"))
        return torch.where(filled < self.max_cache_length, filled, scores.argmin(dim=-1))

    def protected(self, input_pos: Tensor) -> Tensor:
        """Slots that must not be evicted: global (sink) tokens and the recent window, [B, pos_heads, L].

        The recent window counts the token being inserted, so after the insert exactly the
        `recent_window` most recent positions are held.
        """
        if not self.protects_global_and_recent:
            return torch.zeros_like(self.pos, dtype=torch.bool)
        return (self.pos < self.global_tokens) | (self.pos > input_pos - self.recent_window)

    # Set by cache_spec.build_caches: prompt + new tokens; a budget at least this large never evicts.
    capacity_needed: int = 1 << 62

    # ---- statistics ---------------------------------------------------------------------------------

    def held_tokens(self) -> Tensor:
        """Tokens held per head, [B, n_kv]."""
        return self.mask.sum(dim=(-1, -2))

    def bits_per_value(self) -> int:
        return 16

    def compression_ratio_per_head(self) -> Tensor:
        """1 − (held × bits/16) / seen per head (DESIGN.md §6), [B, n_kv]; 0 for a head that saw nothing."""
        seen = self.inserted.clamp(min=1).double()
        ratio = 1.0 - self.held_tokens().double() * (self.bits_per_value() / 16.0) / seen
        return torch.where(self.inserted > 0, ratio, torch.zeros_like(ratio))

    def nbytes(self) -> int:
        """Physical bytes of every buffer this cache holds (K/V, positions, masks, scores, scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


# ---- registry --------------------------------------------------------------------------------------

CACHE_STRATEGIES: dict[str, type[KVCache]] = {}


def register_strategy(cls: type[KVCache]) -> type[KVCache]:
    if not cls.name or cls.name in CACHE_STRATEGIES:
        raise ValueError(f"strategy name {cls.name!r} is empty or already registered")
    CACHE_STRATEGIES[cls.name] = cls
    return cls


def get_strategy(name: str) -> type[KVCache]:
    if name not in CACHE_STRATEGIES:
        raise UserError(f"unknown cache strategy {name!r}; available: {', '.join(sorted(CACHE_STRATEGIES))}")
    return CACHE_STRATEGIES[name]


@register_strategy
class FullCache(KVCache):
    """Keeps everything: the cache is sized to the whole sequence (prompt + max_new_tokens)."""

    name = "full"
    protects_global_and_recent = False


def cache_statistics(caches: list[KVCache]) -> dict:
    """Measured statistics over all layers (DESIGN.md §6): compression per layer/head and averaged,
    physical bytes, tokens held and evicted."""
    if not caches:
        return {"cache_bytes": 0, "compression_ratio": 0.0}
    per_head = [c.compression_ratio_per_head().mean(dim=0) for c in caches]  # [n_kv] per layer
    held = [c.held_tokens().float().mean(dim=0) for c in caches]
    seen = [c.inserted.float().mean(dim=0) for c in caches]
    return {
        "cache_bytes": sum(c.nbytes() for c in caches),
        "compression_ratio": round(float(torch.stack(per_head).mean()), 4),
        "compression_ratio_per_layer": [round(float(r.mean()), 4) for r in per_head],
        "compression_ratio_per_head": [[round(float(x), 4) for x in r] for r in per_head],
        "tokens_held_per_layer": [round(float(h.mean()), 2) for h in held],
        "evictions_per_layer": [round(float((s - h).mean()), 2) for s, h in zip(seen, held, strict=False)],
        "cache_budget_per_layer": [c.max_cache_length for c in caches],
    }
