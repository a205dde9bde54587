"""Prompt compression: which prompt tokens a layer keeps when the prompt is longer than its budget.

Each compressor scores the prompt positions; global (sink) tokens and the most recent tokens are
always kept, and the `budget − protected` best-scoring others fill the rest. A head-specific
compressor (its scores differ per KV head) can only feed a head-specific cache, whose `pos` is per head.

- `recent_global`: StreamingLLM, the newest tokens.
- `random`: a seeded random subset.
- `keep_it_odd`: odd positions.
- `l2`: the keys with the lowest L2 norm (arXiv 2406.11430).
- `heavy_hitter`: SnapKV (arXiv 2404.14469): attention from an observation window of the last W prompt
  queries, pooled over neighbouring keys with kernel K (keeps clusters, not isolated spikes), top-k per
  head; the window is always kept.
- `full`: keeps everything, so it refuses a prompt longer than the budget.
- `hybrid`: FastGen's per-head profiling (cache_hybrid.py) chooses the kept tokens itself.
- `gated`: the learned forget gates (cache_gated.py): keeps the highest log_gate × age at the end of the
  prompt, i.e. the tokens the gates say are still retained; only a gated cache receives the gates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from errors import UserError


def prompt_attention(q: Tensor, k: Tensor, rows: Tensor) -> Tensor:
    """Causal attention of the prompt queries at `rows` over all prompt keys, averaged over the query
    heads of each KV group (GQA): [B, n_kv, len(rows), T], float32."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    qc = q[:, :, rows].reshape(B, n_kv, H // n_kv, len(rows), D)
    scores = (qc @ k[:, :, None].transpose(-1, -2)).float() / D**0.5
    scores = scores.masked_fill(torch.arange(T, device=q.device) > rows[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=2)


def above_uniform(attn: Tensor, rows: Tensor) -> Tensor:
    """1.0 where query `rows[i]` gave a key at least uniform attention (1 / the rows[i] + 1 keys it sees)."""
    keys = torch.arange(attn.shape[-1], device=attn.device)
    return (attn >= 1.0 / (rows[:, None] + 1)).float() * (keys <= rows[:, None])


def prompt_attention_received(q: Tensor, k: Tensor, count_above_uniform: bool = False, chunk: int = 256) -> Tensor:
    """Attention each prompt key receives from all prompt queries, averaged over the query heads of each
    KV group and summed over queries: [B, n_kv, T].

    With `count_above_uniform`, the number of queries that gave the key at least uniform attention
    (1 / number of keys the query sees) instead. Computed in query chunks, each over the keys it can see
    only (causal: chunk [s, e) reads keys [0, e)), so memory stays O(chunk × T) and the work is half of a
    full T × T pass; the query heads of a group are rows of one matmul against their shared keys.
    """
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    received = torch.zeros(B, n_kv, T, dtype=torch.float32, device=q.device)
    scale = 1.0 / D**0.5
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        rows = torch.arange(start, end, device=q.device)
        qc = q[:, :, start:end].reshape(B, n_kv, rep * (end - start), D)
        scores = (qc @ k[:, :, :end].transpose(-1, -2)).float().mul_(scale)  # [B, n_kv, rep*rows, end]
        future = torch.arange(end, device=q.device) > rows[:, None]  # [rows, end]
        scores.masked_fill_(future.repeat(rep, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if count_above_uniform:  # the group's mean attention against uniform, as at decode (above_uniform)
            mean = probs.view(B, n_kv, rep, end - start, end).mean(dim=2)
            received[:, :, :end] += above_uniform(mean, rows).sum(dim=2)
        else:
            received[:, :, :end] += probs.sum(dim=2) / rep
    return received


def random_seed(cache) -> int:  # noqa: ANN001
    """Per-run, per-layer seed of random eviction (`--seed`), shared by the random cache and compressor."""
    return int(cache.hparams.get("seed", 0)) * 1_000_003 + cache.layer_idx


def hashed_scores(pos: Tensor, step: Tensor, seed: int | Tensor) -> Tensor:
    """Pseudo-random scores in [0, 2^32) from (position, step, seed): a murmur-style integer finaliser.

    Deterministic for a seed, the same eager and compiled, and free of generator state in the graph.
    """
    x = (pos * 0x9E3779B1 + step * 0x85EBCA77 + seed) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x = ((x ^ (x >> 12)) * 0x297A2D39) & 0xFFFFFFFF
    return (x ^ (x >> 15)).float()


@dataclass(frozen=True)
class PromptCompressor:
    # scores(cache, k [B, n_kv, T, D], q [B, n_head, T, D]) -> [B, 1 or n_kv, T]; higher is kept
    scores: Callable[..., Tensor] | None
    head_specific: bool


def _positions(k: Tensor) -> Tensor:
    return torch.arange(k.shape[2], device=k.device).view(1, 1, -1).expand(k.shape[0], 1, -1)


def _recent_global_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    return _positions(k).float()


def _random_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    return hashed_scores(_positions(k), torch.tensor(k.shape[2], device=k.device), random_seed(cache))


def _keep_it_odd_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    pos = _positions(k)
    return (pos % 2) * k.shape[2] + pos.float()


def _l2_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    return -k.float().norm(dim=-1)


def _snapkv_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    T = k.shape[2]
    window = min(cache.snapkv_window, T)
    rows = torch.arange(T - window, T, device=k.device)
    votes = prompt_attention(q, k, rows).sum(dim=2)  # [B, n_kv, T]
    kernel = cache.snapkv_kernel
    if kernel > 1:
        votes = F.max_pool1d(votes, kernel_size=kernel, stride=1, padding=kernel // 2)[..., :T]
    return votes


def _gated_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    log_gate = getattr(cache, "prompt_log_gates", None)  # [B, n_kv, T], set by GatedCache.observe_gates
    if log_gate is None:
        raise UserError(f"prompt compression 'gated' needs the learned gates, which only the gated cache receives "
                        f"(got a {cache.name} cache); use --cache_strategy gated or another compressor")
    age = (k.shape[2] - 1 - _positions(k)).float()
    return log_gate * age


PROMPT_COMPRESSORS: dict[str, PromptCompressor] = {
    "full": PromptCompressor(None, head_specific=False),
    "recent_global": PromptCompressor(_recent_global_scores, head_specific=False),
    "random": PromptCompressor(_random_scores, head_specific=False),
    "keep_it_odd": PromptCompressor(_keep_it_odd_scores, head_specific=False),
    "l2": PromptCompressor(_l2_scores, head_specific=True),
    "heavy_hitter": PromptCompressor(_snapkv_scores, head_specific=True),
    "hybrid": PromptCompressor(None, head_specific=True),
    "gated": PromptCompressor(_gated_scores, head_specific=True),
}


def compress_prompt(cache, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    """Sorted indices of the prompt tokens `cache` keeps: [B, pos_heads, budget]."""
    name = cache.prompt_compression
    compressor = PROMPT_COMPRESSORS[name]
    T, budget = k.shape[2], cache.max_cache_length
    if compressor.scores is None:
        raise UserError(
            f"the prompt ({T} tokens) is longer than a {cache.name} cache of {budget} tokens and prompt "
            f"compression '{name}' keeps everything: choose another --prompt_compression_strategy, "
            "a larger budget, or --feed_long_prompts"
        )
    scores = compressor.scores(cache, k, q).float()
    pos = _positions(k)
    window = cache.recent_window
    if name == "heavy_hitter":
        window = max(window, min(cache.snapkv_window, budget - cache.global_tokens))
    protected = (pos < cache.global_tokens) | (pos >= T - window)
    scores = scores.masked_fill(protected, float("inf"))
    keep = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
    return keep.expand(k.shape[0], cache.pos.shape[1], budget)
