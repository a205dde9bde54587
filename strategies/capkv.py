"""`capkv`: capacity-aware eviction (CapKV, Tang, Yang, Lv & Zhen 2026, "Rethinking KV Cache Eviction via a
Unified Information-Theoretic Objective", arXiv 2604.25975).

Under a linear-Gaussian surrogate of attention, the information a kept set of tokens carries about the output
is a log-determinant, log det(I + Σᵢ wᵢ uᵢuᵢᵀ), of the tokens' output directions uᵢ weighted by how much the
queries attend to them. A token's share of that capacity is its weighted leverage in the capacity matrix, so
CapKV keeps the tokens with the largest

    scoreᵢ = wᵢ · vᵢᵀ A⁻¹ vᵢ,   A = I + Σⱼ (wⱼ + ε) vⱼvⱼᵀ,   wᵢ = exp(τ · (cos(μ, kᵢ) − maxⱼ cos(μ, kⱼ)))

with the value vᵢ as the output direction, μ an anchor of the queries, τ = `--capkv_tau` (5) and ε = 1e-6, as
kvpress's CapPress: keys and anchor normalised, the exponent shifted by its maximum, the first `global_tokens`
(sinks) out of every sum and kept.

- Prompt: μ is the mean of the prompt's queries after the sinks, over the query heads of the KV group; the best
  scores are kept (sinks and the recent window protected).
- Decode (the paper compresses the prompt): a decoded token is scored when it enters, against the prompt's μ,
  its maximum cosine and A (kept from the prefill: A⁻¹ as the whitening map W = L⁻¹ of A = LLᵀ, so the leverage
  is ‖W v‖², d² per head); prompt tokens keep the scores they were kept by.

Where this differs from the press: the anchor is the mean of the queries after RoPE (a cache receives rotated
queries; kvpress rotates the pre-RoPE mean by RoPE averaged over the next 512 positions, which damps the
fast-rotating pairs as averaging the rotated queries does), and one anchor, weight and capacity matrix per KV
head (the press keeps them per query head and averages the scores over the group: a cache's buffers are sized
before it sees how many query heads share a KV head). Solved in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, Setting, finite_float, register_strategy
from kv_storage import scatter_slots
from prompt_compression import ScoredOnce
from strategies.critical_kv import PromptValueNorms

TAU = Setting("capkv_tau", 5.0, type=finite_float, low=0.0,
              help="temperature τ of the query relevance exp(τ·cos(anchor, key)) (5, as kvpress's CapPress)")
EPSILON = 1e-6  # added to each weight in the capacity matrix (kvpress's epsilon)


def capacity_statistics(k: Tensor, v: Tensor, q: Tensor, tau: float) -> dict[str, Tensor]:
    """From the prompt's keys and values [B, n_kv, n, d] and queries [B, n_head, n, d] (sinks left out): the
    unit anchor [B, n_kv, d], the largest cosine [B, n_kv, 1] and the whitening map W = L⁻¹ [B, n_kv, d, d]
    of the capacity matrix A = I + Σ (w + ε) v vᵀ = LLᵀ (float64)."""
    B, H, n, d = k.shape
    queries = q.double().unflatten(1, (H, -1))  # [B, n_kv, rep, n, d]
    anchor = F.normalize(queries.mean(dim=(2, 3)), dim=-1) if n else queries.new_zeros(B, H, d)
    cosine = (F.normalize(k.double(), dim=-1) @ anchor[..., None])[..., 0]  # [B, H, n]
    top = cosine.amax(-1, keepdim=True) if n else torch.zeros(B, H, 1, dtype=torch.float64, device=k.device)
    weight = torch.exp(tau * (cosine - top))
    x = v.double()
    eye = torch.eye(d, dtype=torch.float64, device=k.device)
    factor = torch.linalg.cholesky(eye + (x * (weight + EPSILON)[..., None]).transpose(-1, -2) @ x)
    whiten = torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False)
    return dict(anchor=anchor, top=top, whiten=whiten)


def capacity_scores(k: Tensor, v: Tensor, stats: dict[str, Tensor], tau: float) -> Tensor:
    """w · vᵀA⁻¹v of keys and values [B, n_kv, n, d] against `capacity_statistics`: [B, n_kv, n] float64."""
    cosine = (F.normalize(k.double(), dim=-1) @ stats["anchor"][..., None])[..., 0]
    leverage = (v.double() @ stats["whiten"].transpose(-1, -2)).square().sum(-1)
    return torch.exp(tau * (cosine - stats["top"])) * leverage


@register_strategy
class CapKVCache(ScoredOnce, PromptValueNorms, KVCache):
    name = "capkv"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (TAU,)
    head_specific = True
    keeps_prompt_values = True
    slot_buffers = ("score",)  # the score each held token was kept by, or entered with

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, head_dim, *args, **kwargs)
        B, H, d = batch_size, n_kv_heads, head_dim
        kw = dict(dtype=torch.float64, device=self.pos.device)
        # The prompt's statistics a decoded token is scored against (capacity_statistics), and the incoming
        # token's value (insert sees it, after_insert only its key).
        self.register_buffer("anchor", torch.zeros(B, H, d, **kw))
        self.register_buffer("top_cosine", torch.zeros(B, H, 1, **kw))
        self.register_buffer("whiten", torch.zeros(B, H, d, d, **kw))
        self.register_buffer("incoming_value", torch.zeros(B, H, 1, d, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.score

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Every prompt token's score [B, n_kv, T] float32 (the sinks above the rest) and the statistics."""
        v, tau = cls.values_for(cache, k), float(cache.setting(TAU))
        g = min(cache.global_tokens, k.shape[2])
        stats = capacity_statistics(k[:, :, g:], v[:, :, g:], q[:, :, g:], tau)
        scored = capacity_scores(k[:, :, g:], v[:, :, g:], stats, tau).float()
        top = scored.amax(-1, keepdim=True) + 1 if scored.shape[-1] else scored.new_ones(*scored.shape[:2], 1)
        return torch.cat([top.expand(*scored.shape[:2], g), scored], dim=-1), stats

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        scores, stats = self.scored_prompt(k, q)
        self.prompt_values = None  # the last reader of the prompt's values
        self.anchor.copy_(stats["anchor"])
        self.top_cosine.copy_(stats["top"])
        self.whiten.copy_(stats["whiten"])
        n = keep.shape[-1]
        self.score[:, :, :n] = scores.gather(2, keep)

    def observe_token_values(self, v: Tensor) -> None:
        self.incoming_value.copy_(v)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        stats = dict(anchor=self.anchor, top=self.top_cosine, whiten=self.whiten)
        score = capacity_scores(k, self.incoming_value, stats, float(self.setting(TAU)))
        scatter_slots(self.score, 2, slot[..., None], score.float())
