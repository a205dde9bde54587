"""`random`: the floor every scoring rule must beat."""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, register_strategy, row_positions
from prompt_compression import LayerSeed, hashed_scores, random_seed


@register_strategy
class RandomCache(LayerSeed, KVCache):
    """Evicts a uniformly random unprotected token: the floor every scoring rule must beat.

    Scores are a hash of (seed, layer, position, step) rather than torch.rand, so a run is reproducible
    for a seed in eager and compiled mode alike and needs no generator state in the compiled graph.
    """

    name = "random"
    hyperparameters = ("global_tokens", "recent_window", "seed")

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return hashed_scores(self.pos, row_positions(input_pos), self.seed)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        # The true positions and length (a chunked prefill scores held tokens + a chunk: cache.scored_positions).
        return hashed_scores(cache.scored_positions(k), torch.tensor(cache.scored_length(k), device=k.device),
                             random_seed(cache))
