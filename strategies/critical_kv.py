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
- ‖v_i‖ instead of ‖W_o v_i‖: a cache receives K/V but not the layer's output projection (the patch that
  passes W_o is in the report that introduced this file); for a W_o close to a scaled orthogonal map the
  two rank alike.
- One query (TOVA's latest) instead of SnapKV's observation window, and one stage: the paper first keeps
  the top attention tokens, then re-ranks by the bound; the product alone is its second stage.
- The prompt rule needs the prompt's values, which reach a cache's own prefill only: another cache using
  `critical_kv` as its --prompt_compression_strategy is refused, and a pooled cache
  (--budget_allocation adakv, whose prefill does not hand them on) selects its prompt by attention alone.
"""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, register_strategy
from errors import UserError
from strategies.tova import TovaCache


class PromptValueNorms:
    """Mixed in before KVCache by a strategy whose prompt rule weighs tokens by ‖v‖: a prompt rule sees keys and
    queries only, and the prompt's values reach a cache's own prefill alone, which keeps their norms here."""

    # ‖v‖ of the last prompt's tokens, [B, n_kv, T] (eager, T floats per head; set by this cache's own
    # prefill, a chunked prefill's virtual prompt too, cleared by reset), for the prompt rule.
    prompt_value_norms: Tensor | None = None

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.prompt_value_norms = v.float().norm(dim=-1)
        super().prefill(input_pos, k, v, q, k_store)

    def reset(self) -> None:
        super().reset()
        self.prompt_value_norms = None

    @classmethod
    def value_norms_for(cls, cache: KVCache, k: Tensor) -> Tensor | None:
        """The value norms of the prompt keys k [B, n_kv, T, D] `cache` is scoring; None for a pooled cache of
        this strategy (--budget_allocation adakv, whose prefill does not hand them on); refused for a cache of
        another strategy using this rule as its --prompt_compression_strategy."""
        norms = getattr(cache, "prompt_value_norms", None)
        if norms is not None and norms.shape[-1] == k.shape[2]:
            return norms
        if isinstance(cache, cls):
            return None
        raise UserError(f"prompt compression '{cls.name}' needs the prompt's values, which only a {cls.name} cache "
                        f"receives (got a {cache.name} cache); use --cache_strategy {cls.name} or another "
                        "compressor")


@register_strategy
class CriticalKVCache(PromptValueNorms, TovaCache):
    name = "critical_kv"
    hyperparameters = ("global_tokens", "recent_window")

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.last_attention * self.values().float().norm(dim=-1)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        attention = TovaCache.prompt_scores(cache, k, q)
        norms = cls.value_norms_for(cache, k)
        return attention if norms is None else attention * norms
