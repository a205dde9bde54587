"""`heavy_hitter`: H2O / ScissorHands at decode, SnapKV at prefill."""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, grouped_mean, register_strategy
from prompt_compression import above_uniform, prompt_attention, prompt_attention_received, snapkv_votes


@register_strategy
class HeavyHitterCache(KVCache):
    """H2O (arXiv 2306.14048) / ScissorHands: evict the token with the lowest average attention received
    since it entered the cache. `history_window_size` W > 1 averages over the last W steps only;
    `attn_thresholding` counts the steps where a token got at least uniform attention instead of summing.
    The prompt's own causal attention seeds the history at prefill."""

    name = "heavy_hitter"
    hyperparameters = ("global_tokens", "recent_window", "history_window_size", "attn_thresholding")
    head_specific = True
    needs_attention = True

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        B, H, L = batch_size, n_kv_heads, self.max_cache_length
        self.window = int(self.hparams.get("history_window_size", 1))
        self.thresholding = bool(self.hparams.get("attn_thresholding", False))
        kw = dict(device=self.pos.device)
        self.register_buffer("attn_sum", torch.zeros(B, H, L, **kw))  # whole-history sum (window 1)
        self.register_buffer("attn_steps", torch.zeros(B, H, L, **kw))  # steps each slot has been attended from
        if self.window > 1:
            self.register_buffer("attn_history", torch.zeros(B, H, L, self.window, **kw))
            self.register_buffer("step", torch.zeros((), dtype=torch.long, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        if self.window > 1:
            return self.attn_history.sum(-1) / self.attn_steps.clamp(min=1, max=self.window)
        return self.attn_sum / self.attn_steps.clamp(min=1)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        """SnapKV (arXiv 2404.14469): the attention the last `snapkv_window` prompt queries give each key,
        pooled over neighbouring keys; the prompt-time form of "the most attended tokens stay"."""
        return snapkv_votes(q, k, cache.snapkv_window, cache.snapkv_kernel)

    @classmethod
    def prompt_protected_window(cls, cache: KVCache) -> int:
        # SnapKV keeps its observation window itself (as far as the budget allows after the sinks).
        return max(cache.recent_window, min(cache.snapkv_window, cache.prompt_target() - cache.global_tokens))

    def update_state(self, probs: Tensor) -> None:
        attn = grouped_mean(probs)
        if self.thresholding:
            uniform = 1.0 / self.held_tokens().clamp(min=1)[..., None]
            attn = (attn >= uniform).float() * self.mask[:, :, 0]
        self.attn_steps += self.mask[:, :, 0].float()
        if self.window > 1:
            column = (self.step % self.window).view(1, 1, 1, 1).expand(*attn.shape, 1)
            self.attn_history.scatter_(3, column, attn[..., None])
            self.step += 1
        else:
            self.attn_sum += attn

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        received = prompt_attention_received(q, k, count_above_uniform=self.thresholding)
        T, n = k.shape[2], keep.shape[-1]
        steps = (T - torch.arange(T, device=k.device)).float().expand_as(received)  # queries that saw the key
        self.attn_sum[:, :, :n] = received.gather(2, keep)
        self.attn_steps[:, :, :n] = steps.gather(2, keep)
        if self.window > 1:
            # The last W prompt queries are the first W "steps" of the history, oldest in column 0, and
            # the step counter points at the column the next decode step overwrites.
            w = min(self.window, T)
            rows = torch.arange(T - w, T, device=k.device)
            attn = prompt_attention(q, k, rows)  # [B, H, w, T]
            if self.thresholding:
                attn = above_uniform(attn, rows)
            self.attn_history.zero_()
            self.attn_history[:, :, :n, :w] = attn.gather(3, keep[:, :, None, :].expand(-1, -1, w, -1)).transpose(2, 3)
            self.attn_steps[:, :, :n] = self.attn_steps[:, :, :n].clamp(max=self.window)
            self.step.fill_(w % self.window)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        index = slot[..., None]
        self.attn_sum.scatter_(2, index, 0.0)
        self.attn_steps.scatter_(2, index, 0.0)
        if self.window > 1:
            self.attn_history.scatter_(2, index[..., None].expand(*index.shape, self.window), 0.0)
