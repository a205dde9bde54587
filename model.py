"""A Llama-architecture decoder in the spirit of gpt-fast: RMSNorm, RoPE, grouped-query attention,
SwiGLU, optional tied embeddings and q/k/v biases (Qwen2). One KV cache module per layer.

Weights are always held in the Hugging Face "rotate-half" RoPE layout; the GGUF loader undoes
llama.cpp's interleaved-pair permutation of the q/k projections (see checkpoint.py), so a single
RoPE implementation serves every checkpoint format.

Two entry points share one forward:
- prefill (T > 1, positions 0..T-1): full causal attention over the prompt itself, then each layer's
  cache keeps what fits its budget (it may compress the prompt);
- decode (T == 1): the cache picks a slot, stores the new key/value, and attention runs over the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cache import KVCache


@dataclass
class ModelArgs:
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0 means dim // n_head
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context_length: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    rope_scaling: dict = field(default_factory=dict)  # Hugging Face `rope_scaling` (llama3 / linear)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inverse_frequencies(args: ModelArgs) -> Tensor:
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    kind = args.rope_scaling.get("rope_type", args.rope_scaling.get("type")) if args.rope_scaling else None
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / args.rope_scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
        s = args.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_tables(args: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [context_length, head_dim] in the rotate-half layout, float32."""
    inv_freq = rope_inverse_frequencies(args)
    angles = torch.outer(torch.arange(args.context_length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, D]; cos/sin: [T, D]. Rotation in float32, result in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of T queries over a cache without repeating K/V per query head.

    q: [B, n_head, T, D]; k, v: [B, n_kv, L, D]; mask: bool, broadcastable to [B, n_kv, rep*T, L].
    The rep query heads that share a KV head are folded into rows, so each KV head is read once.
    Returns (output [B, n_head, T, D], probabilities [B, n_kv, rep*T, L] in float32).
    """
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    qg = q.reshape(B, n_kv, rep * T, D)
    scores = (qg @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs.to(v.dtype) @ v
    return out.reshape(B, H, T, D), probs


def soft_gated_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, global_tokens: int, recent_window: int
) -> tuple[Tensor, Tensor]:
    """Causal attention with soft eviction, for training the gates (train_gates.py).

    Key j, seen from query t ≥ j, gets (t − j)·log_gate_j added to its logit: its attention is scaled by
    its retention g_j^(t−j), per KV head and shared by that head's query heads. Keys the cache protects
    (the first `global_tokens`, and the `recent_window` newest for each query) are not decayed.
    q [B, H, T, D]; k, v [B, n_kv, T, D]; log_gate [B, n_kv, T] (≤ 0). Explicit attention: a float bias
    that needs gradients rules out the fused kernel, and training sequences are short.
    Returns (output [B, H, T, D], retained [B, n_kv, T]: Σ_j retention of the decayable keys each query
    sees, i.e. how many tokens beyond the protected ones a cache would have to hold).
    """
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    t = torch.arange(T, device=q.device)
    age = (t[:, None] - t[None, :]).float()  # [T(query), T(key)]
    decayable = (age >= recent_window) & (t[None, :] >= global_tokens)
    decay = torch.where(decayable, age * log_gate[:, :, None, :], 0.0)  # [B, n_kv, T, T]
    bias = decay.masked_fill(age < 0, float("-inf"))
    qg = q.reshape(B, n_kv, H // n_kv, T, D)
    scores = (qg @ k[:, :, None].transpose(-1, -2)).float() * (1.0 / math.sqrt(D)) + bias[:, :, None]
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v[:, :, None]
    retained = (decay.exp() * decayable).sum(dim=-1)
    return out.reshape(B, H, T, D), retained


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_head * args.head_dim, bias=args.attention_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_head * args.head_dim, bias=args.attention_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_head * args.head_dim, bias=args.attention_bias)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None
        # Learned forget gate (gates.Gate: normed hidden state -> log-gates [B, n_kv, T]), attached by
        # gates.attach_gates for gated caches and gate training; None otherwise.
        self.gate: nn.Module | None = None
        # (global_tokens, recent_window) while training gates: the cache-less forward then attends with
        # soft eviction and leaves the soft number of retained tokens in `self.retained`.
        self.soft_gating: tuple[int, int] | None = None
        self.retained: Tensor | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        cache = self.kv_cache
        if cache is not None and cache.needs_gates:
            # Each token's gate goes to the cache before its K/V (prefill or update_kv) so they stay together.
            cache.observe_gates(self.gate(x))
        if cache is None and self.soft_gating is not None:
            y, self.retained = soft_gated_attention(q, k, v, self.gate(x), *self.soft_gating)
        elif T > 1 or cache is None:
            # Prefill: causal attention over the prompt itself (the fused kernel; no probabilities).
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if cache is not None:
                cache.prefill(input_pos, k, v, q)
        else:
            k_all, v_all, mask = cache.update_kv(input_pos, k, v)
            if cache.needs_attention or x.device.type == "cpu":
                # On the CPU the explicit grouped matmul + softmax is ~3.5x faster than SDPA at 4k cached
                # tokens (DESIGN.md §7), and it yields the probabilities for caches that need them.
                y, probs = grouped_attention(q, k_all, v_all, mask)
                if cache.needs_attention:
                    # Grouped by KV head, [B, n_kv, rep, L]: the cache decides how to pool the query heads.
                    cache.update_state(probs.view(B, self.n_kv_head, -1, probs.shape[-1]))
            else:  # GPU: the fused kernel, no probabilities materialised
                head_mask = mask.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
                y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=head_mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer_idx)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope_tables()

    def init_rope_tables(self) -> None:
        """(Re)build the RoPE tables in float32 on the embedding's device; call after `.to(dtype)`,
        which would otherwise round the angles of late positions."""
        device = self.tok_embeddings.weight.device
        cos, sin = rope_tables(self.args)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def setup_caches(self, caches: list[KVCache]) -> None:
        """Attach one cache per layer (built by cache_spec.build_caches)."""
        if len(caches) != self.args.n_layer:
            raise ValueError(f"got {len(caches)} caches for {self.args.n_layer} layers")
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            if cache.needs_gates and layer.attention.gate is None:
                raise ValueError(f"layer {i}: the {cache.name} cache needs learned gates, but the model has none "
                                 "attached (gates.attach_gates / gates.attach_random_gates; generate.setup_caches "
                                 "loads the trained ones)")
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.attention.kv_cache = cache

    def remove_caches(self) -> None:
        """Back to a plain causal forward with no cache (a reference pass over a whole sequence)."""
        for layer in self.layers:
            layer.attention.kv_cache = None

    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers if layer.attention.kv_cache is not None]

    def reset_caches(self) -> None:
        for cache in self.caches():
            cache.reset()

    def forward(self, idx: Tensor, input_pos: Tensor, last_logits_only: bool = False,
                run_block: Callable[..., Tensor] | None = None) -> Tensor:
        """idx: [B, T] token ids; input_pos: [T] absolute positions (a device tensor).

        Returns float32 logits [B, T, vocab], or [B, 1, vocab] with `last_logits_only` (a prefill needs
        only the last position, and the vocabulary projection is the largest matmul of a long prompt).
        `run_block(layer, x, cos, sin, input_pos)` replaces each block's call: the compiled decode step
        passes one compiled function that every layer shares (generate.CompiledDecodeStep).
        """
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        for cache in self.caches():
            if cache.needs_token_ids:  # e.g. FastGen's special-token and punctuation policies
                cache.observe_tokens(idx)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos) if run_block is None else run_block(layer, x, cos, sin, input_pos)
        if last_logits_only:
            x = x[:, -1:]
        return self.output(self.norm(x)).float()
