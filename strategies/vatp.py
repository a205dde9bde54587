"""`vatp`: Value-Aware Token Pruning (Guo, Kamigaito and Watanabe 2024, "Attention Score is not All You Need for
Token Importance Indicator in KV Cache Reduction: Value Also Matters", arXiv 2406.12335).

A token's contribution to the attention output is its weight times its value vector, and value norms are far
from uniform (the attention sinks, which draw most of the attention, carry some of the smallest values). So
VATP ranks a token by its attention score times the ℓ1 norm of its value, ‖v_i‖₁, instead of the score alone,
and keeps the first tokens regardless (here `--global_tokens`, 4 by default), since their small values would
otherwise evict the sinks the model needs. The paper applies the product to H2O's and Scissorhands' scores;
this cache applies it to `heavy_hitter`'s, whatever its settings say they are:

- decode: heavy_hitter's score (the average attention received since entry; the last W steps with
  `--history_window_size`, the steps above uniform attention with `--attn_thresholding`, Scissorhands' count)
  times the ℓ1 norm of the stored value (read back from the storage, so a quantized value weighs as it is read);
- prompt: heavy_hitter's prompt rule (SnapKV's votes, or H2O's own score with `--heavy_hitter_prompt_rule h2o`,
  the paper's H2O w/ VATP: preset `vatp`) times the ℓ1 norms of the prompt's values.

Where this differs from the paper: heavy_hitter averages the attention a token received over the steps it was
held (H2O's paper sums it), so the product is of the average; the decode statistics themselves are
heavy_hitter's, unchanged. As critical_kv's, the prompt rule needs the prompt's values, which reach a cache's
own prefill only: another cache using `vatp` as its --prompt_compression_strategy is refused.
"""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, register_strategy
from strategies.critical_kv import PromptValueNorms
from strategies.heavy_hitter import HeavyHitterCache


@register_strategy
class ValueAwareCache(PromptValueNorms, HeavyHitterCache):
    name = "vatp"
    value_norm_order = 1

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return super().token_scores(input_pos) * self.value_norms(self.values())

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor] | None]:
        # The statistics (H2O's sums and counts, which seed the decode history) stay the attention's own.
        scores, statistics = super().scoring(cache, k, q)
        return scores * cls.value_norms_for(cache, k), statistics
