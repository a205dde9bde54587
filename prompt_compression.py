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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from errors import UserError


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
    from cache import hashed_scores

    seed = int(cache.hparams.get("seed", 0)) * 1_000_003 + cache.layer_idx
    return hashed_scores(_positions(k), torch.tensor(k.shape[2], device=k.device), seed)


def _keep_it_odd_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    pos = _positions(k)
    return (pos % 2) * k.shape[2] + pos.float()


def _l2_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    return -k.float().norm(dim=-1)


def _snapkv_scores(cache, k: Tensor, q: Tensor) -> Tensor:  # noqa: ANN001
    from cache import prompt_attention

    T = k.shape[2]
    window = min(cache.snapkv_window, T)
    rows = torch.arange(T - window, T, device=k.device)
    votes = prompt_attention(q, k, rows).sum(dim=2)  # [B, n_kv, T]
    kernel = cache.snapkv_kernel
    if kernel > 1:
        votes = F.max_pool1d(votes, kernel_size=kernel, stride=1, padding=kernel // 2)[..., :T]
    return votes


PROMPT_COMPRESSORS: dict[str, PromptCompressor] = {
    "full": PromptCompressor(None, head_specific=False),
    "recent_global": PromptCompressor(_recent_global_scores, head_specific=False),
    "random": PromptCompressor(_random_scores, head_specific=False),
    "keep_it_odd": PromptCompressor(_keep_it_odd_scores, head_specific=False),
    "l2": PromptCompressor(_l2_scores, head_specific=True),
    "heavy_hitter": PromptCompressor(_snapkv_scores, head_specific=True),
    "hybrid": PromptCompressor(None, head_specific=True),
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
