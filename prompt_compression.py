"""Prompt compression: which prompt tokens a layer keeps when the prompt is longer than its budget.

The scores come from a strategy's own rule (`KVCache.prompt_scores`, next to the `token_scores` it evicts
by, in the strategy's class); this module does what every rule shares: global (sink) tokens and the
most recent tokens are always kept, and the `budget − protected` best-scoring others fill the rest, per
KV head for a head-specific rule (which can only feed a head-specific cache, whose `pos` is per head).
It also holds the prompt-attention helpers those rules and the caches' initial scores use.

- `recent_global`: the newest tokens; `random`: a seeded random subset; `keep_it_odd`: odd positions;
  `l2`: the keys with the lowest L2 norm; `gated`: the highest log_gate × age as the next token arrives.
- `heavy_hitter`: SnapKV (arXiv 2404.14469): attention from an observation window of the last W prompt
  queries, pooled over neighbouring keys with kernel K (keeps clusters, not isolated spikes), top-k per
  head; the window is always kept. Its settings also give kvpress's SnapKVPress exactly
  (configs/snapkv_kvpress.yaml: average pooling per query head, prefix-only votes, W 64, K 5, no sinks).
- `full`: keeps everything, so it refuses a prompt longer than the budget; `hybrid` (FastGen) profiles
  the prompt itself.

With `--budget_allocation adakv` (budget_allocation.py) a head-specific rule's scores choose (head, token)
pairs over the whole layer instead (`adaptive_prompt_tokens`: Ada-KV), so heads keep different numbers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from errors import UserError


def prompt_attention(q: Tensor, k: Tensor, n_rows: int, per_query_head: bool = False) -> Tensor:
    """Causal attention of the prompt's last `n_rows` queries (positions S − n_rows..S − 1, S = k.shape[2])
    over the prompt keys, averaged over the query heads of each KV group (GQA): [B, n_kv, n_rows, S],
    float32; with `per_query_head` not averaged: [B, n_kv, rep, n_rows, S]. One block of
    causal_attention_blocks."""
    S = k.shape[2]
    (_, probs), = causal_attention_blocks(q[:, :, :S], k, S - n_rows, max_elements=0)
    return probs if per_query_head else probs.mean(dim=2)


def above_uniform(attn: Tensor, rows: Tensor) -> Tensor:
    """1.0 where query `rows[i]` gave a key at least uniform attention (1 / the rows[i] + 1 keys it sees)."""
    keys = torch.arange(attn.shape[-1], device=attn.device)
    return (attn >= 1.0 / (rows[:, None] + 1)).float() * (keys <= rows[:, None])


# Probabilities per block of query rows in the whole-prompt passes. On a GPU 2^26 (256 MiB in float32): a
# block is a few kernels, so a long prompt's pass costs its reads, not thousands of launches of 256-row pieces.
# On the CPU 2^21 (8 MiB): a block's scores, probabilities and sums stay in the caches from one op to the next,
# and the causal mask's wasted upper triangle shrinks to the blocks' diagonal squares. H2O's received
# attention over a 2048-token prompt, one bundled-model layer in bf16, 2 threads: 188 ms in blocks of 2^26,
# 36 ms in blocks of 2^21 (4096 tokens: 480 and 105 ms; 32 heads of 128: 526 and 132 ms; 2^20 and smaller
# were slower again: docs/performance.md).
GPU_BLOCK_ELEMENTS = 2**26
CPU_BLOCK_ELEMENTS = 2**21


def block_elements(device: torch.device) -> int:
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else GPU_BLOCK_ELEMENTS


def causal_attention_blocks(q: Tensor, k: Tensor, first_query: int = 0, max_elements: int | None = None,
                            key_valid: Tensor | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """The prompt's causal attention from query `first_query` on, in blocks of query rows: (rows [n],
    probs [B, n_kv, rep, n, end] float32, end = the last row + 1: the keys the block can see), every query
    head's own probabilities (rep query heads per KV head), at most about `max_elements` of them a block
    (None: `block_elements` of q's device; 0: one block). `key_valid` [B, n_kv, T] (bool): the keys queries may
    see (False: left out of every softmax).

    One pass reads each probability once: a KV head's query heads and rows form one matrix against its keys
    (K read once, no broadcast copy), the scale is folded into q, only the block's diagonal square is masked,
    and the softmax reads the product's dtype and writes float32."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    if max_elements is None:
        max_elements = block_elements(q.device)
    size = max(1, max_elements // (B * H * T)) if max_elements else T  # 0: the rows left, as one block
    for start in range(first_query, T, size):
        end = min(start + size, T)
        n = end - start
        rows = (q[:, :, start:end] * D**-0.5).reshape(B, n_kv, rep * n, D)
        scores = (rows @ k[:, :, :end].transpose(-1, -2)).view(B, n_kv, rep, n, end)
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores[..., start:].masked_fill_(future, float("-inf"))
        if key_valid is not None:
            scores.masked_fill_(~key_valid[:, :, None, None, :end], float("-inf"))
        yield torch.arange(start, end, device=q.device), torch.softmax(scores, dim=-1, dtype=torch.float32)


def prompt_attention_received(q: Tensor, k: Tensor, count_above_uniform: bool = False, first_query: int = 0,
                              path: str | None = None) -> Tensor:
    """Attention each prompt key receives from all prompt queries (from `first_query` on: a chunked
    prefill's re-prefill counts only the chunk's), averaged over the query heads of each KV group and
    summed over queries: [B, n_kv, T].

    With `count_above_uniform`, the number of queries that gave the key at least uniform attention
    (1 / number of keys the query sees; of the group's mean attention) instead. `path` (None: the
    device's, `received_attention_path`): "blocks", each block of queries reading only the keys it can see
    (causal_attention_blocks), so the work is half of a full T × T pass; or "fused", two fused attention
    passes that never hold the probabilities (received_attention_fused; sums only)."""
    if not count_above_uniform and (path or received_attention_path(q)) == "fused":
        try:
            return received_attention_fused(q, k, first_query)
        except RuntimeError as e:  # a GPU kernel that refuses these shapes or this dtype: the blocks serve
            if q.device.type == "cpu":
                raise
            _warn_once(f"warning: fused received attention failed on {q.device.type} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}); computing it in blocks")
    B, H, T, _ = q.shape
    n_kv = k.shape[1]
    received = torch.zeros(B, n_kv, T, dtype=torch.float32, device=q.device)
    for rows, probs in causal_attention_blocks(q, k, first_query):
        end = probs.shape[-1]
        if count_above_uniform:
            received[:, :, :end] += above_uniform(probs.mean(dim=2), rows).sum(dim=2)
        else:  # the group mean is linear: sum over heads and rows at once, one division at the end
            received[:, :, :end] += probs.sum(dim=(2, 3))
    return received if count_above_uniform else received / (H // n_kv)


# The received sums by fused attention kernels instead of materialized probabilities: GPUs only, by default.
# On this project's 2-core CPU the blocks ran 1.6-5.3x faster than two passes of the CPU's flash kernel (bf16,
# 1024-4096 tokens; docs/performance.md); on a GPU the blocks are memory-bound (scores, a float32 copy,
# softmax and sums each through memory), which the fused passes avoid. KV_RECEIVED_ATTENTION=blocks|fused
# overrides.
RECEIVED_ATTENTION_ENV = "KV_RECEIVED_ATTENTION"
RECEIVED_ATTENTION_PATHS = ("blocks", "fused")
FLASH_MAX_HEAD_DIM = 256  # CUDA's flash kernel; the second pass adds BIAS_DIMENSIONS to the head
# A bias past any score: queries before a chunked re-prefill's first one give no attention (exp(-1e4) = 0).
EXCLUDED_QUERY_BIAS = -1e4
BIAS_PARTS = 3  # the bias in three terms of the input dtype: ~24 bits of it even in bfloat16
BIAS_DIMENSIONS = 8  # the parts, padded with zeros to the kernels' alignment of head sizes
_warned: set[str] = set()


def received_attention_path(q: Tensor) -> str:
    """The fused passes for queries off the CPU whose heads leave room for the second pass's extra
    dimensions, else the blocks; KV_RECEIVED_ATTENTION overrides."""
    chosen = os.environ.get(RECEIVED_ATTENTION_ENV)
    if chosen is None:
        fits = q.shape[-1] + BIAS_DIMENSIONS <= FLASH_MAX_HEAD_DIM
        return "fused" if q.device.type != "cpu" and fits else "blocks"
    if chosen not in RECEIVED_ATTENTION_PATHS:
        raise UserError(f"{RECEIVED_ATTENTION_ENV}={chosen!r}: give one of {', '.join(RECEIVED_ATTENTION_PATHS)}")
    return chosen


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr)


def causal_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention [B, H, T, D] of equal-length q, k, v and each query row's log-sum-exp of its scaled
    scores [B, H, T] (float32), from the device's fused kernel: flash (CUDA half types, CPU), else CUDA's
    memory-efficient kernel (float32 on CUDA; its log-sum-exp is padded to 32 rows)."""
    T = q.shape[2]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                          scale=scale)[:2]
    return out, lse[..., :T].float()


def received_attention_fused(q: Tensor, k: Tensor, first_query: int = 0, max_elements: int | None = None) -> Tensor:
    """prompt_attention_received's sums (`count_above_uniform` off) by two causal attention passes.

    Key j receives r_j = Σ_{i ≥ j} exp(s_ij − lse_i), s_ij = q_i·k_j / √D, lse_i query i's log-sum-exp. The
    first pass gives lse_i. The second swaps the roles, the keys as queries and the queries as keys, both
    reversed so that "i ≥ j" is the kernel's causal mask, with −lse_i folded into the product: query j gets
    extra dimensions of ones, key i the matching −lse_i · √D split into BIAS_PARTS terms that the input dtype
    holds exactly (each the rounding of what the others leave), so s'_ji = s_ij − lse_i accumulates in the
    kernel's float32 and its log-sum-exp is log r_j. Nothing of size T × T is stored; KV groups go through
    together as long as their widened copies stay within about `max_elements` (None: `block_elements` of the
    device), so memory stays O(block) as with the blocks. Queries before `first_query` get
    EXCLUDED_QUERY_BIAS instead."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    if max_elements is None:
        max_elements = block_elements(q.device)
    groups = max(1, max_elements // (B * rep * T * (D + BIAS_DIMENSIONS)))
    return torch.cat([_received_by_group(q[:, g * rep : (g + groups) * rep], k[:, g : g + groups], first_query)
                      for g in range(0, n_kv, groups)], dim=1)


def _received_by_group(q: Tensor, k: Tensor, first_query: int) -> Tensor:
    """received_attention_fused for some KV groups at once: [B, n_kv, T]."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    keys = k.repeat_interleave(H // n_kv, dim=1)
    scale = D**-0.5
    _, lse = causal_attention_with_lse(q, keys, keys, scale)
    bias = -lse.double() / scale
    bias[..., :first_query] = EXCLUDED_QUERY_BIAS / scale
    parts = []
    for _ in range(BIAS_PARTS):
        parts.append(bias.to(q.dtype))
        bias = bias - parts[-1].double()
    pad = BIAS_DIMENSIONS - BIAS_PARTS
    swapped_keys = torch.cat([q, torch.stack(parts, dim=-1), q.new_zeros(B, H, T, pad)], dim=-1)
    swapped_queries = torch.cat([keys, keys.new_ones(B, H, T, BIAS_PARTS), keys.new_zeros(B, H, T, pad)], dim=-1)
    values = torch.zeros_like(swapped_keys)
    _, log_received = causal_attention_with_lse(swapped_queries.flip(2), swapped_keys.flip(2), values, scale)
    return torch.exp(log_received.flip(-1)).view(B, n_kv, H // n_kv, T).mean(dim=2)


def random_seed(cache) -> int:
    """Per-run, per-layer seed of random eviction (`--seed`), shared by the random cache and compressor."""
    return int(cache.hparams.get("seed", 0)) * 1_000_003 + cache.layer_idx


def hashed_bits(pos: Tensor, step: Tensor, seed: int | Tensor) -> Tensor:
    """Pseudo-random integers in [0, 2^32) (int64) from (position, step, seed): a murmur-style integer finaliser.

    Deterministic for a seed, the same eager and compiled, and free of generator state in the graph.
    """
    x = (pos * 0x9E3779B1 + step * 0x85EBCA77 + seed) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x = ((x ^ (x >> 12)) * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


def hashed_scores(pos: Tensor, step: Tensor, seed: int | Tensor) -> Tensor:
    """hashed_bits as float scores (random eviction's)."""
    return hashed_bits(pos, step, seed).float()


def hashed_uniform(pos: Tensor, step: Tensor, seed: int | Tensor) -> Tensor:
    """Uniforms strictly inside (0, 1): (2m + 1) / 2^24, exact in float32, m hashed_bits' top 23 bits. Computed
    in 32-bit arithmetic (int32, wrapping: the same bits as hashed_bits' int64 form, tested), about four times
    faster outside a compiled graph, for noise drawn for every query-key pair of a prompt."""
    seed = ((seed & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000  # the same 32 bits as a signed int32
    x = pos.int() * -0x61C8864F + step.int() * -0x7A143589 + (seed.int() if isinstance(seed, Tensor) else seed)
    x = (x ^ ((x >> 15) & 0x1FFFF)) * 0x2C1B3C6D
    x = (x ^ ((x >> 12) & 0xFFFFF)) * 0x297A2D39
    x = x ^ ((x >> 15) & 0x1FFFF)
    return (((x >> 9) & 0x7FFFFF) * 2 + 1).float() / (1 << 24)


def prompt_positions(k: Tensor) -> Tensor:
    """Positions 0..T-1 of the prompt whose keys are k [B, n_kv, T, D], as [B, 1, T]."""
    return torch.arange(k.shape[2], device=k.device).view(1, 1, -1).expand(k.shape[0], 1, -1)


SNAPKV_POOLINGS = ("max", "avg")


def snapkv_votes(q: Tensor, k: Tensor, window: int, kernel: int, pooling: str = "max", per_query_head: bool = False,
                 prefix_only: bool = False) -> Tensor:
    """SnapKV's votes: attention of the last `window` prompt queries to each key, summed over the window,
    pooled over `kernel` neighbouring keys (`pooling` max, or avg with zero padding counted, as torch's
    avg_pool1d and kvpress) and averaged over each KV group's query heads: [B, n_kv, T].

    By default the group mean comes first and the pooling runs over every key, the window's own included
    (the window's large self-votes then spill into the keys just before it). `per_query_head` pools each
    query head's votes before the group mean (SnapKV's code and kvpress's SnapKVPress; the same for avg,
    which is linear). `prefix_only` scores only the keys before the window (votes of the window's queries
    on the prefix, pooled over the prefix alone) and gives the window the largest prefix score of the
    batch row, so the window stays (kvpress's SnapKVPress pads it with the score maximum)."""
    T = k.shape[2]
    w = min(window, T)
    votes = prompt_attention(q, k, w, per_query_head).sum(dim=-2)  # [B, n_kv, (rep,) T]
    n = T - w if prefix_only else T
    if prefix_only and n == 0:  # the whole prompt is the window: nothing to choose from
        return torch.zeros(k.shape[0], k.shape[1], T, device=k.device)
    votes = pool_votes(votes[..., :n], kernel, pooling)
    if per_query_head:
        votes = votes.mean(dim=2)
    if prefix_only:
        top = votes.flatten(1).amax(dim=1).view(-1, 1, 1).expand(-1, votes.shape[1], w)
        votes = torch.cat([votes, top], dim=-1)
    return votes


def pool_votes(votes: Tensor, kernel: int, pooling: str) -> Tensor:
    """Max- or average-pool the last dimension over `kernel` neighbours (odd), same length out."""
    if kernel <= 1:
        return votes
    flat = votes.reshape(-1, 1, votes.shape[-1])
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).view(votes.shape)


def compress_prompt(cache, input_pos: Tensor, k: Tensor, q: Tensor) -> Tensor:
    """Sorted indices of the prompt tokens `cache` keeps: [B, pos_heads, budget]."""
    rule = cache.prompt_compressor
    T, budget = k.shape[2], cache.prompt_target()
    scores = None if rule is None else rule.prompt_scores(cache, k, q)
    if scores is None:
        name = "full" if rule is None else rule.name
        raise UserError(
            f"the prompt ({T} tokens) is longer than a {cache.name} cache of {budget} tokens and prompt "
            f"compression '{name}' keeps everything: choose another --prompt_compression_strategy, "
            "a larger budget, or --feed_long_prompts"
        )
    return top_prompt_tokens(scores.float(), cache.global_tokens, rule.prompt_protected_window(cache), budget,
                             cache.pos.shape[1])


def top_prompt_tokens(scores: Tensor, global_tokens: int, recent_window: int, budget: int, pos_heads: int) -> Tensor:
    """The shared selection: the first `global_tokens` and the last `recent_window` positions, then the
    best-scoring others, `budget` in all, sorted: scores [B, 1 or n_kv, T] -> [B, pos_heads, budget]."""
    B, _, T = scores.shape
    pos = torch.arange(T, device=scores.device)
    protected = (pos < global_tokens) | (pos >= T - recent_window)
    keep = largest(scores.masked_fill(protected, float("inf")), budget).sort(dim=-1).values
    return keep.expand(B, pos_heads, budget)


def adaptive_prompt_tokens(scores: Tensor, global_tokens: int, recent_window: int, budget: int, floor: int) -> Tensor:
    """Ada-KV's selection (Feng et al. 2024, arXiv 2407.11550): the layer keeps `budget` tokens per head on
    average, chosen as the best (head, token) pairs over all heads at once, so a head whose scores are
    concentrated gives slots to one whose scores are spread. Protected tokens (the first `global_tokens`,
    the last `recent_window`) are kept in every head, and every head keeps at least its `floor` best
    tokens (protected ones count; Ada-KV's safeguard, as kvpress's AdaKVPress: floor = int(alpha·budget)).

    scores [B, H, T] (one row per KV head, T > budget) -> keep [B, H, T] bool, exactly H·budget per batch row.
    """
    B, H, T = scores.shape
    pos = torch.arange(T, device=scores.device)
    protected = (pos < global_tokens) | (pos >= T - recent_window)
    s = scores.float().masked_fill(protected, float("inf"))
    if floor > 0:  # the safeguard: each head's best `floor` cannot lose to another head's
        s = s.scatter(-1, largest(s, min(floor, T)), float("inf"))
    chosen = largest(s.flatten(1), H * budget)
    return torch.zeros(B, H * T, dtype=torch.bool, device=scores.device).scatter(1, chosen, True).view(B, H, T)


def largest(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores along the last dimension, equal scores in index order. Max-pooled
    votes tie exactly across a pooling window, and topk breaks ties differently on a CPU and a GPU; a
    stable sort makes every device keep the same (head, token) pairs."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def attention_since_entry(cache, k: Tensor, q: Tensor, carried: Tensor | None,
                          count_above_uniform: bool = False) -> tuple[Tensor, Tensor]:
    """H2O's statistics over a prompt, [B, n_kv, T] each: the attention each key received from every query at or
    after it (prompt_attention_received), and how many those queries are. In a chunked prefill's re-prefill the
    held tokens' sums from the earlier chunks (`carried`, see cache_chunking's carry_over) are added to what the
    chunk's queries give them, rather than re-scored by the held tokens' own queries over what survived."""
    held = cache.scored_held_tokens(k)
    received = prompt_attention_received(q, k, count_above_uniform=count_above_uniform, first_query=held)
    if held and carried is not None:
        received[:, :, :held] += carried
    steps = (cache.scored_length(k) - cache.scored_positions(k)).float().expand_as(received)
    return received, steps


class CarriedAttentionSums:
    """Mixed in (before `KVCache`) by a strategy whose `attn_sum` accumulates the attention of every query (H2O's
    sums: heavy_hitter, cam, d2o): a chunked prefill hands the held tokens' sums to the next chunk's re-prefill
    (`carried_attn_sum`, which its prompt rule passes to `attention_since_entry`), rather than re-scoring them by the
    held tokens' own queries over what survived."""

    carried_attn_sum: Tensor | None = None

    def carry_over(self, n: int) -> object:
        return self.attn_sum[:, :, :n].clone()

    def take_over(self, carried: object) -> None:
        self.carried_attn_sum = carried


class LayerSeed:
    """Mixed in (before `KVCache`) by a strategy that draws hashed random numbers: the layer's seed (`--seed`,
    `random_seed`) as a buffer rather than a Python int, so the layers share one compiled graph; set when the
    cache is configured (a setting: reset keeps it)."""

    row_shared_buffers = ("seed",)  # the same for every row
    setting_buffers = ("seed",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("seed", torch.zeros((), dtype=torch.long, device=self.pos.device))

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        self.seed.fill_(random_seed(self))


class ScoredOnce:
    """Mixed in by a strategy whose prompt rule computes statistics its `after_prefill` needs too (compactor's
    whitening map, capkv's capacity matrix, H2O's and Keyformer's sums): `scoring(cache, k, q)` -> (scores,
    statistics). What the rule computed for its own cache is kept there and taken back by `scored_prompt` for the
    same keys, so a compressed prompt is scored once; a prompt that fitted, or that another rule chose, is scored
    there. Statistics None: nothing for after_prefill (heavy_hitter's SnapKV votes), nothing kept."""

    @classmethod
    def scoring(cls, cache, k: Tensor, q: Tensor) -> tuple[Tensor, dict]:
        raise NotImplementedError

    @classmethod
    def prompt_scores(cls, cache, k: Tensor, q: Tensor) -> Tensor:
        scores, statistics = cls.scoring(cache, k, q)
        if isinstance(cache, cls) and statistics is not None:
            cache.__dict__["prompt_scoring"] = (k, scores, statistics)
        return scores

    def scored_prompt(self, k: Tensor, q: Tensor) -> tuple[Tensor, dict]:
        stashed = self.__dict__.pop("prompt_scoring", None)
        if stashed is not None and stashed[0] is k:
            return stashed[1], stashed[2]
        return self.scoring(self, k, q)

    def reset(self) -> None:
        super().reset()
        self.__dict__.pop("prompt_scoring", None)


def stashed_scoring(cache: object) -> tuple | None:
    """What a ScoredOnce rule's `prompt_scores` kept on `cache` for its after_prefill; None if nothing."""
    return cache.__dict__.get("prompt_scoring")


def restash_scoring(cache: object, stashed: tuple | None, k: Tensor) -> None:
    """Give `cache` back a scoring taken by `stashed_scoring`, now for keys `k` (the same keys as another tensor:
    a pool's head re-entered after a chunk, its head view gone in between), so after_prefill does not score again."""
    if stashed is not None:
        cache.__dict__["prompt_scoring"] = (k, *stashed[1:])
