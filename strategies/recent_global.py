"""`recent_global`: StreamingLLM (arXiv 2309.17453), attention sinks and a sliding window."""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, register_strategy


@register_strategy
class RecentGlobalCache(KVCache):
    """StreamingLLM (arXiv 2309.17453): attention sinks (the first `global_tokens`) + a sliding window."""

    name = "recent_global"
    hyperparameters = ("global_tokens",)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.pos.float()  # the oldest non-global token goes first

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cache.scored_positions(k).float()
