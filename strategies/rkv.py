"""`rkv`: R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
arXiv 2505.24133).

Long reasoning traces repeat themselves, so the most attended tokens are often near-copies of each
other. R-KV scores a token by its importance minus its redundancy, Z_i = λ·I_i − (1 − λ)·R_i, and evicts
the lowest: I_i is the attention it receives, R_i its share of the head's redundancy, the softmax over the
held keys of each key's mean cosine similarity to the others. Both are distributions over the held tokens
(the attention sums to 1, and so does the softmax), as in the reference code, which is what lets one λ weigh
them: a raw mean similarity (up to 1 a token) would outweigh attention probabilities (~1/L) at any λ but the
largest. λ = `--rkv_lambda`, 0.07 by default (the reference code's `mix_lambda`).

- Decode: I_i is TOVA's (strategies/tova.py: the latest query's attention, per KV group); R_i is
  recomputed from the stored keys of the held slots at each eviction (dequantized on quantized storage),
  so it needs no state beyond TOVA's.
- Prompt: the same score over the prompt, I_i from the last prompt query, R_i over all prompt keys.

Where this differs from the paper: R-KV takes I_i from an observation window of the last α queries
(averaged, max-pooled); here I_i is the latest query's (so the prompt rule is the decode rule). Before its
softmax the reference code zeroes, for each key, its similarity to the newest key more similar than 0.5 (so the
newest copy of a repeated key counts as less redundant) and averages over every key (the key itself
counting 0); here the mean is over the other held keys and nothing is zeroed, which needs no L × L matrix.
It costs L dot products per head at each eviction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, Setting, finite_float, register_strategy
from strategies.tova import TovaCache

LAMBDA = Setting("rkv_lambda", 0.07, type=finite_float, low=0.0, high=1.0,
                 help="weight of importance (attention) against redundancy (key similarity): λ·I − (1 − λ)·R")


def redundancy(keys: Tensor, held: Tensor | None) -> Tensor:
    """Mean cosine similarity of each key to the other `held` keys ([B, n_kv, L] bool; None: all of them):
    [B, n_kv, L] float32, 0 where nothing else is held.

    The sum of a key's similarities to the held keys is its dot product with the sum of their unit vectors,
    so no L x L similarity matrix is formed: O(L·D) a head instead of O(L²·D), at every decode step too."""
    unit = F.normalize(keys.float(), dim=-1)
    weight = torch.ones_like(unit[..., 0]) if held is None else held.float()
    total = (weight[..., None] * unit).sum(dim=-2, keepdim=True)  # [B, n_kv, 1, D]
    own = (unit * unit).sum(-1)  # 1, or 0 for a zero key (F.normalize leaves it zero)
    others = (unit * total).sum(-1) - weight * own
    count = (weight.sum(-1, keepdim=True) - weight).clamp(min=1)
    return others / count


def redundancy_share(keys: Tensor, held: Tensor | None) -> Tensor:
    """R-KV's redundancy term: the softmax over the `held` keys of `redundancy`, [B, n_kv, L] float32 (0 at slots
    not held), a distribution over the held tokens as the attention it is weighed against."""
    mean = redundancy(keys, held)
    if held is None:
        return mean.softmax(dim=-1)
    # A finite fill, not −inf: a head holding nothing yet gets a uniform row, zeroed below, rather than NaNs.
    return mean.masked_fill(~held, -1e4).softmax(dim=-1) * held


@register_strategy
class RKVCache(TovaCache):
    name = "rkv"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (LAMBDA,)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        keys = self.keys()
        held = self.mask[:, :, 0]
        if keys.shape[1] != held.shape[1]:  # a pooled cache: one K/V head of pool slots, masked per head
            keys = keys.expand(-1, held.shape[1], -1, -1)
        return self.combine(self, self.last_attention, redundancy_share(keys, held))

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cls.combine(cache, TovaCache.prompt_scores(cache, k, q), redundancy_share(k, None))

    @staticmethod
    def combine(cache: KVCache, importance: Tensor, redundant: Tensor) -> Tensor:
        lam = float(cache.setting(LAMBDA))
        return lam * importance - (1 - lam) * redundant
