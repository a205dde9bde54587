"""`critical_kv`: output-aware selection (CriticalKV, Feng et al. 2025, "Identify Critical KV Cache in LLM
Inference from an Output Perturbation Perspective", arXiv 2502.03805).

Attention weights alone do not say how much a token moves the layer's output: its contribution is
a_i · W_o v_i, so CriticalKV bounds the output perturbation of evicting token i by a_i · ‖W_o v_i‖ and
keeps the tokens with the largest bound. Here the attention is TOVA's (strategies/tova.py: the latest
query's, per KV group) and the score of a held token is a_i · ‖v_i‖₂.

- Decode: the latest step's attention times the norm of the stored value (read back from the storage,
  so quantized storage scores the values attention reads); the lowest is evicted.
- Prompt: the last prompt query's attention times the norms of the prompt's values.

Where this differs from the paper:
- ‖v_i‖₂ instead of ‖W_o v_i‖₁ (the paper's bound and its code take the ℓ1 norm of the projected value): a
  cache receives K/V but not the layer's output projection; for a W_o close to a scaled orthogonal map
  ‖W_o v‖₁ is on average proportional to ‖v‖₂ (not to ‖v‖₁), so the two rank alike.
- No ε: kvpress's CriticalKVPress ranks by (a_i + 10⁻⁴)·‖W_o v_i‖, which orders tokens whose attention is
  below ~10⁻⁴ by their value norm alone; the paper's bound has none.
- One query (TOVA's latest) instead of SnapKV's observation window, and one stage: the paper first keeps
  the top attention tokens, then re-ranks by the bound; the product alone is its second stage.
- The prompt rule needs the prompt's values, which reach a cache's own prefill only: another cache using
  `critical_kv` as its --prompt_compression_strategy is refused.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from cache import KVCache, register_strategy
from errors import UserError
from strategies.tova import TovaCache


class PromptValueNorms:
    """Mixed in before KVCache by a strategy whose prompt rule weighs tokens by their values: a prompt rule sees
    keys and queries only, so the values the cache is given with a prompt are kept here
    (`observe_prompt_values`: a prefill's, a chunked prefill's virtual prompt's, one head's under adakv): their
    norms, and with `keeps_prompt_values` the values themselves, which that strategy's `after_prefill` drops
    (the last reader: a prompt's values are the size of its keys)."""

    # ‖v‖ of the last prompt's tokens, [B, n_kv, T] (eager, T floats per head; cleared by reset), of the
    # order the strategy weighs values by (value_norm_order: 2, or VATP's 1).
    prompt_value_norms: Tensor | None = None
    value_norm_order: ClassVar[float] = 2
    # The values themselves, [B, n_kv, T, D], for a strategy that sets keeps_prompt_values.
    prompt_values: Tensor | None = None
    keeps_prompt_values: bool = False

    def observe_prompt_values(self, v: Tensor) -> None:
        self.prompt_value_norms = self.value_norms(v)
        if self.keeps_prompt_values:
            self.prompt_values = v

    def reset(self) -> None:
        super().reset()
        self.prompt_value_norms = self.prompt_values = None

    @classmethod
    def value_norms(cls, v: Tensor) -> Tensor:
        """‖v‖ of order `value_norm_order` over the last dimension, in float32: [..., D] -> [...]."""
        return torch.linalg.vector_norm(v.float(), ord=cls.value_norm_order, dim=-1)

    @classmethod
    def value_norms_for(cls, cache: KVCache, k: Tensor) -> Tensor:
        """The value norms of the prompt keys k [B, n_kv, T, D] `cache` is scoring; refused for a cache of another
        strategy using this rule as its --prompt_compression_strategy (its values never reach this rule)."""
        return cls.observed_for(cache, k, "prompt_value_norms")

    @classmethod
    def values_for(cls, cache: KVCache, k: Tensor) -> Tensor:
        """The values [B, n_kv, T, D] of the prompt keys k `cache` is scoring (keeps_prompt_values), as above."""
        return cls.observed_for(cache, k, "prompt_values")

    @classmethod
    def observed_by(cls, cache_class: type) -> bool:
        """Whether a cache of `cache_class` keeps what this rule reads of the prompt's values: norms of this rule's
        order (a cache weighing by ℓ2 norms cannot serve VATP's ℓ1), and the values themselves where it reads them."""
        return (issubclass(cache_class, PromptValueNorms) and cache_class.value_norm_order == cls.value_norm_order
                and (cache_class.keeps_prompt_values or not cls.keeps_prompt_values))

    @classmethod
    def observed_for(cls, cache: KVCache, k: Tensor, attribute: str) -> Tensor:
        observed = getattr(cache, attribute, None)
        if observed is not None and observed.shape[2] == k.shape[2] and cls.observed_by(type(cache)):
            return observed
        if isinstance(cache, cls):
            raise ValueError(f"a {cls.name} cache was asked to score a prompt whose values it was not given")
        raise UserError(prompt_values_refusal(cls.name, cache.name))


def prompt_values_refusal(rule: str, cache: str) -> str:
    """Why a `cache` cache cannot take `rule` as its --prompt_compression_strategy: one line."""
    return (f"prompt compression '{rule}' weighs tokens by the prompt's values as a {rule} cache keeps them (got a "
            f"{cache} cache); use --cache_strategy {rule} or another compressor")


@register_strategy
class CriticalKVCache(PromptValueNorms, TovaCache):
    name = "critical_kv"
    hyperparameters = ("global_tokens", "recent_window")

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.last_attention * self.value_norms(self.values())

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        attention = TovaCache.prompt_scores(cache, k, q)
        return attention * cls.value_norms_for(cache, k)
