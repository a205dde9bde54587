"""`l2`: keys with a low L2 norm draw the most attention (arXiv 2406.11430).

Every layer is compressed, as kvpress's KnormPress; the paper's code leaves its first layers uncompressed
(`skip_layers` 0 and 1, or more), where the norm does not predict attention: per-layer budgets do that here
(`--max_cache_length 1.0 1.0 0.5 ...`, one value a layer)."""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, register_strategy
from kv_storage import scatter_slots


@register_strategy
class L2NormCache(KVCache):
    """Keeps the keys with the lowest L2 norm, which draw the most attention (arXiv 2406.11430)."""

    name = "l2"
    hyperparameters = ("global_tokens", "recent_window")
    head_specific = True
    slot_buffers = ("key_norm",)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return -self.key_norm  # the largest norm is evicted first

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return -k.float().norm(dim=-1)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        n = keep.shape[-1]
        self.key_norm[:, :, :n] = k.float().norm(dim=-1).gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.key_norm, 2, slot[..., None], k.float().norm(dim=-1))
