"""`compactor`: Compactor (Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression
with Approximate Leverage Scores", arXiv 2507.08143).

Query-agnostic: a token is kept for what the context itself says about it, whatever question follows. Two
scores, each z-normalised over the layer's scored tokens of every KV head (one mean and spread a layer, as
kvpress's presses and the authors' code, so a head whose leverage spreads wider weighs it more), are blended as
λ · z(leverage) + z(attention), and each head keeps its best:

- Leverage: the statistical leverage of the token's key among the head's keys, ℓᵢ = cᵢᵀ (CᵀC)⁻¹ cᵢ with C the
  centred keys (cᵢ = kᵢ − mean). A key far outside the directions the other keys span is an outlier the
  rest cannot stand in for (a geometric score, as in leverage-score row sampling).
- Attention: non-causal attention within chunks of `--compactor_chunk` tokens (every query of a chunk
  attends to every key of the chunk), summed over the chunk's queries and averaged over the query heads of
  the KV group, times ‖vᵢ‖, then smoothed over neighbouring positions (a window of 3).

λ (`--compactor_blending`) defaults to the compression ratio, 1 − kept / prompt tokens, as kvpress's
CompactorPress (the paper's authors' press): the harder the compression, the more the outliers count. The
first `global_tokens` (attention sinks, whose keys are outliers of their own) are kept and left out of both
scores' statistics.

- Prompt: the blended score of every prompt token; the best are kept (sinks and the recent window
  protected).
- Decode: Compactor compresses the prompt only. Here the prompt's statistics are kept (its keys' mean, the
  whitening map L⁻¹ of their regularised Gram matrix LLᵀ, and the leverages' mean and spread), a decoded
  token is scored when it enters by the leverage of its key against them (d² per head, not a pass over
  the held keys), with an average attention term (z = 0: it has no chunk of queries), and the lowest
  score held is evicted; prompt tokens keep the scores they were kept by.

Where this differs from the paper (and from kvpress's press):
- Exact leverage scores of the d-dimensional keys (d ≤ 256, so the d × d Gram matrix is cheap), with a
  ridge of 1e-6 × its mean eigenvalue so a head with fewer scored tokens than channels stays invertible,
  where the paper approximates them with a Gaussian sketch and kvpress solves by Cholesky with jitter.
- Keys after RoPE (a cache receives them rotated), where kvpress recomputes pre-RoPE keys from the
  hidden states; leverage is not rotation-invariant per position, so scores differ from pre-RoPE ones.
- Statistics leave out the sinks but include the recent window (whose tokens become candidates at decode);
  kvpress's press leaves out its first 8 and last 4 tokens.
- The z-scores' statistics are each batch row's (kvpress's are the whole batch's, which makes a row's scores
  depend on the others; a pool re-prefilling its heads one at a time after a chunk gathers every head's parts,
  `head_statistics`); the last, partial chunk is a softmax over its own keys from its own queries (kvpress
  pads it).
The attention logits are q·k unscaled (no 1/√d), as kvpress's non-causal attention and the authors' engine
(softmax scale 1): a sharper distribution than the layer's own attention, which the z-score does not undo.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, Setting, finite_float, register_strategy
from kv_storage import scatter_slots
from prompt_compression import ScoredOnce, block_elements
from strategies.critical_kv import PromptValueNorms

BLENDING = Setting("compactor_blending", None, type=finite_float, low=0.0, prompt_rule=True,
                   help="weight λ of the leverage z-score against the attention z-score (default: the "
                        "compression ratio, 1 − kept / prompt tokens, as kvpress's CompactorPress)")
CHUNK = Setting("compactor_chunk", 256, low=1, prompt_rule=True,
                help="tokens per chunk of the non-causal attention score (256, as kvpress)")
# Ridge on the centred keys' Gram matrix, relative to its mean eigenvalue (trace / d).
RIDGE = 1e-6


def whitening(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Mean [B, H, d] and whitening map W = L⁻¹ [B, H, d, d] (float64) of keys [B, H, n, d], LLᵀ the ridge-
    regularised Gram matrix of the centred keys: a key's leverage is then ‖W (k − mean)‖²."""
    x = keys.double()
    mean = x.mean(dim=2)
    c = x - mean[:, :, None]
    gram = c.transpose(-1, -2) @ c
    d = gram.shape[-1]
    eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    factor = torch.linalg.cholesky(gram + RIDGE * scale[..., None, None] * eye)
    return mean, torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False)


def leverage(keys: Tensor, mean: Tensor, whiten: Tensor) -> Tensor:
    """Leverage of keys [B, H, n, d] against (mean, whiten) from `whitening`: [B, H, n] float64."""
    c = keys.double() - mean[:, :, None]
    return (c @ whiten.transpose(-1, -2)).square().sum(-1)


def chunk_attention(q: Tensor, k: Tensor, chunk: int) -> Tensor:
    """Non-causal attention within consecutive chunks of `chunk` tokens (logits q·k, unscaled: the module
    docstring), summed over each chunk's queries and averaged over the query heads of each KV group:
    q [B, n_head, n, d], k [B, n_kv, n, d] -> [B, n_kv, n] float32. The last chunk holds the remainder (a
    softmax over its own keys only)."""
    B, n_head, n, d = q.shape
    n_kv = k.shape[1]
    rep = n_head // n_kv
    n_chunks = math.ceil(n / chunk)
    pad = n_chunks * chunk - n
    qs = F.pad(q.float(), (0, 0, 0, pad)).view(B, n_kv, rep, n_chunks, chunk, d)
    ks = F.pad(k.float(), (0, 0, 0, pad)).view(B, n_kv, 1, n_chunks, chunk, d)
    real = torch.arange(n_chunks * chunk, device=q.device).view(n_chunks, chunk) < n  # [n_chunks, chunk]
    out = torch.empty(B, n_kv, n_chunks, chunk, device=q.device)
    # Blocks of chunks so the probabilities stay within the prompt passes' block size.
    per_block = max(1, block_elements(q.device) // (B * n_head * chunk * chunk))
    for first in range(0, n_chunks, per_block):
        block = slice(first, first + per_block)
        logits = qs[:, :, :, block] @ ks[:, :, :, block].transpose(-1, -2)
        logits = logits.masked_fill(~real[block, None, :], float("-inf"))
        probs = logits.softmax(dim=-1) * real[block, :, None]  # padded queries give nothing
        out[:, :, block] = probs.sum(dim=-2).mean(dim=2)
    return out.flatten(2)[..., :n]


def row_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and sample std of x [B, heads, n] over each batch row's heads and tokens, [B, 1, 1] each (a spread
    under 1e-6, or a single value, counts as 1e-6)."""
    flat = x.flatten(1)
    std = flat.std(dim=-1) if flat.shape[-1] > 1 else torch.zeros_like(flat[:, 0])
    return flat.mean(dim=-1).view(-1, 1, 1), std.clamp(min=1e-6).view(-1, 1, 1)


def blending(cache: KVCache, prompt_tokens: float) -> float:
    """λ: the setting, else the compression ratio: of the prompt when it exceeds the target, else the one decode
    eviction reaches (the budget against prompt + new tokens)."""
    value = cache.setting(BLENDING)
    if value is not None:
        return float(value)
    target = cache.prompt_target()
    if prompt_tokens > target:
        return 1.0 - target / prompt_tokens
    return max(0.0, 1.0 - cache.max_cache_length / cache.capacity_needed)


def scored_parts(cache: KVCache, k: Tensor, q: Tensor, norms: Tensor, g: int) -> tuple[Tensor, ...]:
    """The keys' mean and whitening map, the leverages and the smoothed attention × ‖v‖ of the tokens after the
    first g (the sinks): what compactor_scores z-normalises and blends. A pool's head scored alone after a chunk
    takes its leverages and attention from what the pool gathered of it (`head_statistics`) for the layer's
    moments."""
    mean, whiten = whitening(k[:, :, g:])
    if cache.layer_statistics is not None:
        own = cache.layer_statistics["heads"][cache.first_kv_head]
        return mean, whiten, own["leverage"], own["attention"]
    lev = leverage(k[:, :, g:], mean, whiten)
    attention = chunk_attention(q[:, :, g:], k[:, :, g:], int(cache.setting(CHUNK)))
    attention = attention * norms[..., g:]
    attention = F.avg_pool1d(attention, kernel_size=3, stride=1, padding=1)  # zero padding counted, as kvpress
    return mean, whiten, lev, attention


def compactor_scores(cache: KVCache, k: Tensor, q: Tensor, norms: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The blended scores of prompt keys k [B, n_kv, T, d] (queries q [B, n_head, T, d], value norms [B, n_kv, T]):
    [B, n_kv, T] float32 (the sinks get the largest score), and the statistics a decoded token is
    scored against (whitening, leverage mean and std, λ)."""
    B, H, T, _ = k.shape
    g = min(cache.global_tokens, T)
    # A pool's head scored alone after a chunk takes the moments (and λ) of every head's virtual prompt, as the
    # layer's heads scored together do (PooledCache.gather_layer_statistics, `head_statistics` below).
    layer = cache.layer_statistics
    lam = blending(cache, T if layer is None else float(layer["prompt_tokens"].float().mean()))
    if T - g < 2:  # nothing to take statistics over: every token is a sink or alone
        mean, whiten = whitening(k)
        lev_mean = torch.zeros(B, H, 1, dtype=torch.float64, device=k.device)
        stats = dict(mean=mean, whiten=whiten, lev_mean=lev_mean, lev_std=torch.ones_like(lev_mean), blend=lam)
        return torch.zeros(B, H, T, device=k.device), stats
    mean, whiten, lev, attention = scored_parts(cache, k, q, norms, g)
    lev_mean, lev_std = row_moments(lev if layer is None else layer["leverage"])
    att_mean, att_std = row_moments(attention if layer is None else layer["attention"])
    scored = (lam * (lev - lev_mean) / lev_std).float() + (attention - att_mean) / att_std
    scores = torch.cat([scored.amax(-1, keepdim=True).expand(B, H, g), scored], dim=-1)  # no host read
    return scores, dict(mean=mean, whiten=whiten, lev_mean=lev_mean, lev_std=lev_std, blend=lam)


@register_strategy
class CompactorCache(ScoredOnce, PromptValueNorms, KVCache):
    name = "compactor"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (BLENDING, CHUNK)
    head_specific = True
    slot_buffers = ("score",)  # the blended score each held token was kept by, or entered with

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, head_dim, *args, **kwargs)
        B, H, d = batch_size, n_kv_heads, head_dim
        kw = dict(dtype=torch.float64, device=self.pos.device)
        # A decoded key's score λ·(‖W(k − μ)‖² − mean) / std against the prompt's statistics (compactor_scores),
        # folded at prefill into ‖A k − b‖² − c (A = W·√(λ / std), b = A μ, c = λ·mean / std): a matrix-vector
        # product and a sum per head in the decode step.
        self.register_buffer("decode_map", torch.zeros(B, H, d, d, **kw))
        self.register_buffer("decode_bias", torch.zeros(B, H, d, **kw))
        self.register_buffer("decode_offset", torch.zeros(B, H, 1, **kw))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.score

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return compactor_scores(cache, k, q, cls.value_norms_for(cache, k))

    @classmethod
    def head_statistics(cls, cache: KVCache, k: Tensor, q: Tensor) -> dict[str, Tensor]:
        """One head's leverages and attention (after the sinks) and its prompt's length, which the z-scores' moments
        and λ are taken over with the other heads' (the layer's, as one shot)."""
        T, g = k.shape[2], min(cache.global_tokens, k.shape[2])
        count = torch.full((k.shape[0], 1, 1), T, device=k.device)
        if T - g < 2:
            return {"leverage": k.new_zeros(k.shape[0], 1, 0, dtype=torch.float64),
                    "attention": k.new_zeros(k.shape[0], 1, 0, dtype=torch.float32), "prompt_tokens": count}
        _, _, lev, attention = scored_parts(cache, k, q, cls.value_norms_for(cache, k), g)
        return {"leverage": lev, "attention": attention, "prompt_tokens": count}

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        scores, stats = self.scored_prompt(k, q)
        gain = (stats["blend"] / stats["lev_std"]).sqrt()  # [B, 1, 1]: one spread a layer
        decode_map = stats["whiten"] * gain[..., None]
        self.decode_map.copy_(decode_map)
        self.decode_bias.copy_((decode_map @ stats["mean"][..., None])[..., 0])
        self.decode_offset.copy_(stats["blend"] * stats["lev_mean"] / stats["lev_std"])
        n = keep.shape[-1]
        self.score[:, :, :n] = scores.gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        whitened = k.double() @ self.decode_map.transpose(-1, -2) - self.decode_bias[:, :, None]  # [B, n_kv, 1, d]
        score = whitened.square().sum(-1) - self.decode_offset  # [B, n_kv, 1]
        scatter_slots(self.score, 2, slot[..., None], score.float())
