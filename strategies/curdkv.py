"""`curdkv`: value-guided selection by approximate CUR leverage (CurDKV, Sengupta, Chaudhary & Chakraborty 2025,
"Value-Guided KV Compression for LLMs via Approximated CUR Decomposition", arXiv 2509.15038).

A token's effect on the layer's output softmax(QKᵀ)V runs through its value as much as through its key, so
CurDKV keeps the rows of K and V that a CUR decomposition of them would sample: rows of large leverage. As
kvpress's CURPress, a row's leverage is approximated by its squared norm (the length-squared sampling of early
randomized CUR algorithms), normalised within consecutive windows of `--curdkv_window` tokens (16) so that a
stretch of large-norm tokens cannot take the whole budget:

    k̃ᵢ = ‖kᵢ‖² / Σ_{j ∈ window(i)} ‖kⱼ‖²,   ṽᵢ likewise,   scoreᵢ = k̃ᵢ · ṽᵢ / Σⱼ k̃ⱼ ṽⱼ   (per KV head)

`--curdkv_leverage` picks key (k̃), value (ṽ), kv_avg ((k̃ + ṽ) / 2) or kv_product (the default, above). The
last window holds the remainder of the prompt and is normalised over its own tokens (as kvpress). Sinks are
kept by the cache's `global_tokens`, kvpress's `num_sinks`.

- Prompt: the score of every prompt token; the best are kept (sinks and the recent window protected).
- Decode: CurDKV compresses the prompt only. Here a decoded token is scored when it enters, against the window
  of the last `--curdkv_window` tokens the cache was given (itself included: the windows a causal stream can
  know), on the scale of the prompt's scores (divided by the prompt's Σⱼ k̃ⱼ ṽⱼ); the lowest score held is
  evicted, and prompt tokens keep the scores they were kept by.

Where this differs from the paper and the press: exact squared norms where they may first project K and V on
a Gaussian matrix (‖xG‖² estimates ‖x‖²; the press's default projects nothing), and the decode rule above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from kv_storage import scatter_slots
from strategies.critical_kv import PromptValueNorms

LEVERAGES = ("kv_product", "kv_avg", "key", "value")
# Own settings, not prompt-rule ones: the rule needs the prompt's values, which no other cache hands it.
WINDOW = Setting("curdkv_window", 16, low=1,
                 help="tokens per window the squared norms are normalised over (16, as kvpress's CURPress)")
LEVERAGE = Setting("curdkv_leverage", LEVERAGES[0], type=str, choices=LEVERAGES,
                   help="score by the keys' normalised squared norms, the values', their mean or their product")


def window_normalised(x: Tensor, window: int) -> Tensor:
    """x [B, H, T] ≥ 0 divided by its sum over consecutive windows of `window` entries (the last one the
    remainder; a window that sums to 0 gives 0)."""
    T = x.shape[-1]
    pad = (-T) % window
    blocks = F.pad(x, (0, pad)).unflatten(-1, (-1, window))
    return (blocks / blocks.sum(-1, keepdim=True).clamp(min=1e-30)).flatten(-2)[..., :T]


def combine(k_share: Tensor, v_share: Tensor, leverage: str) -> Tensor:
    """The --curdkv_leverage combination of the keys' and values' normalised squared norms."""
    if leverage == "key":
        return k_share
    if leverage == "value":
        return v_share
    if leverage == "kv_avg":
        return (k_share + v_share) / 2
    return k_share * v_share


@register_strategy
class CurDKVCache(PromptValueNorms, KVCache):
    name = "curdkv"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (WINDOW, LEVERAGE)
    head_specific = True
    slot_buffers = ("score",)  # the score each held token was kept by, or entered with

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, head_dim, *args, **kwargs)
        window = int(self.setting(WINDOW))
        kw = dict(dtype=torch.float32, device=self.pos.device)
        # Squared key and value norms of the last `window` tokens given to the cache (oldest first; zeros
        # before there were that many), the decode rule's window; the incoming token's squared value norm
        # (insert sees its value, after_insert its key only); the prompt's Σ k̃ṽ per head.
        self.register_buffer("recent_key_sq", torch.zeros(batch_size, n_kv_heads, window, **kw))
        self.register_buffer("recent_value_sq", torch.zeros(batch_size, n_kv_heads, window, **kw))
        self.register_buffer("incoming_value_sq", torch.zeros(batch_size, n_kv_heads, 1, **kw))
        self.register_buffer("prompt_total", torch.ones(batch_size, n_kv_heads, 1, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.score

    @classmethod
    def unscaled_scores(cls, cache: KVCache, k: Tensor) -> Tensor:
        """k̃ṽ (or the chosen combination) of the prompt keys k [B, n_kv, T, D]: [B, n_kv, T] float32."""
        window = int(cache.setting(WINDOW))
        k_share = window_normalised(k.float().square().sum(-1), window)
        v_share = window_normalised(cls.value_norms_for(cache, k).square(), window)
        return combine(k_share, v_share, str(cache.setting(LEVERAGE)))

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        scores = cls.unscaled_scores(cache, k)
        return scores / scores.sum(-1, keepdim=True).clamp(min=1e-30)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        scores = self.unscaled_scores(self, k)
        total = scores.sum(-1, keepdim=True).clamp(min=1e-30)
        self.prompt_total.copy_(total)
        n = keep.shape[-1]
        self.score[:, :, :n] = (scores / total).gather(2, keep)
        window, T = self.recent_key_sq.shape[-1], k.shape[2]
        tail = min(window, T)
        self.recent_key_sq.zero_()
        self.recent_value_sq.zero_()
        self.recent_key_sq[..., window - tail :] = k[:, :, T - tail :].float().square().sum(-1)
        self.recent_value_sq[..., window - tail :] = self.prompt_value_norms[..., T - tail :].square()

    def observe_token_values(self, v: Tensor) -> None:
        self.incoming_value_sq.copy_(v.float().square().sum(-1))

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        key_sq = k.float().square().sum(-1)  # [B, n_kv, 1]
        self.recent_key_sq.copy_(torch.cat([self.recent_key_sq[..., 1:], key_sq], -1))
        self.recent_value_sq.copy_(torch.cat([self.recent_value_sq[..., 1:], self.incoming_value_sq], -1))
        k_share = key_sq / self.recent_key_sq.sum(-1, keepdim=True).clamp(min=1e-30)
        v_share = self.incoming_value_sq / self.recent_value_sq.sum(-1, keepdim=True).clamp(min=1e-30)
        score = combine(k_share, v_share, str(self.setting(LEVERAGE))) / self.prompt_total
        scatter_slots(self.score, 2, slot[..., None], score)
