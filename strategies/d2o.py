"""`d2o`: D2O (Dynamic Discriminative Operations, ICLR 2025, arXiv 2406.13035) at the token level, as the authors'
code runs it (`D2O_LayerKVCache`): H2O's eviction, and a compensation that merges an evicted token into the kept
token its key is closest to, when it is close enough.

Eviction: the held token, per KV head, that has received the least attention in all (the plain sum over every
query that saw it, the prompt's included: the authors' `hh_score`, not heavy_hitter's average), the sinks and the
recent window kept. The prompt is compressed by the same sums over its own causal attention.

Merge, per KV head: an evicted token's nearest kept token by the cosine similarity s of their keys (as stored:
after RoPE, before it under --rerotate_positions). Where s averaged over the KV heads reaches the threshold τ, the
nearest token's key and value become the authors' scatter-mean: (x_t + Σ s·x_e) / (1 + the number of tokens merged
into t), keys and values alike. While decoding the incoming token is kept too, so it may be the nearest. τ is an
exponential moving average of the head-averaged similarity of what is evicted: the first compression sets it to
the mean over the tokens it evicts, each later one (a decode step's token, a later chunk's tokens) sets
τ ← α·τ + (1 − α)·their mean before comparing (α = `d2o_ema`, the authors' 0.5).

Not here: D2O's layer level (budgets from each layer's attention variance, and its first two and last layers left
whole) needs data-dependent layer budgets; the authors' code keeps every query head's cache (H2O's scores per query
head), where a KV head here ranks by its group's mean attention, as heavy_hitter does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, finite_float, grouped_mean, register_strategy
from kv_storage import gather_rows, scatter_slots
from prompt_compression import CarriedAttentionSums, ScoredOnce, attention_since_entry

# Evicted prompt tokens compared with the kept ones at a time: bounds the similarity block (a 32k prompt's
# evicted tokens against its kept ones would be gigabytes at the 8B shape).
SIMILARITY_BLOCK = 1024


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of every row of a [..., m, D] with every row of b [..., n, D]: [..., m, n], float32, as dot
    products over norms (the rows are read, not normalised into copies)."""
    a, b = a.float(), b.float()
    norms = a.norm(dim=-1).clamp(min=1e-6)[..., :, None] * b.norm(dim=-1).clamp(min=1e-6)[..., None, :]
    return (a @ b.mT) / norms


def cosine_to_one(rows: Tensor, key: Tensor) -> Tensor:
    """Cosine similarity of every row of rows [B, H, n, D] with one key [B, H, 1, D]: [B, H, n], float32. Products
    summed over D rather than a matrix product: one fused reduction with the norms when compiled (a decode step's
    merge has a key a head, and the held keys)."""
    rows, key = rows.float(), key.float()
    norms = (rows * rows).sum(-1).sqrt().clamp(min=1e-6) * key.norm(dim=-1).clamp(min=1e-6)
    return (rows * key).sum(-1) / norms


def nearest(evicted: Tensor, kept: Tensor) -> tuple[Tensor, Tensor]:
    """Each evicted key's [B, H, m, D] most similar kept key [B, H, n, D]: (similarity, index) [B, H, m], in blocks
    of evicted keys."""
    best = [cosine(evicted[:, :, start : start + SIMILARITY_BLOCK], kept).max(dim=-1)
            for start in range(0, evicted.shape[2], SIMILARITY_BLOCK)]
    return torch.cat([b.values for b in best], -1), torch.cat([b.indices for b in best], -1)


def scatter_mean(kept: Tensor, targets: Tensor, similarity: Tensor, merged: Tensor, evicted: Tensor) -> Tensor:
    """The authors' merge (torch.scatter_reduce 'mean', include_self): kept [B, H, n, D] rows gain the evicted rows
    [B, H, m, D] aimed at them (targets [B, H, m]) that merge (`merged` [B, m]), weighted by their similarity [B, H,
    m], divided by 1 + their number."""
    merged = merged[:, None, :].expand_as(similarity).float()
    sums = torch.zeros_like(kept, dtype=torch.float32).scatter_add_(
        2, targets[..., None].expand_as(evicted), (similarity * merged)[..., None] * evicted.float())
    count = torch.zeros(kept.shape[:3], device=kept.device).scatter_add_(2, targets, merged)
    return ((kept.float() + sums) / (1 + count[..., None])).to(kept.dtype)


@register_strategy
class D2OCache(CarriedAttentionSums, ScoredOnce, KVCache):
    """D2O: evict the lowest attention received in all (per KV head), and merge the evicted token's key and value
    into its nearest kept token where their similarity reaches a moving threshold."""

    name = "d2o"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (
        EMA := Setting("d2o_ema", 0.5, type=finite_float, low=0.0, high=1.0,
                       help="α of the merge threshold's moving average, τ ← α·τ + (1 − α)·the evicted tokens' mean "
                            "similarity (0.5: the authors' code)"),
        NO_MERGE := Setting("d2o_no_merge", False, type=None,
                            help="evict as d2o but drop what is evicted (the ablation of D2O's compensation)"),
    )
    head_specific = True
    needs_attention = True
    merges_values = True
    merges_keys = True
    prompt_rule_needs_own_cache = "merges what it evicts into the tokens only a d2o cache keeps"
    # The attention each held token has received in all, per KV head.
    slot_buffers = ("attn_sum",)

    def __init__(self, batch_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, *args, **kwargs)
        self.ema = float(self.setting(self.EMA))
        self.merging = not bool(self.setting(self.NO_MERGE))
        # Per row: the merge threshold τ, and whether a compression has set it yet.
        self.register_buffer("threshold", torch.zeros(batch_size, device=self.pos.device))
        self.register_buffer("threshold_set", torch.zeros(batch_size, dtype=torch.bool, device=self.pos.device))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.attn_sum

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The attention each prompt key received from every query at or after it (the group's mean), summed; a
        chunked prefill's held tokens keep their sums from the earlier chunks."""
        carried = cache.carried_attn_sum if isinstance(cache, D2OCache) else None
        received, _ = attention_since_entry(cache, k, q, carried)
        return received, {"received": received}

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        _, stats = self.scored_prompt(k, q)
        self.attn_sum[:, :, : keep.shape[-1]] = stats["received"].gather(2, keep)

    def update_state(self, probs: Tensor) -> None:
        if self.evicts_after_prompt:
            self.attn_sum += grouped_mean(probs)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.attn_sum, 2, slot[..., None], 0.0)

    # ---- the merge -------------------------------------------------------------------------------------------

    def merge_gate(self, similarity: Tensor, evicting: Tensor) -> Tensor:
        """Which evicted tokens merge, [B, m], from their similarities to their nearest kept tokens [B, H, m], in
        the rows that evict (`evicting` [B]); the rows' thresholds move first (an exponential moving average of the
        evicted tokens' mean similarity, set by a row's first compression)."""
        per_token = similarity.mean(dim=1)  # [B, m]: averaged over the KV heads
        mean = per_token.mean(dim=-1)
        moved = torch.where(self.threshold_set, self.ema * self.threshold + (1 - self.ema) * mean, mean)
        self.threshold.copy_(torch.where(evicting, moved, self.threshold))
        self.threshold_set.logical_or_(evicting)
        return evicting[:, None] & (per_token >= self.threshold[:, None])

    def merge_evicted_prompt(self, keep: Tensor, k: Tensor, v: Tensor, kept_k: Tensor,
                             kept_v: Tensor) -> tuple[Tensor, Tensor]:
        if not self.merging:
            return kept_k, kept_v
        B, H, T, _ = k.shape
        held = torch.zeros(B, H, T, dtype=torch.bool, device=k.device).scatter_(2, keep, True)
        evicted = held.float().argsort(dim=-1, stable=True)[..., : T - keep.shape[-1]]  # [B, H, m], by position
        evicted_k, evicted_v = gather_rows(k, evicted), gather_rows(v, evicted)
        similarity, target = nearest(evicted_k, kept_k)
        merged = self.merge_gate(similarity, torch.ones(B, dtype=torch.bool, device=k.device))
        kept_k = scatter_mean(kept_k, target, similarity, merged, evicted_k)
        kept_v = scatter_mean(kept_v, target, similarity, merged, evicted_v)
        if self.prefill_chunk and self.storage.exact_in_chunks:  # the next chunk re-prefills from the merged copies
            self.__dict__["merged_prompt"] = (kept_k, kept_v)
        return kept_k, kept_v

    def keep_exact_kv(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        super().keep_exact_kv(k, v, positions)
        merged = self.__dict__.pop("merged_prompt", None)
        if merged is not None:
            self.chunk_keys = merged[0] if self.chunk_keys is not None else None
            self.chunk_values = merged[1] if self.chunk_values is not None else None

    def before_write(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Merge the token leaving `slot` [B, H] (rows whose cache is full) into its nearest held token or the
        incoming one; the incoming token's key and value are returned (merged into where it is the nearest)."""
        if self.never_full or not self.evicts_after_prompt or not self.merging:
            return k, v
        L = self.mask.shape[-1]
        keys, values = self.storage.keys(), self.storage.values()
        index = slot[..., None]  # [B, H, 1]
        evicted_k, evicted_v = gather_rows(keys, index), gather_rows(values, index)
        others = self.mask[:, :, 0] & (torch.arange(L, device=slot.device) != index)
        # The held keys' similarities and the incoming key's (column L), without copying the keys into one tensor.
        to_held = cosine_to_one(keys, evicted_k).masked_fill(~others, float("-inf"))
        similarity, target = torch.cat([to_held, cosine_to_one(k, evicted_k)], -1).max(dim=-1, keepdim=True)
        evicting = (self.filled >= self.row_budget).all(dim=1)  # [B]: the slot holds a token to evict
        merged = self.merge_gate(similarity, evicting)  # [B, 1]
        weight = (similarity * merged[:, None, :])[..., None]  # [B, H, 1, 1]
        # A held target gets (x_t + s·x_e) / 2; where the incoming token is the target, or nothing merges, the
        # write goes to the evicted slot, which the incoming token overwrites next.
        held_target = merged[:, None, :] & (target < L)
        slots = torch.where(held_target, target, index)
        old_k, old_v = gather_rows(keys, slots), gather_rows(values, slots)
        self.storage.write_keys(slots, torch.where(held_target[..., None], (old_k + weight * evicted_k) / 2, old_k))
        self.storage.add_to_values(slots, torch.where(held_target[..., None], (weight * evicted_v - old_v) / 2, 0.0),
                                   values)
        incoming = (merged[:, None, :] & (target == L))[..., None]
        return (torch.where(incoming, (k + weight * evicted_k) / 2, k).to(k.dtype),
                torch.where(incoming, (v + weight * evicted_v) / 2, v).to(v.dtype))
