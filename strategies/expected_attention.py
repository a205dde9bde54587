"""`expected_attention`: score each key by the attention future queries are expected to give it, from a
Gaussian model of the queries (kvpress's ExpectedAttentionPress, NVIDIA 2025; the kvpress paper,
arXiv 2510.00636).

If a future query q of a KV group is Gaussian, q ~ N(μ, Σ), the expected unnormalised attention it gives
a key k (head_dim d) is the log-normal mean

    E[exp(qᵀk / √d)] = exp(μᵀk / √d + kᵀΣk / (2d)),

so a key's expected attention ranks as its *expected logit* μᵀk / √d + kᵀΣk / (2d) (the softmax over the
held keys is monotone in it). The lowest expected logit is evicted. μ and Σ are the mean and covariance
of the last `--expected_attention_window` prompt queries of each query head, averaged over the query heads
of the KV group; `--expected_attention_covariance diagonal` keeps Σ's diagonal, `none` drops the term.

Where this differs from kvpress, and why:
- kvpress takes pre-RoPE statistics and rotates them by the RoPE rotation averaged over the next n
  positions. A cache here receives queries after RoPE and not the model's rotation tables, so the
  statistics are of the post-RoPE queries of the window: their rotation is averaged over the W positions
  just before the future ones (the same damping of fast-rotating pairs, slow pairs at their current
  angle), not over the future positions themselves. kvpress's statistics are of every prompt query but the
  first 4 (rotated away from their positions); post-RoPE statistics of the whole prompt would average
  rotations the next queries do not have, so here the window W nearest them (a prompt of at most W tokens:
  every query, the sinks' too).
- kvpress averages the per-head softmaxes over a group and multiplies by ‖v‖; here the statistics are
  averaged over the group (one expected query per KV head: buffers sized without the number of query
  heads, which a cache does not know before the prompt) and values are not used, because the prompt rule
  (`prompt_scores`) sees keys and queries only and must order tokens as the decode rule does.
- No decode query reaches a cache (insert gets K/V, update_state probabilities), so the statistics are
  fixed at prefill; each inserted key gets its expected logit under them once, when it arrives.

Buffers: `query_mean` [B, n_kv, d], `query_cov` [B, n_kv, d, d] (only its diagonal [B, n_kv, d] in the
other modes, zero for `none`),
`expected_logit` [B, n_kv, L]; all fixed-shape, so the compiled step never recompiles.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from errors import UserError
from kv_storage import scatter_slots

COVARIANCE_MODES = ("full", "diagonal", "none")
# Another cache using this rule as its --prompt_compression_strategy reads the defaults (not prompt_rule
# settings: the run identity leaves them out when no layer's strategy is expected_attention).
WINDOW = Setting("expected_attention_window", 64, low=1,
                 help="the last W prompt queries whose mean and covariance model future queries")
COVARIANCE = Setting("expected_attention_covariance", COVARIANCE_MODES[0], type=str, choices=COVARIANCE_MODES,
                     help="the query covariance term (full, its diagonal, or none: the mean only)")


def query_statistics(q: Tensor, n_kv: int, window: int, covariance: str) -> tuple[Tensor, Tensor]:
    """Mean [B, n_kv, d] and covariance (float32) of the last `window` queries q [B, n_head, T, d] of each
    query head, averaged over the query heads of each KV group. The covariance is [B, n_kv, d, d] when
    `full`, else its diagonal [B, n_kv, d] (zero for `none`)."""
    B, H, T, d = q.shape
    recent = q[:, :, T - min(window, T) :].float().reshape(B, n_kv, H // n_kv, -1, d)
    mean = recent.mean(dim=3)  # [B, n_kv, rep, d]
    centred = recent - mean[:, :, :, None]
    if covariance == "full":
        cov = (centred.transpose(-1, -2) @ centred / centred.shape[3]).mean(dim=2)  # [B, n_kv, d, d]
    else:
        cov = centred.square().mean(dim=3).mean(dim=2) * (covariance == "diagonal")  # [B, n_kv, d]
    return mean.mean(dim=2), cov


def expected_logit(k: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    """μᵀk / √d + kᵀΣk / (2d) of keys k [B, n_kv, n, d]: [B, n_kv, n] float32 (Σ full [B, n_kv, d, d], or
    its diagonal [B, n_kv, d])."""
    kf = k.float()
    d = kf.shape[-1]
    linear = (kf @ mean[..., None])[..., 0] / math.sqrt(d)
    if cov.dim() == kf.dim():  # full
        quadratic = ((kf @ cov) * kf).sum(-1) / (2 * d)
    else:
        quadratic = (kf.square() * cov[:, :, None]).sum(-1) / (2 * d)
    return linear + quadratic


def query_settings(cache: KVCache) -> tuple[int, str]:
    """(window, covariance mode) of `cache`, the declared defaults for a cache that does not read them."""
    window, covariance = cache.setting(WINDOW), cache.setting(COVARIANCE)
    WINDOW.check(window)
    if covariance not in COVARIANCE_MODES:
        raise UserError(f"--expected_attention_covariance must be one of {', '.join(COVARIANCE_MODES)}, "
                        f"got {covariance}")
    return int(window), str(covariance)


@register_strategy
class ExpectedAttentionCache(KVCache):
    name = "expected_attention"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (WINDOW, COVARIANCE)
    slot_buffers = ("expected_logit",)
    head_specific = True

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, head_dim, *args, **kwargs)
        B, H, d = batch_size, n_kv_heads, head_dim
        kw = dict(device=self.pos.device)
        self.register_buffer("query_mean", torch.zeros(B, H, d, **kw))
        # The full covariance only when it is used (d × d per KV head), else its diagonal.
        cov_shape = (B, H, d, d) if query_settings(self)[1] == "full" else (B, H, d)
        self.register_buffer("query_cov", torch.zeros(cov_shape, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.expected_logit  # the key future queries are expected to attend to least goes first

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        window, covariance = query_settings(cache)
        return expected_logit(k, *query_statistics(q, k.shape[1], window, covariance))

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        mean, cov = query_statistics(q, k.shape[1], *query_settings(self))
        self.query_mean.copy_(mean)
        self.query_cov.copy_(cov)
        n = keep.shape[-1]
        self.expected_logit[:, :, :n] = expected_logit(k, mean, cov).gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.expected_logit, 2, slot[..., None], expected_logit(k, self.query_mean, self.query_cov))
