"""`random`: the floor every scoring rule must beat."""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, register_strategy, row_positions
from prompt_compression import hashed_scores, random_seed


@register_strategy
class RandomCache(KVCache):
    """Evicts a uniformly random unprotected token: the floor every scoring rule must beat.

    Scores are a hash of (seed, layer, position, step) rather than torch.rand, so a run is reproducible
    for a seed in eager and compiled mode alike and needs no generator state in the compiled graph.
    """

    name = "random"
    hyperparameters = ("global_tokens", "recent_window", "seed")
    row_shared_buffers = ("seed",)  # the layer's seed, the same for every row

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # The per-layer seed is a buffer, not a Python int: layers then share one compiled graph.
        self.register_buffer("seed", torch.zeros((), dtype=torch.long, device=self.pos.device))

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        self.seed.fill_(random_seed(self))

    def reset(self) -> None:
        super().reset()
        self.seed.fill_(random_seed(self))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return hashed_scores(self.pos, row_positions(input_pos), self.seed)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        # The true positions and length (a chunked prefill scores held tokens + a chunk: cache.scored_positions).
        return hashed_scores(cache.scored_positions(k), torch.tensor(cache.scored_length(k), device=k.device),
                             random_seed(cache))
