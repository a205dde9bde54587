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


@register_strategy
class CriticalKVCache(TovaCache):
    name = "critical_kv"
    hyperparameters = ("global_tokens", "recent_window")

    # ‖v‖ of the last prompt's tokens, [B, n_kv, T] (eager, T floats per head; set by this cache's own
    # prefill, cleared by reset), for the prompt rule.
    prompt_value_norms: Tensor | None = None

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.prompt_value_norms = v.float().norm(dim=-1)
        super().prefill(input_pos, k, v, q, k_store)

    def reset(self) -> None:
        super().reset()
        self.prompt_value_norms = None

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.last_attention * self.values().float().norm(dim=-1)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        attention = TovaCache.prompt_scores(cache, k, q)
        norms = getattr(cache, "prompt_value_norms", None)
        if norms is not None and norms.shape[-1] == k.shape[2]:
            return attention * norms
        if isinstance(cache, CriticalKVCache):  # pooled (adakv): its prefill does not pass the values on
            return attention
        raise UserError(f"prompt compression 'critical_kv' needs the prompt's values, which only a critical_kv "
                        f"cache receives (got a {cache.name} cache); use --cache_strategy critical_kv or another "
                        "compressor")
