"""A Llama-family decoder in the spirit of gpt-fast: RMSNorm, RoPE, grouped-query attention, gated MLP,
one KV cache module per layer. The architecture differences the loaders read from a checkpoint are
ModelArgs fields, each a small step around the same forward:

- q/k/v biases (Qwen2); per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3);
- Gemma 3: embeddings scaled by sqrt(dim), norms that multiply by (1 + weight), norms after attention
  and after the MLP as well as before, GELU(tanh) gating, a query scale of its own, and sliding-window
  ("local") layers with their own RoPE base interleaved with global layers;
- a sliding window on every layer (Mistral, Phi-3), partial rotary embeddings (Phi-3 family).

Weights are always held in the Hugging Face "rotate-half" RoPE layout; the GGUF loader undoes
llama.cpp's interleaved-pair permutation of the q/k projections (see checkpoint_gguf.py), so a single
RoPE implementation serves every checkpoint format.

Two entry points share one forward:
- prefill (T > 1, positions 0..T-1): full causal attention over the prompt itself, then each layer's
  cache keeps what fits its budget (it may compress the prompt);
- decode (T == 1): the cache picks a slot, stores the new key/value, and attention runs over the cache;
  the rows may be at different positions (input_pos [B]), each rotated by its own.
Rows of different lengths are prefilled together packed into one sequence (packed_prefill.py: attention and
the caches row by row over each row's span), or one at a time in their row context (`cache_row`) where a
prefill cannot be shared.

With re-rotation (`--rerotate_positions`, rerotation.py) the caches store keys before RoPE, and after the
prompt RoPE is applied at ranks within each head's cache instead of at positions in the text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cpu_bf16_kernels
from attention import attend_slots, follows_window, grouped_attention, prompt_attention, soft_gated_attention
from cache import KVCache
from cache_chunking import Rerotation
from chunk_attention import chunk_attention
from errors import UserError
from packed_prefill import PackedRows, row_turn, store_row
from rerotation import query_ranks, slot_ranks
from rope import apply_rope, rope_tables, rotate_by_rank

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Linear(nn.Linear):
    """nn.Linear whose CPU bfloat16 decode step streams the weights with a kernel (cpu_bf16_kernels.py)."""

    def forward(self, x: Tensor) -> Tensor:
        return cpu_bf16_kernels.linear(x, self.weight, self.bias)


def linears(x: Tensor, *layers: nn.Linear) -> list[Tensor]:
    """[layer(x) for layer in layers]; the CPU bf16 decode step reads their stacked weights in one kernel call
    (one dispatch and one parallel region for q, k and v, or gate and up, instead of one each)."""
    return cpu_bf16_kernels.linears(x, [layer.weight for layer in layers], [layer.bias for layer in layers])


def stack_projections(*layers: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """One contiguous [Σ out, in] weight (and bias) for projections of the same input; each layer's parameter
    becomes a view of its rows, so the weights are held once and keep their names (state dicts, loaders,
    calibration read them as before)."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    start = 0
    for layer in layers:
        rows = slice(start, start + layer.out_features)
        layer.weight.data = weight[rows]
        if bias is not None:
            layer.bias.data = bias[rows]
        start = rows.stop
    return weight, bias


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
    partial_rotary_factor: float = 1.0  # fraction of each head's dimensions that RoPE rotates (Phi-3 family)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma stores weight − 1
    sandwich_norms: bool = False  # Gemma 3: RMSNorm on the attention and MLP outputs too
    hidden_act: str = "silu"  # MLP gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embedding_scale: float = 1.0  # Gemma: embeddings × sqrt(dim)
    query_scale: float = 0.0  # attention logit scale; 0 means head_dim ** -0.5
    final_logit_softcap: float = 0.0  # logits = cap · tanh(logits / cap) when > 0
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included); 0: none
    # Per layer "full_attention" / "sliding_attention"; [] means every layer alike: sliding iff sliding_window.
    layer_types: list[str] = field(default_factory=list)
    local_rope_base: float = 0.0  # RoPE base of sliding layers when it differs (Gemma 3); unscaled
    # Divisors of the global layers' rotated frequencies, one per pair of dimensions: a GGUF's `rope_freqs`
    # tensor (llama.cpp's form of Llama 3.1's scaling, computed by its converter); [] means none.
    rope_freq_factors: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.layer_types and len(self.layer_types) != self.n_layer:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.n_layer} layers")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ValueError(f"{len(self.rope_freq_factors)} RoPE frequency factors for {self.rope_dim // 2} "
                             "rotated pairs of dimensions")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` in tokens, or 0 for a layer that attends to everything."""
        if not self.sliding_window:
            return 0
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        # Gemma stores weight − 1 and multiplies by (1 + weight) in float32; adding the 1 here rather than
        # to the loaded weight keeps bfloat16 weights rounding exactly as in the reference.
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (xf * weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        self.wq = Linear(args.dim, args.n_head * args.head_dim, bias=args.attention_bias)
        self.wk = Linear(args.dim, args.n_kv_head * args.head_dim, bias=args.attention_bias)
        self.wv = Linear(args.dim, args.n_kv_head * args.head_dim, bias=args.attention_bias)
        self.wo = Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        # The attention kernels scale logits by head_dim ** -0.5; a model with its own scale (Gemma 3's
        # query_pre_attn_scalar) gets the ratio folded into q, so every kernel and compressor sees it.
        self.q_rescale = args.query_scale * math.sqrt(args.head_dim) if args.query_scale else 1.0
        self.sliding_window = args.layer_window(layer_idx)  # 0: attends to everything
        self.kv_cache: KVCache | None = None
        # q, k and v's weights stacked (Transformer.fuse_projections): one product where set.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        # Learned forget gate (gates.Gate: normed hidden state -> log-gates [B, n_kv, T]), attached by
        # gates.attach_gates for gated caches and gate training; None otherwise.
        self.gate: nn.Module | None = None
        # (global_tokens, recent_window) while training gates: the cache-less forward then attends with
        # soft eviction and leaves the soft number of retained tokens in `self.retained`.
        self.soft_gating: tuple[int, int] | None = None
        self.retained: Tensor | None = None

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, dim] -> q [B, n_head, T, D], k and v [B, n_kv, T, D], before RoPE and the q/k norms."""
        B, T, _ = x.shape
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(
                [self.wq.out_features, self.wk.out_features, self.wv.out_features], dim=-1)
        else:
            q, k, v = linears(x, self.wq, self.wk, self.wv)
        return (q.view(B, T, self.n_head, self.head_dim).transpose(1, 2),
                k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2),
                v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, append: bool = False,
                chunk: bool = False, rows: PackedRows | None = None) -> Tensor:
        B, T, _ = x.shape
        if chunk:  # a chunk of a chunked prefill: cos/sin are the whole tables (held keys may need them)
            return self.forward_chunk(x, cos, sin, input_pos, rows)
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cache = self.kv_cache
        # Re-rotation (rerotation.py): the cache stores pre-RoPE keys; after the prompt, q and the held keys are
        # rotated by rank once the cache has the new token, and cos/sin are the whole tables (Transformer.forward).
        rerotate = cache is not None and cache.rerotate_positions
        by_rank = rerotate and (append or T == 1)
        k_plain = k
        if not by_rank:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_rescale != 1.0:
            q = q * self.q_rescale

        log_gates = self.gate(x) if cache is not None and cache.needs_gates else None
        if log_gates is not None and rows is None:
            # Each token's gate goes to the cache before its K/V (prefill or insert) so they stay together.
            cache.observe_gates(log_gates)
        if cache is None and self.soft_gating is not None:
            y, self.retained = soft_gated_attention(q, k, v, self.gate(x), *self.soft_gating)
        elif append and cache is not None:
            y = self.attend_appended(q, k, v, input_pos, cos, sin, by_rank)
        elif rows is not None:
            y = self.attend_packed_rows(rows, input_pos, q, k, v, k_plain if rerotate else None, log_gates)
        elif T > 1 or cache is None:
            # Prefill: causal attention over the prompt itself.
            y = prompt_attention(q, k, v, self.sliding_window)
            if cache is not None:  # k_store only when re-rotating: prefill(input_pos, k, v, q) stays the contract
                cache.prefill(input_pos, k, v, q, **({"k_store": k_plain} if rerotate else {}))
        else:
            y = self.attend_decode(q, k, v, input_pos, cos, sin, by_rank)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def attend_packed_rows(self, rows: PackedRows, input_pos: Tensor, q: Tensor, k: Tensor, v: Tensor,
                           k_store: Tensor | None, log_gates: Tensor | None) -> Tensor:
        """A prefill of packed prompts (packed_prefill.py; q, k, v [1, heads, sum of lengths, D]): each row's
        causal attention over its own span, and its tokens into the cache in its row context."""
        out = []
        for i, span in enumerate(rows.spans):
            out.append(prompt_attention(q[:, :, span], k[:, :, span], v[:, :, span], self.sliding_window))
            if self.kv_cache is not None:
                store_row(self.kv_cache, rows, i, input_pos, k, v, q, k_store, log_gates)
        return torch.cat(out, dim=2)

    def attend_appended(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, cos: Tensor, sin: Tensor,
                        by_rank: bool) -> Tensor:
        """A chunk after the prompt (kvpress protocol): into the cache's empty slots, then each query attends
        over the held tokens at or before its own position."""
        cache, (B, _, T, _) = self.kv_cache, q.shape
        k_all, v_all, mask = cache.append(input_pos, k, v)
        if by_rank:
            q, k_all = rotate_by_rank(q, k_all, cache.pos, input_pos, cos, sin)
        pos = cache.pos.expand(B, self.n_kv_head, -1)
        visible = mask[:, :, 0, None, :] & (pos[:, :, None, :] <= input_pos.view(1, 1, T, 1))  # [B, n_kv, T, L]
        visible = visible.repeat(1, 1, self.n_head // self.n_kv_head, 1)
        if cache.pooled:  # one K/V pool for all heads (budget_allocation.py): every query row over it
            visible = visible.reshape(B, 1, -1, visible.shape[-1])
        return grouped_attention(q, k_all, v_all, visible)[0]

    def attend_decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, cos: Tensor, sin: Tensor,
                      by_rank: bool) -> Tensor:
        """A decode step: the new token into the cache (its strategy evicts), then attention over its slots."""
        cache, B = self.kv_cache, q.shape[0]
        cache.insert(input_pos, k, v)
        mask = cache.mask
        if cache.pooled:
            # One K/V pool for all heads (budget_allocation.py): each query head attends over the slots its KV
            # head holds, as rows of one group, [B, 1, n_head, P]; probabilities stay [B, n_kv, rep, P].
            mask = mask.expand(-1, -1, self.n_head // self.n_kv_head, -1).reshape(B, 1, self.n_head, -1)
        if by_rank:  # re-rotated keys are turned after they are rebuilt
            q, k_all = rotate_by_rank(q, cache.keys(), cache.pos, input_pos, cos, sin)
            y, probs = grouped_attention(q, k_all, cache.values(), mask)
        elif not (cache.needs_attention or q.device.type == "cpu"):
            # GPU: the fused kernel, no probabilities materialised. Faster than the grouped product below and than
            # FlexAttention's decode kernel at 32k cached tokens on an H200 (docs/performance.md, 2026-12-04).
            head_mask = mask.transpose(1, 2) if cache.pooled else mask.repeat_interleave(
                self.n_head // self.n_kv_head, dim=1)
            return F.scaled_dot_product_attention(q, cache.keys(), cache.values(), attn_mask=head_mask,
                                                  enable_gqa=True)
        else:
            # On the CPU the explicit grouped matmul + softmax is ~3.5x faster than SDPA at 4k cached tokens
            # (docs/DESIGN.md §7), and it yields the probabilities for caches that need them.
            y, probs = attend_slots(cache, q, mask)
        if cache.needs_attention:
            # Grouped by KV head, [B, n_kv, rep, L]: the cache decides how to pool the query heads.
            cache.update_state(probs.view(B, self.n_kv_head, -1, probs.shape[-1]))
        return y

    def forward_chunk(self, x: Tensor, cos_table: Tensor, sin_table: Tensor, input_pos: Tensor,
                      rows: PackedRows | None = None) -> Tensor:
        """A prompt chunk (--prefill_chunk, KVCache.prefill_chunk_tokens): projected, then attended and stored
        by attend_chunk, for the whole batch or, with `rows` (packed_prefill.prefill_packed_chunks), for each
        row's span of the packed chunks in its row context."""
        B, T, _ = x.shape
        cache = self.kv_cache
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        log_gates = self.gate(x) if cache.needs_gates else None
        if rows is None:
            if log_gates is not None:
                cache.observe_gates(log_gates, chunk=True)
            y = self.attend_chunk(q, k, v, input_pos, cos_table, sin_table)
        else:
            parts = []
            for i, span in enumerate(rows.spans):
                with cache.row(rows.cache_rows[i]):
                    row_turn(cache, rows, i, log_gates, chunk=True)
                    parts.append(self.attend_chunk(q[:, :, span], k[:, :, span], v[:, :, span], input_pos[span],
                                                   cos_table, sin_table))
            y = torch.cat(parts, dim=2)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def attend_chunk(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, cos_table: Tensor,
                     sin_table: Tensor) -> Tensor:
        """A chunk's q, k, v (before RoPE) at positions input_pos: the first chunk is a prefill; the queries of a
        later one attend over the held tokens and the chunk itself, causally (as a one-shot prefill's would,
        minus what was evicted), then the cache compresses held + chunk. RoPE is at true positions, or with
        re-rotation (rerotation.py) at ranks: the held tokens of each head at 0..n−1 in order of position and
        the chunk at n..n+T−1, so the prompt may run past the context."""
        B, _, T, _ = q.shape
        cache = self.kv_cache
        rep = self.n_head // self.n_kv_head

        def rope_at(t: Tensor, at: Tensor) -> Tensor:  # t [B, heads, N, D] at positions or ranks [1|B, 1|heads, N]
            if at.shape[1] not in (1, t.shape[1]):  # per KV head: each query head at its KV head's
                at = at.repeat_interleave(rep, dim=1)
            return apply_rope(t, F.embedding(at.clamp(min=0), cos_table), F.embedding(at.clamp(min=0), sin_table))

        first = cache.chunk_queries is None
        rerotation = None
        if cache.rerotate_positions:
            # The first chunk starts the prompt: its positions are its ranks. A later one follows the n held.
            at = input_pos.view(1, 1, T)
            if not first:
                at = query_ranks(cache.pos, input_pos) + torch.arange(T, device=q.device)
            q_plain = q * self.q_rescale if self.q_rescale != 1.0 else q
            rerotation = Rerotation(k, q_plain, rope_at)
            q, k = rope_at(q, at), rope_at(k, at)
        else:
            q, k = (apply_rope(t, cos_table[input_pos], sin_table[input_pos]) for t in (q, k))
        if self.q_rescale != 1.0:
            q = q * self.q_rescale
        if first:  # a prefill
            y = prompt_attention(q, k, v, self.sliding_window)
        else:
            held, held_v = cache.chunk_held_keys(), cache.chunk_held_values()
            if cache.pooled:  # one K/V pool (budget_allocation.py): every head over it, masked to its own slots
                held, held_v = (t.expand(B, self.n_kv_head, -1, -1) for t in (held, held_v))
            if rerotation is not None:
                held = rope_at(held, slot_ranks(cache.pos))
            y = chunk_attention(q, held, held_v, k, v, cache.mask[:, :, 0], cache.pos, input_pos, self.sliding_window)
        cache.prefill_chunk_tokens(input_pos, k, v, q, rerotation)
        return y


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)  # down
        self.act = ACTIVATIONS[args.hidden_act]
        self.register_buffer("gate_up_weight", None, persistent=False)  # Transformer.fuse_projections

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = linears(x, self.w1, self.w3)
        return self.w2(self.act(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer_idx)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        if args.sandwich_norms:
            self.post_attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.sandwich = args.sandwich_norms

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, append: bool = False,
                chunk: bool = False, rows: PackedRows | None = None) -> Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, input_pos, append, chunk, rows)
        if self.sandwich:
            h = x + self.post_attention_norm(attended)
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        h = x + attended
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Bumped whenever the caches start over or a row is refilled (reset_caches, cache_row): what a prompt may
        # change that the compiled step's guards read (CompiledDecodeStep checks them all once after it).
        self.cache_epoch = 0
        # On the CPU, the buffer holding every weight in step order (weight_arena.py; set by the loaders).
        self.weight_arena = None
        # On the meta device (the loaders build the model there and assign the checkpoint's weights) the table
        # is not initialised: a meta tensor's normal_ runs a Python decomposition that imports torch._dynamo,
        # 1.2 s of every eager run's start.
        on_meta = torch.get_default_device().type == "meta"
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=torch.empty(args.vocab_size, args.dim) if on_meta else None)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # Sliding layers' own tables (Gemma 3's local RoPE base); empty when they share the global ones.
        self.register_buffer("rope_local_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_local_sin", torch.empty(0), persistent=False)
        self.init_rope_tables()

    def _apply(self, fn: Callable, recurse: bool = True) -> Transformer:
        # .to(), .float(), .cuda() ... give the parameters new memory: the arena's handle goes with them, so
        # the old buffer is freed with its last view instead of outliving the weights it held.
        self.weight_arena = None
        return super()._apply(fn, recurse)

    def fuse_projections(self) -> None:
        """Stack each layer's q, k, v weights into one matrix, and gate with up: a batch-1 decode step only
        reads weights, and on a GPU a matrix-vector product of a small matrix (k and v are 4096 x 1024 at the
        8B shape) runs below the bandwidth a large one reaches; one product reads the same bytes in fewer,
        larger kernels (gpt-fast stores them stacked for this reason). Call it once the weights are on their
        device (build_model does, off the CPU): moving the model afterwards copies the views apart. The CPU
        needs none of it: its bf16 kernel already reads stacked projections in one call (cpu_bf16_kernels.py)
        and float32 stores the wide ones input-major (checkpoint.wide_projection_weights)."""
        for layer in self.layers:
            attention, mlp = layer.attention, layer.feed_forward
            attention.qkv_weight, attention.qkv_bias = stack_projections(attention.wq, attention.wk, attention.wv)
            mlp.gate_up_weight = stack_projections(mlp.w1, mlp.w3)[0]

    def init_rope_tables(self) -> None:
        """(Re)build the RoPE tables in float32 on the embedding's device; call after `.to(dtype)`,
        which would otherwise round the angles of late positions."""
        device = self.tok_embeddings.weight.device
        self.rope_cos, self.rope_sin = self._rope_tables_on(device)
        if self.args.local_rope_base:
            self.rope_local_cos, self.rope_local_sin = self._rope_tables_on(device, local=True)

    def _rope_tables_on(self, device: torch.device, local: bool = False) -> tuple[Tensor, Tensor]:
        if device.type == "meta":  # shapes only: see the embedding's table in __init__ (and nothing to compute)
            shape = (self.args.context_length, 2 * len(range(0, self.args.rope_dim, 2)))
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        cos, sin = rope_tables(self.args, local=local)
        return cos.to(device), sin.to(device)

    def setup_caches(self, caches: list[KVCache]) -> None:
        """Attach one cache per layer (built by cache_spec.build_caches)."""
        if len(caches) != self.args.n_layer:
            raise ValueError(f"got {len(caches)} caches for {self.args.n_layer} layers")
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            if cache.needs_gates and layer.attention.gate is None:
                raise ValueError(f"layer {i}: the {cache.name} cache needs learned gates, but the model has none "
                                 "attached (gates.attach_gates / gates.attach_random_gates; cache_setup.setup_caches "
                                 "loads the trained ones)")
            window = layer.attention.sliding_window
            if window and not follows_window(cache, window):
                raise UserError(f"layer {i} attends to its last {window} tokens only, but its {cache.name} cache can "
                                "hold older ones; sliding layers need the window policy "
                                "(model_policies.apply_model_layer_policies)")
        if len({c.rerotate_positions for c in caches}) > 1:
            raise ValueError("either every layer's cache re-rotates positions or none does (one RoPE table per step)")
        for i, cache in enumerate(caches):
            if cache.rerotate_positions and cache.max_cache_length > self.args.context_length:
                # Its ranks would index past the RoPE tables (cache_setup.check_budgets says so to users, earlier).
                raise ValueError(f"layer {i}: a re-rotating cache of {cache.max_cache_length} tokens exceeds the "
                                 f"model's context of {self.args.context_length}")
            # A chunk's queries sit at ranks up to the held tokens + the chunk (forward_chunk) in a cache that
            # compresses (a debug_ twin's shadow; its full reference holds ranks = positions, checked above).
            for c in (m for m in cache.modules() if isinstance(m, KVCache) and m.name != "full"):
                if any(isinstance(x, KVCache) for x in c.children()) or not c.rerotate_positions:
                    continue
                if c.max_cache_length + c.prefill_chunk > self.args.context_length:
                    raise ValueError(f"layer {i}: a re-rotating cache of {c.max_cache_length} tokens with chunks of "
                                     f"{c.prefill_chunk} puts ranks past the model's context of "
                                     f"{self.args.context_length}")
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.attention.kv_cache = cache

    def remove_caches(self) -> None:
        """Back to a plain causal forward with no cache (a reference pass over a whole sequence)."""
        for layer in self.layers:
            layer.attention.kv_cache = None

    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers if layer.attention.kv_cache is not None]

    def batch_invariant(self, rows: int | None = None) -> bool:
        """Whether every row of a batch of `rows` (default: the caches' rows) gets, bit for bit, the products it
        gets alone (cpu_bf16_kernels.batch_invariant: the CPU kernels, up to MAX_ROWS rows)."""
        if rows is None:
            caches = self.caches()
            rows = caches[0].pos.shape[0] if caches else 1
        return cpu_bf16_kernels.batch_invariant(self.output.weight, rows)

    @contextmanager
    def cache_row(self, b: int) -> Iterator[Transformer]:
        """The row context of every layer's cache (KVCache.row): inside it the model is a batch-1 model of row
        b, for the work rows cannot share (a prompt of its own length, a chunk at its own positions)."""
        self.cache_epoch += 1
        with ExitStack() as stack:
            for cache in self.caches():
                stack.enter_context(cache.row(b))
            yield self

    def reset_caches(self) -> None:
        self.cache_epoch += 1
        for cache in self.caches():
            cache.reset()

    def rope_tables(self, input_pos: Tensor, by_rank: bool, chunk: bool,
                    decode: bool) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """(cos, sin, the sliding-window layers' (cos, sin)): the tables' rows at input_pos, or whole when the
        layers index them themselves (by rank, or a prompt chunk's positions)."""
        index = slice(None) if by_rank or chunk else input_pos
        tables = [self.rope_cos[index], self.rope_sin[index]]
        if self.args.local_rope_base:
            tables += [self.rope_local_cos[index], self.rope_local_sin[index]]
        if decode and not by_rank:
            # A decode step's rows may be at different positions (input_pos [B]): its rows of the tables,
            # [1 or B, R], become [1 or B, 1, 1, R], which broadcast against q/k [B, heads, 1, D] row by row.
            tables = [t[:, None, None] for t in tables]
        cos, sin = tables[:2]
        return cos, sin, tuple(tables[2:]) or (cos, sin)

    def forward(self, idx: Tensor, input_pos: Tensor, last_logits_only: bool = False,
                run_block: Callable[..., Tensor] | None = None, append: bool = False, chunk: bool = False,
                rows: PackedRows | None = None, logits_at: int | None = None) -> Tensor:
        """idx: [B, T] token ids; input_pos: [T] absolute positions shared by the rows (a device tensor), or
        at a decode step (T = 1) [B], each row at its own position.

        Returns float32 logits [B, T, vocab], or [B, 1, vocab] with `last_logits_only` (a prefill needs
        only the last position, and the vocabulary projection is the largest matmul of a long prompt).
        `run_block(layer, x, cos, sin, input_pos)` replaces each block's call: the compiled decode step
        passes one compiled function that every layer shares (compiled_step.CompiledDecodeStep). `append`: the T
        tokens follow what the caches already hold (KVCache.append) instead of being a prompt. With caches that
        re-rotate positions, input_pos may exceed the context after the prompt (RoPE then sees ranks only).
        `chunk`: the T > 1 tokens are a chunk of a prompt fed in pieces (generate.prefill, --prefill_chunk).
        `rows`: a prefill of prompts of different lengths packed into idx [1, T] (packed_prefill.py), input_pos
        each token's position in its own prompt; `last_logits_only` then gives each prompt's last token's
        logits, [rows, 1, vocab]. `logits_at`: the logits of that position only, [B, 1, vocab] (KVzip's
        reconstruction pass prefills the context that opens its sequence: strategies/kvzip.py).
        """
        caches = self.caches()
        if rows is not None:
            self.cache_epoch += 1  # the rows' contexts are entered layer by layer (see cache_row)
        for cache in caches:
            if cache.needs_token_ids and rows is None:  # e.g. FastGen's special-token and punctuation policies
                cache.observe_tokens(idx, chunk)
        # Re-rotating caches after the prompt: the layers index the tables by rank (rotate_by_rank), and
        # input_pos, which may lie past the context then, indexes nothing.
        by_rank = bool(caches) and caches[0].rerotate_positions and (append or idx.shape[1] == 1)
        cos, sin, local = self.rope_tables(input_pos, by_rank, chunk, decode=idx.shape[1] == 1)
        x = self.tok_embeddings(idx)
        if self.args.embedding_scale != 1.0:
            # Scaled in the weights' dtype, as the reference does (the scale itself is rounded there too).
            x = x * torch.tensor(self.args.embedding_scale, dtype=x.dtype, device=x.device)
        for layer in self.layers:
            rope = local if layer.attention.sliding_window else (cos, sin)
            if run_block is None:
                x = layer(x, *rope, input_pos, append, chunk, rows)
            else:
                x = run_block(layer, x, *rope, input_pos)
        if last_logits_only and rows is not None:
            x = x[0, [span.stop - 1 for span in rows.spans], None]
        elif last_logits_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[:, logits_at : logits_at + 1]
        logits = self.output(self.norm(x)).float()
        if self.args.final_logit_softcap:
            logits = self.args.final_logit_softcap * torch.tanh(logits / self.args.final_logit_softcap)
        return logits
