"""`keep_it_odd`: the smallest strategy, the worked example of docs/DESIGN.md §4."""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, register_strategy


@register_strategy
class KeepItOddCache(KVCache):
    """A toy, to show how small a strategy is: evict even positions (oldest first), keep odd ones."""

    name = "keep_it_odd"
    hyperparameters = ("global_tokens", "recent_window")

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.odd_first(self.pos, self.capacity_needed)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cls.odd_first(cache.scored_positions(k), cache.scored_length(k))

    @staticmethod
    def odd_first(pos: Tensor, span: int) -> Tensor:
        """Odd positions above even ones (`span` exceeds every position), the newest first within each."""
        return (pos % 2) * float(span) + pos.float()
