"""`keydiff`: KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

KeyDiff observes that keys pointing away from the common direction of a head's keys draw distinctive
attention, while keys close to it are redundant: it evicts the key whose cosine similarity to the anchor,
the mean of the unit-normalised keys, is highest. It reads no attention, so it runs with fused
attention kernels (SDPA / flash) that never materialise probabilities.

One rule, used twice, per KV head (head-specific):
- decode: the anchor is the mean unit key of the tokens the cache holds (the ones competing for
  eviction), recomputed from the stored keys at each eviction (on quantized storage: the dequantized
  keys, which are the keys attention reads);
- prompt: the anchor is the mean unit key of the prompt, which is the same rule over the prompt's keys.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, register_strategy


@register_strategy
class KeyDiffCache(KVCache):
    name = "keydiff"
    hyperparameters = ("global_tokens", "recent_window")
    head_specific = True

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.key_diversity(self.keys(), self.mask[:, :, 0])

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cls.key_diversity(k, None)

    @staticmethod
    def key_diversity(keys: Tensor, held: Tensor | None) -> Tensor:
        """−cos(key, anchor) per slot, [B, n_kv, L] (the highest similarity is evicted first); the anchor is
        the mean unit key over the `held` slots ([B, n_kv, L] bool; None: all of them)."""
        unit = F.normalize(keys.float(), dim=-1)
        if held is None:
            anchor = unit.mean(dim=2, keepdim=True)
        else:
            weight = held[..., None].float()
            anchor = (unit * weight).sum(dim=2, keepdim=True) / weight.sum(dim=2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(unit, anchor, dim=-1)
