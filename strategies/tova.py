"""`tova`: TOVA, Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv 2401.06104).

TOVA treats the bounded cache as the state of an RNN and, at every step, drops the token the current
query attends to least: no history is accumulated (that is the difference from H2O's `heavy_hitter`).
The score of a held token is its attention from the latest query, averaged over the query heads that
share its KV head (the paper averages over all heads; with grouped-query attention each KV head holds its
own tokens, so the average is per group and the cache is head-specific).

One rule, used twice:
- decode: `update_state` stores the step's attention over the slots; the next step evicts its argmin
  (the paper evicts right after the attention of step t; doing it as step t + 1 inserts is the same
  choice, with the newest token never a candidate, as it is inside the protected recent window anyway);
- prompt: the attention the last prompt query gives every prompt key (the same rule at prefill).
"""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, grouped_mean, register_strategy
from prompt_compression import prompt_attention


@register_strategy
class TovaCache(KVCache):
    name = "tova"
    hyperparameters = ("global_tokens", "recent_window")
    head_specific = True
    needs_attention = True
    slot_buffers = ("last_attention",)  # the latest query's attention over the slots (0 for empty ones)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.last_attention  # the token the latest query attended to least goes first

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return prompt_attention(q, k, 1)[:, :, 0]

    def update_state(self, probs: Tensor) -> None:
        self.last_attention.copy_(grouped_mean(probs))

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        # The last prompt query attended over the whole prompt: its attention is the "latest query"
        # the first decode step evicts by.
        n = keep.shape[-1]
        self.last_attention[:, :, :n] = TovaCache.prompt_scores(self, k, q).gather(2, keep)
