"""`heavy_hitter`: H2O / ScissorHands at decode; at prefill SnapKV's window votes, or H2O's own score
(`--heavy_hitter_prompt_rule h2o`: kvpress's ObservedAttentionPress)."""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, grouped_mean, register_strategy
from kv_storage import scatter_slots
from prompt_compression import (
    SNAPKV_POOLINGS,
    CarriedAttentionSums,
    ScoredOnce,
    above_uniform,
    attention_since_entry,
    prompt_attention,
    prompt_attention_received,
    snapkv_votes,
)

PROMPT_RULES = ("snapkv", "h2o")
SNAPKV_RULE = ("heavy_hitter_prompt_rule", "snapkv")


@register_strategy
class HeavyHitterCache(CarriedAttentionSums, ScoredOnce, KVCache):
    """H2O (arXiv 2306.14048) / ScissorHands: evict the token with the lowest average attention received
    since it entered the cache. `history_window_size` W > 1 averages over the last W steps only;
    `attn_thresholding` counts the steps where a token got at least uniform attention instead of summing.
    The prompt's own causal attention seeds the history at prefill."""

    name = "heavy_hitter"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (
        HISTORY_WINDOW := Setting("history_window_size", 1, low=1,
                                  help="average attention over the last W steps (1 = whole history, as H2O)"),
        THRESHOLDING := Setting("attn_thresholding", False, type=None,
                                help="count steps with at least uniform attention instead of summing"),
        PROMPT_RULE := Setting("heavy_hitter_prompt_rule", PROMPT_RULES[0], type=str, choices=PROMPT_RULES,
                               prompt_rule=True,
                               help="prompt compression: snapkv (the last prompt queries' votes, pooled) or h2o "
                                    "(the average attention a token received from every prompt query after it; "
                                    "kvpress's ObservedAttentionPress)"),
        SNAPKV_WINDOW := Setting("snapkv_window", 32, low=1, prompt_rule=True, read_if=SNAPKV_RULE,
                                 help="prompt compression: last W queries vote (32: SnapKV's LongBench runs; "
                                      "kvpress's SnapKVPress uses 64)"),
        SNAPKV_KERNEL := Setting("snapkv_kernel", 7, low=1, odd=True, prompt_rule=True, read_if=SNAPKV_RULE,
                                 help="prompt compression: pooling kernel over the votes (7, max: SnapKV's "
                                      "LongBench runs; kvpress's SnapKVPress average-pools with 5)"),
        SNAPKV_POOLING := Setting("snapkv_pooling", SNAPKV_POOLINGS[0], type=str, choices=SNAPKV_POOLINGS,
                                  prompt_rule=True, read_if=SNAPKV_RULE,
                                  help="prompt compression: max- or average-pool the votes (avg: kvpress's "
                                       "SnapKVPress, zero padding counted)"),
        SNAPKV_PER_HEAD := Setting("snapkv_pool_per_query_head", False, type=None, prompt_rule=True,
                                   read_if=SNAPKV_RULE,
                                   help="prompt compression: pool each query head's votes, then average over the "
                                        "KV group (SnapKV's code, kvpress); default: average, then pool"),
        SNAPKV_PREFIX := Setting("snapkv_prefix_votes", False, type=None, prompt_rule=True, read_if=SNAPKV_RULE,
                                 help="prompt compression: score only the keys before the window (the window's "
                                      "votes on the prefix) and keep the window (kvpress); default: pool over "
                                      "the window too"),
    )
    head_specific = True
    needs_attention = True
    # With `evicts_after_prompt` False (KVCache; the kvpress protocols) the H2O statistics, which only decode
    # eviction reads, are not updated, nor seeded at prefill (a pass over all T x T prompt attention) unless the
    # h2o prompt rule reads them in a chunked prefill's next chunk.
    # The whole-history attention sum (window 1) and the steps each slot has been attended from.
    slot_buffers = ("attn_sum", "attn_steps")

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        B, H, L = batch_size, n_kv_heads, self.max_cache_length
        self.window = int(self.setting(self.HISTORY_WINDOW))
        self.thresholding = bool(self.setting(self.THRESHOLDING))
        kw = dict(device=self.pos.device)
        if self.window > 1:
            self.register_buffer("attn_history", torch.zeros(B, H, L, self.window, **kw))
            # Per row: a row's first column after the prompt depends on its prompt length.
            self.register_buffer("step", torch.zeros(B, dtype=torch.long, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        if self.window > 1:
            return self.attn_history.sum(-1) / self.attn_steps.clamp(min=1, max=self.window)
        return self.attn_sum / self.attn_steps.clamp(min=1)

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor] | None]:
        """SnapKV (arXiv 2404.14469): the attention the last `snapkv_window` prompt queries give each key,
        pooled over neighbouring keys; the prompt-time form of "the most attended tokens stay". Or, under
        the h2o rule, H2O's own score over the prompt (observed_attention), whose sums after_prefill seeds the
        decode statistics with (ScoredOnce: one pass)."""
        if cache.setting(cls.PROMPT_RULE) == "h2o":
            received, steps = cls.observed_attention(cache, k, q)
            return received / steps, {"received": received, "steps": steps}
        return snapkv_votes(q, k, cache.setting(cls.SNAPKV_WINDOW), cache.setting(cls.SNAPKV_KERNEL),
                            cache.setting(cls.SNAPKV_POOLING), bool(cache.setting(cls.SNAPKV_PER_HEAD)),
                            bool(cache.setting(cls.SNAPKV_PREFIX))), None

    @classmethod
    def observed_attention(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        """H2O's statistics over the prompt, [B, n_kv, T] each: the attention a key received from every query at
        or after it (the group's mean) and how many those queries are, so that their ratio is the score the
        decode rule ranks by. Its own cache carries a chunked prefill's held tokens' sums over from the earlier
        chunks (and counts steps above uniform under `attn_thresholding`); as another cache's prompt rule the
        held tokens and the chunk are scored as one prompt, by their own queries (as SnapKV's window is)."""
        if isinstance(cache, cls):
            return attention_since_entry(cache, k, q, cache.carried_attn_sum, cache.thresholding)
        T = k.shape[2]
        steps = torch.arange(T, 0, -1, device=k.device, dtype=torch.float32).expand(k.shape[0], k.shape[1], T)
        return prompt_attention_received(q, k), steps

    @classmethod
    def prompt_protected_window(cls, cache: KVCache) -> int:
        if cache.setting(cls.PROMPT_RULE) == "h2o":
            return cache.recent_window
        # SnapKV keeps its observation window itself (as far as the budget allows after the sinks).
        window = cache.setting(cls.SNAPKV_WINDOW)
        return max(cache.recent_window, min(window, cache.prompt_target() - cache.global_tokens))

    def update_state(self, probs: Tensor) -> None:
        if not self.evicts_after_prompt:
            return
        attn = grouped_mean(probs)
        if self.thresholding:
            uniform = 1.0 / self.held_tokens().clamp(min=1)[..., None]
            attn = (attn >= uniform).float() * self.mask[:, :, 0]
        self.attn_steps += self.mask[:, :, 0].float()
        if self.window > 1:
            column = (self.step % self.window).view(-1, 1, 1, 1).expand(*attn.shape, 1)
            scatter_slots(self.attn_history, 3, column, attn[..., None])
            self.step += 1
        else:
            self.attn_sum += attn

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        h2o_rule = self.setting(self.PROMPT_RULE) == "h2o"
        # The h2o prompt rule reads the sums in a chunked prefill's next chunk, even where nothing is evicted
        # after the prompt (the kvpress protocols).
        if not self.evicts_after_prompt and not h2o_rule:
            return
        # H2O's sums accumulate over every query: in a chunked prefill's re-prefill (held tokens + the chunk) a
        # held token keeps its sum from the earlier chunks and gains what the chunk's queries give it, rather
        # than what the held tokens' own queries give it over the held tokens (recomputing would re-score them
        # with attention restricted to what survived). The history window (W > 1) is the latest W queries' and
        # is recomputed: exact when the chunk has at least W tokens.
        if h2o_rule:
            statistics = self.scored_prompt(k, q)[1]
            received, steps = statistics["received"], statistics["steps"]
        else:
            received, steps = attention_since_entry(self, k, q, self.carried_attn_sum, self.thresholding)
        T, n = k.shape[2], keep.shape[-1]
        self.attn_sum[:, :, :n] = received.gather(2, keep)
        self.attn_steps[:, :, :n] = steps.gather(2, keep)
        if self.window > 1:
            # The last W prompt queries are the first W "steps" of the history, oldest in column 0, and
            # the step counter points at the column the next decode step overwrites.
            w = min(self.window, T)
            rows = torch.arange(T - w, T, device=k.device)
            attn = prompt_attention(q, k, w)  # [B, H, w, T]
            if self.thresholding:
                attn = above_uniform(attn, rows)
            self.attn_history.zero_()
            self.attn_history[:, :, :n, :w] = attn.gather(3, keep[:, :, None, :].expand(-1, -1, w, -1)).transpose(2, 3)
            self.attn_steps[:, :, :n] = self.attn_steps[:, :, :n].clamp(max=self.window)
            self.step.fill_(w % self.window)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        index = slot[..., None]
        scatter_slots(self.attn_sum, 2, index, 0.0)
        scatter_slots(self.attn_steps, 2, index, 0.0)
        if self.window > 1:
            scatter_slots(self.attn_history, 2, index[..., None].expand(*index.shape, self.window), 0.0)
