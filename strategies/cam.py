"""`cam`: CaM (Cache Merging, ICML 2024): an evicted token's value is merged into the tokens that follow it rather
than dropped, as kvpress's CAMPress does it step by step (`compression_interval` 1).

Eviction: the held token with the lowest average attention received since it entered (H2O's score: the sum A
over every query that saw it, the prompt's included, its KV group's query heads averaged, over the number of
those queries), averaged over the KV heads: one token for all heads, as the press averages its scorer over the
heads. The scorer is a choice here (the press takes any): heavy_hitter's decode rule.

Merge, per KV head: the evicted token's window is the `cam_merge_window` held tokens right after it in
position order (the incoming token included when fewer follow it); with probability min(1, D_e / mean D of
the window) each of them gains v_e / (window size), D the attention received since decoding began (the press's
running sum, reset at each prefill: a prompt token's D does not count the prompt's queries). The Bernoulli draw
is a hashed uniform of (seed, layer, position, head), so a run is reproducible eager, compiled and in a batch.
Where the press merges after the step's attention (its D includes that step's), this tool evicts, and so
merges, when the token comes in, before the step's attention, as every strategy here evicts. The prompt is
compressed by the same average over its own causal attention, without merging (the press merges while decoding
only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, grouped_mean, register_strategy, row_positions
from kv_storage import scatter_slots
from prompt_compression import CarriedAttentionSums, LayerSeed, ScoredOnce, attention_since_entry, hashed_scores


def merge_probability(evicted: Tensor, window_mean: Tensor) -> Tensor:
    """min(1, D_e / mean D of the window), the press's rule for a zero mean: 0/0 -> 0, x/0 -> 1."""
    ratio = evicted / window_mean.clamp(min=torch.finfo(window_mean.dtype).tiny)
    return torch.where(window_mean > 0, ratio.clamp(0, 1), (evicted > 0).to(ratio.dtype))


@register_strategy
class CamCache(LayerSeed, CarriedAttentionSums, ScoredOnce, KVCache):
    """CaM: evict the lowest average attention received (H2O's, averaged over heads) and merge its value, per head with
    probability min(1, D_e / mean D of its window; D: since decoding began), into the `cam_merge_window` tokens
    after it."""

    name = "cam"
    hyperparameters = ("global_tokens", "recent_window", "seed")
    settings = (
        MERGE_WINDOW := Setting("cam_merge_window", 32, low=1,
                                help="held tokens after an evicted one that share its value (kvpress's merge_budget, "
                                     "32)"),
        NO_MERGE := Setting("cam_no_merge", False, type=None,
                            help="evict as cam but drop the evicted value (the ablation of CaM's merge)"),
    )
    needs_attention = True
    merges_values = True
    # Per KV head: the attention each held token has received since it entered (the prompt's queries included)
    # and from how many queries (the eviction score is their ratio), and since decoding began (the press's
    # running sum, which its merge reads).
    slot_buffers = ("attn_sum", "attn_steps", "decode_attn")

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # The window and the incoming token: the most a window can hold.
        self.window = min(int(self.setting(self.MERGE_WINDOW)), self.max_cache_length + 1)
        self.merging = not bool(self.setting(self.NO_MERGE))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return (self.attn_sum / self.attn_steps.clamp(min=1)).mean(dim=1, keepdim=True)

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """H2O's average over the prompt's causal attention (a re-prefill: the held tokens' carried sums plus what
        the chunk's queries give, over every query at or after each token), averaged over the heads."""
        carried = cache.carried_attn_sum if isinstance(cache, CamCache) else None  # another cache's are not A's
        received, steps = attention_since_entry(cache, k, q, carried)
        scores = (received / steps.clamp(min=1)).mean(dim=1, keepdim=True)
        return scores, {"received": received, "steps": steps}

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        if not self.evicts_after_prompt:
            return
        _, stats = self.scored_prompt(k, q)
        n = keep.shape[-1]
        index = keep.expand(*stats["received"].shape[:2], n)
        self.attn_sum[:, :, :n] = stats["received"].gather(2, index)
        self.attn_steps[:, :, :n] = stats["steps"].gather(2, index)

    def update_state(self, probs: Tensor) -> None:
        if self.evicts_after_prompt:
            attn = grouped_mean(probs)
            self.attn_sum += attn
            self.attn_steps += self.mask[:, :, 0].float()
            self.decode_attn += attn

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        index = slot[..., None].expand(-1, self.n_kv_heads, 1)
        for state in (self.attn_sum, self.attn_steps, self.decode_attn):
            scatter_slots(state, 2, index, 0.0)

    def before_write(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Merge the token leaving `slot` [B, 1] (rows whose cache is full) into its window; the incoming token's
        key and value (its own share when it is in the window) are returned."""
        if self.never_full or not self.evicts_after_prompt or not self.merging:
            return k, v
        B, H, _, D = v.shape
        evicted_pos = self.pos.gather(2, slot[..., None])  # [B, 1, 1]
        # The window: held tokens after the evicted one, then the incoming token (column L), by position.
        after = torch.where(self.pos > evicted_pos, self.pos, torch.iinfo(self.pos.dtype).max)
        incoming = row_positions(input_pos).view(-1, 1, 1).expand(B, 1, 1)
        order, targets = torch.cat([after, incoming], -1).topk(self.window, dim=-1, largest=False)
        in_window = (order < torch.iinfo(order.dtype).max).expand(B, H, -1)  # [B, H, m]
        targets = targets.expand(B, H, -1)
        size = in_window.sum(-1, keepdim=True)  # [B, H, 1], at least the incoming token
        attn = torch.cat([self.decode_attn, self.decode_attn.new_zeros(B, H, 1)], -1)  # the incoming token's: 0
        window_mean = (attn.gather(2, targets) * in_window).sum(-1, keepdim=True) / size
        evicted_slot = slot[..., None].expand(B, H, 1)
        p = merge_probability(self.decode_attn.gather(2, evicted_slot), window_mean)
        heads = torch.arange(H, device=v.device).view(1, H, 1)
        draw = hashed_scores(evicted_pos, heads, self.seed) / 2.0**32  # [B, H, 1], uniform in [0, 1)
        full = (self.filled >= self.row_budget)[..., None]  # [B, 1, 1]: the slot holds a token to evict
        merged = (draw < p) & full
        values = self.storage.values()  # read once (on quantized storage, a dequantization of every slot)
        evicted_v = values.gather(2, evicted_slot[..., None].expand(B, H, 1, D))
        share = evicted_v * (merged / size)[..., None]  # [B, H, 1, D]
        held_target = in_window & (targets < self.max_cache_length)
        # Entries that are not a held target point at the evicted slot with nothing to add (the incoming token
        # overwrites it next).
        self.storage.add_to_values(torch.where(held_target, targets, evicted_slot),
                                   share * held_target[..., None], values)
        gets_share = (in_window & (targets == self.max_cache_length)).any(-1, keepdim=True)  # [B, H, 1]
        return k, v + share.to(v.dtype) * gets_share[..., None]
